"""
The agent's side of the gate: an asyncio server on a private Unix socket

Only the agent's own uid and root get an answer (``SO_PEERCRED``); bad input gets a
:class:`~remote_agent.gate.messages.GateErrorReply`, is counted and reaches no handler.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import stat
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final

from remote_agent.errors import GateError
from remote_agent.gate.messages import (
    MAX_REQUEST_BYTES,
    AnyGateReply,
    AnyGateRequest,
    GateAck,
    GateDecisionReply,
    GateErrorReply,
    PrepareJobRequest,
    decode_request,
    encode,
)
from remote_agent.gate.paths import MAX_SOCKET_PATH, worker_environment
from remote_agent.interfaces import GATE_CLOSED_STATUS, GateDecision, GateHandler, JobStart
from remote_agent.private_dir import private_directory
from remote_agent.protocol.ratelog import RateLimitedLog

if TYPE_CHECKING:
    import asyncio

log = logging.getLogger("remote_agent.gate")
_rejections = RateLimitedLog(log)

#: how long the server waits for a connected hook to send its request, in seconds
REQUEST_TIMEOUT_S: Final = 5.0
#: mode of the socket file: the agent's user only (root passes any mode)
SOCKET_MODE: Final = 0o600


def _short(text: str, limit: int = 200) -> str:
    """One line of at most ``limit`` characters, for messages that travel on"""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _peer(writer: asyncio.StreamWriter) -> dict[str, int]:
    """pid/uid/gid of the connected hook (Linux ``SO_PEERCRED``); empty if unknown"""
    sock = writer.get_extra_info("socket")
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return {}
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    except OSError:
        return {}
    pid, uid, gid = (int.from_bytes(raw[i : i + 4], sys.byteorder) for i in (0, 4, 8))
    return {"peer_pid": pid, "peer_uid": uid, "peer_gid": gid}


class GateServer:
    """
    Serve the gate socket at ``path`` for ``handler``

    The directory of ``path`` is created 0700 (or, if it exists, must belong to
    the agent's user and be writable by nobody else: :func:`private_directory`);
    the socket file is :data:`SOCKET_MODE`. Every connection's peer is checked
    with ``SO_PEERCRED``: only ``allowed_uids`` (default: the agent's own uid
    and root) are answered. Whoever can connect can only ask questions and
    report payload ends: the startd, not the gate, starts payloads, and the
    agent asks the startd before it calls the drone idle.

    Counters in :attr:`counts`: ``prepare_job``, ``allowed``, ``refused``,
    ``job_exit``, and the errors ``peer_refused``, ``oversized``, ``malformed``,
    ``timeout``, ``handler_error``, ``not_settled``, ``reply_failed``, ``internal_error``.
    Every error is logged rate-limited.
    """

    def __init__(
        self,
        path: Path,
        handler: GateHandler,
        *,
        mode: int = SOCKET_MODE,
        allowed_uids: Iterable[int] | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.path = Path(path)
        self.handler = handler
        self.mode = mode
        self.allowed_uids = frozenset(
            allowed_uids if allowed_uids is not None else (os.geteuid(), 0)
        )
        self.request_timeout_s = request_timeout_s
        self.counts: collections.Counter[str] = collections.Counter()
        self._server: asyncio.Server | None = None
        self._inode: tuple[int, int] | None = None

    def environment(self) -> dict[str, str]:
        """What the worker's environment needs so that hooks find this gate"""
        return worker_environment(self.path)

    async def start(self) -> None:
        """
        Bind the socket (replacing a stale one) and start answering

        :raises GateError: the path is too long for ``AF_UNIX``, its directory
            is not private to the agent's user, it is in use by a live gate, or
            it is something other than a socket
        """
        import asyncio

        if len(os.fsencode(self.path)) > MAX_SOCKET_PATH:
            raise GateError(
                f"gate socket path {self.path} is longer than {MAX_SOCKET_PATH} bytes;"
                " use a shorter one"
            )
        try:
            private_directory(self.path.parent)
        except OSError as err:
            raise GateError(f"cannot serve the gate at {self.path}: {err}") from err
        self._remove_stale(self.path)
        old_umask = os.umask(0o177)  # the socket is never open to others, not even briefly
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=os.fspath(self.path))
            os.chmod(self.path, self.mode)
        except OSError as err:
            raise GateError(f"cannot serve the gate at {self.path}: {err}") from err
        finally:
            os.umask(old_umask)
        info = self.path.stat()
        self._inode = (info.st_dev, info.st_ino)
        log.info("gate listening on %s", self.path)

    async def close(self) -> None:
        """Stop answering and remove the socket file"""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        try:
            info = self.path.stat()
            if (info.st_dev, info.st_ino) == self._inode:
                self.path.unlink()
        except OSError:
            pass

    def _remove_stale(self, path: Path) -> None:
        try:
            info = path.lstat()
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(info.st_mode):
            raise GateError(f"{path} exists and is not a socket; not replacing it")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(os.fspath(path))
            except OSError:
                log.info("removing stale gate socket %s", path)
                path.unlink()
                return
        raise GateError(f"another process already serves a gate at {path}")

    def _reject(self, kind: str, message: str, *args: object, extra: Mapping[str, object]) -> None:
        self.counts[kind] += 1
        _rejections.warning(kind, message, *args, extra=extra)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        import asyncio

        peer = _peer(writer)
        try:
            reply = await self._answer(reader, peer)
            writer.write(encode(reply))
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError) as err:
            self._reject("reply_failed", "gate reply not delivered: %s", err, extra=peer)
        except Exception:
            # whatever a client sends, the gate keeps serving the next one
            self.counts["internal_error"] += 1
            _rejections.log(
                logging.ERROR, "internal_error", "the gate failed on a request", extra=peer
            )
            log.debug("gate failure", exc_info=True)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, peer: dict[str, int]) -> AnyGateReply:
        import asyncio

        data = bytearray()
        try:
            async with asyncio.timeout(self.request_timeout_s):
                while len(data) <= MAX_REQUEST_BYTES:
                    chunk = await reader.read(MAX_REQUEST_BYTES + 1 - len(data))
                    if not chunk:
                        break
                    data += chunk
        except TimeoutError:
            self._reject(
                "timeout",
                "gate request not complete within %gs",
                self.request_timeout_s,
                extra=peer,
            )
            return GateErrorReply(error=f"request not complete within {self.request_timeout_s:g}s")
        if len(data) > MAX_REQUEST_BYTES:
            self._reject(
                "oversized", "gate request over %d bytes rejected", MAX_REQUEST_BYTES, extra=peer
            )
            return GateErrorReply(error=f"request larger than {MAX_REQUEST_BYTES} bytes")
        uid = peer.get("peer_uid")
        if uid is None or uid not in self.allowed_uids:
            # read first, answer, then close: closing on unread data would reset the connection
            self._reject(
                "peer_refused",
                "gate connection from uid %s refused: only uids %s may use the gate",
                uid,
                sorted(self.allowed_uids),
                extra=peer,
            )
            return GateErrorReply(
                error=f"uid {uid} may not use this gate; only the drone's own user may"
            )
        try:
            request = decode_request(bytes(data))
        except RecursionError:
            self._reject(
                "malformed", "malformed gate request rejected: nested too deeply", extra=peer
            )
            return GateErrorReply(error="malformed request: nested too deeply")
        except Exception as err:  # msgspec.DecodeError, ValueError, or anything else
            self._reject(
                "malformed", "malformed gate request rejected: %s", _short(str(err)), extra=peer
            )
            return GateErrorReply(error=_short(f"malformed request: {err}"))
        # the handler decides in one step of the loop; a yes or an ack is sent only once
        # what it recorded is on disk
        reply = self._dispatch(request, peer)
        if isinstance(reply, GateAck) or (isinstance(reply, GateDecisionReply) and reply.allow):
            try:
                async with asyncio.timeout(self.request_timeout_s):
                    await self.handler.settled()
            except TimeoutError:
                self._reject(
                    "not_settled",
                    "the agent's record of a gate request was not on disk within %gs",
                    self.request_timeout_s,
                    extra=peer,
                )
                return GateErrorReply(error="the agent's disk did not take the record in time")
        return reply

    def _dispatch(self, request: AnyGateRequest, peer: dict[str, int]) -> AnyGateReply:
        extra = {**peer, "job": request.job_id}
        try:
            if isinstance(request, PrepareJobRequest):
                self.counts["prepare_job"] += 1
                decision = self.handler.prepare_job(
                    JobStart(
                        job_id=request.job_id,
                        slot=request.slot,
                        owner=request.owner,
                        requested_s=request.requested_s,
                    )
                )
                return self._decision_reply(decision, extra)
            self.counts["job_exit"] += 1
            self.handler.job_exited(
                request.job_id, request.how, request.exit_code, request.duration_s
            )
            log.info("payload %s ended (%s)", request.job_id, request.how, extra=extra)
            return GateAck()
        except Exception as err:
            self.counts["handler_error"] += 1
            _rejections.log(
                logging.ERROR,
                "handler_error",
                "the agent failed to answer a gate request: %r",
                err,
                extra=extra,
            )
            log.debug("gate handler failure", exc_info=True)
            return GateErrorReply(error=_short(f"agent error: {type(err).__name__}: {err}"))

    def _decision_reply(
        self, decision: GateDecision, extra: dict[str, object]
    ) -> GateDecisionReply:
        if decision.allow:
            self.counts["allowed"] += 1
            log.info("payload %s allowed", extra["job"], extra=extra)
            return GateDecisionReply(allow=True, message=_short(decision.message))
        status = decision.status_code
        if status < 300:
            # 1-299 would put the user's job on hold: never let a refusal do that
            log.warning("refusal code %d is not benign; using %d", status, GATE_CLOSED_STATUS)
            status = GATE_CLOSED_STATUS
        self.counts["refused"] += 1
        log.info("payload %s refused (%d)", extra["job"], status, extra=extra)
        return GateDecisionReply(
            allow=False, status_code=status, message=_short(decision.message or "refused")
        )
