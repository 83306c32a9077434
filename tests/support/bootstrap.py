"""Helpers for the bootstrap tests: a manager with an issuer, site identities, an asker"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator
from pathlib import Path

import nkeys
from nats.aio.client import Client

from broker.manager.issuer import IssuerSettings
from broker.manager.service import ManagerService, ManagerSettings
from broker.server.auth.authority import load_authority
from broker.server.auth.credentials import bootstrap_credentials
from broker.server.embedded import EmbeddedServer
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
from remote_agent.protocol.names import Namespace, bootstrap_inbox
from support.agent import SITE

NS = Namespace()
#: the drone a test bootstraps, unless it names another
DRONE = "site1-00000000aa"


def manager_settings(
    tmp_path: Path, server: EmbeddedServer, authority: Path, **issuer: float
) -> ManagerSettings:
    return ManagerSettings(
        servers=[server.url],
        creds=str(tmp_path / "manager.creds"),
        retry_s=0.2,
        issuer=IssuerSettings(authority=authority, **issuer),
    )


def site_bootstrap(tmp_path: Path, authority: Path, site: str = SITE) -> Path:
    path = tmp_path / f"bootstrap-{site}.creds"
    path.write_text(bootstrap_credentials(load_authority(authority), NS, site))
    return path


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
        self, request: object, subject_site: str | None = None, nc: Client | None = None
    ) -> Issued | IssueRefused:
        """Send ``request`` (a message, or raw bytes) to the issuer and decode its answer"""
        data = request if isinstance(request, bytes) else ev.encode(request)  # type: ignore[arg-type]
        subject = NS.bootstrap(subject_site or self.site)
        if nc is not None:
            return decode_bootstrap_reply((await nc.request(subject, data, timeout=2)).data)
        async with self.connected() as own:
            msg = await own.request(subject, data, timeout=2)
        return decode_bootstrap_reply(msg.data)


def refused(reply: Issued | IssueRefused, reason: Refusal) -> None:
    assert isinstance(reply, IssueRefused), reply
    assert reply.reason is reason, reply
