"""The sidecar's own Kubernetes client (sidecar.kubeapi) and its watch follower
(sidecar.kubewatch) against a misbehaving apiserver: testkit/fake_apiserver.py, a real
HTTP server on loopback that can throttle, stall, close, answer 410, cut its lines into
slow pieces and serve objects of more than a MiB. Real sidecar processes against it:
tests/integration/test_kube_misbehaving.py; the same client against the real
kube-apiserver: tests/integration/test_kubeapi.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar import kubewatch
from sidecar.kubeapi import CredentialsError, KubeClient, KubeError, load_credentials
from sidecar.kubewatch import Follower
from testkit.fake_apiserver import LEASES, PODS, FakeApiserver

NS = "team"
LEASE = LEASES.format(ns=NS)
POD = PODS.format(ns=NS)


@pytest.fixture
def fake() -> Iterator[FakeApiserver]:
    with FakeApiserver() as server:
        yield server


def client_of(fake: FakeApiserver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
              **cluster: Any) -> KubeClient:
    monkeypatch.setenv("KUBECONFIG", str(fake.kubeconfig(tmp_path / "kc.json", NS,
                                                         **cluster)))
    return KubeClient.connect()


async def until(check: Any, timeout: float, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        if (found := check()):
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout}s")
        await asyncio.sleep(interval)


def lease(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"holderIdentity": "a"}}


# -- Retry-After ------------------------------------------------------------------------

async def test_a_429_retry_after_is_waited_out_and_the_call_sent_again(fake, tmp_path,
                                                                       monkeypatch):
    client = client_of(fake, tmp_path, monkeypatch)
    try:
        fake.throttle(1, 1.5)
        sent = time.monotonic()
        assert await client.get_or_none(f"{LEASE}/jobs") is None  # 404 after the 429
        assert time.monotonic() - sent >= 1.5
        first, second = fake.calls(sent)
        assert second.at - first.at >= 1.5
        # A longer wait is the caller's to make: the error carries it, at once.
        fake.throttle(1, 60)
        sent = time.monotonic()
        with pytest.raises(KubeError) as refused:
            await client.post(LEASE, lease("jobs"))
        assert (refused.value.status, refused.value.retry_after) == (429, 60.0)
        assert str(refused.value) == (f"create leases {NS}: HTTP 429: too many requests "
                                      "(retry after 60s)")
        assert time.monotonic() - sent < 1.0
    finally:
        await client.close()


async def test_a_watch_answered_429_waits_its_retry_after(fake, tmp_path, monkeypatch):
    client = client_of(fake, tmp_path, monkeypatch)
    await client.post(LEASE, lease("jobs"))
    fake.throttle(1, 2.5)
    since = time.monotonic()
    follower = Follower(client, LEASE, "jobs", lambda kind, obj: None, quiet=30, what="t")
    try:
        await until(lambda: follower.up, 6)
        first, second = fake.watches(since)[:2]
        assert second.at - first.at >= 2.5
    finally:
        follower.stop()
        await client.close()


# -- watches that end at once, fail, resume ------------------------------------------

async def test_an_instantly_closing_server_gets_about_one_watch_a_second_then_fewer(
        fake, tmp_path, monkeypatch):
    client = client_of(fake, tmp_path, monkeypatch)
    await client.post(LEASE, lease("jobs"))
    fake.close_watches = True
    since = time.monotonic()
    follower = Follower(client, LEASE, "jobs", lambda kind, obj: None, quiet=30, what="t")
    try:
        await asyncio.sleep(4.0)
        sent = fake.watches(since)
        # 0.8 s, then 1.6 s, ... each drawn from [d, 2d): at most 4 in 4 s.
        assert 2 <= len(sent) <= 4, [round(r.at - since, 2) for r in sent]
        assert not follower.up
    finally:
        follower.stop()
        await client.close()


async def test_bookmarks_are_resumed_from(fake, tmp_path, monkeypatch):
    client = client_of(fake, tmp_path, monkeypatch)
    await client.post(LEASE, lease("jobs"))
    created = fake.get(f"{LEASE}/jobs")["metadata"]["resourceVersion"]
    await client.post(LEASE, lease("other"))  # the store moves on; "jobs" does not change
    fake.bookmark_every = 0.2
    seen: list[str] = []
    since = time.monotonic()
    follower = Follower(client, LEASE, "jobs", lambda kind, obj: seen.append(kind),
                        quiet=30, what="t", watch_seconds=2)
    try:
        await until(lambda: len(fake.watches(since)) >= 2, 6)
        first, second = fake.watches(since)[:2]
        assert "resourceVersion" not in first.query and first.query[
            "allowWatchBookmarks"] == "true"
        # Resumed from the bookmark's version (the store's), not the object's own.
        assert int(second.query["resourceVersion"]) > int(created)
        assert seen == ["ADDED"]  # nothing replayed
    finally:
        follower.stop()
        await client.close()


async def test_410_starts_over_from_the_current_state_once_then_backs_off(
        fake, tmp_path, monkeypatch):
    client = client_of(fake, tmp_path, monkeypatch)
    await client.post(LEASE, lease("jobs"))
    seen: list[str] = []
    since = time.monotonic()
    follower = Follower(client, LEASE, "jobs", lambda kind, obj: seen.append(kind),
                        quiet=30, what="t")
    try:
        await until(lambda: seen == ["ADDED"], 3)
        fake.gone_watches = True
        fake.end_watches()
        await asyncio.sleep(2.0)
        watches = fake.watches(since)
        # The first: current state; the resumed one: 410; at once from the current state
        # (410 again): from then on only after the backoff.
        assert "resourceVersion" in watches[1].query
        assert "resourceVersion" not in watches[2].query
        assert watches[2].at - watches[1].at < 0.5
        assert len(watches) <= 5, len(watches)
        fake.gone_watches = False
        await until(lambda: seen == ["ADDED", "ADDED"], 5)
    finally:
        follower.stop()
        await client.close()


async def test_any_error_restarts_the_watch_and_is_reported_meanwhile(fake, tmp_path,
                                                                     monkeypatch):
    """A standby whose watch task died on an exception stayed deaf until a restart."""
    client = client_of(fake, tmp_path, monkeypatch)
    await client.post(LEASE, lease("jobs"))
    calls: list[str] = []

    def deliver(kind: str, obj: dict[str, Any]) -> None:
        calls.append(kind)
        if len(calls) == 1:
            raise TypeError("can't compare offset-naive and offset-aware datetimes")

    follower = Follower(client, LEASE, "jobs", deliver, quiet=30, what="the watch of X")
    try:
        await until(lambda: calls, 3)
        assert kubewatch.problems() == ["the watch of X restarting after an error: "
                                        "TypeError: can't compare offset-naive and "
                                        "offset-aware datetimes"]
        assert not follower.up
        await until(lambda: follower.up, 5)  # re-opened after the backoff, delivered
        assert calls == ["ADDED", "ADDED"] and kubewatch.problems() == []
    finally:
        follower.stop()
        await client.close()


# -- stalls, half-open connections ------------------------------------------------------

async def test_a_stalled_watch_is_noticed_after_quiet_seconds(fake, tmp_path, monkeypatch):
    client = client_of(fake, tmp_path, monkeypatch)
    await client.post(LEASE, lease("jobs"))
    seen: list[str] = []
    follower = Follower(client, LEASE, "jobs",
                        lambda kind, obj: seen.append(obj["spec"]["holderIdentity"]),
                        quiet=0.5, what="t")
    try:
        await until(lambda: follower.up, 3)
        await asyncio.sleep(1.5)  # idle: quiet checks find nothing missed
        assert follower.up and len(fake.watches()) == 1
        fake.stall_watches = True
        current = fake.get(f"{LEASE}/jobs")
        current["spec"]["holderIdentity"] = "b"
        changed = time.monotonic()
        await client.put(f"{LEASE}/jobs", current)
        await until(lambda: not follower.up, 3)
        # The quiet period plus the check's grace for an event on its way.
        assert time.monotonic() - changed < 0.5 + 0.25 + 0.5
        fake.stall_watches = False
        await until(lambda: seen[-1:] == ["b"] and follower.up, 5)
    finally:
        follower.stop()
        await client.close()


async def test_a_deletion_a_stalled_watch_missed_is_delivered(fake, tmp_path, monkeypatch):
    client = client_of(fake, tmp_path, monkeypatch)
    await client.post(LEASE, lease("jobs"))
    seen: list[str] = []
    follower = Follower(client, LEASE, "jobs", lambda kind, obj: seen.append(kind),
                        quiet=0.5, what="t")
    try:
        await until(lambda: follower.up, 3)
        fake.stall_watches = True
        fake.delete(f"{LEASE}/jobs")
        await until(lambda: seen == ["ADDED", "DELETED"], 3)
        # A new watch of an object that is not there sends nothing, and is up at once.
        await until(lambda: follower.up, 5)
        await asyncio.sleep(1.5)  # and its quiet checks find nothing missed
        assert follower.up and seen == ["ADDED", "DELETED"]
    finally:
        follower.stop()
        await client.close()


async def test_connections_probe_a_silent_peer(fake, tmp_path, monkeypatch):
    """TCP keepalive on the client's connections (a peer gone without a FIN or RST
    fails the connection within seconds); ``ss`` shows the kernel's keepalive timer."""
    client = client_of(fake, tmp_path, monkeypatch)
    await client.post(LEASE, lease("jobs"))
    follower = Follower(client, LEASE, "jobs", lambda kind, obj: None, quiet=30, what="t")
    try:
        await until(lambda: follower.up, 3)
        port = fake.url.rsplit(":", 1)[1]
        out = subprocess.run(["ss", "-tnoH", "state", "established", "dst",
                              f"127.0.0.1:{port}"], capture_output=True, text=True,
                             check=True).stdout
        assert out.strip() and all("timer:(keepalive" in line
                                   for line in out.strip().splitlines()), out
    finally:
        follower.stop()
        await client.close()


