"""remote_agent/protocol/transient.py: which NATS failures pass, and retrying while they do"""

from __future__ import annotations

import nats.errors
import nats.js.errors
import pytest

from remote_agent.protocol.errors import HandshakeError, SchemaError
from remote_agent.protocol.transient import is_transient, patiently


def _api(code: int, err_code: int, description: str) -> nats.js.errors.APIError:
    """The error nats-py raises for a JetStream API answer with this error"""
    try:
        nats.js.errors.APIError.from_error(
            {"code": code, "err_code": err_code, "description": description}
        )
    except nats.js.errors.APIError as err:
        return err
    raise AssertionError("from_error always raises")


@pytest.mark.parametrize(
    "error",
    [
        nats.errors.TimeoutError(),
        nats.errors.FlushTimeoutError(),
        nats.js.errors.FetchTimeoutError(),
        TimeoutError(),
        nats.errors.NoRespondersError(),
        nats.js.errors.NoStreamResponseError(),  # a publish while the stream has no leader
        nats.errors.ConnectionClosedError(),
        nats.errors.ConnectionReconnectingError(),
        nats.errors.OutboundBufferLimitError(),
        nats.errors.StaleConnectionError(),
        nats.errors.UnexpectedEOF(),
        ConnectionResetError(),
        _api(503, 10008, "JetStream system temporarily unavailable"),
        _api(500, 10009, "JetStream cluster can not handle request"),
        _api(503, 10163, "expected last sequence per subject temporarily unavailable"),
        _api(500, 10047, "insufficient storage resources available"),
        nats.js.errors.ServiceUnavailableError(),  # what nats-py makes of "no responders"
    ],
    ids=lambda err: f"{type(err).__name__}:{getattr(err, 'err_code', '')}",
)
def test_passing_failures_are_transient(error: BaseException) -> None:
    assert is_transient(error)


@pytest.mark.parametrize(
    "error",
    [
        _api(400, 10071, "wrong last sequence: 3"),  # a compare-and-set that lost
        nats.js.errors.KeyWrongLastSequenceError(),
        _api(404, 10059, "stream not found"),
        nats.js.errors.KeyNotFoundError(),
        nats.js.errors.BucketNotFoundError(),
        _api(400, 10065, "subjects overlap with an existing stream"),
        _api(503, 10039, "jetstream not enabled for account"),  # a 503 that stays
        _api(500, 10110, "stream does not permit purges"),  # a 500 that stays
        nats.js.errors.ServerError(),
        nats.js.errors.APIError(),
        nats.errors.ConnectionDrainingError(),  # closing on purpose
        nats.errors.BadSubjectError(),
        SchemaError("not a record"),
        HandshakeError("no record"),
        ValueError("a bug"),
    ],
    ids=lambda err: f"{type(err).__name__}:{getattr(err, 'err_code', '')}",
)
def test_answers_that_do_not_change_are_not_transient(error: BaseException) -> None:
    assert not is_transient(error)


async def test_patiently_retries_transient_failures_until_the_call_succeeds() -> None:
    failures = [nats.js.errors.NoStreamResponseError(), nats.errors.TimeoutError()]
    told: list[BaseException] = []

    async def call() -> str:
        if failures:
            raise failures.pop(0)
        return "stored"

    assert await patiently(call, 30.0, told.append) == "stored"
    assert [type(err) for err in told] == [
        nats.js.errors.NoStreamResponseError,
        nats.errors.TimeoutError,
    ]


async def test_patiently_raises_any_other_error_at_once() -> None:
    calls = 0

    async def call() -> None:
        nonlocal calls
        calls += 1
        raise nats.js.errors.KeyWrongLastSequenceError()

    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await patiently(call, 30.0)
    assert calls == 1


async def test_patiently_gives_up_with_the_last_error_after_its_budget() -> None:
    calls = 0

    async def call() -> None:
        nonlocal calls
        calls += 1
        raise nats.errors.NoRespondersError()

    with pytest.raises(nats.errors.NoRespondersError):
        await patiently(call, 0.0)
    assert calls == 1
