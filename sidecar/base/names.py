"""Names that end up in someone else's syntax: Kubernetes object names (the one rule
shared by the kubernetes backend, the injector and the settings check) and SQL
identifiers (schema and table names). A bottom-layer module: it imports nothing from
``sidecar``.

A Lease object is named ``{key_prefix}.{name}`` and must be a DNS-1123 subdomain, as the
apiserver checks it: lowercase letters, digits, ``-`` and ``.``, each dot-separated part
starting and ending with a letter or digit, at most 253 characters in all.
"""

from __future__ import annotations

import re

MAX_OBJECT_NAME = 253
OBJECT_NAME_RULE = ("lowercase letters, digits, '-' and '.', starting and ending with a "
                    "letter or digit, at most 253 characters")
_SQL_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def prefixed(key_prefix: str, name: str) -> str:
    """The key of lease ``name``: ``{key_prefix}.{name}``, or ``name`` with no prefix."""
    return f"{key_prefix}.{name}" if key_prefix else name


def is_object_name(text: str) -> bool:
    """True if ``text`` is a valid Kubernetes object name (a DNS-1123 subdomain)."""
    # fullmatch, not match with "$": "$" also matches before a trailing newline.
    return len(text) <= MAX_OBJECT_NAME and _DNS_SUBDOMAIN.fullmatch(text) is not None


def object_name_problem(key_prefix: str, name: str) -> str | None:
    """Why the Lease object of ``name`` could not exist, in one line; None if it can."""
    candidate = prefixed(key_prefix, name)
    if is_object_name(candidate):
        return None
    return (f"{candidate!r} (key prefix + name) is not a valid Kubernetes object name: "
            f"{OBJECT_NAME_RULE}")


def validate_identifier(kind: str, value: str) -> str:
    """Schema and table names end up in SQL text, so only plain identifiers pass."""
    if not _SQL_IDENTIFIER.match(value):
        raise ValueError(
            f"{kind} {value!r} is not a plain identifier (letters, digits, _; max 63)"
        )
    return value
