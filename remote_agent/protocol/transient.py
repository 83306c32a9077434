"""
Retrying NATS and JetStream calls: which failures pass, the one classification every retry
uses, and the delays between tries (:class:`Backoff`)

A call that failed with an error :func:`is_transient` accepts may succeed when made again:
the server is away or busy, or the stream or bucket it asked has no leader for a moment (a
node of a cluster went down). nats-py raises, for the same passing cause, different errors by call:

- a request nobody answers: ``NoRespondersError``; a JetStream publish turns it into
  ``NoStreamResponseError`` (nats/js/client.py ``publish``), the JetStream management API
  into ``ServiceUnavailableError`` (nats/js/manager.py ``_api_request``);
- a stream or bucket between leaders answers "JetStream system temporarily unavailable"
  (503, err_code 10008), "JetStream cluster can not handle request" (500, 10009), "expected
  last sequence per subject temporarily unavailable" (503, 10163) or "incomplete results"
  (503, 10004), or does not answer (``TimeoutError``);
- a server out of room answers "insufficient resources" (503, 10023) or "insufficient
  storage/memory resources available" (500, 10047, 10028) until retention frees some;
- a connection that is closed, reconnecting, stale or has its buffer full.

Every other error is an answer that will not change by asking again: the request is refused,
the key is missing, the compare-and-set lost. The same status code says either: a ``500``
is also "stream does not permit purges" (10110), a ``503`` also "JetStream not enabled for
account" (10039), so a JetStream API error is judged by its code and error code (nats-server
server/errors.json).

A write that failed transiently may still have been stored: a retry must never apply a
change twice. The publisher sends the same ``Nats-Msg-Id`` again (the stream drops the
copy); a compare-and-set re-reads and compares before it writes again
(:mod:`remote_agent.protocol.handshake`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final, TypeVar

import nats.errors
import nats.js.errors

T = TypeVar("T")

#: the errors after which the same call may succeed, whatever they say
_ALWAYS: Final[tuple[type[BaseException], ...]] = (
    nats.errors.TimeoutError,  # also FlushTimeoutError, FetchTimeoutError
    TimeoutError,  # asyncio.wait_for
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,  # also UnexpectedEOF
    nats.js.errors.NoStreamResponseError,
    OSError,
)
#: the JetStream API errors, as (code, err_code), after which the same call may succeed
_PASSING_API_ERRORS: Final = frozenset(
    {
        # between leaders
        (503, 10008),  # JSClusterNotAvailErr: JetStream system temporarily unavailable
        (503, 10004),  # JSClusterIncompleteErr: incomplete results
        (503, 10163),  # JSStreamExpectedLastSeqPerSubjectNotReady
        (500, 10009),  # JSClusterNotLeaderErr: JetStream cluster can not handle request
        (500, 10007),  # JSClusterNotAssignedErr: not assigned to this server (yet)
        (500, 10118),  # JSStreamOfflineErr: stream is offline (a node starting)
        (500, 10194),  # JSStreamOfflineReasonErrF
        (503, 10077),  # JSStreamStoreFailedF: the store closed under the write
        # out of room until retention frees some: an agent must not drop its events for it
        (503, 10023),  # JSInsufficientResourcesErr
        (500, 10047),  # JSStorageResourcesExceededErr
        (500, 10028),  # JSMemoryResourcesExceededErr
    }
)

#: how long a read or compare-and-set of a bucket is retried while it fails transiently,
#: in seconds: longer than a cluster takes to elect a stream's new leader after its old one
#: died (nats-server's raft waits 4 to 9 s before it calls an election)
TRANSIENT_BUDGET_S: Final = 30.0


def is_transient(err: BaseException) -> bool:
    """Whether the call that raised ``err`` may succeed when made again"""
    if isinstance(err, nats.js.errors.APIError):
        # nats-py makes some (its KV errors) without a code or error code
        code, err_code = getattr(err, "code", None), getattr(err, "err_code", None)
        if isinstance(err, nats.js.errors.ServiceUnavailableError) and err_code is None:
            return True  # what nats-py makes of "no responders" to an API request
        return (code, err_code) in _PASSING_API_ERRORS
    return isinstance(err, _ALWAYS)


async def patiently(
    call: Callable[[], Awaitable[T]],
    budget_s: float = TRANSIENT_BUDGET_S,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """
    ``await call()``, made again after each transient failure, for at most ``budget_s``

    Only for a call that changes nothing or that may be repeated: a read, or a write whose
    repetition cannot apply a change twice.

    :param on_retry: told of each transient failure before the next attempt
    :raises: the last transient error once ``budget_s`` has passed; any other error at once
    """
    deadline = time.monotonic() + budget_s
    backoff = Backoff(first=0.05, most=1.0)
    while True:
        try:
            return await call()
        except Exception as err:
            if not is_transient(err):
                raise
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise
            if on_retry is not None:
                on_retry(err)
            await asyncio.sleep(min(backoff.delay(), remaining))


# --------------------------------------------------------------------------- retry delays
# doubling from a first delay to a cap, with a little jitter


@dataclass(slots=True)
class Backoff:
    """
    The delays before each retry: ``first``, then ``factor`` times the last, at most ``most``

    Each delay is shortened by up to ``jitter`` of itself at random, so that
    clients that failed together do not retry together; a delay is never
    longer than the undisturbed one. :meth:`reset` after a success.
    """

    first: float
    most: float
    factor: float = 2.0
    jitter: float = 0.1
    _next: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.most or self.factor < 1 or not 0 <= self.jitter < 1:
            raise ValueError(f"not a backoff: {self!r}")
        self._next = self.first

    def delay(self) -> float:
        """The delay before the next retry"""
        delay = self._next
        self._next = min(delay * self.factor, self.most)
        return delay * (1.0 - self.jitter * random.random())

    def reset(self) -> None:
        """Start again from ``first``"""
        self._next = self.first