# -- big objects, slow lines ------------------------------------------------------------

async def test_a_pod_of_more_than_a_mebibyte_in_slow_pieces(fake, tmp_path, monkeypatch):
    client = client_of(fake, tmp_path, monkeypatch)
    fake.put_pod(NS, "big", ready=True, padding=1_500_000)
    fake.piece_size, fake.piece_delay = 65_536, 0.005
    seen: list[int] = []
    follower = Follower(client, POD, "big", lambda kind, obj: seen.append(
        len(obj["metadata"]["annotations"]["padding"])), quiet=30, what="t")
    try:
        await until(lambda: seen, 10)
        assert seen == [1_500_000] and follower.up
        pod = await client.get(f"{POD}/big")
        assert len(pod["metadata"]["annotations"]["padding"]) == 1_500_000
        assert await client.version_of(f"{POD}/big") == pod["metadata"]["resourceVersion"]
    finally:
        follower.stop()
        await client.close()


# -- credentials, proxies ---------------------------------------------------------------

async def test_a_401_on_a_watch_rereads_the_token_file(fake, tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text("old")
    path = tmp_path / "kc.json"
    fake.kubeconfig(path, NS)
    doc = json.loads(path.read_text())
    doc["users"][0]["user"] = {"tokenFile": "token"}
    path.write_text(json.dumps(doc))
    monkeypatch.setenv("KUBECONFIG", str(path))
    client = KubeClient.connect()
    await asyncio.sleep(0)
    fake.tokens = {"old"}
    await client.post(LEASE, lease("jobs"))
    fake.tokens = {"new"}  # the token rotated: the apiserver takes only the new one
    token.write_text("new")
    since = time.monotonic()
    follower = Follower(client, LEASE, "jobs", lambda kind, obj: None, quiet=30, what="t")
    try:
        # The first watch's 401 re-read the file: the next one (after the backoff) works,
        # not a minute later when the file would be due again.
        await until(lambda: follower.up, 4)
        first, second = fake.watches(since)[:2]
        assert first.headers["authorization"] == "Bearer old"
        assert second.headers["authorization"] == "Bearer new"
    finally:
        follower.stop()
        await client.close()


async def test_the_proxy_environment_and_the_kubeconfigs_proxy_url(fake, tmp_path,
                                                                  monkeypatch):
    """The kubeconfig names a server no resolver knows; the proxy (the fake) gets it."""
    for key in ("NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HTTP_PROXY", fake.url)
    client = client_of(fake, tmp_path, monkeypatch, server="http://apiserver.invalid:6443")
    try:
        assert await client.get_or_none(f"{LEASE}/jobs") is None
        assert fake.calls()[-1].host == "apiserver.invalid:6443"
    finally:
        await client.close()
    monkeypatch.delenv("HTTP_PROXY")
    client = client_of(fake, tmp_path, monkeypatch, server="http://apiserver.invalid:6443",
                       **{"proxy-url": fake.url})
    try:
        await client.post(LEASE, lease("jobs"))
        assert fake.calls()[-1].host == "apiserver.invalid:6443"
    finally:
        await client.close()


def write(path: Path, doc: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def test_kubeconfig_files_merge_as_kubectl_merges_them(tmp_path, monkeypatch):
    first = write(tmp_path / "a" / "config", {
        "current-context": "work",
        "contexts": [{"name": "work", "context": {"cluster": "prod", "user": "me",
                                                  "namespace": "jobs"}}],
        "users": [{"name": "me", "user": {"tokenFile": "me.token"}}]})
    (tmp_path / "a" / "me.token").write_text("first-token")
    second = write(tmp_path / "b" / "config", {
        "current-context": "other",  # the first file's current-context wins
        "clusters": [{"name": "prod", "cluster": {"server": "http://127.0.0.1:6443"}}],
        "users": [{"name": "me", "user": {"token": "loses"}}]})  # the first file wins
    monkeypatch.setenv("KUBECONFIG", f"{first}:{tmp_path / 'missing'}:{second}")
    creds = load_credentials()
    assert (creds.server, creds.namespace, creds.token) == (
        "http://127.0.0.1:6443", "jobs", "first-token")
    assert creds.token_file == tmp_path / "a" / "me.token"  # relative to its own file


@pytest.mark.parametrize(("user", "what"), [
    ({"as": "admin"}, "impersonation (as)"),
    ({"username": "u", "password": "p"}, "basic auth (username)"),
    ({"exec": {"command": "x"}}, "exec")])
def test_what_the_client_cannot_do_is_refused_in_one_line(tmp_path, monkeypatch, user,
                                                         what):
    path = write(tmp_path / "config", {
        "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {"server": "http://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": user}]})
    monkeypatch.setenv("KUBECONFIG", str(path))
    with pytest.raises(CredentialsError) as refused:
        load_credentials()
    assert str(refused.value) == (
        "kubernetes: no usable credentials (KUBECONFIG or in-cluster): the kubeconfig user "
        f"uses {what}, which lease-sidecar does not support (use a token, a tokenFile or "
        "a client certificate)")


def test_a_socks_proxy_is_refused_in_one_line(tmp_path, monkeypatch):
    path = write(tmp_path / "config", {
        "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k"}}],
        "clusters": [{"name": "k", "cluster": {"server": "http://127.0.0.1:1",
                                               "proxy-url": "socks5://127.0.0.1:1080"}}]})
    monkeypatch.setenv("KUBECONFIG", str(path))
    with pytest.raises(CredentialsError, match=r"proxy-url 'socks5://127\.0\.0\.1:1080' is "
                                               r"not an http\(s\) proxy"):
        load_credentials()


async def test_healthz_says_which_watch_is_restarting(fake, tmp_path, monkeypatch):
    """/healthz answers 503 naming the watch while it restarts after an error, and 200
    once it works again; /livez stays 200 (it restarts by itself)."""
    from sidecar.publish.http import Request, build_app
    from sidecar.runtime import Sidecar

    client = client_of(fake, tmp_path, monkeypatch)
    await client.post(LEASE, lease("jobs"))
    failures = [ValueError("bad")]

    def deliver(kind: str, obj: dict[str, Any]) -> None:
        if failures:
            raise failures.pop()

    app = build_app([], status=dict, alive=lambda: True, ready=lambda: True,
                    release=lambda name: "not-holding", degraded=Sidecar.watch_problem)
    follower = Follower(client, LEASE, "jobs", deliver, quiet=30,
                        what="the watch of Lease jobs")
    try:
        await until(lambda: Sidecar.watch_problem(), 3)
        answer = await app.handle(Request("GET", "/healthz"))
        assert answer.status == 503 and json.loads(answer.body) == {
            "ok": False, "reason": "the watch of Lease jobs restarting after an error: "
                                   "ValueError: bad"}
        assert (await app.handle(Request("GET", "/livez"))).status == 200
        await until(lambda: follower.up, 5)
        assert (await app.handle(Request("GET", "/healthz"))).status == 200
    finally:
        follower.stop()
        await client.close()
