"""What the rollout e2e test and bench/bench_rollout.py share: rolling updates of the
injected Deployment, hand-overs counted from the claims the pod observer saw, and the
leader Service followed on the same clock: its EndpointSlices (a watch) and a client
pod asking ``/leader`` through the ClusterIP (kube-proxy's rules).

A *hand-over* is one change of the pod that claims leadership: the observer's claims
(every pod's ``/leader`` polled every 20 ms and its leader file read every 10 ms) in time
order, consecutive claims of one pod taken together. Its *gap* is the time from the end
of the old leader's last claim (its ``valid_until``) to the new leader's first claim.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from testkit import pods_support as ps
from testkit.chaos.checker import claim_time
from testkit.testbed.cluster import Cluster

# The chart's leader Service, selecting the app's pods and lease-role=leader; its port is
# the sidecar's HTTP port, so whoever it reaches answers /leader.
LEADER_SERVICE_PORT = 8099
STRATEGIES: dict[str, dict[str, Any]] = {
    # The Deployment default, written out (25 % of 3 replicas: surge 1, unavailable 0).
    "default": {"type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}},
    "surge1-unavailable0": {"type": "RollingUpdate",
                            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
}


def leader_service_values(release: str) -> tuple[tuple[str, ...], str]:
    """helm ``--set`` values rendering the leader Service for the app's pods; its name."""
    return (
        "leaderService.enabled=true",
        f"leaderService.podSelector.app={ps.APP_LABEL}",
        "leaderService.ports[0].name=http",
        f"leaderService.ports[0].port={LEADER_SERVICE_PORT}",
        f"leaderService.ports[0].targetPort={LEADER_SERVICE_PORT}",
    ), f"{release}-lease-sidecar-leader"


def set_strategy(cluster: Cluster, namespace: str, deployment: str, strategy: str) -> None:
    """Patch the Deployment's update strategy (no rollout: the pod template is unchanged)."""
    cluster.kubectl("-n", namespace, "patch", f"deployment/{deployment}", "--type=merge",
                    "-p", json.dumps({"spec": {"strategy": STRATEGIES[strategy]}}))


@dataclass
class Handover:
    old: str
    new: str
    at: float  # the new leader's first claim
    gap: float  # the old leader's last claim's end -> the new leader's first claim


def handovers(obs: ps.PodObserver, begin: float, end: float) -> list[Handover]:
    """Changes of the claiming pod between ``begin`` and ``end``, in order."""
    spans = [s for s in obs.spans() if s.end > begin and s.start < end]
    runs = sorted((iv for ivs in claim_time(spans).values() for iv in ivs),
                  key=lambda iv: iv.start)
    out: list[Handover] = []
    current = None
    for iv in runs:
        who = iv.who[0]
        if current is not None and who != current.who[0]:
            out.append(Handover(current.who[0], who, iv.start, iv.start - current.end))
        if current is None or who != current.who[0] or iv.end > current.end:
            current = iv
    return out


def rollout(cluster: Cluster, namespace: str, obs: ps.PodObserver,
            deployment: str = "web") -> dict[str, Any]:
    """One ``kubectl rollout restart``, until the old pods are gone and one new pod
    leads: its hand-overs, overlaps, fencing violations and label history verdict."""
    ps.wait_one_leader(cluster, namespace)
    before = {p["metadata"]["name"] for p in ps.app_pods(cluster, namespace)}
    cluster.wait_for(obs.leader_now, 30, "the observer to see a leader")
    begin = time.time()
    cluster.kubectl("-n", namespace, "rollout", "restart", f"deployment/{deployment}")
    ps.wait_rolled_out(cluster, namespace, deployment)
    cluster.wait_for(lambda: not before & set(ps.roles(cluster, namespace)), 120,
                     "the old pods to be gone")
    leader = ps.wait_one_leader(cluster, namespace)
    cluster.wait_for(lambda: obs.leader_now() == leader, 30, "the observer to see the leader")
    end = time.time()
    verdict = obs.verdict(begin, end)
    moves = handovers(obs, begin, end)
    return {
        "begin": begin,
        "end": end,
        "duration": end - begin,
        "handovers": len(moves),
        "gaps": [m.gap for m in moves],
        "moves": [(m.old, m.new, m.at) for m in moves],
        "to_old_pod": sum(m.new in before for m in moves),
        "overlaps": len(verdict.overlaps),
        "fencing_violations": len(verdict.fencing),
        "two_leader_labels": len(ps.two_leader_labels(
            [e for e in obs.label_history() if begin <= e.t <= end])),
        "final_leader": leader,
    }


