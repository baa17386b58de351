"""Writes the reference tables of the docs from the code they describe.

    python -m scripts.gendocs           # rewrite every generated block
    python -m scripts.gendocs --check   # exit 1 naming each block that differs

Each table has one source, so a fact is written once:

- the settings in ``docs/configuration.md``: the option table ``sidecar.config.OPTIONS``
  (meaning, default, bounds, the commands that take each flag);
- the metrics in ``docs/monitoring.md``: what a sidecar's ``/metrics`` serves (names,
  types, labels, HELP texts);
- the values in ``charts/lease-sidecar/README.md``: the chart's ``values.yaml`` (defaults
  and the comment above each key) and ``values.schema.json`` (types, allowed values).

A block sits between ``<!-- generated: NAME ... -->`` and ``<!-- end generated: NAME -->``;
everything around it is written by hand. ``tests/unit/test_generated_docs.py`` fails when
a block differs from what this module produces now. This module is not imported by the
sidecar.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "lease-sidecar"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _sentence(text: str) -> str:
    """``text`` as the first sentence of a cell (kept as written, with a full stop)."""
    text = text.strip()
    return text if not text or text.endswith(".") else text + "."


# --------------------------------------------------------------------------- settings

def _duration(seconds: float) -> str:
    from sidecar.base.clock import format_duration

    return format_duration(seconds)


def _backend_defaults(field: str) -> str:
    """What each backend's entry puts in for an unset LEASE_DSN / LEASE_TABLE."""
    from sidecar.lease import BACKENDS, backend_entry

    found = []
    for name in BACKENDS:
        entry = backend_entry(name)
        if field == "dsn" and entry.default_dsn:
            found.append(f"{name}: `{entry.default_dsn}`")
        if field == "table" and entry.schema_sql:
            found.append(f"{name}: `{entry.default_table}`")
    return "; ".join(found)


def settings_table() -> str:
    from sidecar.config import COMMANDS, DERIVED, OPTIONS

    rows = ["| variable | flag | default | meaning |", "|---|---|---|---|"]
    for option in OPTIONS:
        if option.field in DERIVED:
            default = DERIVED[option.field].text()
        elif option.default is not None:
            default = f"`{option.default}`"
        elif option.field in ("dsn", "table"):
            default = _backend_defaults(option.field)
        else:
            default = option.shown_default or "unset"
        meaning = [_sentence(option.help)]
        choices = getattr(option.parse, "options", None)
        if choices:
            meaning.append("One of " + ", ".join(f"`{c}`" for c in choices) + ".")
        if option.details:
            meaning.append(option.details)
        if option.bounds:
            low, high = option.bounds
            meaning.append(f"From `{_duration(low)}` to `{_duration(high)}`.")
        if option.commands != frozenset({"run", "exec"}):
            meaning.append("Commands: " + ", ".join(
                f"`{c}`" for c in COMMANDS if c in option.commands) + ".")
        rows.append(f"| `{option.env}` | `{option.flag}` | {_cell(default)} | "
                    f"{_cell(' '.join(meaning))} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------- metrics

def metrics_table() -> str:
    from prometheus_client.registry import CollectorRegistry

    from sidecar.metrics import registry_for
    from sidecar.publish.http.limits import Limits
    from sidecar.publish.shards import ShardBoard
    from sidecar.state import LeaseState

    # What /metrics serves: the lease collector, the process collector, the HTTP bounds,
    # and the shard set's collector where LEASE_SHARDS is set.
    state = LeaseState(lease="x", identity="me", role="all", claim_horizon=0.25)
    shard = LeaseState(lease="x-0", identity="me", role="all", claim_horizon=0.25)
    board = ShardBoard([shard], "me", lambda: {"members": 1, "assigned": [], "ok": True})
    registry: CollectorRegistry = registry_for([state], Limits(), board)
    rows = ["| name | type | labels | meaning |", "|---|---|---|---|"]
    process = False
    for family in registry.collect():
        if family.name.startswith("process_"):
            process = True
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        labels: list[str] = []
        for sample in family.samples:
            labels += [k for k in sample.labels if k != "le" and k not in labels]
        shown = ", ".join(f"`{label}`" for label in labels) or "—"
        rows.append(f"| `{name}` | {family.type} | {shown} | "
                    f"{_cell(_sentence(family.documentation))} |")
    if process:
        rows.append("| `process_*` | gauge, counter | — | The standard process collector: "
                    "resident memory, CPU seconds, open file descriptors, start time. |")
    return "\n".join(rows)


# ----------------------------------------------------------------------- chart values

def _comments_by_key(text: str) -> dict[str, str]:
    """The comment block right above each key of values.yaml, by dotted path."""
    found: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    comment: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            comment = []
            continue
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
            continue
        match = re.match(r"^( *)([A-Za-z0-9_]+):", line)
        if not match:
            comment = []
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([key for _, key in stack] + [match.group(2)])
        stack.append((indent, match.group(2)))
        if comment:
            found[path] = " ".join(comment)
        comment = []
    return found


def _schema_at(schema: dict[str, Any], path: list[str]) -> dict[str, Any]:
    node = schema
    for key in path:
        node = node.get("properties", {}).get(key, {})
    return node


def _type(node: dict[str, Any]) -> str:
    if "enum" in node:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in node["enum"])
    kind = node.get("type")
    if isinstance(kind, list):
        return " or ".join(kind)
    return kind or ""


