"""The errors every layer raises, at the bottom of the import graph.

Each message is one line a user can act on, and never contains a password.
"""

from __future__ import annotations

# The exit codes of every lease-sidecar command, in one place (docs/cli.md's exit code
# table tells users the same). 0 is a clean stop; ``exec`` otherwise exits with its
# command's own code (128 + N when signal N ended it).
EXIT_FAILED = 1  # the backend failed; ``handover``: not handed over, or nobody answered
EXIT_BAD_SETTINGS = 2  # one line names the setting (also: postgres behind a pooler)
EXIT_NO_SUCH_LEASE = 3  # ``status``: no such lease, database file or table; ``handover``
EXIT_NOT_ACQUIRED = 75  # ``exec --acquire-timeout`` ran out (EX_TEMPFAIL of sysexits.h)
# ``exec``'s command cannot start: the codes a shell uses, so ``exec`` can stand in for
# ``sh -c``/``exec`` in an entrypoint. sidecar/cli/exec_guard.py repeats them: it runs as a
# stdlib-only script and cannot import this module (a unit test holds them equal).
EXIT_CANNOT_EXECUTE = 126
EXIT_COMMAND_NOT_FOUND = 127


class ConfigError(ValueError):
    """One bad setting; ``str()`` is the line shown to the user (the CLI exits with 2)."""


class BackendError(Exception):
    """The backend could not be reached or answered with an error."""


class Forbidden(BackendError):
    """The backend refused us (HTTP 403, permission denied): reachable, but not ours to
    use until someone grants it; the message names the verb and the resource."""


class NotFound(BackendError):
    """What a read-only command asked for does not exist: no database file, no lease
    table, no such lease. Never a reason to create it."""
