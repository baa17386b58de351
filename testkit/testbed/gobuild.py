"""Build the test-bed tools (Kubernetes components, etcd, helm) from Go modules.

Every tool is compiled once from the Go module proxy into a cache outside the repo::

    ${LEASE_TESTBED_CACHE:-~/.cache/lease-sidecar}/bin/<tool>-<version>/<tool>

Later runs find the cached binary and return in milliseconds.  The Go build tree (a tiny
wrapper module per tool and version) lives in ``<cache>/build``; Go's own module and build
caches are the defaults, so a second tool from the same module reuses compiled packages.

Why wrapper modules: ``go install pkg@version`` refuses modules whose go.mod has
``replace`` directives, and both k8s.io/kubernetes (staging ``k8s.io/*`` modules) and
etcd's server module have them.  The wrapper requires the module and restates those
replacements against published versions.

One more program is built from this repository's own sources: ``clientgo-elector``
(``testkit/interop/clientgo-elector``), client-go's leader election as a small command for
the interoperability test, built against the client-go release that matches the
kube-apiserver in use (``v1.37.2`` -> ``v0.37.2``) and cached per version and source hash.

Usage::

    python -m testkit.testbed.gobuild [TOOL ...|all]

where TOOL is one of :data:`TOOLS` (the control plane's kube-apiserver, kubectl, etcd,
helm, then the one-node cluster's kubelet, kube-controller-manager and kube-scheduler),
``clientgo-elector`` or ``promtool`` (built on demand only).

or ``ensure_binary("kube-apiserver") -> Path`` from Python.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Newest first.  Every Kubernetes component always comes from the same release.
KUBERNETES_VERSIONS: tuple[str, ...] = ("v1.37.2", "v1.36.3", "v1.35.4", "v1.34.4")
ETCD_VERSION = "v3.6.16"
HELM_VERSION = "v3.22.0"
# promtool (checks the chart's PrometheusRule); Prometheus 3.x publishes its Go module as v0.3xx.
PROMTOOL_VERSION = "v0.316.0"

# Used only when a module's go.mod asks for a newer Go than the one installed; this is the
# toolchain version approved for this project (fetched by the go command itself).
FALLBACK_TOOLCHAIN = "go1.27.3"

# Kubernetes components built from k8s.io/kubernetes; all share one wrapper go.mod recipe.
KUBE_COMPONENTS: tuple[str, ...] = (
    "kube-apiserver",
    "kubectl",
    "kubelet",
    "kube-controller-manager",
    "kube-scheduler",
    "kube-proxy",
)

# Order of `all`: the control plane first (every kube test needs it), then the four
# components only the one-node cluster (testkit/testbed/cluster.py) needs.
TOOLS: tuple[str, ...] = (
    "kube-apiserver",
    "kubectl",
    "etcd",
    "helm",
    "kubelet",
    "kube-controller-manager",
    "kube-scheduler",
    "kube-proxy",
)
# Built on demand only (not by ``all``): the rule check is its only user.
OPTIONAL_TOOLS: tuple[str, ...] = ("promtool",)
# Built from sources in this repository rather than from a published module.
LOCAL_TOOLS: tuple[str, ...] = ("clientgo-elector",)
CLIENTGO_ELECTOR_SRC = Path(__file__).resolve().parent.parent / "interop" / "clientgo-elector"


class BuildError(RuntimeError):
    """A tool could not be built; the message says why and where the log is."""


class CompileError(BuildError):
    """The sources were fetched but do not compile or run: retrying will not help.

    Other BuildErrors (module download, `go mod tidy`) may be transient network trouble.
    """


@dataclass(frozen=True)
class Recipe:
    """How to build one tool at one version."""

    tool: str
    version: str
    module: str  # module path to require
    package: str  # main package to build
    ldflags: tuple[str, ...] = ()
    replace_staging_k8s: bool = False  # restate k8s.io/kubernetes' staging replaces
    version_args: tuple[str, ...] = ("--version",)
    tags: tuple[str, ...] = ()  # go build -tags


def cache_root() -> Path:
    env = os.environ.get("LEASE_TESTBED_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "lease-sidecar"


def binary_path(tool: str, version: str) -> Path:
    return cache_root() / "bin" / f"{tool}-{version}" / tool


def log(msg: str) -> None:
    # stderr so `python -m ... | something` still shows progress; flush for CI logs.
    print(f"[testbed-build] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- recipes


def _kube_ldflags(version: str) -> tuple[str, ...]:
    major, minor = re.match(r"v(\d+)\.(\d+)\.", version).groups()  # type: ignore[union-attr]  # versions are vX.Y.Z
    build_date = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    values = {
        "gitVersion": version,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "buildDate": build_date,
    }
    # Both packages carry a copy of the version vars; /version reads component-base's,
    # kubectl's client half reads client-go's.
    flags = []
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {pkg}.{key}={val}" for key, val in values.items()]
    return tuple(flags)


def recipe(tool: str, version: str) -> Recipe:
    if tool in KUBE_COMPONENTS:
        return Recipe(
            tool=tool,
            version=version,
            module="k8s.io/kubernetes",
            package=f"k8s.io/kubernetes/cmd/{tool}",
            ldflags=_kube_ldflags(version),
            replace_staging_k8s=True,
            version_args=("version", "--client") if tool == "kubectl" else ("--version",),
        )
    if tool == "etcd":
        return Recipe(tool, version, "go.etcd.io/etcd/server/v3", "go.etcd.io/etcd/server/v3")
    if tool == "helm":
        return Recipe(
            tool,
            version,
            "helm.sh/helm/v3",
            "helm.sh/helm/v3/cmd/helm",
            ldflags=(f"-X helm.sh/helm/v3/internal/version.version={version}",),
            version_args=("version", "--short"),
        )
    if tool == "promtool":
        return Recipe(
            tool,
            version,
            "github.com/prometheus/prometheus",
            "github.com/prometheus/prometheus/cmd/promtool",
            ldflags=(f"-X github.com/prometheus/common/version.Version={version}",),
            # Leaves out the service-discovery plugins (cloud SDKs): rule checks need
            # none, and the build takes minutes instead of a quarter of an hour.
            tags=("remove_all_sd",),
        )
    known = ", ".join(TOOLS + OPTIONAL_TOOLS + LOCAL_TOOLS)
    raise ValueError(f"unknown tool {tool!r}; expected one of {known}")


def candidate_versions(tool: str) -> tuple[str, ...]:
    if tool in KUBE_COMPONENTS:
        pinned = os.environ.get("LEASE_TESTBED_K8S_VERSION")
        return (pinned,) if pinned else KUBERNETES_VERSIONS
    return {"etcd": (ETCD_VERSION,), "helm": (HELM_VERSION,),
            "promtool": (PROMTOOL_VERSION,)}[tool]


# --------------------------------------------------------------------------- go helpers


def go_executable() -> str:
    found = shutil.which("go") or "/usr/local/go/bin/go"
    if not Path(found).exists():
        raise BuildError("Go toolchain not found: install Go (>= 1.26) and put it on PATH")
    return found


def _go_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        CGO_ENABLED="0",  # static binaries, no C toolchain needed
        GOWORK="off",  # a go.work above the cache must not leak in
        GOFLAGS="-buildvcs=false -mod=mod",
    )
    env.update(extra or {})
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], logfile: Path) -> str:
    """Run a go command; raise BuildError with the output tail if it fails."""
    with logfile.open("a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    with logfile.open("a") as fh:
        fh.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise BuildError(f"`{' '.join(cmd[:3])} ...` failed in {cwd} (log: {logfile}):\n{tail}")
    return proc.stdout


def _go_version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def _module_info(go: str, module: str, version: str, workdir: Path, logfile: Path) -> dict:
    out = _run([go, "mod", "download", "-json", f"{module}@{version}"], workdir, _go_env(), logfile)
    return json.loads(out)


def _toolchain_env(go: str, required: str) -> dict[str, str]:
    """Pick GOTOOLCHAIN: the local Go if new enough, else the approved fallback."""
    local = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True).stdout
    if _go_version_tuple(required) <= _go_version_tuple(local):
        return {"GOTOOLCHAIN": "local"}
    log(f"module needs go {required}, local is {local.strip()}: using {FALLBACK_TOOLCHAIN}")
    return {"GOTOOLCHAIN": FALLBACK_TOOLCHAIN}


def _staging_modules(gomod_text: str) -> list[str]:
    """k8s.io/* modules that k8s.io/kubernetes replaces with ./staging directories."""
    return sorted(set(re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", gomod_text, re.M)))


def _wrapper_gomod(r: Recipe, go_line: str, gomod_text: str) -> str:
    lines = ["module lease-sidecar.local/testbedbuild", "", f"go {go_line}", ""]
    lines.append(f"require {r.module} {r.version}")
    if r.replace_staging_k8s:
        # Staging module k8s.io/foo is published as v0.<minor>.<patch> alongside vX.
        staging_version = "v0." + r.version.split(".", 1)[1]
        lines.append("")
        lines.append("replace (")
        lines += [f"\t{m} => {m} {staging_version}" for m in _staging_modules(gomod_text)]
        lines.append(")")
    return "\n".join(lines) + "\n"


def _go_line(gomod_text: str) -> str:
    m = re.search(r"^go\s+(\S+)", gomod_text, re.M)
    return m.group(1) if m else "1.22"


# --------------------------------------------------------------------------- building


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialize builds of the same tool+version across processes (xdist, two shells)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _prepare_wrapper(r: Recipe, go: str, workdir: Path, logfile: Path) -> dict[str, str]:
    """Write the wrapper module and resolve its dependencies; return the go env to use."""
    log(f"{r.tool} {r.version}: fetching {r.module} ...")
    info = _module_info(go, r.module, r.version, workdir, logfile)
    gomod_text = Path(info["GoMod"]).read_text()
    go_line = _go_line(gomod_text)
    env = _go_env(_toolchain_env(go, go_line))
    (workdir / "go.mod").write_text(_wrapper_gomod(r, go_line, gomod_text))
    # A build-tag-guarded import keeps `go mod tidy` from dropping the requirement.
    (workdir / "tools.go").write_text(
        f'//go:build tools\n\npackage testbedbuild\n\nimport _ "{r.package}"\n'
    )
    log(f"{r.tool} {r.version}: resolving dependencies (go mod tidy) ...")
    _run([go, "mod", "tidy"], workdir, env, logfile)
    return env


def _compile(
    r: Recipe, go: str, workdir: Path, env: dict[str, str], out: Path, logfile: Path
) -> None:
    """`go build -v`, printing a progress line every 100 packages compiled."""
    cmd = [go, "build", "-v", "-trimpath", "-o", str(out)]
    if r.ldflags:
        cmd += ["-ldflags", "-s -w " + " ".join(r.ldflags)]
    if r.tags:
        cmd += ["-tags", ",".join(r.tags)]
    cmd.append(r.package)
    log(f"{r.tool} {r.version}: compiling (first time: many minutes on 2 cores) ...")
    started = time.monotonic()
    with logfile.open("a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(
            cmd, cwd=workdir, env=env, stdout=fh, stderr=subprocess.PIPE, text=True
        )
        assert proc.stderr is not None
        tail: list[str] = []
        for count, line in enumerate(proc.stderr, 1):
            fh.write(line)
            tail = ([*tail, line.rstrip()])[-25:]
            if count % 100 == 0:
                elapsed = time.monotonic() - started
                log(f"{r.tool} {r.version}: {count} packages compiled ({elapsed:.0f}s)")
        if proc.wait() != 0:
            raise CompileError(
                f"go build of {r.package} failed (log: {logfile}):\n" + "\n".join(tail)
            )


def _smoke_test(r: Recipe, binary: Path) -> str:
    proc = subprocess.run(
        [str(binary), *r.version_args], capture_output=True, text=True, timeout=60
    )
    output = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        raise CompileError(f"built {r.tool} does not run: {output[-2000:]}")
    return output


def build(tool: str, version: str) -> Path:
    """Build one tool at one version into the cache (no-op if already there)."""
    r = recipe(tool, version)
    final = binary_path(tool, version)
    with _locked(cache_root() / "locks" / f"{tool}-{version}.lock"):
        if final.exists():  # another process finished it while we waited
            return final
        go = go_executable()
        workdir = cache_root() / "build" / f"{tool}-{version}"
        workdir.mkdir(parents=True, exist_ok=True)
        logfile = workdir / "build.log"
        logfile.write_text("")
        started = time.monotonic()
        env = _prepare_wrapper(r, go, workdir, logfile)
        final.parent.mkdir(parents=True, exist_ok=True)
        # Temp name in the same directory, then rename: an interrupted build never leaves
        # a half-written binary under the name that later runs trust.
        tmp = final.with_name(f".{tool}.tmp-{os.getpid()}")
        try:
            _compile(r, go, workdir, env, tmp, logfile)
            reported = _smoke_test(r, tmp)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        log(f"{tool} {version}: built in {time.monotonic() - started:.0f}s -> {final}")
        log(f"{tool} {version}: reports: {reported.splitlines()[0] if reported else '?'}")
        return final


def _failed_marker(tool: str, version: str) -> Path:
    return cache_root() / "build" / f"{tool}-{version}" / "FAILED"


def _kubernetes_version() -> str:
    """The Kubernetes release to use: the newest candidate that is cached or builds.

    A release whose sources failed to compile is remembered (``FAILED`` marker) so later
    runs go straight to the next one; delete the marker or set LEASE_TESTBED_RETRY=1 to
    try it again.  Download errors are not remembered: they may be transient.
    """
    retry = os.environ.get("LEASE_TESTBED_RETRY") == "1"
    errors = []
    for version in candidate_versions("kube-apiserver"):
        if binary_path("kube-apiserver", version).exists():
            return version
        marker = _failed_marker("kube-apiserver", version)
        if marker.exists() and not retry:
            errors.append(f"{version}: failed before (see {marker})")
            continue
        try:
            build("kube-apiserver", version)
            return version
        except CompileError as exc:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(str(exc))
            errors.append(f"{version}: {exc}")
            log(f"kube-apiserver {version} failed, trying an older release")
    raise BuildError("no Kubernetes release could be built:\n" + "\n\n".join(errors))


def clientgo_version(kube_version: str) -> str:
    """client-go is published as v0.<minor>.<patch> alongside Kubernetes v1.<minor>.<patch>."""
    return "v0." + kube_version.split(".", 1)[1]


def clientgo_elector() -> Path:
    """Build (once per client-go version and source) and return ``clientgo-elector``.

    The committed go.mod/go.sum pin the client-go that matches the newest test-bed
    release; when the test bed had to fall back to an older kube-apiserver, the copy in
    the build directory is re-pointed at that release's client-go before building.
    """
    version = clientgo_version(_kubernetes_version())
    sources = {name: (CLIENTGO_ELECTOR_SRC / name).read_bytes()
               for name in ("main.go", "go.mod", "go.sum")}
    digest = hashlib.sha256(b"".join(name.encode() + b"\0" + data
                                     for name, data in sorted(sources.items())))
    final = (cache_root() / "bin" / f"clientgo-elector-{version}-{digest.hexdigest()[:12]}"
             / "clientgo-elector")
    with _locked(cache_root() / "locks" / f"clientgo-elector-{version}.lock"):
        if final.exists():
            return final
        go = go_executable()
        workdir = cache_root() / "build" / f"clientgo-elector-{version}"
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        for name, data in sources.items():
            (workdir / name).write_bytes(data)
        logfile = workdir / "build.log"
        started = time.monotonic()
        env = _go_env(_toolchain_env(go, _go_line(sources["go.mod"].decode())))
        if f"k8s.io/client-go {version}" not in sources["go.mod"].decode():
            log(f"clientgo-elector: re-pointing at k8s.io/client-go {version} ...")
            _run([go, "mod", "edit", f"-require=k8s.io/client-go@{version}",
                  f"-require=k8s.io/apimachinery@{version}"], workdir, env, logfile)
            _run([go, "mod", "tidy"], workdir, env, logfile)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".clientgo-elector.tmp-{os.getpid()}")
        try:
            log(f"clientgo-elector {version}: compiling ...")
            _run([go, "build", "-trimpath", "-o", str(tmp), "."], workdir, env, logfile)
            # Without -lease/-identity it must refuse with exit 2: proves it runs.
            proc = subprocess.run([str(tmp)], capture_output=True, text=True, timeout=60)
            if proc.returncode != 2 or "-lease and -identity" not in proc.stderr:
                raise CompileError(f"built clientgo-elector does not run: {proc.stderr[-2000:]}")
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        log(f"clientgo-elector {version}: built in {time.monotonic() - started:.0f}s -> {final}")
        return final


def resolve_version(tool: str) -> str:
    if tool in KUBE_COMPONENTS:
        return _kubernetes_version()
    return candidate_versions(tool)[0]


def ensure_binary(name: str) -> Path:
    """Return the cached binary for ``name``, building it first if needed."""
    if name == "clientgo-elector":
        return clientgo_elector()
    recipe(name, "v0.0.0")  # validates the name before any slow work
    version = resolve_version(name)
    path = binary_path(name, version)
    if path.exists():
        return path
    return build(name, version)


def tool_version(name: str) -> str:
    """The version ``ensure_binary(name)`` builds or returns."""
    return resolve_version(name)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv) or ["all"]
    names = [*TOOLS, *LOCAL_TOOLS] if args == ["all"] else args
    started = time.monotonic()
    try:
        for name in names:
            path = ensure_binary(name)
            print(f"{name}\t{path}", flush=True)
    except (BuildError, ValueError) as exc:
        log(f"ERROR: {exc}")
        return 1
    log(f"done in {time.monotonic() - started:.1f}s (cache: {cache_root()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
