"""The site's hook for links that leave docs/: kept for the forge, rewritten for the site,
and a missing target is a warning (a failed `mkdocs build --strict`)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from scripts import mkdocs_hooks
from testkit.support import REPO


def page(name: str) -> SimpleNamespace:
    docs = REPO / "docs"
    return SimpleNamespace(file=SimpleNamespace(abs_src_path=str(docs / name), src_uri=name))


CONFIG = {"docs_dir": str(REPO / "docs")}


def test_links_out_of_docs_are_rewritten_for_the_site(caplog) -> None:
    text = ("See [the chart's values](../charts/lease-sidecar/README.md#values), "
            "[`CHANGELOG.md`](../CHANGELOG.md), [a page](design.md) and "
            "[the build file](../pyproject.toml).\n\n"
            "```\n[kept](../nowhere.md)\n```\n")
    out = mkdocs_hooks.on_page_markdown(text, page("index.md"), CONFIG, None)
    # The three repository files the site shows as pages of their own become links.
    assert "[the chart's values](chart-values.md#values)" in out
    assert "[`CHANGELOG.md`](changelog.md)," in out and "[a page](design.md)" in out
    assert "[the build file](_repo/pyproject.toml)" in out
    assert "[kept](../nowhere.md)" in out  # code blocks are left alone
    assert not caplog.records


def test_a_link_to_a_missing_repository_file_is_a_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        mkdocs_hooks.on_page_markdown("[gone](../no-such-file.json)", page("index.md"),
                                      CONFIG, None)
    assert "no-such-file.json" in caplog.text


def test_a_repository_page_links_relative_to_its_own_file(caplog) -> None:
    changelog = SimpleNamespace(file=SimpleNamespace(abs_src_path=None, src_uri="changelog.md"))
    text = ("[hand-over](docs/handover.md#one-hand-over-per-rollout), "
            "[guide](DEVELOPMENT.md#the-image), [home](README.md), "
            "[notes](bench/results/chaos-sqlite.md), [results](bench/results/core.json)")
    out = mkdocs_hooks.on_page_markdown(text, changelog, CONFIG, None)
    assert "[hand-over](handover.md#one-hand-over-per-rollout)" in out
    assert "[guide](development.md#the-image)" in out
    assert "[home](index.md)" in out
    assert "notes (`bench/results/chaos-sqlite.md`)" in out
    assert "[results](_repo/bench/results/core.json)" in out
    assert not caplog.records
    chart = SimpleNamespace(file=SimpleNamespace(abs_src_path=None, src_uri="chart-values.md"))
    out = mkdocs_hooks.on_page_markdown("[docs](../../docs/kubernetes.md)", chart, CONFIG, None)
    assert out == "[docs](kubernetes.md)"