@dataclass
class SliceWatch:
    """``kubectl get endpointslices --watch`` of one Service: after every event, when it
    arrived and the ready endpoint addresses of all its slices together."""

    cluster: Cluster
    namespace: str
    service: str
    history: list[tuple[float, frozenset[str]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._slices: dict[str, frozenset[str]] = {}
        self._lock = threading.Lock()
        from testkit.testbed import gobuild

        self._proc = subprocess.Popen(
            [str(gobuild.ensure_binary("kubectl")), f"--kubeconfig={self.cluster.kubeconfig}",
             "-n", self.namespace, "get", "endpointslices",
             "-l", f"kubernetes.io/service-name={self.service}",
             "--watch", "--output-watch-events", "-o", "json"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        decoder = json.JSONDecoder()
        buffer = ""
        for chunk in iter(self._proc.stdout.readline, ""):
            buffer += chunk
            while buffer.strip():
                try:
                    event, end = decoder.raw_decode(buffer.lstrip())
                except ValueError:
                    break
                buffer = buffer.lstrip()[end:]
                self._on_event(event)

    def _on_event(self, event: dict[str, Any]) -> None:
        now = time.time()
        obj = event["object"]
        ready = frozenset(a for e in obj.get("endpoints") or []
                          if (e.get("conditions") or {}).get("ready")
                          for a in e["addresses"])
        with self._lock:
            if event["type"] == "DELETED":
                self._slices.pop(obj["metadata"]["name"], None)
            else:
                self._slices[obj["metadata"]["name"]] = ready
            self.history.append((now, frozenset().union(*self._slices.values())))

    def ready_now(self) -> frozenset[str]:
        with self._lock:
            return self.history[-1][1] if self.history else frozenset()

    def only_after(self, address: str, t: float) -> float | None:
        """When the ready endpoints first became exactly ``{address}`` after ``t``."""
        with self._lock:
            history = list(self.history)
        was = next((ready for at, ready in reversed(history) if at <= t), frozenset())
        if was == {address}:
            return t
        return next((at for at, ready in history if at > t and ready == {address}), None)

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=10)


def pod_ip(obs: ps.PodObserver, pod: str) -> str | None:
    seen = obs.pods.get(pod)
    return seen["status"].get("podIP") if seen else None


def settle_times(obs: ps.PodObserver, watch: SliceWatch,
                 moves: list[tuple[str, str, float]]) -> list[dict[str, float]]:
    """Per hand-over: the new leader's first claim -> its label ``leader`` (pod watch)
    -> the leader Service's ready endpoints exactly its pod IP (EndpointSlice watch)."""
    out = []
    labels = obs.label_history()
    for _, new, at in moves:
        ip = pod_ip(obs, new)
        labelled = next((e.t for e in labels
                         if e.pod == new and e.role == "leader" and e.t >= at - 1.0), None)
        settled = watch.only_after(ip, at) if ip else None
        if settled is None or labelled is None:
            continue
        out.append({"claim_to_label": max(0.0, labelled - at),
                    "claim_to_endpoints": settled - at,
                    "label_to_endpoints": max(0.0, settled - labelled)})
    return out


CLIENT_SCRIPT = r'''
import json, os, threading, time, urllib.error, urllib.request

URL, PERIOD = os.environ["TARGET_URL"], float(os.environ["PERIOD"])
done, cond = {}, threading.Condition()

def ask(seq):
    # A new connection each time: kube-proxy's rules at that moment pick its endpoint.
    sent = time.time()
    try:
        with urllib.request.urlopen(URL, timeout=2.0) as answer:
            status, body = answer.status, json.load(answer)
    except urllib.error.HTTPError as err:
        status, body = err.code, json.load(err)
    except (OSError, ValueError) as err:
        status, body = 0, {"error": str(err)[:80]}
    with cond:
        done[seq] = (sent, status, body.get("identity"), body.get("error"))
        cond.notify()

def report():
    # In the order the requests were sent; each change of who answers, every answer that
    # is not a 200 (hand-overs only), and a heartbeat a second.
    seq, last, beat = 0, None, 0.0
    while True:
        with cond:
            while seq not in done:
                cond.wait()
            sent, status, identity, error = done.pop(seq)
        if (status, identity) != last or status != 200 or sent - beat >= 1.0:
            print(json.dumps({"sent": sent, "status": status, "identity": identity,
                              "error": error, "count": seq + 1}), flush=True)
            last, beat = (status, identity), sent
        seq += 1

threading.Thread(target=report, daemon=True).start()
seq = 0
while True:  # one request every PERIOD, whether or not earlier ones have been answered
    threading.Thread(target=ask, args=(seq,), daemon=True).start()
    seq += 1
    time.sleep(PERIOD)
'''


@dataclass
class Answer:
    sent: float  # when the request that got it was sent (host and pod share one clock)
    status: int  # 0: no HTTP answer (refused: no endpoints; timed out)
    identity: str | None  # the answering sidecar's identity (its pod name)
    count: int  # requests made so far, this one included
    error: str | None = None  # why there was no HTTP answer

    @property
    def key(self) -> tuple[int, str | None]:
        return (self.status, self.identity)


class ServiceClient:
    """A pod asking ``/leader`` through a Service's ClusterIP every ``period`` seconds (a
    new connection each time, not waiting for earlier answers: a request sent to a pod
    that is gone hangs until its timeout), logging each change of who answers in the
    order the requests were sent; its log followed with ``kubectl logs -f``."""

    def __init__(self, cluster: Cluster, namespace: str, service: str, image: str,
                 period: float = 0.02, name: str = "service-client") -> None:
        self.cluster, self.namespace, self.name = cluster, namespace, name
        ip = cluster.kubectl_json("-n", namespace, "get", "service", service)["spec"][
            "clusterIP"]
        self.url = f"http://{ip}:{LEADER_SERVICE_PORT}/leader"
        cluster.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": name}},
            "spec": {
                "automountServiceAccountToken": False,
                "terminationGracePeriodSeconds": 1,
                "containers": [{
                    "name": "client", "image": image, "imagePullPolicy": "Never",
                    "command": ["python", "-u", "-c", CLIENT_SCRIPT],
                    "env": [{"name": "TARGET_URL", "value": self.url},
                            {"name": "PERIOD", "value": str(period)}],
                    # Enough CPU share that its threads start on time on a busy node.
                    "resources": {"requests": {"cpu": "100m", "memory": "32Mi"},
                                  "limits": {"memory": "128Mi"}},
                    "securityContext": ps.RESTRICTED_CONTAINER,
                }],
            },
        }))
        cluster.kubectl("-n", namespace, "wait", "--for=condition=Ready", f"pod/{name}",
                        "--timeout=120s", timeout=130)
        self.answers: list[Answer] = []
        self._lock = threading.Lock()
        from testkit.testbed import gobuild

        self._proc = subprocess.Popen(
            [str(gobuild.ensure_binary("kubectl")), f"--kubeconfig={cluster.kubeconfig}",
             "-n", namespace, "logs", "-f", name],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        cluster.wait_for(lambda: self.answers, 30, "the Service client's first answer")

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                x = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                self.answers.append(Answer(x["sent"], x["status"], x["identity"], x["count"],
                                           x.get("error")))

    def history(self) -> list[Answer]:
        with self._lock:
            return list(self.answers)

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=10)
        self.cluster.kubectl("-n", self.namespace, "delete", "pod", self.name, "--wait=false",
                             check=False)


