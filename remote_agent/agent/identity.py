"""
The drone's own identity: a key made on the drone, a short-lived JWT from the issuer

:class:`BootstrapIdentity` makes the drone's user key (its seed is kept only in the
private spool directory, mode 0600, so that a restarted agent asks for the same key),
trades the one-time token for a JWT over the site's bootstrap identity, and renews the
JWT at half its lifetime, counted on the monotonic clock from the issuer's answer (the
drone's wall clock may be wrong); the connection then reconnects with the new one. Its rule: a
refusal the issuer calls permanent cuts the drone off (gate shut, self-drain); anything
else is retried, and the events wait in the spool.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

import nats.errors
import nkeys

from remote_agent.errors import IdentityError
from remote_agent.protocol.bootstrap import (
    EnrollRequest,
    Issued,
    IssueRefused,
    RenewRequest,
    decode_bootstrap_reply,
    signing_input,
)
from remote_agent.protocol.connect import close, connect
from remote_agent.protocol.errors import SchemaError
from remote_agent.protocol.events import encode, kind_of
from remote_agent.protocol.names import Namespace, bootstrap_inbox
from remote_agent.protocol.ratelog import RateLimitedLog
from remote_agent.protocol.transient import Backoff

log = logging.getLogger("remote_agent.identity")

#: the file in the spool directory that keeps the drone's seed
SEED_FILE: Final = "identity.seed"
#: seconds an issuer request waits for its answer
_REQUEST_TIMEOUT_S: Final = 5.0
#: the soonest a renewal is tried again after a failure, and the longest wait
_RETRY_FIRST_S: Final = 1.0
_RETRY_MOST_S: Final = 30.0


def load_or_make_key(spool_dir: Path) -> nkeys.KeyPair:
    """
    The drone's user key from ``spool_dir/identity.seed``, made (mode 0600) if missing

    :raises IdentityError: if the file cannot be read, written, or holds no user seed
    """
    path = spool_dir / SEED_FILE
    try:
        seed = path.read_bytes().strip()
    except FileNotFoundError:
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(seed + b"\n")
        except FileExistsError:  # another agent of the drone made it meanwhile
            return load_or_make_key(spool_dir)
        except OSError as err:
            raise IdentityError(f"cannot write the drone's key {path}: {err}") from err
    except OSError as err:
        raise IdentityError(f"cannot read the drone's key {path}: {err}") from err
    try:
        key = nkeys.from_seed(bytearray(seed))
        public: bytes = key.public_key
    except (nkeys.NkeysError, ValueError) as err:
        raise IdentityError(f"{path} holds no drone key: {err}") from err
    if not public.startswith(b"U"):
        raise IdentityError(f"{path} holds no user key")
    return key


class BootstrapIdentity:
    """
    The JWT and key the publisher connects with (:meth:`user_jwt`, :meth:`sign`)

    :param on_refused: called once with the reason when the issuer refuses for good
    :param on_renewed: awaited after each renewal: reconnect with the new JWT
    """

    def __init__(
        self,
        key: nkeys.KeyPair,
        *,
        site: str,
        drone: str,
        token: str,
        bootstrap_creds: Path,
        servers: tuple[str, ...],
        namespace: Namespace,
        on_refused: Callable[[str], None],
    ) -> None:
        self._key = key
        public: bytes = key.public_key
        self.public_key = public.decode()
        self._site = site
        self._drone = drone
        self._token = token
        self._creds = bootstrap_creds
        self._servers = servers
        self._namespace = namespace
        self._on_refused = on_refused
        self._jwt: str | None = None
        #: when the current JWT expires, by the issuer's clock
        self.expires: dt.datetime | None = None
        #: when to renew it, on the monotonic clock
        self._renew_at: float | None = None
        #: set once the first JWT is here
        self.ready = asyncio.Event()
        #: why the issuer refused for good, once it did
        self.refused: str | None = None
        self.renewals = 0
        self._enrolled = False
        self._say = RateLimitedLog(log, 60.0)

    # ------------------------------------------------------------ nats-py's callbacks

    def user_jwt(self) -> bytes:
        """The JWT to connect with (nats-py calls it at every connect and reconnect)"""
        assert self._jwt is not None, "connect only once the identity is ready"
        return self._jwt.encode()

    def sign(self, nonce: str) -> bytes:
        """The server's nonce, signed with the drone's key, base64"""
        signed: bytes = self._key.sign(nonce.encode())
        return base64.b64encode(signed)

    # ------------------------------------------------------------ getting JWTs

    async def run(self, renewed: Callable[[], Awaitable[None]]) -> None:
        """
        Enroll, then renew at half of each JWT's lifetime, forever (or until refused)

        :param renewed: called after every renewal (the publisher reconnects)
        """
        backoff = Backoff(first=_RETRY_FIRST_S, most=_RETRY_MOST_S)
        while self.refused is None:
            if self._renew_at is not None:
                # at least a second: a lifetime of nothing must not renew in a loop
                await asyncio.sleep(max(_RETRY_FIRST_S, self._renew_at - time.monotonic()))
            while True:
                outcome = await self._obtain()
                if outcome is True:
                    backoff.reset()
                    break
                if outcome is False:
                    return  # refused for good
                await asyncio.sleep(backoff.delay())
            if self.renewals:
                await renewed()

    async def _obtain(self) -> bool | None:
        """One request: ``True`` issued, ``False`` refused for good, ``None`` ask again"""
        try:
            reply = await self._ask()
        except (nats.errors.Error, OSError, TimeoutError) as err:
            self._say.log(
                logging.WARNING,
                "unreachable",
                "cannot reach the issuer for this drone's identity (%r); %s",
                err,
                "the gate stays shut" if self._jwt is None else "asking again",
            )
            return None
        except SchemaError as err:
            self._say.log(logging.WARNING, "garbled", "the issuer's answer is garbled: %s", err)
            return None
        if isinstance(reply, Issued):
            first = self._jwt is None
            self._jwt, self.expires = reply.jwt, reply.expires
            self._renew_at = time.monotonic() + _lifetime(reply) / 2
            if not first:
                self.renewals += 1
            self._enrolled = True
            log.info(
                "%s this drone's identity (key %s), valid until %s",
                "got" if first else "renewed",
                self.public_key[:12],
                reply.expires.isoformat(timespec="seconds"),
            )
            self.ready.set()
            return True
        return self._refusal(reply)

    def _refusal(self, reply: IssueRefused) -> bool | None:
        if not reply.reason.permanent:
            self._say.log(
                logging.WARNING,
                f"refused {reply.reason}",
                "the issuer asks this drone to ask again (%s: %s)",
                reply.reason,
                reply.error,
            )
            return None
        self.refused = f"the issuer refused this drone's identity: {reply.reason} ({reply.error})"
        log.error("%s; the gate stays shut", self.refused)
        self._on_refused(self.refused)
        return False

    async def _ask(self) -> Issued | IssueRefused:
        """Send the enrollment (first) or a renewal over the site's bootstrap identity"""
        at = dt.datetime.now(dt.UTC)
        kind = kind_of(RenewRequest if self._enrolled else EnrollRequest)
        signature: bytes = self._key.sign(
            signing_input(kind, self._site, self._drone, self.public_key, at)
        )
        site, drone, public = self._site, self._drone, self.public_key
        request: EnrollRequest | RenewRequest
        if self._enrolled:
            request = RenewRequest(
                site=site, drone=drone, public_key=public, at=at, signature=signature
            )
        else:
            request = EnrollRequest(
                site=site,
                drone=drone,
                public_key=public,
                at=at,
                signature=signature,
                token=self._token,
            )
        nc = await connect(
            list(self._servers),
            name=f"cobald-remote-bootstrap-{self._drone}",
            user_credentials=str(self._creds),
            inbox_prefix=bootstrap_inbox(self._site),
            connect_timeout=_REQUEST_TIMEOUT_S,
            max_reconnect_attempts=0,
            allow_reconnect=False,
        )
        try:
            msg = await nc.request(
                self._namespace.bootstrap(self._site), encode(request), timeout=_REQUEST_TIMEOUT_S
            )
        finally:
            await close(nc)
        return decode_bootstrap_reply(msg.data)


def _lifetime(issued: Issued) -> float:
    """
    Seconds the JWT of ``issued`` is valid from now: the issuer's ``valid_s``; without it
    (an issuer that does not say), ``expires`` against this drone's clock
    """
    if issued.valid_s is not None:
        return issued.valid_s
    return (issued.expires - dt.datetime.now(dt.UTC)).total_seconds()
