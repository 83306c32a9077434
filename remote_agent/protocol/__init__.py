"""What the drone and the manager share: the wire schema, NATS names, the handshake, connecting

The only part of :mod:`remote_agent` that :mod:`broker` imports. Importing this
package imports nothing else (the hook path stays free of asyncio and nats-py).
"""