def _leaves(values: dict[str, Any], schema: dict[str, Any],
            prefix: list[str]) -> Iterator[tuple[list[str], Any]]:
    for key, value in values.items():
        path = [*prefix, key]
        node = _schema_at(schema, path)
        if isinstance(value, dict) and value and node.get("properties"):
            yield from _leaves(value, schema, path)
        else:
            yield path, value


def values_table() -> str:
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    schema = json.loads((CHART / "values.schema.json").read_text())
    comments = _comments_by_key(text)
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for path, value in _leaves(values, schema, []):
        dotted = ".".join(path)
        node = _schema_at(schema, path)
        # A group's comment describes its first key when that key has none of its own.
        description = comments.get(dotted) or node.get("description", "")
        default = json.dumps(value, separators=(", ", ": "))
        rows.append(f"| `{dotted}` | {_type(node)} | `{_cell(default)}` | "
                    f"{_cell(description)} |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- blocks

TARGETS: dict[str, tuple[Path, Callable[[], str]]] = {
    "settings": (REPO / "docs" / "configuration.md", settings_table),
    "metrics": (REPO / "docs" / "monitoring.md", metrics_table),
    "chart-values": (CHART / "README.md", values_table),
}


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)


def _block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated: {re.escape(name)} .*?-->\n)(.*?)"
                      rf"(<!-- end generated: {re.escape(name)} -->)", re.S)


def current(name: str) -> str | None:
    """The block as the file has it now (None when the markers are missing)."""
    path, _ = TARGETS[name]
    found = _block(name).search(path.read_text())
    return found.group(2) if found else None


def expected(name: str) -> str:
    return TARGETS[name][1]() + "\n"


def write(name: str) -> bool:
    """Rewrite one block; True when the file changed."""
    path, _ = TARGETS[name]
    text = path.read_text()
    pattern = _block(name)
    if not pattern.search(text):
        raise SystemExit(f"{_shown(path)}: no '<!-- generated: {name} -->' block")
    new = pattern.sub(lambda m: m.group(1) + expected(name) + m.group(3), text)
    if new != text:
        path.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.gendocs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a block differs")
    args = parser.parse_args(argv)
    stale = []
    for name, (path, _) in TARGETS.items():
        where = f"{_shown(path)} ({name})"
        if args.check:
            if current(name) != expected(name):
                stale.append(where)
        elif write(name):
            print(f"rewrote {where}")
    if stale:
        print("out of date, run python -m scripts.gendocs: " + ", ".join(stale),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