def through_service(client: ServiceClient, moves: list[tuple[str, str, float]],
                    end: float) -> list[dict[str, Any]]:
    """Per hand-over, from the client pod's answers through the ClusterIP while the new
    leader led (from its first claim to its last ``200`` the client got, or ``end``):

    - ``claim_to_client``: the new leader's first claim -> the first request through
      the Service that the new leader answered 200 (the Service has settled: label,
      EndpointSlice and kube-proxy's rules all name it);
    - requests sent after that one that the new leader did not answer 200: ``other_pod``
      another pod answered (the claim "a client reaches only the leader once the
      endpoints have settled" is that there are none), ``no_answer`` none did (refused,
      or no answer within the client's timeout on a busy node), ``leader_not_200`` the
      new leader answered otherwise; ``not_leader`` lists them all.

    The client logs each change of answer and every answer that is not a 200, in the
    order sent, so a logged answer stands for the requests up to the next one.
    """
    answers = [a for a in client.history() if a.sent < end]
    runs = [(a, b.count - a.count) for a, b in itertools.pairwise(answers)]
    if answers:
        runs.append((answers[-1], 1))
    out = []
    for i, (_, new, at) in enumerate(moves):
        until = moves[i + 1][2] if i + 1 < len(moves) else end
        # Up to the new leader's last 200: what came after is its own stepping down.
        window = [(a, n) for k, (a, n) in enumerate(runs) if a.sent < until and (
            k + 1 == len(runs) or runs[k + 1][0].sent > at)]
        led = [k for k, (a, _) in enumerate(window) if a.key == (200, new)]
        window = window[led[0]:led[-1] + 1] if led else []
        wrong = [(a, n) for a, n in window if a.key != (200, new)]
        out.append({
            "claim_to_client": max(0.0, window[0][0].sent - at) if window else None,
            "other_pod": sum(n for a, n in wrong if a.identity not in (None, new)),
            "no_answer": sum(n for a, n in wrong if a.status == 0),
            "leader_not_200": sum(n for a, n in wrong if a.identity == new),
            "not_leader": [f"{a.status} {a.identity} {a.error} at +{a.sent - at:.3f}s"
                           for a, _ in wrong],
        })
    return out


def settled_through_service(cluster: Cluster, client: ServiceClient,
                            row: dict[str, Any]) -> list[dict[str, Any]]:
    """After :func:`rollout`: wait until the client pod gets the final leader's answers
    through the Service and has asked for one more second; then :func:`through_service`
    for the rollout's moves."""
    leader = row["final_leader"]

    def settled() -> bool:
        answers = client.history()
        first = next((a.sent for a in answers if a.key == (200, leader)
                      and a.sent >= row["begin"]), None)
        return first is not None and answers[-1].sent >= first + 1.0

    cluster.wait_for(settled, 60, "the Service client to reach the new leader", 0.1)
    return through_service(client, row["moves"], time.time())


def leader_answers(address: str, timeout: float = 2.0) -> tuple[int, dict[str, Any]]:
    """GET ``/leader`` of the pod at ``address`` (the leader Service's target port)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{address}:{LEADER_SERVICE_PORT}/leader",
                                    timeout=timeout) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)
