"""
Idempotent provisioning of every stream and KV bucket cobald-remote needs

Its rule: what is missing is created, what differs is updated in place, and a conflict the
server will not resolve is a :class:`ProvisioningError` that says what and where.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from broker.errors import ProvisioningError
from remote_agent.protocol.errors import HandshakeError
from remote_agent.protocol.fields import DEFAULT_MAX_SIZE
from remote_agent.protocol.names import Namespace, kv_stream, kv_subjects
from remote_agent.protocol.proof import load_proof_key
from remote_agent.protocol.transient import is_transient, patiently

log = logging.getLogger("cobald.runtime.cobald_remote.provision")

Action = Literal["created", "updated", "unchanged"]

#: server error codes worth translating (nats-server ``server/errors.json``)
_SUBJECT_OVERLAP = 10065
_JETSTREAM_DISABLED = (10039, 10076)
_STORAGE_EXCEEDED = 10047
#: "stream configuration update can not cancel deny purge"
_CANNOT_CANCEL_DENY_PURGE = 10052

#: the event stream's size cap: room for the history of thousands of drones
DEFAULT_EVENT_MAX_BYTES: Final = 4 * 1024**3
#: messages kept per event subject (one per event kind and drone)
DEFAULT_EVENT_MAX_MSGS_PER_SUBJECT: Final = 512


@dataclass(frozen=True, slots=True)
class Topology:
    """
    What the bus looks like: names, replication, retention

    :param replicas: copies of every stream; 3 on a NATS cluster, 1 on one server
    :param event_max_age_s: how long events stay in the stream (timeline and replay)
    :param event_max_bytes: size cap of the event stream, ``-1`` for none; past it
        the oldest messages go (``docs/deployment.md#limits``)
    :param event_max_msgs_per_subject: messages kept per subject, ``-1`` for no cap;
        a drone has one subject per event kind, so this bounds how much of the
        stream, and of the manager's backlog, one drone can hold: a flooding
        drone evicts only its own older events
    :param duplicate_window_s: how long JetStream remembers ``Nats-Msg-Id`` values;
        later resends are dropped by the registry's per-drone sequence instead
    :param max_message_bytes: largest message the streams accept
    """

    namespace: Namespace = field(default_factory=Namespace)
    replicas: int = 1
    event_max_age_s: float = 7 * 24 * 3600.0
    event_max_bytes: int = DEFAULT_EVENT_MAX_BYTES
    event_max_msgs_per_subject: int = DEFAULT_EVENT_MAX_MSGS_PER_SUBJECT
    duplicate_window_s: float = 300.0
    max_message_bytes: int = DEFAULT_MAX_SIZE

    def event_stream(self) -> StreamConfig:
        """Every drone event and every manager note, in one order"""
        ns = self.namespace
        return StreamConfig(
            name=ns.event_stream,
            description="cobald-remote drone lifecycle events and manager notes",
            subjects=[ns.all_events, ns.all_manager_notes],
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD,
            max_age=self.event_max_age_s,
            max_bytes=self.event_max_bytes,
            max_msgs_per_subject=self.event_max_msgs_per_subject,
            max_msg_size=self.max_message_bytes,
            storage=StorageType.FILE,
            num_replicas=self.replicas,
            duplicate_window=self.duplicate_window_s,
            allow_rollup_hdrs=False,  # a "Nats-Rollup" header is refused, not obeyed
        )

    def record_bucket(self) -> StreamConfig:
        """
        The handshake KV bucket, as the stream nats-py's ``create_key_value`` makes

        One record per drone (history 1), compare-and-set writes only. No
        rollups: a drone may put any header on a write to its own key, and with
        rollups allowed ``Nats-Rollup: all`` there would erase every other drone's
        record (nats-server refuses the header with "rollup not permitted",
        nats-server ``server/stream.go:7094``). Purges through the JetStream API are
        allowed: the manager purges the records of retired drones
        (:mod:`broker.manager.retire`), and drones may not publish to the API.
        The server refuses to lift ``deny_purge`` from a bucket made with it
        (:func:`ensure_stream` keeps it then, and says so).
        """
        return self._bucket(
            self.namespace.record_bucket,
            "cobald-remote drone handshake records",
            max_msg_size=self.max_message_bytes,
            deny_purge=False,
        )

    def manager_bucket(self) -> StreamConfig:
        """
        The manager's own KV bucket (the record proof key), as ``create_key_value`` makes it

        No purges. Drones have no permission to read it (``broker/server/auth/``).
        Its key is written once, by :func:`provision`: the bucket refuses every
        later message on the key's subject (discard new per subject), also a
        server's answer that a drone's reply subject would send there.
        """
        return self._bucket(
            self.namespace.manager_bucket,
            "cobald-remote manager secrets",
            max_msg_size=1024,
            discard_new_per_subject=True,
        )

    def grant_bucket(self) -> StreamConfig:
        """
        The issuer's bootstrap grants (:mod:`broker.manager.grants`), one per drone

        Compare-and-set writes by the manager only; neither drones nor bootstrap
        identities may read it. Purges allowed: a retired drone's grant goes.
        """
        return self._bucket(
            self.namespace.grant_bucket,
            "cobald-remote bootstrap grants",
            max_msg_size=4096,
            deny_purge=False,
        )

    def _bucket(
        self,
        bucket: str,
        description: str,
        *,
        max_msg_size: int,
        deny_purge: bool = True,
        **extra: Any,
    ) -> StreamConfig:
        """A KV bucket's stream as ``create_key_value`` makes it, with no rollups"""
        return StreamConfig(
            name=kv_stream(bucket),
            description=description,
            subjects=[f"{kv_subjects(bucket)}>"],
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.NEW,
            max_msgs_per_subject=1,
            max_msg_size=max_msg_size,
            storage=StorageType.FILE,
            num_replicas=self.replicas,
            duplicate_window=120.0,
            allow_rollup_hdrs=False,
            allow_direct=True,
            deny_delete=True,
            deny_purge=deny_purge,
            **extra,
        )

    def streams(self) -> list[StreamConfig]:
        return [
            self.event_stream(),
            self.record_bucket(),
            self.manager_bucket(),
            self.grant_bucket(),
        ]


#: the fields we set and therefore compare; everything else is the operator's
_COMPARED = (
    "subjects",
    "retention",
    "discard",
    "max_age",
    "max_bytes",
    "max_msgs_per_subject",
    "max_msg_size",
    "storage",
    "num_replicas",
    "duplicate_window",
    "allow_rollup_hdrs",
    "allow_direct",
    "deny_delete",
    "deny_purge",
    "discard_new_per_subject",
)


def _same(want: object, have: object) -> bool:
    if want is None:  # we leave it to the server's default
        return True
    if isinstance(want, list) and isinstance(have, list):
        return sorted(want) == sorted(have)
    if isinstance(want, float) or isinstance(have, float):
        # the server speaks nanoseconds, nats-py seconds; 0 and None both mean "unset"
        return math.isclose(float(want or 0), float(have or 0), abs_tol=1e-6)  # type: ignore[arg-type]
    return want == have


def differences(want: StreamConfig, have: StreamConfig) -> list[str]:
    """Names of the fields in which an existing stream differs from ``want``"""
    return [name for name in _COMPARED if not _same(getattr(want, name), getattr(have, name))]


def _explain(name: str, err: nats.js.errors.APIError) -> str:
    if err.err_code == _SUBJECT_OVERLAP:
        return (
            f"its subjects overlap with another stream on the server ({err.description}); "
            "remove or narrow that stream, or choose another prefix"
        )
    if err.err_code in _JETSTREAM_DISABLED:
        return "the server has no JetStream enabled for this account"
    if err.err_code == _STORAGE_EXCEEDED:
        return (
            f"{err.description}: the stream's max_bytes (times its replicas) does not fit "
            "the account's disk limit (cobald-remote auth init --max-disk) or the "
            "servers' max_file_store; lower the cap or raise the limit"
        )
    return f"{err.description} (code {err.code}, err_code {err.err_code})"


async def ensure_stream(js: JetStreamContext, config: StreamConfig) -> Action:
    """
    Create the stream or update it in place; safe to call on every start

    :raises ProvisioningError: if the server rejects ``config``
    """
    assert config.name is not None
    name = config.name
    try:
        info = await patiently(lambda: js.stream_info(name))
    except nats.js.errors.NotFoundError:
        try:
            # repeated after a transient failure it finds the stream made, which is no error
            await patiently(lambda: js.add_stream(config))
        except nats.js.errors.APIError as err:
            raise ProvisioningError(name, _explain(name, err)) from err
        log.info("created stream %s", name, extra={"stream": name})
        return "created"
    except nats.js.errors.APIError as err:
        raise ProvisioningError(name, _explain(name, err)) from err
    changed = differences(config, info.config)
    if not changed:
        log.debug("stream %s is up to date", name)
        return "unchanged"
    try:
        changed = await _update(js, config, info.config, changed)
    except nats.js.errors.APIError as err:
        raise ProvisioningError(
            name,
            f"the existing stream differs in {', '.join(changed)} and the server refused "
            f"to update it: {_explain(name, err)}",
        ) from err
    if not changed:
        return "unchanged"
    log.info("updated stream %s (%s)", name, ", ".join(changed), extra={"stream": name})
    return "updated"


async def _update(
    js: JetStreamContext, config: StreamConfig, have: StreamConfig, changed: list[str]
) -> list[str]:
    """
    Update in place; a ``deny_purge`` the server will not lift is kept, with a warning

    :returns: the fields changed
    """
    try:
        await patiently(lambda: js.update_stream(config))
        return changed
    except nats.js.errors.APIError as err:
        if err.err_code != _CANNOT_CANCEL_DENY_PURGE or not have.deny_purge:
            raise
    log.warning(
        "stream %s denies purges and the server will not lift that: the records of "
        "retired drones stay in it (recreate the bucket to allow purges, "
        'docs: operations, "Retention")',
        config.name,
        extra={"stream": config.name},
    )
    rest = [name for name in changed if name != "deny_purge"]
    if rest:
        await js.update_stream(dataclasses.replace(config, deny_purge=True))
    return rest


async def check_jetstream(js: JetStreamContext) -> None:
    """
    Fail early and clearly if the server has no JetStream

    :raises ProvisioningError: if JetStream does not answer
    """
    await patiently(lambda: _account_info(js))


async def _account_info(js: JetStreamContext) -> None:
    """
    Ask for the account's JetStream; a server that answers that it is unavailable for now
    (a cluster electing its leader) raises the transient error, to be asked again

    :raises ProvisioningError: if nothing answers, or the server refuses
    """
    no_jetstream = "start nats-server with -js or a jetstream {} block"
    try:
        await js.account_info()
    except nats.js.errors.APIError as err:
        if isinstance(err, nats.js.errors.ServiceUnavailableError) and err.err_code is None:
            # what nats-py makes of "no responders"
            raise ProvisioningError(
                "JetStream", f"the server has no JetStream ({no_jetstream})"
            ) from err
        if is_transient(err):  # JetStream is there, not ready yet
            raise
        raise ProvisioningError("JetStream", _explain("JetStream", err)) from err
    except nats.errors.NoRespondersError as err:
        raise ProvisioningError(
            "JetStream", f"the server has no JetStream ({no_jetstream})"
        ) from err
    except nats.errors.TimeoutError as err:
        # a subject the credentials may not publish to gets no answer, not "no responders"
        raise ProvisioningError(
            "JetStream",
            f"JetStream did not answer: the credentials may not use its API, or the server "
            f"has none ({no_jetstream})",
        ) from err


async def provision(js: JetStreamContext, topology: Topology | None = None) -> dict[str, Action]:
    """
    Bring every stream and bucket of ``topology`` into place

    :returns: what was done to each stream, by name
    :raises ProvisioningError: on the first stream the server will not accept
    """
    topology = topology or Topology()
    await check_jetstream(js)
    actions = {config.name or "": await ensure_stream(js, config) for config in topology.streams()}
    try:
        await load_proof_key(js, topology.namespace)  # made now, before any drone can write
    except HandshakeError as err:
        raise ProvisioningError(topology.namespace.manager_bucket, str(err)) from err
    return actions
