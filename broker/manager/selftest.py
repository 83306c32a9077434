"""
The site self-test: one stand-in drone's whole life against the operator's server and manager

Its rule: every step is one the product takes anyway, through the code that takes it. The
drone is the real agent (``cobald-remote agent run --no-startd``) around a stand-in worker
process; it gets its identity from the running manager's issuer (a token minted in the grants
bucket, as the TARDIS glue mints one at submit) or from a per-drone ``.creds`` file; the drain
is the control API's (as ``cobald-remote drain``), the end and the timeline are read as
``cobald-remote timeline`` reads them, and the running manager is seen through its durable
consumer's acknowledgements. The drone's name starts with :data:`SELFTEST_PREFIX`; nothing of
another drone is read for writing, and what the test wrote (its record, grant and events) is
purged at the end, as the manager retires a drone.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from broker.errors import BrokerError
from broker.manager.control import Control
from broker.manager.grants import GrantStore
from broker.manager.registry import Registry
from broker.manager.timeline import Row, read_timeline
from broker.server.auth.jwt import creds_claims
from broker.server.connection import connect_once
from broker.server.durable import DEFAULT_DURABLE
from remote_agent.protocol.connect import close, credentials_refused
from remote_agent.protocol.environment import BUS_SETTINGS_ENV, TARDIS_SETTINGS_ENV
from remote_agent.protocol.errors import HandshakeError
from remote_agent.protocol.events import RecordPhase
from remote_agent.protocol.names import Namespace, check_token, kv_stream

#: every self-test drone's name starts with it; no other drone is ever written
SELFTEST_PREFIX: Final = "selftest-"
#: how the self-test drone's connections and its worker are named
CLIENT_NAME: Final = "cobald-remote-selftest"
#: the stand-in worker: a process that runs until it is told to end (SIGTERM)
STAND_IN_WORKER: Final = (
    "import signal, sys, time; "
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
    "time.sleep(86400)"
)
#: seconds between the stand-in drone's heartbeats
HEARTBEAT_S: Final = 5.0
#: seconds the drain gives the stand-in drone (it runs no payload: it drains at once)
DRAIN_S: Final = 300.0
#: seconds a minted token waits for the stand-in drone
TOKEN_VALID_S: Final = 600.0
#: lines of the agent's log a failed step quotes
LOG_LINES: Final = 5
#: the events the agent publishes from its start to the claim, without a startd
FIRST_EVENTS: Final = ("agent_started", "worker_started", "gate_opened")
#: the variables of the operator's environment the stand-in agent must not inherit
_DRONE_ENV: Final = frozenset(
    {*BUS_SETTINGS_ENV.values(), *TARDIS_SETTINGS_ENV.values(), "TardisDroneUuid"}
)


@dataclass(slots=True)
class Step:
    """One step: passed (``ok``), failed, or not run (``ok is None``); what to do if it failed"""

    name: str
    ok: bool | None = None
    detail: str = ""
    fix: str = ""


@dataclass(frozen=True, slots=True)
class Options:
    """What the operator gave: the bus (as every command takes it) and the drone's identity"""

    server: str
    creds: str | None
    prefix: str
    domain: str | None
    site: str | None = None
    #: a drone's ``.creds`` file (``auth drone selftest-...``)
    drone_creds: str | None = None
    #: the site's bootstrap ``.creds`` file (``auth bootstrap SITE``)
    bootstrap_creds: str | None = None
    #: seconds each step waits for what it waits for
    timeout_s: float = 60.0
    #: the agent's command line: ``cobald-remote`` as this interpreter runs it
    cli: tuple[str, ...] = (sys.executable, "-m", "broker.cli")


