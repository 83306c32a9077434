"""
How the pull loop reports a message it could not hand over

A handler that raised, or a message the server gave up on after ``max_deliver``
deliveries: counted in :class:`~broker.jetstream.messages.ConsumerStats` and logged,
rate-limited, with its subject and the exception's type, never its payload.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Final

from broker.jetstream.messages import ConsumerStats
from remote_agent.protocol.ratelog import RateLimitedLog

log = logging.getLogger("cobald.runtime.cobald_remote.consumer")
#: handler errors and given-up messages come in floods: one line per kind and interval
_rejections = RateLimitedLog(log)

#: exception types counted by name at most; more are counted as ``other``
_MAX_ERROR_KINDS: Final = 32


def handler_failed(
    stats: ConsumerStats,
    stream: str,
    consumer: str,
    acks: bool,
    subject: str | bytes,
    err: Exception,
) -> None:
    """Count and log (rate-limited) a handler that raised: its subject and error type only"""
    stats.handler_errors += 1
    kinds = stats.handler_error_types
    kind = type(err).__name__
    if kind not in kinds and len(kinds) >= _MAX_ERROR_KINDS:
        kind = "other"
    kinds[kind] = kinds.get(kind, 0) + 1
    if isinstance(subject, bytes):
        subject = subject.decode("utf-8", "replace")
    subject = subject[:256]
    _rejections.warning(
        f"handler {stream} {consumer} {kind}",
        "handler raised %s (at %s) on %s (stream %s, consumer %s): message %s",
        kind,
        _Origin(err),
        subject,
        stream,
        consumer,
        "terminated" if acks else "skipped",
        extra={"subject": subject},
    )


def given_up(stats: ConsumerStats, stream: str, consumer: str, advisory: bytes) -> None:
    """The server's advisory: a message reached ``max_deliver`` and is not delivered again"""
    stats.max_deliveries += 1
    try:
        body = json.loads(advisory)
        seq, deliveries = int(body["stream_seq"]), int(body["deliveries"])
    except (ValueError, TypeError, KeyError):
        seq = deliveries = -1
    _rejections.warning(
        f"max_deliver {stream} {consumer}",
        "message %d of stream %s was delivered %d times to %s without an answer: "
        "the server gives up on it (max_deliver)",
        seq,
        stream,
        deliveries,
        consumer,
    )


class _Origin:
    """Where an exception was raised, ``file.py:line``, worked out only if a line is written"""

    __slots__ = ("err",)

    def __init__(self, err: BaseException) -> None:
        self.err = err

    def __str__(self) -> str:
        tb = self.err.__traceback__
        if tb is None:
            return "?"
        while tb.tb_next is not None:
            tb = tb.tb_next
        return f"{os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}"
