"""
The gate's requests and replies: one MessagePack map each way, tagged by ``op``

Local IPC between a hook and the agent of one installation, not bus schema.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from remote_agent.protocol.events import PayloadEnd
from remote_agent.protocol.fields import Seconds

#: version of the request/reply format below
GATE_PROTOCOL_VERSION: Final = 1
#: the largest request the server reads, in bytes (a request is ~100 bytes)
MAX_REQUEST_BYTES: Final = 4096
#: the largest reply the hook reads, in bytes
MAX_REPLY_BYTES: Final = 4096
#: the longest job id a request may carry, in characters: what the gate reads, not what
#: the agent keeps (it refuses a job id over :data:`~remote_agent.protocol.fields.MAX_JOB_ID`)
MAX_REQUEST_JOB_ID: Final = 128
#: the longest slot name and owner a request may carry, in characters
MAX_REQUEST_NAME: Final = 256
#: the longest message or error text a reply may carry, in characters
MAX_REPLY_TEXT: Final = 256

# \A...\Z, not ^...$: "$" also matches before a trailing newline
JobIdText = Annotated[
    str,
    msgspec.Meta(min_length=1, max_length=MAX_REQUEST_JOB_ID, pattern=r"\A[^\x00-\x1f\x7f]+\Z"),
]
NameText = Annotated[
    str, msgspec.Meta(max_length=MAX_REQUEST_NAME, pattern=r"\A[^\x00-\x1f\x7f]*\Z")
]
ShortText = Annotated[str, msgspec.Meta(max_length=MAX_REPLY_TEXT)]


class GateRequest(msgspec.Struct, frozen=True, kw_only=True, tag_field="op"):
    """What a hook asks; ``v`` is :data:`GATE_PROTOCOL_VERSION`"""

    v: int = GATE_PROTOCOL_VERSION


class PrepareJobRequest(GateRequest, frozen=True, kw_only=True, tag="prepare_job"):
    """HOOK_PREPARE_JOB: may this payload start?"""

    job_id: JobIdText
    slot: NameText = ""
    owner: NameText = ""
    #: the runtime the job ad requests or expects, in seconds (``None``: it gives none)
    requested_s: Seconds | None = None


class JobExitRequest(GateRequest, frozen=True, kw_only=True, tag="job_exit"):
    """HOOK_JOB_EXIT: this payload ended"""

    job_id: JobIdText
    how: PayloadEnd
    #: the payload's exit code; negative: killed by that signal; None: unknown
    exit_code: int | None = None
    duration_s: Seconds | None = None


class GateReply(msgspec.Struct, frozen=True, kw_only=True, tag_field="op"):
    """What the agent answers"""


class GateDecisionReply(GateReply, frozen=True, kw_only=True, tag="decision"):
    """The answer to :class:`PrepareJobRequest`"""

    allow: bool
    #: for a refusal: the ``HookStatusCode`` to print (always >= 300)
    status_code: int = 0
    message: ShortText = ""


class GateAck(GateReply, frozen=True, kw_only=True, tag="ack"):
    """The answer to :class:`JobExitRequest`"""


class GateErrorReply(GateReply, frozen=True, kw_only=True, tag="error"):
    """The request was not acted upon"""

    error: ShortText


AnyGateRequest = PrepareJobRequest | JobExitRequest
AnyGateReply = GateDecisionReply | GateAck | GateErrorReply

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(AnyGateRequest)
_reply_decoder = msgspec.msgpack.Decoder(AnyGateReply)


def encode(message: AnyGateRequest | AnyGateReply) -> bytes:
    """One request or reply as MessagePack"""
    return _encoder.encode(message)


def decode_request(data: bytes) -> AnyGateRequest:
    """
    A request from the wire, strictly

    :raises msgspec.DecodeError: not MessagePack, or not a valid request
    :raises ValueError: a version this code does not speak
    """
    request = _request_decoder.decode(data)
    if request.v != GATE_PROTOCOL_VERSION:
        raise ValueError(f"unsupported gate protocol version {request.v}")
    return request


def decode_reply(data: bytes) -> AnyGateReply:
    """
    A reply from the wire

    :raises msgspec.DecodeError: not MessagePack, or not a valid reply
    """
    return _reply_decoder.decode(data)
