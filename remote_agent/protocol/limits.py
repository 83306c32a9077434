"""
Size limits of the wire schema: of one encoded message, and of what an agent puts in one

An agent keeps its events within the snapshot limits, so that the largest event it can
encode stays well below :data:`DEFAULT_MAX_SIZE` and the stream never rejects one
(``tests/unit/test_agent_limits.py`` builds the worst case). Readers enforce the first.
"""

from __future__ import annotations

from typing import Final

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
