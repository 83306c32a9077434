"""The local gate: a Unix socket on which the agent answers HTCondor's job hooks

The hook side (``client``, ``messages``, ``paths``) imports neither asyncio nor nats-py.
"""
