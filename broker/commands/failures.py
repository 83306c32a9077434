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
    and gives :data:`EXIT_FAILURE`; anything else propagates with its traceback.
    """
    try:
        result = args.run(args)
        if isinstance(result, Coroutine):
            import asyncio

            result = asyncio.run(result)
    except Exception as err:
        if not isinstance(err, _reported()):
            raise
        print(f"cobald-remote: {err}", file=sys.stderr)
        return EXIT_FAILURE
    return int(result)
