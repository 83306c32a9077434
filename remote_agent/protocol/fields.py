"""Field types of the wire schema: subject tokens, timezone-aware times, non-negative numbers"""

from __future__ import annotations

import datetime as dt
import sys
from typing import Annotated

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