@dataclass(slots=True)
class Result:
    """The self-test's outcome: its steps in order, the drone's timeline, what stays behind"""

    site: str
    drone: str
    mode: str
    steps: list[Step] = field(default_factory=list)
    timeline: list[Row] = field(default_factory=list)
    remains: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(step.ok is not False for step in self.steps) and any(
            step.ok for step in self.steps
        )

    def to_json(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {
            "passed": self.passed,
            "site": self.site,
            "drone": self.drone,
            "mode": self.mode,
            "steps": [asdict(step) for step in self.steps],
            "timeline": [asdict(row) for row in self.timeline],
            "remains": self.remains,
        }


class _Failed(Exception):
    """A step failed; its :class:`Step` says why and what to do; later steps are not run"""


#: what a step may fail with besides :class:`_Failed`: said in its detail
_STEP_ERRORS: Final = (BrokerError, HandshakeError, nats.errors.Error, OSError, TimeoutError)


def _mode(options: Options) -> str:
    if options.drone_creds and options.bootstrap_creds:
        raise BrokerError("give --drone-creds or --bootstrap-creds, not both")
    if options.bootstrap_creds:
        return "bootstrap"
    return "drone-creds" if options.drone_creds else "anonymous"


def _command(options: Options, *words: str) -> str:
    """A ``cobald-remote`` command line with the options the operator gave this one"""
    line = ["cobald-remote", *words, "--server", options.server]
    if options.creds:
        line += ["--creds", options.creds]
    if options.prefix != Namespace().prefix:
        line += ["--prefix", options.prefix]
    if options.domain:
        line += ["--domain", options.domain]
    return " ".join(line)


def _kind(row: Row) -> str:
    """The kind of event a timeline row shows (``gate_opened``), ``""`` for the drone's end"""
    return row.drone_event.split(" ")[0].rstrip(":") if row.source == "agent" else ""


class SelfTest:
    """One run of the self-test (:func:`run_selftest`)"""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.namespace = Namespace(options.prefix)
        self.mode = _mode(options)
        site, drone = self._identity()
        self.result = Result(site=site, drone=drone, mode=self.mode)
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._control: Control | None = None
        self._grants: GrantStore | None = None
        self._agent: asyncio.subprocess.Process | None = None
        self._workdir = Path(tempfile.mkdtemp(prefix="cobald-remote-selftest-"))
        self._log = self._workdir / "agent.log"
        self._wrote: set[str] = set()  # record, grant, events
        self._token = ""  # the bootstrap token minted for the drone
        #: the agent's option for its identity, its file's path made absolute
        self._identity_options = (
            ["--creds", os.path.abspath(options.drone_creds)]
            if options.drone_creds
            else ["--bootstrap-creds", os.path.abspath(options.bootstrap_creds)]
            if options.bootstrap_creds
            else []
        )

    # ------------------------------------------------------------------ identity

    def _identity(self) -> tuple[str, str]:
        """The drone's site and name: from its ``.creds`` file, else a new selftest name"""
        if self.options.drone_creds:
            return self._creds_identity(self.options.drone_creds)
        if not self.options.site:
            raise BrokerError("give --site (the site the stand-in drone belongs to)")
        site = check_token(self.options.site, "site")
        return site, SELFTEST_PREFIX + secrets.token_hex(5)

    def _creds_identity(self, path: str) -> tuple[str, str]:
        """The site and drone whose events a drone's ``.creds`` file may publish"""
        claims = self._claims(path, "--drone-creds")
        allowed = claims.get("nats", {}).get("pub", {}).get("allow", [])
        found = set()
        for subject in allowed if isinstance(allowed, list) else []:
            with contextlib.suppress(Exception):
                site, drone, _ = self.namespace.parse_event_subject(subject)
                found.add((site, drone))
        if len(found) != 1:
            raise BrokerError(
                f"--drone-creds {path} are not one drone's credentials (their user may publish "
                f"the events of {len(found)} drones under prefix {self.namespace.prefix!r}): "
                f"make them with cobald-remote auth drone {SELFTEST_PREFIX}0123456789 --site SITE "
                "--authority ... --out FILE"
            )
        site, drone = found.pop()
        if self.options.site and self.options.site != site:
            raise BrokerError(
                f"--drone-creds {path} are drone {drone!r}'s of site {site!r}, not of site "
                f"{self.options.site!r}: make them with --site {self.options.site}"
            )
        if not drone.startswith(SELFTEST_PREFIX):
            raise BrokerError(
                f"--drone-creds {path} are the credentials of drone {drone!r}, which is not a "
                f"self-test drone: the self-test drains and purges its drone, so it runs only as "
                f"a drone whose name starts with {SELFTEST_PREFIX!r} (cobald-remote auth drone "
                f"{SELFTEST_PREFIX}0123456789 --site {site} --authority ... --out FILE)"
            )
        return site, drone

    @staticmethod
    def _claims(path: str, option: str) -> dict[str, Any]:
        try:
            return creds_claims(Path(path).read_text())
        except OSError as err:
            raise BrokerError(f"cannot read {option} {path}: {err.strerror or err}") from None
        except BrokerError as err:
            raise BrokerError(f"{option} {path}: {err}") from None

    # ------------------------------------------------------------------ running

    async def run(self) -> Result:
        """Every step in order until one fails, then the clean-up; never raises for a step"""
        steps: list[tuple[str, Callable[[Step], Awaitable[None]]]] = [
            ("server", self._server),
            ("provisioned", self._provisioned),
            ("manager", self._manager),
            ("credentials", self._credentials),
            ("agent", self._start_agent),
        ]
        if self.mode == "bootstrap":
            steps.append(("enrolled", self._enrolled))
        steps += [
            ("claim", self._claim),
            ("events", self._events),
            ("drain", self._drain),
            ("end", self._end),
            ("timeline", self._timeline),
        ]
        failed = False
        try:
            for name, run in steps:
                step = Step(name)
                self.result.steps.append(step)
                if failed:
                    continue
                try:
                    await run(step)
                    step.ok = True
                except _Failed:
                    step.ok, failed = False, True
                except _STEP_ERRORS as err:
                    step.ok, failed = False, True
                    step.detail = step.detail or f"{type(err).__name__}: {err}"
        finally:  # also when cancelled (Ctrl-C): its agent runs in a session of its own
            await self._clean_up()
        return self.result

    def _fail(self, step: Step, detail: str, fix: str) -> _Failed:
        step.detail, step.fix = detail, fix
        return _Failed(detail)

    async def _wait(self, condition: Callable[[], Awaitable[bool]], *, agent: bool = True) -> bool:
        """Whether ``condition`` came true within the timeout (``False`` if the agent ended)"""
        deadline = time.monotonic() + self.options.timeout_s
        while time.monotonic() < deadline:
            if await condition():
                return True
            if agent and self._agent is not None and self._agent.returncode is not None:
                return await condition()
            await asyncio.sleep(0.2)
        return False

    def _agent_said(self) -> str:
        """The agent's last warnings and errors (its exit code if it ended), for a failed step"""
        lines = []
        with contextlib.suppress(OSError):
            for text in self._log.read_text(errors="replace").splitlines():
                try:
                    line = json.loads(text)
                except ValueError:
                    if text.strip():
                        lines.append(text.strip())
                    continue
                if isinstance(line, dict) and line.get("level") in ("WARNING", "ERROR"):
                    lines.append(str(line.get("message", "")))
        ended = ""
        if self._agent is not None and self._agent.returncode is not None:
            ended = f"the agent exited with {self._agent.returncode}"
        said = "; ".join(lines[-LOG_LINES:])
        return "; ".join(part for part in (ended, f"its log: {said}" if said else "") if part)

    # ------------------------------------------------------------------ the steps

    async def _server(self, step: Step) -> None:
        options = self.options
        try:
            self._nc = await connect_once(options.server, options.creds, name=CLIENT_NAME)
        except BrokerError as err:
            if credentials_refused(err.__cause__) or "refused the credentials" in str(err):
                which = options.creds or "(none given)"
                raise self._fail(
                    step,
                    str(err),
                    f"the server does not accept --creds {which}: give the manager's "
                    "credentials (cobald-remote auth manager --authority ... --out FILE), made "
                    "from the authority whose auth.conf the server includes",
                ) from None
            raise self._fail(
                step,
                str(err),
                f"start the NATS server or correct --server {options.server} "
                "(systemctl status cobald-remote-nats; the URL of its client port)",
            ) from None
        self._js = self._nc.jetstream(domain=options.domain)
        step.detail = f"connected to {options.server}" + (
            f" with {options.creds}" if options.creds else " without credentials"
        )

    async def _provisioned(self, step: Step) -> None:
        assert self._js is not None
        ns = self.namespace
        wanted = [ns.event_stream, ns.record_stream, kv_stream(ns.manager_bucket)]
        if self.mode == "bootstrap":
            wanted.append(kv_stream(ns.grant_bucket))
        missing = []
        for stream in wanted:
            try:
                await self._js.stream_info(stream)
            except nats.js.errors.NotFoundError:
                missing.append(stream)
            except (nats.errors.TimeoutError, TimeoutError, nats.js.errors.APIError) as err:
                raise self._refused(step, f"cannot read stream {stream}: {err!r}") from None
        if missing:
            raise self._fail(
                step,
                f"missing on {self.options.server}: {', '.join(missing)}",
                f"run {_command(self.options, 'broker', 'init')}",
            )
        step.detail = "streams and buckets: " + ", ".join(wanted)

    def _refused(self, step: Step, detail: str) -> _Failed:
        """A request refused or unanswered: not the manager's credentials, or no JetStream"""
        assert self._nc is not None
        last = self._nc.last_error
        if last is not None and "permissions violation" in str(last).lower():
            return self._fail(
                step,
                f"{detail}: {last}",
                f"--creds {self.options.creds} are not the manager's: give the manager's "
                "credentials (cobald-remote auth manager --authority ... --out FILE)",
            )
        return self._fail(
            step,
            detail,
            "check that the server runs JetStream"
            + (f" in domain {self.options.domain}" if self.options.domain else "")
            + f", then run {_command(self.options, 'broker', 'init')}",
        )

    async def _manager(self, step: Step) -> None:
        assert self._js is not None and self._nc is not None
        try:
            info = await self._js.consumer_info(self.namespace.event_stream, DEFAULT_DURABLE)
        except nats.js.errors.NotFoundError:
            raise self._fail(
                step,
                f"no consumer {DEFAULT_DURABLE} on {self.namespace.event_stream}: no manager has "
                "read this stream",
                "start the manager: the COBalD daemon with this bus in its bus: section "
                "(systemctl start cobald-remote-manager; cobald-remote check-config FILE)",
            ) from None
        registry = Registry(self.namespace)
        try:
            self._control = await Control.open(self._nc, registry, domain=self.options.domain)
        except (HandshakeError, nats.errors.Error) as err:
            raise self._refused(step, f"cannot open the handshake buckets: {err}") from None
        if self.mode == "bootstrap":
            try:
                self._grants = await GrantStore.open(self._js, self.namespace)
            except HandshakeError as err:
                raise self._fail(
                    step, str(err), f"run {_command(self.options, 'broker', 'init')}"
                ) from None
        step.detail = (
            f"consumer {DEFAULT_DURABLE} has {info.num_pending} messages pending; "
            "whether the manager reads them shows with the drone's events"
        )

    async def _credentials(self, step: Step) -> None:
        site, drone = self.result.site, self.result.drone
        if self.mode == "anonymous":
            await self._try_connect(step, None, "")
            step.detail = (
                f"drone {site}/{drone} connects without credentials: the server accepts "
                "anonymous clients, so everyone who reaches it has every permission"
            )
            return
        if self.mode == "drone-creds":
            assert self.options.drone_creds is not None
            await self._try_connect(step, self.options.drone_creds, "--drone-creds")
            step.detail = f"{self.options.drone_creds} are drone {site}/{drone}'s"
            return
        path = self.options.bootstrap_creds
        assert path is not None and self._grants is not None
        claims = self._claims(path, "--bootstrap-creds")
        allowed = claims.get("nats", {}).get("pub", {}).get("allow", [])
        subject = self.namespace.bootstrap(site)
        if subject not in (allowed if isinstance(allowed, list) else []):
            raise self._fail(
                step,
                f"{path} may not publish to {subject} (it allows {allowed})",
                f"--bootstrap-creds must be site {site}'s bootstrap credentials: "
                f"cobald-remote auth bootstrap {site} --authority ... --out FILE"
                + (f" --prefix {self.options.prefix}" if self.options.prefix != "cobald" else ""),
            )
        await self._try_connect(step, path, "--bootstrap-creds")
        self._token = await self._grants.mint(site, drone, TOKEN_VALID_S, dt.datetime.now(dt.UTC))
        self._wrote.add("grant")
        step.detail = f"{path} are site {site}'s bootstrap credentials; a token minted for {drone}"

    async def _try_connect(self, step: Step, creds: str | None, option: str) -> None:
        try:
            nc = await connect_once(self.options.server, creds, name=CLIENT_NAME)
        except BrokerError as err:
            if option:
                fix = (
                    f"the server does not accept {option} {creds}: make them again from the "
                    "authority whose auth.conf the server includes (an expired or revoked file "
                    "is refused too)"
                )
            else:
                fix = (
                    "the server wants credentials: give the stand-in drone some, "
                    "--bootstrap-creds (a site's, cobald-remote auth bootstrap SITE) or "
                    f"--drone-creds (cobald-remote auth drone {SELFTEST_PREFIX}0123456789 "
                    "--site SITE)"
                )
            raise self._fail(step, str(err), fix) from None
        await close(nc)

    async def _start_agent(self, step: Step) -> None:
        options = self.options
        site, drone = self.result.site, self.result.drone
        argv = [
            *options.cli,
            "agent",
            "run",
            "--drone",
            drone,
            "--site",
            site,
            "--prefix",
            options.prefix,
            "--no-startd",
            "--heartbeat",
            str(HEARTBEAT_S),
            "--spool-dir",
            str(self._workdir / "spool"),
            "--log-format",
            "json",
        ]
        for url in options.server.split(","):
            if url.strip():
                argv += ["--url", url.strip()]
        if options.domain:
            argv += ["--domain", options.domain]
        env = {key: value for key, value in os.environ.items() if key not in _DRONE_ENV}
        env.pop("COBALD_REMOTE_TOKEN", None)
        env.pop("COBALD_REMOTE_BOOTSTRAP_CREDS", None)
        argv += self._identity_options
        if self.mode == "bootstrap":
            env["COBALD_REMOTE_TOKEN"] = self._token
        argv += ["--", sys.executable, "-c", STAND_IN_WORKER]
        with self._log.open("wb") as log:
            self._agent = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,  # a Ctrl-C reaches the self-test alone, which stops it
            )
        step.detail = (
            f"agent (pid {self._agent.pid}) for {site}/{drone} around a stand-in worker, "
            f"spool {self._workdir / 'spool'}"
        )

    async def _enrolled(self, step: Step) -> None:
        assert self._grants is not None
        site, drone = self.result.site, self.result.drone
        grants = self._grants

        async def enrolled() -> bool:
            found = await grants.get(site, drone)
            return found is not None and found[0].public_key is not None

        if not await self._wait(enrolled):
            said = self._agent_said()
            fix = (
                "the manager's issuer did not answer: run the manager with bus.bootstrap_key "
                "set in its COBalD configuration (cobald-remote check-config FILE shows it), "
                "and check its log"
            )
            if "refused" in said:
                fix = "the issuer refused the drone (see its log line above and the manager's)"
            raise self._fail(
                step, f"no enrollment within {self.options.timeout_s:.0f}s; {said}", fix
            )
        step.detail = f"the issuer signed {drone} an identity for its own key"

    async def _claim(self, step: Step) -> None:
        assert self._control is not None
        store = self._control.store
        site, drone = self.result.site, self.result.drone

        async def claimed() -> bool:
            found = await store.read(site, drone)
            if found is not None:
                self._wrote.add("record")
            return found is not None and found.record.phase is RecordPhase.UP

        if not await self._wait(claimed):
            said = self._agent_said()
            fix = "see the agent's log above; docs: operations.md, 'Errors you may see'"
            if "permissions violation" in said.lower():
                fix = (
                    f"the server refused the drone's own subjects: the credentials are not "
                    f"{site}/{drone}'s"
                    + (f" with domain {self.options.domain}" if self.options.domain else "")
                    + f" (cobald-remote auth drone {drone} --site {site}"
                    + (f" --domain {self.options.domain}" if self.options.domain else "")
                    + ")"
                )
            elif "provisioned" in said or "bucket" in said:
                fix = f"run {_command(self.options, 'broker', 'init')}"
            raise self._fail(
                step, f"no claimed record within {self.options.timeout_s:.0f}s; {said}", fix
            )
        step.detail = f"record {self.namespace.record_key(site, drone)} is up, the agent's claim"

    async def _rows(self) -> list[Row]:
        assert self._nc is not None
        return await read_timeline(
            self._nc,
            self.namespace,
            self.result.drone,
            self.result.site,
            domain=self.options.domain,
        )

    async def _events(self, step: Step) -> None:
        assert self._js is not None
        rows: list[Row] = []

        async def published() -> bool:
            nonlocal rows
            rows = await self._rows()
            seen = {_kind(row) for row in rows}
            return all(kind in seen for kind in FIRST_EVENTS)

        if not await self._wait(published):
            raise self._fail(
                step,
                f"events in {self.namespace.event_stream}: "
                f"{[row.drone_event for row in rows]}; {self._agent_said()}",
                "see the agent's log above",
            )
        self._wrote.add("events")
        await self._manager_read(step, rows)
        step.detail = (
            f"{len(rows)} events stored ({', '.join(dict.fromkeys(map(_kind, rows)))}), "
            f"read and acknowledged by the manager's consumer {DEFAULT_DURABLE}"
        )

    async def _manager_read(self, step: Step, rows: list[Row]) -> None:
        """Wait until the running manager's durable consumer acknowledged every row's event"""
        assert self._js is not None
        js, stream = self._js, self.namespace.event_stream
        last = max(row.stream_seq or 0 for row in rows)
        acked = 0

        async def consumed() -> bool:
            nonlocal acked
            info = await js.consumer_info(stream, DEFAULT_DURABLE)
            acked = info.ack_floor.stream_seq if info.ack_floor else 0
            return acked >= last

        if not await self._wait(consumed, agent=False):
            raise self._fail(
                step,
                f"{len(rows)} events stored (the last at stream sequence {last}), but the "
                f"manager's consumer {DEFAULT_DURABLE} acknowledged only up to {acked}",
                "the manager is not running or not reading: systemctl status "
                "cobald-remote-manager, and its log (journalctl -u cobald-remote-manager)",
            )

    async def _drain(self, step: Step) -> None:
        assert self._control is not None
        site, drone = self.result.site, self.result.drone
        deadline = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=DRAIN_S)
        result = await self._control.drain(site, drone, deadline, "cobald-remote selftest")
        if result.outcome not in ("accepted", "drained"):
            raise self._fail(
                step,
                f"drain {result.outcome}: {result.detail}; {self._agent_said()}",
                "the agent did not answer its command subject: check that the drone's "
                "credentials allow it (cobald-remote auth drone) and the agent's log",
            )
        step.detail = f"drain {result.outcome}, deadline in {DRAIN_S:.0f}s"

    async def _end(self, step: Step) -> None:
        assert self._control is not None and self._agent is not None
        store = self._control.store
        agent = self._agent
        site, drone = self.result.site, self.result.drone
        try:
            code = await asyncio.wait_for(agent.wait(), self.options.timeout_s)
        except TimeoutError:
            raise self._fail(
                step,
                f"the agent still runs {self.options.timeout_s:.0f}s after its drain; "
                f"{self._agent_said()}",
                "see the agent's log above",
            ) from None
        found = await store.read(site, drone)
        phase = found.record.phase if found is not None else None
        if code != 0 or phase is not RecordPhase.DRAINED:
            raise self._fail(
                step,
                f"the agent exited with {code}, its record is {phase}; {self._agent_said()}",
                "see the agent's log above",
            )
        step.detail = "the agent exited with 0; its record says drained"

    async def _timeline(self, step: Step) -> None:
        rows: list[Row] = []

        async def ended() -> bool:
            nonlocal rows
            rows = await self._rows()
            return any(row.source == "manager" for row in rows)

        if not await self._wait(ended, agent=False):
            raise self._fail(
                step,
                f"the timeline shows no end: {[row.drone_event for row in rows]}",
                "the drone's last events did not reach the stream; see the agent's log",
            )
        self.result.timeline = rows
        await self._manager_read(step, rows)
        step.detail = (
            f"{len(rows)} rows, ending with: {rows[-1].drone_event}; the manager read them"
        )

    # ------------------------------------------------------------------ clean-up

    async def _clean_up(self) -> None:
        """Stop the agent if it runs; purge the drone's record, grant and events; say what stays"""
        remains = self.result.remains
        agent = self._agent
        if agent is not None and agent.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(agent.wait(), 30)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(agent.pid, signal.SIGKILL)
                await agent.wait()
        site, drone = self.result.site, self.result.drone
        ns = self.namespace
        if self._js is not None:
            purges = [
                ("record", ns.record_stream, ns.record_subject(site, drone)),
                ("events", ns.event_stream, f"{ns.drone_root(site, drone)}.>"),
            ]
            for what, stream, subject in purges:
                if what not in self._wrote:
                    continue
                try:
                    await self._js.purge_stream(stream, subject=subject)
                except (nats.errors.Error, TimeoutError) as err:
                    remains.append(f"its {what} ({subject} in {stream}: purge refused, {err})")
            if self._grants is not None and "grant" in self._wrote:
                try:
                    await self._grants.purge(site, drone)
                except (nats.errors.Error, TimeoutError) as err:
                    remains.append(f"its bootstrap grant ({err})")
        if self._wrote:
            remains.append(
                f"the running manager keeps {site}/{drone} in memory, ended, until it retires "
                "it (bus.retain_ended_s); a restarted manager does not see it"
            )
        if self._nc is not None:
            await close(self._nc)
        shutil.rmtree(self._workdir, ignore_errors=True)


async def run_selftest(options: Options) -> Result:
    """
    Run the self-test (:class:`SelfTest`)

    :raises BrokerError: if the options contradict each other or name a drone that is not
        a self-test drone; a failed step is reported in the result instead
    """
    return await SelfTest(options).run()
