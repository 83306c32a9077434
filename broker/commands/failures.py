"""The one mapping of the commands' failures to a line on stderr and an exit status"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Coroutine
from typing import Final

#: exit status of a command that failed in a way it reports in one line
EXIT_FAILURE: Final = 1


def _reported() -> tuple[type[Exception], ...]:
    """The failures a command reports in one line (imported once one has happened)"""
    from broker.errors import BrokerError
    from remote_agent.protocol.errors import HandshakeError, SchemaError

    return BrokerError, SchemaError, HandshakeError


def run(args: argparse.Namespace) -> int:
    """
    Run the chosen command (a coroutine in its own event loop), return its exit status

    An expected failure (:func:`_reported`) is printed as ``cobald-remote: <why>``
    and gives :data:`EXIT_FAILURE`, and so is a module missing because this is the
    drone-side install (:class:`~broker.errors.NeedsManager`); anything else
    propagates with its traceback.
    """
    try:
        result = args.run(args)
        if isinstance(result, Coroutine):
            import asyncio

            result = asyncio.run(result)
    except Exception as err:
        reported = _needs_manager(err, args) or err
        if not isinstance(reported, _reported()):
            raise
        print(f"cobald-remote: {reported}", file=sys.stderr)
        return EXIT_FAILURE
    return int(result)


def _needs_manager(err: Exception, args: argparse.Namespace) -> Exception | None:
    """A drone-side install's missing manager module as the one line that names the extra"""
    if not isinstance(err, ImportError):
        return None
    from broker.errors import NeedsManager

    return NeedsManager.of(err, getattr(args, "group", None) or "this command")
