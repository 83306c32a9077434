"""
What the wire schema's fields hold: their types (subject tokens, timezone-aware times,
non-negative numbers, finite durations) and the size limits

Readers enforce the size of one encoded message (:data:`DEFAULT_MAX_SIZE`). An agent
keeps its events within the snapshot limits, so that the largest event it can encode stays
well below it and the stream never rejects one (``tests/unit/test_agent_limits.py`` builds
the worst case).
"""

from __future__ import annotations

import datetime as dt
import sys
from typing import Annotated, Final

import msgspec

from remote_agent.protocol.names import MAX_TOKEN, TOKEN_RULE, is_token

#: a subject token: site names, drone uuids, prefixes (no dots, wildcards or whitespace).
#: msgspec checks the length; :func:`check_tokens` applies the whole rule
#: (:func:`~remote_agent.protocol.names.is_token`) in the ``__post_init__`` of every
#: message that carries tokens, with one ``str.strip`` of the allowed characters instead
#: of msgspec's ``pattern`` (``bench/README.md``, "Token checks").
Token = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TOKEN)]


def check_tokens(message: object, names: tuple[str, ...]) -> None:
    """Raise the error for the first of ``names`` that is no token (msgspec reports it)"""
    for name in names:
        value = getattr(message, name)
        if not is_token(value):
            raise ValueError(f"`{name}` must be a subject token ({TOKEN_RULE}), not {value!r}")


#: a timezone-aware point in time; encoded as the MessagePack timestamp extension (-1)
UtcTime = Annotated[dt.datetime, msgspec.Meta(tz=True)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
#: a duration: a finite float >= 0. The upper bound rejects infinity (``ge`` alone lets it
#: pass) and both bounds reject NaN, so no reader ever computes with a non-finite number
#: a writer sent. Every float of the wire schema is one of these.
Seconds = Annotated[float, msgspec.Meta(ge=0, le=sys.float_info.max)]


# --------------------------------------------------------------------------- size limits
# of one encoded message, and of what an agent puts in one

#: default limit on the size of one encoded message, in bytes
DEFAULT_MAX_SIZE: Final = 64 * 1024

#: payloads in a snapshot at most, whatever the number of slots
MAX_PAYLOADS: Final = 256
#: the longest job id a payload may have; the agent's gate refuses a longer one (390)
MAX_JOB_ID: Final = 64
#: the longest slot name or hostname an agent keeps; longer ones are cut
MAX_NAME: Final = 64
#: the longest free text (reasons, notes, details) an agent keeps; longer text is cut
MAX_TEXT: Final = 1024
#: the most characters of the worker command line in an event, all arguments together
MAX_COMMAND: Final = 4096
#: request ids are cut to this many characters
MAX_REQUEST_ID: Final = 128
