"""
A client that publishes one message as fast as its socket takes it, until it is killed

Run as a script in a process of its own (so that its loop shares nothing with the test's)::

    python flooder.py URL CREDS SUBJECT REPLY BODY_FILE

It speaks the NATS protocol itself (INFO, CONNECT with the user JWT and the nonce signed
by the seed of ``CREDS``, then ``PUB`` after ``PUB`` written in blocks of many) instead of
going through nats-py, whose ``publish`` costs more per message than the server does. It
answers the server's ``PING`` and drops everything else it reads. It prints ``flooding``
once the server accepted it and the first block is written.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import sys
from pathlib import Path

import nkeys

#: messages written at once
BLOCK = 500


def _creds(path: Path) -> tuple[str, nkeys.KeyPair]:
    text = path.read_text()
    jwt = re.search(r"-----BEGIN NATS USER JWT-----\s*(\S+)", text)
    seed = re.search(r"-----BEGIN USER NKEY SEED-----\s*(\S+)", text)
    if jwt is None or seed is None:
        raise SystemExit(f"{path} is no .creds file")
    return jwt[1], nkeys.from_seed(bytearray(seed[1].encode()))


async def _answer_pings(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while line := await reader.readline():
        if line.startswith(b"PING"):
            writer.write(b"PONG\r\n")


async def flood(url: str, creds: Path, subject: str, reply: str, body: bytes) -> None:
    jwt, key = _creds(creds)
    host, _, port = url.removeprefix("nats://").rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 20)
    info = json.loads((await reader.readline()).removeprefix(b"INFO "))
    signature = base64.urlsafe_b64encode(key.sign(info["nonce"].encode())).rstrip(b"=")
    connect = {
        "jwt": jwt,
        "sig": signature.decode(),
        "verbose": False,
        "pedantic": False,
        "protocol": 1,
        "headers": True,
        "no_responders": True,
        "name": "flooder",
        "lang": "python",
        "version": "0",
    }
    writer.write(b"CONNECT " + json.dumps(connect).encode() + b"\r\nPING\r\n")
    answer = await reader.readline()
    if not answer.startswith(b"PONG"):
        raise SystemExit(f"the server refused the flooder: {answer!r}")
    pings = asyncio.create_task(_answer_pings(reader, writer))
    block = b"PUB %s %s %d\r\n%s\r\n" % (subject.encode(), reply.encode(), len(body), body) * BLOCK
    writer.write(block)
    await writer.drain()
    print("flooding", flush=True)
    while not pings.done():
        writer.write(block)
        await writer.drain()


def main() -> None:
    url, creds, subject, reply, body = sys.argv[1:]
    asyncio.run(flood(url, Path(creds), subject, reply, Path(body).read_bytes()))


if __name__ == "__main__":
    main()
