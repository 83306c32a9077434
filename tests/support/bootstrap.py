"""Helpers for the bootstrap tests: a manager with an issuer, site identities, an asker"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import sys
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import nkeys
from nats.aio.client import Client

from broker.manager.issuer import IssuerSettings
from broker.manager.issuer_thread import THREAD_NAME
from broker.manager.registry import Registry
from broker.manager.service import ManagerService, ManagerSettings
from broker.server.auth.authority import (
    create_authority,
    issuer_key_of,
    load_authority,
    save_authority,
    save_issuer_key,
)
from broker.server.auth.credentials import (
    bootstrap_credentials,
    leaf_credentials,
    manager_credentials,
)
from broker.server.embedded import EmbeddedServer
from broker.server.provision import provision
from remote_agent.agent import Agent
from remote_agent.agent.identity import SEED_FILE
from remote_agent.deploy_files import DEPLOY_DIR
from remote_agent.protocol import events as ev
from remote_agent.protocol.bootstrap import (
    EnrollRequest,
    Issued,
    IssueRefused,
    Refusal,
    RenewRequest,
    decode_bootstrap_reply,
    signing_input,
)
from remote_agent.protocol.connect import close, connect
from remote_agent.protocol.events import DroneState
from remote_agent.protocol.names import Namespace, bootstrap_inbox
from support import flooder
from support.agent import SITE
from support.agent import settings as agent_settings
from support.processes import start_process
from support.servers import hub_and_leaf, uncomment
from support.waiting import wait_until

NS = Namespace()
#: the drone a test bootstraps, unless it names another
DRONE = "site1-00000000aa"


def manager_settings(
    tmp_path: Path,
    server: EmbeddedServer,
    authority: Path,
    *,
    domain: str | None = None,
    **issuer: float,
) -> ManagerSettings:
    """The manager on ``server`` with the issuer of ``authority``, with ``issuer`` settings"""
    return ManagerSettings(
        servers=[server.url],
        creds=str(tmp_path / "manager.creds"),
        domain=domain,
        retry_s=0.2,
        issuer=IssuerSettings(key=issuer_key(tmp_path, authority), **issuer),
    )


def issuer_key(tmp_path: Path, authority: Path) -> Path:
    """The issuer's key file (``auth issuer-key``) of ``authority``"""
    path = tmp_path / "issuer-key.json"
    save_issuer_key(issuer_key_of(load_authority(authority)), path)
    return path


@contextlib.asynccontextmanager
async def secured_hub_and_leaf(
    tmp_path: Path,
) -> AsyncIterator[tuple[EmbeddedServer, EmbeddedServer, Path]]:
    """
    A hub (single.conf) and a site's leaf node (leaf.conf), both in operator mode

    As ``docs/deployment.md`` sets them up: the same authority's server configuration on
    both, the leaf's remote on its own credentials; JetStream domain ``hub``, provisioned.
    Yields the hub, the leaf and the authority file; ``tmp_path / "manager.creds"`` holds
    the manager's credentials.
    """
    authority_file = tmp_path / "authority.json"
    save_authority(create_authority(), authority_file)
    authority = load_authority(authority_file)
    nats_dir = DEPLOY_DIR / "nats"
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "auth.conf").write_text(authority.server_config())
    (conf / "single.conf").write_text((nats_dir / "single.conf").read_text())
    (conf / "hub.conf").write_text('include "single.conf"\ninclude "auth.conf"\n')
    leaf_creds, manager = conf / "leaf.creds", tmp_path / "manager.creds"
    leaf_creds.write_text(leaf_credentials(authority, SITE))
    manager.write_text(manager_credentials(authority))
    leaf_conf = uncomment(
        (nats_dir / "leaf.conf").read_text(), "credentials:", "account:", 'include "auth.conf"'
    )
    leaf_conf = leaf_conf.replace("/etc/cobald-remote/nats/site1-leaf.creds", str(leaf_creds))
    (conf / "leaf.conf").write_text(
        leaf_conf.replace("ACCOUNT_PUBLIC_KEY", authority.account_public)
    )
    hub, leaf = hub_and_leaf(tmp_path, conf / "hub.conf", conf / "leaf.conf")
    async with hub, leaf:
        nc = await connect(hub.url, user_credentials=str(manager))
        try:
            await provision(nc.jetstream())
        finally:
            await close(nc)
        yield hub, leaf, authority_file


def site_bootstrap(tmp_path: Path, authority: Path, site: str = SITE) -> Path:
    path = tmp_path / f"bootstrap-{site}.creds"
    path.write_text(bootstrap_credentials(load_authority(authority), NS, site))
    return path


def bootstrapped(
    tmp_path: Path, server: EmbeddedServer, authority: Path, token: str, drone: str = DRONE
) -> Agent:
    """An in-process agent that bootstraps with ``token`` over the site's identity"""
    return Agent(
        agent_settings(
            tmp_path,
            server.url,
            drone,
            bootstrap_token=token,
            bootstrap_creds=site_bootstrap(tmp_path, authority),
        )
    )


async def minted(service: ManagerService, drone: str = DRONE, site: str = SITE) -> str:
    await asyncio.wait_for(service.ready.wait(), 30)
    assert service.issuer is not None
    return await service.issuer.mint(site, drone)


