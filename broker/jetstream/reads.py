"""
One-shot reads: every message an ephemeral ``AckPolicy.NONE`` consumer has at its creation

Its rule: a read ends when as many messages as the consumer reported pending were
read, or, asked every half second until then, when the server has none left to deliver
and every one it delivered was read (messages purged after the consumer counted them never
come); the consumer is deleted however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Final

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from broker.errors import BrokerError, ConsumerError
from broker.jetstream.messages import ConsumerStats, Disposition, PullSettings
from broker.jetstream.pull import PullConsumer
from remote_agent.protocol.names import DEFAULT_API_PREFIX

#: pull batch of :func:`read_all`
READ_ALL_BATCH: Final = 2000
#: seconds without the end after which :func:`read_all` asks whether any message is left
QUIET_CHECK_S: Final = 0.5


async def read_all(
    nc: Client,
    js: JetStreamContext,
    stream: str,
    config: ConsumerConfig,
    handler: Callable[[str, str, bytes, Mapping[str, str] | None], object],
    *,
    headers: bool = False,
    settings: PullSettings | None = None,
    api: str = DEFAULT_API_PREFIX,
    timeout_s: float | None = None,
    stats: ConsumerStats | None = None,
) -> int:
    """
    Read every message an ephemeral ``AckPolicy.NONE`` consumer has at its creation

    Creates the consumer from ``config``, hands each message to ``handler``
    until as many as the consumer reported pending at creation were read,
    then deletes it. Messages stored later are read too if they arrive first;
    the caller must tolerate that (the registry does, by ``seq``). A message
    whose handler raises is read all the same: it is skipped, counted in
    ``stats.handler_errors`` and logged, and the reading goes on.

    :param stats: counters to add to (a new :class:`ConsumerStats` by default)
    :returns: the number of messages read, those whose handler raised included
    :raises ConsumerError: if the consumer cannot be created
    :raises TimeoutError: if the messages do not all arrive within ``timeout_s``
        (default: 120 s, plus a second for every 10,000 messages)
    """
    config = _ephemeral(config)
    try:
        info = await js.add_consumer(stream, config)
    except nats.js.errors.APIError as err:
        raise ConsumerError(f"cannot read {stream!r}: {err.description}") from err
    wanted = info.num_pending or 0
    if timeout_s is None:
        timeout_s = 120.0 + wanted / 10_000
    if wanted == 0:
        await _delete_quietly(js, stream, info.name)
        return 0
    done = asyncio.Event()
    count = 0

    def handle(
        subject: str, reply: str, data: bytes, msg_headers: Mapping[str, str] | None
    ) -> Disposition:
        nonlocal count
        count += 1  # before the handler: a message it raises on was read, too
        if count >= wanted:
            done.set()
        handler(subject, reply, data, msg_headers)
        return Disposition.ACK

    # AckNone and a known end: large batches save round trips
    settings = settings or PullSettings(batch=max(1, min(wanted, READ_ALL_BATCH)))
    pull = PullConsumer(
        nc,
        stream,
        info.name,
        handle,
        acks=False,
        headers=headers,
        settings=settings,
        api=api,
        stats=stats,
    )
    runner = asyncio.create_task(pull.run(done))
    try:
        await _until_read(js, stream, info.name, done, runner, lambda: count, timeout_s)
        if runner.done() and not done.is_set():
            runner.result()  # raises what ended it
    except TimeoutError:
        raise TimeoutError(
            f"read {count} of {wanted} messages of {stream!r} in {timeout_s:.0f}s"
        ) from None
    finally:
        done.set()
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError, BrokerError):
            await runner
        await _delete_quietly(js, stream, info.name)
    return count


async def _until_read(
    js: JetStreamContext,
    stream: str,
    name: str,
    done: asyncio.Event,
    runner: asyncio.Task[None],
    read: Callable[[], int],
    timeout_s: float,
) -> None:
    """
    Wait until ``done``, the runner's end, or a consumer with nothing left for us

    :raises TimeoutError: after ``timeout_s``
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not (done.is_set() or runner.done()):
        left = deadline - loop.time()
        if left <= 0:
            raise TimeoutError
        try:
            await asyncio.wait_for(_first_done(done, runner), min(left, QUIET_CHECK_S))
            continue
        except TimeoutError:
            pass
        # were the rest purged after the consumer counted them?
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
            state = await js.consumer_info(stream, name)
            if not state.num_pending and state.delivered.consumer_seq <= read():
                return


async def _first_done(done: asyncio.Event, task: asyncio.Task[None]) -> None:
    waiter = asyncio.ensure_future(done.wait())
    try:
        await asyncio.wait([waiter, task], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


def _ephemeral(config: ConsumerConfig) -> ConsumerConfig:
    return ConsumerConfig(
        description=config.description,
        deliver_policy=config.deliver_policy,
        opt_start_seq=config.opt_start_seq,
        opt_start_time=config.opt_start_time,
        ack_policy=AckPolicy.NONE,
        filter_subject=config.filter_subject,
        filter_subjects=config.filter_subjects,
        inactive_threshold=config.inactive_threshold or 60.0,
        mem_storage=True,
        num_replicas=1,
    )


async def _delete_quietly(js: JetStreamContext, stream: str, name: str) -> None:
    with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
        await js.delete_consumer(stream, name)


@contextlib.contextmanager
def stream_errors(error: Callable[[str], Exception], missing: str = "stream") -> Iterator[None]:
    """Raise ``error`` with an operator's explanation for a stream that cannot be read"""
    try:
        yield
    except nats.js.errors.NotFoundError as err:
        raise error(
            f"{missing} missing ({err.description}): run 'cobald-remote broker init'"
        ) from None
    except (nats.errors.Error, TimeoutError) as err:
        raise error(f"cannot read the event stream: {err}") from None
