"""Hide secrets in any text before it is logged, shown in ``/status`` or printed.

One function, :func:`redact`, for every output channel (the JSON log formatter, the
``/status`` body, the CLI's error line, ``Settings.public()``, backend error messages).
It works on whole texts, not only on DSNs, because drivers echo connection strings
inside their own error messages. Three layers:

- URL userinfo: ``scheme://user:SECRET@host`` up to the *last* ``@`` of the URL, so a
  raw ``@`` inside a password (which libpq and asyncpg would split at the first ``@``)
  never shows its tail;
- ``key=value`` pairs whose key names a secret (``password``, ``sslpassword``, ``PWD``,
  ``KeyStoreSecret``, any case, spaces around ``=``), in the three syntaxes that carry
  them: URL queries (``?password=x&…``), libpq key-value strings (``password=x`` or
  ``password='y z'``) and ODBC strings (``PWD=x;`` or ``PWD={a}};b}`` with ``}}`` as an
  escaped brace);
- the exact passwords found in the configured DSNs (:func:`remember_secrets`), so a
  driver that echoes the bare password, or a DSN too malformed to parse, still shows
  ``***``.

Over-redaction (hiding a little more than the secret) is accepted; showing any part of
a secret is not.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable
from typing import Any, overload

MASK = "***"

# Keys that carry a secret in libpq (password, sslpassword), ODBC (PWD, Password) and
# driver extensions (KeyStoreSecret, ClientSecret, ...): any key containing these words.
_SECRET_KEY = r"[A-Za-z_-]*(?:password|passwd|pwd|secret)[A-Za-z0-9_-]*"

# scheme://user:SECRET@ — the user part may itself hold a raw '@' (it must not, but a
# broken DSN is exactly what gets echoed in an error); SECRET runs to the last '@' of
# the URL (no whitespace), so a raw '@' in the password is masked in full.
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^\s:/?#]*?:)(\S*)@")

# ?password=…&: a URL query value runs to '&', '#' or whitespace (a ';' is data there).
_QUERY_PARAM = re.compile(r"(?i)([?&]" + _SECRET_KEY + r"=)[^&#\s]*")

# A whole DSN (for remember_secrets): the password runs to the last '@', spaces and all.
_DSN_USERINFO = re.compile(r"(?is)^\s*[a-z][a-z0-9+.-]*://[^:/?#]*?:(.*)@")

# key = value, with the value in one of the quoting styles that carry secrets:
#   {…} ODBC braces with '}}' escapes; '…' / "…" libpq quotes with backslash escapes;
#   otherwise a bare value up to ';' or '&', or to whitespace followed by another
#   'key=' (libpq separates pairs by spaces; an ODBC value may itself contain spaces).
#   An unterminated brace or quote is masked to the end of the text.
_KEY_VALUE = re.compile(
    r"(?i)(?<![\w-])(" + _SECRET_KEY + r")(\s*=\s*)"
    r"(\*\*\*(?![^\s;&#])"  # already masked (a URL query value): keep the text after it
    r"|\{(?:[^}]|\}\})*(?:\}|$)"
    r"|'(?:[^'\\]|\\.)*(?:'|$)"
    r"|\"(?:[^\"\\]|\\.)*(?:\"|$)"
    r"|[^;&\r\n]*?(?=;|&|\r|\n|$|\s+[\w-]+\s*=))",
    re.DOTALL,
)

# Bare passwords of the configured DSNs; short ones would mask ordinary words.
_MIN_REMEMBERED = 4
# Process-wide on purpose: a password must be masked in every line this process writes —
# the JSON log formatter, exception text from any library, /status, the CLI's errors —
# and those reach redact() through no object we could hand a set to. Written once, by
# config loading; tests reset it with forget_secrets().
_remembered: set[str] = set()


@overload
def redact(text: str) -> str: ...


@overload
def redact(text: None) -> None: ...


def redact(text: str | None) -> str | None:
    """``text`` with every password-like value replaced by ``***``."""
    if not text:
        return text
    text = _URL_USERINFO.sub(lambda m: f"{m.group(1)}{MASK}@", text)
    text = _QUERY_PARAM.sub(lambda m: f"{m.group(1)}{MASK}", text)
    text = _KEY_VALUE.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)
    # Longest first, so a secret that contains another is masked whole.
    for secret in sorted(_remembered, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, MASK)
    return text


def redact_tree(value: Any) -> Any:
    """:func:`redact` applied to every string inside dicts, lists and tuples."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: redact_tree(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [redact_tree(item) for item in value]
    return value


def remember_secrets(dsns: Iterable[str | None]) -> None:
    """Remember the passwords inside these DSNs (raw and percent-decoded forms)."""
    for dsn in dsns:
        for secret in secrets_in(dsn or ""):
            for form in (secret, urllib.parse.unquote(secret)):
                if len(form) >= _MIN_REMEMBERED and form != MASK:
                    _remembered.add(form)


def forget_secrets() -> None:
    """Tests start from a clean slate."""
    _remembered.clear()


def secrets_in(text: str) -> list[str]:
    """The secret values :func:`redact` would mask in ``text`` (quotes and braces off)."""
    found = [m.group(2) for m in _URL_USERINFO.finditer(text)]
    found += [m.group(1) for m in _DSN_USERINFO.finditer(text)]
    found += [urllib.parse.unquote_plus(m.group(0).split("=", 1)[1])
              for m in _QUERY_PARAM.finditer(text)]
    for m in _KEY_VALUE.finditer(text):
        value = m.group(3).strip()
        if value[:1] == "{":
            value = value[1:-1] if value.endswith("}") else value[1:]
            value = value.replace("}}", "}")
        elif value[:1] in "'\"":
            quote = value[0]
            value = value[1:-1] if len(value) > 1 and value.endswith(quote) else value[1:]
            value = re.sub(r"\\(.)", r"\1", value)
        found.append(value)
    return [value for value in found if value]
