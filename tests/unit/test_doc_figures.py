"""No measured figure is typed by hand in the README, the docs or the CHANGELOG: every
number with a unit outside a generated block (<!-- bench:NAME --> from the results
files, <!-- generated: … --> from the code) is a configured value — a default, a bound,
a period — or it fails here. Measured figures belong in a results file and a generated
table (python -m bench.report); see docs/benchmarks.md."""

from __future__ import annotations

import re

from testkit.support import REPO

GENERATED = [re.compile(r"<!-- bench:[a-z0-9-]+ -->.*?<!-- /bench -->", re.S),
             re.compile(r"<!-- generated: [^>]*-->.*?<!-- end generated[^>]*-->", re.S)]
# Commands, settings and literal values are written as code.
CODE = [re.compile(r"^```.*?^```", re.M | re.S), re.compile(r"`[^`]+`")]
NUMBER = r"\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(
    rf"(?<![\w.\-/]){NUMBER}(?:\s?(?:\u2013|to)\s?{NUMBER})?\s?"
    r"(?:ms|µs|us|s|seconds?|minutes?|min|hours?|h|MiB|MB|KiB|KB|kB|GiB|GB|B|bytes|%|"
    r"req/s|millicores)(?![\w/])")
# Words before a figure that make it a configured value: a bound, a period, a setting.
CONFIGURED_BEFORE = re.compile(
    r"(?:≤|<|≥|>|±|\+|at most|at least|up to|within|every|per|after|bounded (?:at|by)|timeout|"
    r"lease|renew(?: interval)?|horizon|margin|retry(?: period)?|deadline|grace|period|"
    r"limit|for)\s*\(?$", re.I)
CONFIGURED_AFTER = re.compile(
    r"^\s*(?:by default|\(the default|, the default|default|lease\b|renew interval|"
    r"(?:safety )?margin|(?:claim )?horizon|retry period|timeout|jitter)", re.I)
# Defaults and limits written without such a word, and where each is set.
ALLOWED = {
    "15 s": "LEASE_DURATION's default (sidecar/config.py)",
    "250 ms": "LEASE_CLAIM_HORIZON's default",
    "1 s": "LEASE_SAFETY_MARGIN's default and the kubernetes backend's minimum",
    "2 s": "the renew interval derived from the default lease (2/15 of it)",
    "4.67 s": "the kubernetes backend's derived renew interval for the default lease",
    "10 s": "LEASE_APP_UNREADY_AFTER's and LEASE_EXEC_GRACE's defaults",
    "5 s": "the HTTP endpoint's header timeout, LEASE_REPLICA_TIMEOUT's default",
    "30 s": "the long-poll's longest wait, sidecar.startTimeoutSeconds",
    "128 MiB": "the chart's memory limit (values.yaml)",
    "1 KiB": "the HTTP endpoint's line limits (sidecar/publish/http)",
    "8 bytes": "the advisory lock id's length",
    "0.8 s": "the kube client's first watch back-off (BACKOFF_FIRST, sidecar/kubewatch.py)",
    "32 KiB": "the kube client's TLS read buffer; asyncio's own is 256 KiB",
    "256 KiB": "asyncio's default TLS read buffer",
    "1.5 MiB": "the pod size tests/integration/test_kube_misbehaving.py serves",
}

# Measured figures still typed on pages other engineers are rewriting; each goes into a
# generated block (or away) with that rewrite, and then leaves this list.
PENDING: set[tuple[str, str]] = set()


def pages() -> list:
    return [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md"))]


def blank(match: re.Match[str]) -> str:
    return re.sub(r"[^\n]", " ", match.group(0))


def typed_figures(text: str) -> list[tuple[int, str, str]]:
    """(line, figure, line text) of every figure no rule allows."""
    for pattern in (*GENERATED, *CODE):
        text = pattern.sub(blank, text)
    # A paragraph is one line of text: a setting's name may stand on the line before.
    flat = text.replace("\n", " ")
    lines = text.splitlines()
    found = []
    for m in FIGURE.finditer(flat):
        figure = re.sub(r"\s+", " ", m.group(0))
        if figure in ALLOWED or CONFIGURED_BEFORE.search(flat[:m.start()].rstrip()) \
                or CONFIGURED_AFTER.match(flat[m.end():]):
            continue
        number = text.count("\n", 0, m.start()) + 1
        found.append((number, figure, lines[number - 1].strip()))
    return found


def test_no_page_types_a_measured_figure():
    typed = [f"{page.relative_to(REPO)}:{line}: {figure!r} in: {text[:100]}"
             for page in pages() for line, figure, text in typed_figures(page.read_text())
             if (page.relative_to(REPO).as_posix(), figure) not in PENDING]
    assert not typed, ("figures typed by hand (put them in a results file and a "
                       "<!-- bench:NAME --> block, or remove them):\n" + "\n".join(typed))


def test_a_typed_figure_is_found_and_configured_values_are_not():
    text = ("Start-up takes 135\u2013186 ms p50.\n"
            "A scrape is 5.9 KB.\n"
            "The lease (15 s by default) and a horizon of 250 ms; retried every 2 s, "
            "at most 30 s, within 5 s.\n"
            "<!-- bench:core -->\n| a | 3,223 / 3,476 ms |\n<!-- /bench -->\n"
            "`--grace 60s` and\n```sh\nsleep 2s\n```\n")
    assert [f for _, f, _ in typed_figures(text)] == ["135\u2013186 ms", "5.9 KB"]
