"""One JSON object per log line, with the ``extra`` fields of each call.

Every string in the line (message, extra fields, exception text) passes through
:func:`sidecar.redact.redact`: a driver error that echoes a DSN never logs a password.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings

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
        if record.exc_info:
            line["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(line, default=str)


def setup(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Library warnings (urllib3's InsecureRequestWarning on every request to an apiserver
    # whose TLS is not verified) become JSON log lines, each text once, not once a call.
    logging.captureWarnings(True)
    warnings.filterwarnings("once")
    # aiohttp's access log is off; its error logs stay. kopf is chatty at info.
    logging.getLogger("kopf").setLevel(max(logging.WARNING, root.level))
