"""JSON-lines log records for the drone, one object per line (cf. cobald ``format_json``)"""

from __future__ import annotations

import datetime as dt
import json
import logging

#: attributes every LogRecord has; anything else came in through ``extra``
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message"}


class JsonLines(logging.Formatter):
    """One JSON object per record: UTC time, level, logger, message, and every ``extra``"""

    def format(self, record: logging.LogRecord) -> str:
        data = {
            "at": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        data.update((k, v) for k, v in vars(record).items() if k not in _STANDARD)
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)
