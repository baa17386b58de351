"""One JSON object per log line, with the ``extra`` fields of each call.

Every string in the line (message, extra fields, exception text) passes through
:func:`sidecar.base.redact.redact`: a driver error that echoes a DSN never logs a password.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import warnings

from sidecar.base.clock import rfc3339
from sidecar.base.redact import redact, redact_tree

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


# kopf's logger for watch streams: at DEBUG it says when a retried request succeeds,
# the only sign kopf gives that the apiserver is back (a few lines per stream restart).
KOPF_WATCH_LOGGER = "kopf._cogs.clients.watching"


class KopfApiOutage(logging.Filter):
    """One line when kopf loses the apiserver, one when it has it back.

    kopf retries a failed request up to 8 times, logging every attempt at ERROR (34 lines
    per sidecar in a 90 s outage). This lets the first failure of an outage through as
    one warning, drops the rest, and turns the first "Request attempt … succeeded" into
    "kubernetes API reachable again" with the number of lines dropped. A failure after
    ``quiet`` seconds without one starts a new outage even if the recovery went unseen
    (a request that succeeds at its first attempt logs nothing). Other kopf lines pass;
    kopf's DEBUG lines, enabled on :data:`KOPF_WATCH_LOGGER` for this, only below
    ``level``.
    """

    FAILED = re.compile(r"Request attempt #\S+ failed; [^:]*: "
                        r"(?P<what>.*?)(?: -> (?P<error>.*))?$", re.DOTALL)
    SUCCEEDED = re.compile(r"Request attempt #\S+ succeeded: (?P<what>.*)$", re.DOTALL)

    def __init__(self, level: int, quiet: float = 60.0) -> None:
        super().__init__()
        self.level = level
        self.quiet = quiet
        self.dropped = 0
        self.last_failure: float | None = None  # monotonic, during an outage

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("kopf"):
            return True
        message = record.getMessage()
        failed = self.FAILED.match(message)
        if failed:
            now = time.monotonic()
            ongoing = self.last_failure is not None and now - self.last_failure < self.quiet
            self.last_failure = now
            if ongoing:
                self.dropped += 1
                return False
            self.dropped = 0
            self._rewrite(record, logging.WARNING,
                          "kubernetes API unreachable (kopf retries; one line until it is back)",
                          request=failed["what"], error=failed["error"] or message)
            return True
        if self.SUCCEEDED.match(message) and self.last_failure is not None:
            self.last_failure = None
            self._rewrite(record, logging.INFO, "kubernetes API reachable again (kopf)",
                          failures_not_logged=self.dropped)
            return True
        return record.levelno >= self.level

    @staticmethod
    def _rewrite(record: logging.LogRecord, level: int, message: str, **fields: object) -> None:
        record.levelno, record.levelname = level, logging.getLevelName(level)
        record.msg, record.args = message, None
        record.__dict__.update(fields)


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
    logging.getLogger(KOPF_WATCH_LOGGER).setLevel(logging.DEBUG)
    handler.addFilter(KopfApiOutage(root.level))