class Asker:
    """A client on a site's bootstrap identity that sends hand-made requests"""

    def __init__(self, url: str, creds: Path, site: str = SITE) -> None:
        self.url, self.creds, self.site = url, creds, site
        #: what the server said about this client's requests (permission violations)
        self.errors: list[str] = []
        self.key = nkeys.from_seed(nkeys.encode_seed(bytes(32), nkeys.PREFIX_BYTE_USER))

    async def _note(self, err: Exception) -> None:
        self.errors.append(str(err))

    def with_seed_of(self, spool_dir: Path) -> Asker:
        """Ask with the key a drone made and kept in its spool directory"""
        self.key = nkeys.from_seed(bytearray((spool_dir / SEED_FILE).read_bytes().strip()))
        return self

    def with_key(self, seed_byte: int) -> Asker:
        self.key = nkeys.from_seed(
            nkeys.encode_seed(bytes([seed_byte]) * 32, nkeys.PREFIX_BYTE_USER)
        )
        return self

    @property
    def public(self) -> str:
        public: bytes = self.key.public_key
        return public.decode()

    def enroll(
        self, drone: str, token: str, *, site: str | None = None, at: dt.datetime | None = None
    ) -> EnrollRequest:
        site = site or self.site
        at = at or dt.datetime.now(dt.UTC)
        signature = self.key.sign(signing_input("enroll", site, drone, self.public, at))
        return EnrollRequest(
            site=site, drone=drone, public_key=self.public, at=at, signature=signature, token=token
        )

    def renew(self, drone: str) -> RenewRequest:
        at = dt.datetime.now(dt.UTC)
        signature = self.key.sign(signing_input("renew", self.site, drone, self.public, at))
        return RenewRequest(
            site=self.site, drone=drone, public_key=self.public, at=at, signature=signature
        )

    @contextlib.asynccontextmanager
    async def connected(self) -> AsyncIterator[Client]:
        """One connection on the site's bootstrap identity, for several requests"""
        nc = await connect(
            self.url,
            user_credentials=str(self.creds),
            inbox_prefix=bootstrap_inbox(self.site),
            allow_reconnect=False,
            error_cb=self._note,
        )
        try:
            yield nc
        finally:
            await close(nc)

    async def ask(
        self,
        request: object,
        subject_site: str | None = None,
        nc: Client | None = None,
        timeout_s: float = 2.0,
    ) -> Issued | IssueRefused:
        """Send ``request`` (a message, or raw bytes) to the issuer and decode its answer"""
        data = request if isinstance(request, bytes) else ev.encode(request)  # type: ignore[arg-type]
        subject = NS.bootstrap(subject_site or self.site)
        if nc is not None:
            return decode_bootstrap_reply((await nc.request(subject, data, timeout_s)).data)
        async with self.connected() as own:
            msg = await own.request(subject, data, timeout_s)
        return decode_bootstrap_reply(msg.data)


@contextlib.asynccontextmanager
async def flooding(
    url: str, creds: Path, body: bytes, site: str = SITE
) -> AsyncIterator[asyncio.subprocess.Process]:
    """
    A process on ``site``'s bootstrap identity sending ``body`` to the issuer, as fast as
    one client can (:mod:`support.flooder`), from once it is flooding until the block ends
    """
    body_file = creds.with_name(f"flood-{site}.bin")
    body_file.write_bytes(body)
    process = await start_process(
        sys.executable,
        Path(flooder.__file__),
        url,
        creds,
        NS.bootstrap(site),
        f"{bootstrap_inbox(site)}.flood",
        body_file,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        started = await asyncio.wait_for(process.stdout.readline(), 30)
        assert started == b"flooding\n", started
        yield process
    finally:
        if process.returncode is None:
            process.terminate()
        await process.wait()


def issuer_threads() -> list[threading.Thread]:
    """The issuers' threads that run in this process (one per running manager)"""
    return [thread for thread in threading.enumerate() if thread.name == THREAD_NAME]


def up(registry: Registry, drone: str = DRONE, site: str = SITE) -> bool:
    """Whether the drone's agent is up and idle, as the manager's registry has it"""
    view = registry.view(site, drone)
    return view is not None and view.state in (DroneState.IDLE, DroneState.BUSY)


def refused(reply: Issued | IssueRefused, reason: Refusal) -> None:
    assert isinstance(reply, IssueRefused), reply
    assert reply.reason is reason, reply


async def violations(
    url: str,
    creds: Path,
    inbox_prefix: str,
    *,
    publish: Sequence[str] = (),
    subscribe: Sequence[str] = (),
) -> None:
    """With ``creds``: each publish and each subscription is a permissions violation"""
    errors: list[str] = []

    async def note(err: Exception) -> None:
        errors.append(str(err))

    nc = await connect(url, user_credentials=str(creds), inbox_prefix=inbox_prefix, error_cb=note)
    try:
        for subject in publish:
            await nc.publish(subject, b"x")
        for subject in subscribe:
            await nc.subscribe(subject)
        await nc.flush()
        expected = len(publish) + len(subscribe)
        await wait_until(lambda: len(errors) >= expected, 10, f"{expected} violations")
    finally:
        await close(nc)
    assert all("permissions violation" in error.lower() for error in errors), errors
    for subject in (*publish, *subscribe):
        assert any(subject.lower() in error for error in errors), (subject, errors)
