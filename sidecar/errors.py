"""The errors every layer raises, at the bottom of the import graph.

Each message is one line a user can act on, and never contains a password.
"""

from __future__ import annotations


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
