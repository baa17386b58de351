"""One JSON object per log line, with the ``extra`` fields of each call.

Every string in the line (message, extra fields, exception text) passes through
:func:`sidecar.redact.redact`: a driver error that echoes a DSN never logs a password.
"""

from __future__ import annotations

import json
import logging
import sys

from sidecar.clock import rfc3339
from sidecar.redact import redact, redact_tree

# Attributes every LogRecord has; anything else came in through ``extra``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


_PLAIN = (str, int, float, bool, type(None), dict, list, tuple)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": rfc3339(record.created), "level": record.levelname.lower(),
                "logger": record.name, "msg": redact(record.getMessage())}
        # Only plain data from ``extra``: libraries (kopf) attach whole objects whose
        # repr would flood the line.
        line.update({k: redact_tree(v) for k, v in vars(record).items()
                     if k not in _STANDARD and isinstance(v, _PLAIN)})
        if record.exc_info and record.name.split(".")[0] != "sidecar":
            # A library's (asyncpg, aiohttp, kopf) logged failure is an expected one
            # (a server gone, a peer hung up) that our own lines already report: its
            # error in one line, not a traceback.
            error = record.exc_info[1]
            if error is not None:
                line["exception"] = redact(f"{type(error).__name__}: {error_text(error)}")
        elif record.exc_info:
            line["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(line, default=str)


def error_text(error: BaseException) -> str:
    """The first line of an error's message (or nothing)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def setup(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's access log is off; its error logs stay. kopf is chatty at info.
    logging.getLogger("kopf").setLevel(max(logging.WARNING, root.level))
