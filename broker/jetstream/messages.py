"""
What the pull layer and its handlers agree on

A handler answers each message with a :class:`Disposition`; :class:`PullSettings`
say how a consumer asks for messages, :class:`ConsumerStats` count what came, and
:func:`metadata` reads a message's stream sequence and times from its reply subject.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


class Disposition(enum.Enum):
    """What a handler tells the server about one message"""

    ACK = "ack"  #: applied: never deliver it again
    TERM = "term"  #: can never be applied (invalid): never deliver it again
    NAK = "nak"  #: not applied now: deliver it again


#: a handler applies one message, ``(subject, reply, data, headers)``, and says
#: what to answer. It runs inside the connection's read loop, so it must not
#: block; ``headers`` is ``None`` unless the consumer was asked for them.
Handler = Callable[[str, str, bytes, "Mapping[str, str] | None"], Disposition]


@dataclass(frozen=True, slots=True)
class PullSettings:
    """
    How a :class:`PullConsumer` asks for messages

    :param batch: messages per pull request; another request is issued when
        fewer than half a batch are still owed, so at most two are outstanding.
        Large batches keep the server streaming, so that each read of the
        socket brings many messages (``docs/architecture.md``, "Consuming the
        event stream"); the durable's ``max_ack_pending``
        (:func:`broker.server.durable.durable_config`) stays well above the
        7,500 a consumer can be owed
    :param expires_s: lifetime of a pull request on the server
    :param idle_heartbeat_s: the server sends a heartbeat this often while a
        request waits; silence for twice as long makes the watchdog re-issue
    :param checks_before_lookup: watchdog re-issues without any answer before
        the consumer's existence is checked with the server
    """

    batch: int = 5000
    expires_s: float = 5.0
    idle_heartbeat_s: float = 2.5
    checks_before_lookup: int = 2

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"batch must be at least 1, not {self.batch}")
        if not (0 < self.idle_heartbeat_s < self.expires_s):
            raise ValueError("need 0 < idle_heartbeat_s < expires_s")

    def request(self) -> bytes:
        return json.dumps(
            {
                "batch": self.batch,
                "expires": int(self.expires_s * 1e9),
                "idle_heartbeat": int(self.idle_heartbeat_s * 1e9),
            }
        ).encode()


@dataclass(slots=True)
class ConsumerStats:
    """Counters of one :class:`PullConsumer` (read them, don't write them)"""

    delivered: int = 0  #: messages handed to the handler
    acked: int = 0
    termed: int = 0  #: terminated: the handler said so, or raised
    nacked: int = 0
    #: the handler raised: the message was terminated (skipped without acks)
    handler_errors: int = 0
    #: :attr:`handler_errors` by the exception's type name
    handler_error_types: dict[str, int] = field(default_factory=dict)
    #: messages the server gave up on after ``max_deliver`` deliveries (its advisory)
    max_deliveries: int = 0
    heartbeats: int = 0
    requests: int = 0  #: pull requests sent
    expired: int = 0  #: 404/408 answers
    cut_short: int = 0  #: 409 answers
    watchdog: int = 0  #: re-issues because of silence
    #: starts that wanted direct dispatch and took nats-py's Msg path: its internals
    #: were not what :mod:`broker.jetstream.fastpath` expects
    direct_fallbacks: int = 0
    statuses: dict[str, int] = field(default_factory=dict)


def metadata(reply: str) -> tuple[int, int, float, int]:
    """
    ``(stream_seq, num_delivered, stored_time, num_pending)`` from a JetStream reply subject

    ``stored_time`` is when the stream stored the message, epoch seconds.
    Faster than nats-py's ``Msg.metadata`` (no datetime, no dataclass).

    :raises ValueError: if ``reply`` is not a JetStream ack subject
    """
    tokens = reply.split(".")
    n = len(tokens)
    if n == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<tm>.<pending>
        return int(tokens[5]), int(tokens[4]), int(tokens[7]) / 1e9, int(tokens[8])
    if n >= 11 and tokens[0] == "$JS" and tokens[1] == "ACK":  # with domain and account hash
        return int(tokens[7]), int(tokens[6]), int(tokens[9]) / 1e9, int(tokens[10])
    raise ValueError(f"not a JetStream reply subject: {reply!r}")
