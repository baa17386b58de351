"""Build the lease-sidecar image from the project's own Dockerfile, without a registry.

The file users build (``docker build -t lease-sidecar .``) is the file built here: only its
``PYTHON_IMAGE`` build argument is pointed at a Debian base made locally, so no image is
pulled from anywhere.

1. **Base** (``localhost/lease-base:<recipe hash>``): ``mmdebstrap --variant=minbase`` of
   Debian bookworm with python3, python3-venv, python-is-python3 and ca-certificates, from
   this machine's own Debian apt sources and ``Acquire::`` settings (read at run time, so
   no mirror is named in the repository), slimmed the way Debian's official ``-slim``
   images are (no docs, man pages or locales; apt keeps no caches in layers). Imported into
   a private buildah store.
2. **Image** (``localhost/lease-sidecar:<input hash>``): ``buildah bud`` of the Dockerfile
   (chroot isolation, so no container runtime or daemon is involved), exported as a
   ``docker save`` archive that ``ctr images import`` reads.

Everything the build needs from this machine is given to it only for the duration of
each ``RUN``, as bind mounts, so nothing of it is committed into the image: the host's CA
bundle over the base's own (package traffic may pass an intercepting CA) and a pip.conf
with the host's pip settings (``/etc/pip.conf`` plus ``PIP_*`` variables).

Both are cached: the base on a hash of its recipe, the image on a hash of the base and of
every file the Dockerfile's build context lets in (see ``.dockerignore``). A file lock
makes concurrent callers build once. Archives live in
``${LEASE_TESTBED_CACHE:-~/.cache/lease-sidecar}/images``.

Usage::

    python -m testkit.testbed.image [build|base|check]

or ``build_image() -> ImageArtifact(path, ref)`` from Python.
"""

from __future__ import annotations

import configparser
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from testkit.testbed.gobuild import _locked, cache_root

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"

# Bump when the way the base or the image is made changes in a way the hashed inputs
# below do not show (a new mmdebstrap option, a changed buildah flag).
RECIPE_VERSION = "1"

SUITE = "bookworm"
# What the Dockerfile expects of its base beyond Debian's minbase: `python -m venv` needs
# python-is-python3 and python3-venv; pip over TLS needs ca-certificates.
BASE_PACKAGES: tuple[str, ...] = ("python3", "python3-venv", "python-is-python3",
                                  "ca-certificates")
# The path filters of Debian's official -slim images, so the image is not padded with
# documentation the real one does not carry.
DPKG_SLIM: tuple[str, ...] = (
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/groff/*",
    "path-exclude=/usr/share/lintian/*",
    "path-exclude=/usr/share/linda/*",
    "path-exclude=/usr/share/locale/*",
)
# The apt settings of Debian's official images (their docker-clean): without them every
# `apt-get update` layer of the Dockerfile carries ~80 MB of package caches.
APT_CLEAN = """\
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
"""  # noqa: E501
# Host apt settings the build needs too (a snapshot mirror's expired Valid-Until, a proxy).
HOST_APT_KEYS: tuple[str, ...] = (
    "Acquire::Check-Valid-Until", "Acquire::Check-Date", "Acquire::http::Proxy",
    "Acquire::https::Proxy", "Acquire::Retries",
)
BASE_ENV: tuple[str, ...] = (
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG=C.UTF-8",
)
# Files that exist (empty) in the base only so that the build can bind-mount the host's
# pip settings over them: a mount onto a missing path would leave an empty file or
# directory behind in every layer that ran with it.
PIP_CONF = "/etc/pip.conf"
PIP_WHEELS = "/srv/pip-wheels"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")

IMAGE_NAME = "localhost/lease-sidecar"
# The Dockerfile's targets and their image names; both are tagged with the same digest
# (of the same inputs), so one ref names the other.
TARGETS = {"sidecar": IMAGE_NAME, "sidecar-sqlserver": f"{IMAGE_NAME}-sqlserver",
           "operator": f"{IMAGE_NAME}-operator"}
BASE_NAME = "localhost/lease-base"
KEEP_ARCHIVES = 4  # newest image archives kept (worktrees sharing the cache alternate)

TOOLS: tuple[str, ...] = ("buildah", "mmdebstrap")


class ImageError(RuntimeError):
    """The base or the image could not be built; the message says why and where the log is."""


class ImageArtifact(NamedTuple):
    """A built image: ``path`` is a docker-archive tar, ``ref`` the name inside it (and
    the name pods use with ``imagePullPolicy: Never``)."""

    path: Path
    ref: str


def log(msg: str) -> None:
    print(f"[testbed-image] {msg}", file=sys.stderr, flush=True)


def images_dir() -> Path:
    return cache_root() / "images"


def unavailable_reason() -> str | None:
    """Why the image cannot be built on this machine, or None if it can."""
    if os.geteuid() != 0:
        return "building the image needs root (buildah and mmdebstrap run as root here)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install buildah mmdebstrap)"
    return None


def cannot_run_reason() -> str | None:
    """Why buildah cannot work here (not root, missing tools, or its store cannot mount:
    no CAP_SYS_ADMIN, say), or None. Costs about a second: it mounts an empty container.
    """
    reason = unavailable_reason()
    if reason:
        return reason
    # Under the build lock: a build starting meanwhile would remove the probe's container.
    with _locked(_build_lock()):
        try:
            container = _buildah("from", "scratch", timeout=120)
            try:
                _buildah("mount", container, timeout=120)
            finally:
                subprocess.run([*buildah_cmd(), "rm", container], capture_output=True,
                               timeout=120)
        except (ImageError, subprocess.TimeoutExpired) as exc:
            return f"buildah cannot run here: {str(exc).splitlines()[0]}"
    return None


def _build_lock() -> Path:
    return cache_root() / "locks" / "image-build.lock"


# --------------------------------------------------------------------------- buildah


def _storage_driver(root: Path) -> str:
    """overlay where the kernel allows it (fast commits); vfs on an overlayfs cache.

    The choice is remembered: a store must keep the driver it was created with.
    """
    marker = root / "DRIVER"
    if marker.exists():
        return marker.read_text().strip()
    driver = os.environ.get("LEASE_IMAGE_STORAGE_DRIVER")
    if not driver:
        root.mkdir(parents=True, exist_ok=True)
        fstype = subprocess.run(["stat", "-f", "-c", "%T", str(root)], capture_output=True,
                                text=True).stdout.strip()
        driver = "vfs" if fstype in ("overlayfs", "overlay") else "overlay"
    root.mkdir(parents=True, exist_ok=True)
    marker.write_text(driver + "\n")
    return driver


def buildah_cmd() -> list[str]:
    """``buildah`` with this test bed's private store (never the machine's default one)."""
    root = images_dir() / "buildah"
    # Run state (locks, mount records) belongs on a tmpfs so a reboot clears it; one per
    # store, since stores must not share it (LEASE_TESTBED_CACHE may name another cache).
    tag = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:8]
    runroot = Path(os.environ.get("XDG_RUNTIME_DIR") or "/run") / f"lease-sidecar-buildah-{tag}"
    return ["buildah", "--root", str(root / "storage"), "--runroot", str(runroot),
            "--storage-driver", _storage_driver(root)]


def _buildah(*args: str, timeout: float = 600) -> str:
    proc = subprocess.run([*buildah_cmd(), *args], capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise ImageError(f"buildah {' '.join(args[:2])} failed: {proc.stderr.strip()[-2000:]}")
    return proc.stdout.strip()


def _has_image(ref: str) -> bool:
    proc = subprocess.run([*buildah_cmd(), "inspect", "--type", "image", ref],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode == 0


def _stream(cmd: list[str], logfile: Path, what: str, show: re.Pattern[str],
            stdin: str | None = None, timeout: float = 3600) -> None:
    """Run a long build step, echoing its milestone lines and keeping all in ``logfile``."""
    started = time.monotonic()
    with logfile.open("a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if stdin is not None else None,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=REPO)
        if stdin is not None:
            assert proc.stdin is not None
            proc.stdin.write(stdin)
            proc.stdin.close()
        assert proc.stdout is not None
        tail: list[str] = []
        for line in proc.stdout:
            fh.write(line)
            tail = [*tail, line.rstrip()][-30:]
            if show.search(line):
                log(f"{what}: {line.strip()[:150]} ({time.monotonic() - started:.0f}s)")
            if time.monotonic() - started > timeout:
                proc.kill()
        if proc.wait() != 0:
            raise ImageError(f"{what} failed (log: {logfile}):\n" + "\n".join(tail))


def _clean_working_containers() -> None:
    """Drop working containers an interrupted build left in the private store (their
    mounts included); called under the build lock, so no live build owns one."""
    subprocess.run([*buildah_cmd(), "rm", "--all"], capture_output=True, timeout=300)
    for partial in images_dir().glob(".lease-sidecar-*.tar.tmp-*"):
        partial.unlink(missing_ok=True)  # an export killed before its rename


# --------------------------------------------------------------------------- base


def _host_sources() -> str:
    """The host's Debian apt sources as deb822 stanzas (other vendors' entries dropped:
    their keys are not in the base)."""
    texts: list[str] = []
    etc = Path("/etc/apt")
    paths = [etc / "sources.list", *sorted((etc / "sources.list.d").glob("*.list"))]
    for path in paths:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            m = re.match(r"\s*deb\s+(\[[^\]]*\]\s+)?(\S+)\s+(\S+)\s+(.+)", line)
            if not m or (m.group(1) and "signed-by" in m.group(1)
                         and "debian-archive-keyring" not in m.group(1)):
                continue
            texts.append(f"Types: deb\nURIs: {m.group(2)}\nSuites: {m.group(3)}\n"
                         f"Components: {m.group(4).strip()}\n")
    for path in sorted((etc / "sources.list.d").glob("*.sources")):
        for stanza in re.split(r"\n\s*\n", path.read_text()):
            fields = {}
            for line in stanza.splitlines():
                if line.strip() and not line.lstrip().startswith("#") and ":" in line:
                    key, _, value = line.partition(":")
                    fields[key.strip().lower()] = value.strip()
            if ("deb" not in fields.get("types", "").split()
                    or fields.get("enabled", "yes").lower() == "no"):
                continue
            signed = fields.get("signed-by", "")
            if signed and "debian-archive-keyring" not in signed:
                continue
            texts.append("".join(f"{k.title() if k != 'uris' else 'URIs'}: {v}\n"
                                 for k, v in fields.items() if k != "enabled"))
    texts = [t for t in texts if re.search(rf"^Suites:.*\b{SUITE}\b", t, re.M | re.I)]
    if not texts:
        raise ImageError(f"no Debian {SUITE} apt source found in /etc/apt on this machine")
    return "\n".join(texts)


def _host_apt_options() -> list[str]:
    proc = subprocess.run(["apt-config", "dump"], capture_output=True, text=True, timeout=60)
    wanted = {k.lower() for k in HOST_APT_KEYS}
    options = []
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key.lower() in wanted:
            options.append(f"{key} {value}")
    return options


class BaseRecipe(NamedTuple):
    sources: str
    apt_options: tuple[str, ...]

    def digest(self) -> str:
        h = hashlib.sha256()
        for part in (RECIPE_VERSION, SUITE, *BASE_PACKAGES, *DPKG_SLIM, APT_CLEAN,
                     *BASE_ENV, PIP_CONF, PIP_WHEELS, self.sources, *self.apt_options):
            h.update(part.encode() + b"\0")
        return h.hexdigest()[:16]

    @property
    def ref(self) -> str:
        return f"{BASE_NAME}:{self.digest()}"


def base_recipe() -> BaseRecipe:
    return BaseRecipe(_host_sources(), tuple(_host_apt_options()))


def _build_base(recipe: BaseRecipe, workdir: Path, logfile: Path) -> None:
    tarball = workdir / "base.tar"
    aptconf = workdir / "apt-clean.conf"
    aptconf.write_text(APT_CLEAN)
    cmd = ["mmdebstrap", "--variant=minbase", "--include=" + ",".join(BASE_PACKAGES),
           *(f"--dpkgopt={opt}" for opt in DPKG_SLIM),
           *(f"--aptopt={opt}" for opt in recipe.apt_options),
           f"--aptopt={aptconf}",
           f"--customize-hook=touch \"$1{PIP_CONF}\" && mkdir -p \"$1{PIP_WHEELS}\"",
           SUITE, str(tarball), "-"]
    log(f"base {recipe.ref}: mmdebstrap {SUITE} (about 80 s) ...")
    _stream(cmd, logfile, "base", re.compile(r"^I: (downloading|installing|extracting|"
                                             r"creating tarball|success)"),
            stdin=recipe.sources)
    log(f"base {recipe.ref}: importing into buildah ...")
    container = _buildah("from", "scratch")
    try:
        _buildah("add", container, str(tarball), "/")
        _buildah("config", *(a for env in BASE_ENV for a in ("--env", env)),
                 "--cmd", "python3", container)
        _buildah("commit", "--quiet", container, recipe.ref)
    finally:
        subprocess.run([*buildah_cmd(), "rm", container], capture_output=True, timeout=120)
        tarball.unlink(missing_ok=True)


def ensure_base() -> str:
    """The base image's ref in the private store, built first if needed."""
    recipe = base_recipe()
    if _has_image(recipe.ref):
        return recipe.ref
    with _locked(_build_lock()):
        return _ensure_base_locked(recipe)


def _ensure_base_locked(recipe: BaseRecipe) -> str:
    if _has_image(recipe.ref):
        return recipe.ref
    _clean_working_containers()
    workdir = images_dir() / "build" / f"base-{recipe.digest()}"
    workdir.mkdir(parents=True, exist_ok=True)
    logfile = workdir / "build.log"
    logfile.write_text("")
    started = time.monotonic()
    _build_base(recipe, workdir, logfile)
    log(f"base {recipe.ref}: built in {time.monotonic() - started:.0f}s")
    return recipe.ref


# --------------------------------------------------------------------------- context


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex over slash-separated relative paths."""
    pattern = pattern.strip().strip("/")
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    # A pattern that matches a directory matches everything under it.
    return re.compile(out + "(?:/.*)?$")


def _ignore_rules(repo: Path) -> list[tuple[bool, re.Pattern[str], str]]:
    path = repo / ".dockerignore"
    rules = []
    if path.exists():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                negate = line.startswith("!")
                raw = line[1:] if negate else line
                rules.append((negate, _ignore_regex(raw), raw.strip().strip("/")))
    return rules


def context_files(repo: Path = REPO) -> list[str]:
    """The files of the build context, as Docker's .dockerignore rules select them (the
    last matching rule wins), sorted."""
    rules = _ignore_rules(repo)

    def excluded(rel: str) -> bool:
        result = False
        for negate, regex, _ in rules:
            if regex.match(rel):
                result = not negate
        return result

    def may_reinclude(rel: str) -> bool:
        return any(negate and (raw.startswith(rel + "/") or raw == rel or "*" in raw)
                   for negate, _, raw in rules)

    found = []
    for dirpath, dirnames, filenames in os.walk(repo):
        reldir = os.path.relpath(dirpath, repo)
        reldir = "" if reldir == "." else reldir + "/"
        dirnames[:] = sorted(d for d in dirnames if d != ".git" and not (
            excluded(reldir + d) and not may_reinclude(reldir + d)))
        found += [reldir + f for f in filenames if not excluded(reldir + f)]
    return sorted(found)


def build_args(base_ref: str, repo: Path = REPO) -> dict[str, str]:
    """The ``--build-arg`` values: only the base is replaced. ODBC_DRIVER is passed with
    the Dockerfile's own default because buildah 1.28 resolves ``FROM odbc-${ODBC_DRIVER}``
    to the stage only when the argument is given explicitly (else it looks for an image
    named odbc-freetds in a registry)."""
    text = (repo / "Dockerfile").read_text()
    m = re.search(r"^ARG\s+ODBC_DRIVER=(\S+)", text, re.M)
    if not m:
        raise ImageError("the Dockerfile has no `ARG ODBC_DRIVER=<default>` line")
    return {"PYTHON_IMAGE": base_ref, "ODBC_DRIVER": m.group(1).strip('"')}


def image_digest(base_ref: str, repo: Path = REPO) -> str:
    h = hashlib.sha256()
    h.update(f"{RECIPE_VERSION}\0{base_ref}\0".encode())
    h.update(json.dumps(build_args(base_ref, repo), sort_keys=True).encode())
    for rel in ["Dockerfile", ".dockerignore", *context_files(repo)]:
        path = repo / rel
        if path.exists():
            h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- image


def _pip_settings() -> tuple[str, list[str]]:
    """The host's pip settings as one pip.conf for the build, and extra mounts.

    /etc/pip.conf plus every ``PIP_*`` variable (pip's own mapping: PIP_INDEX_URL is
    ``index-url``). A local find-links directory is mounted at PIP_WHEELS.
    """
    config = configparser.ConfigParser(interpolation=None)
    config.read(["/etc/pip.conf"])
    if not config.has_section("global"):
        config.add_section("global")
    for name, value in os.environ.items():
        if name.startswith("PIP_") and name not in ("PIP_CONFIG_FILE", "PIP_CERT"):
            config["global"][name[4:].lower().replace("_", "-")] = value
    # The host bundle is mounted over the base's bundle, at its usual path.
    config["global"]["cert"] = str(HOST_CA_BUNDLE)
    mounts = []
    links = config["global"].get("find-links", "")
    local = [p for p in links.split() if p.startswith("/")]
    remote = [p for p in links.split() if not p.startswith("/")]
    if len(local) == 1 and Path(local[0]).is_dir() and any(Path(local[0]).iterdir()):
        mounts += ["--volume", f"{local[0]}:{PIP_WHEELS}:ro"]
        remote.append(PIP_WHEELS)
    if remote:
        config["global"]["find-links"] = " ".join(remote)
    else:
        config.remove_option("global", "find-links")
    lines = ["[global]", *(f"{k} = {v}" for k, v in config["global"].items())]
    return "\n".join(lines) + "\n", mounts


def _archive_path(digest: str, target: str = "sidecar") -> Path:
    return images_dir() / f"{TARGETS[target].removeprefix('localhost/')}-{digest}.tar"


def _build_image(base_ref: str, digest: str, workdir: Path, logfile: Path,
                 target: str = "sidecar") -> Path:
    ref = f"{TARGETS[target]}:{digest}"
    pipconf, mounts = _pip_settings()
    pipconf_path = workdir / "pip.conf"
    pipconf_path.write_text(pipconf)
    pipconf_path.chmod(0o644)
    args = build_args(base_ref)
    cmd = [*buildah_cmd(), "bud", "--layers", "--isolation", "chroot",
           *(a for k, v in args.items() for a in ("--build-arg", f"{k}={v}")),
           "--volume", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro",
           "--volume", f"{pipconf_path}:{PIP_CONF}:ro", *mounts,
           "--target", target, "--file", str(DOCKERFILE), "--tag", ref, str(REPO)]
    log(f"image {ref}: buildah bud of the Dockerfile (about 2 min) ...")
    _stream(cmd, logfile, "image", re.compile(r"^\[\d+/\d+\] STEP \d+/\d+: (FROM|RUN|COPY)"
                                              r"|^Successfully tagged"))
    final = _archive_path(digest, target)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        log(f"image {ref}: exporting the docker archive ...")
        _buildah("push", "--quiet", ref, f"docker-archive:{tmp}:{ref}")
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def _prune(keep: Path) -> None:
    """Keep the newest KEEP_ARCHIVES archives and their tags.

    Then drop dangling images: the untagged leaves of old builds, chiefly each build
    stage's venv. Cached steps that a kept image still builds on have children, so the
    layer cache of the apt stages survives. Called under the build lock: no build of
    this store is running.
    """
    for name in TARGETS.values():
        stem = name.removeprefix("localhost/")
        archives = sorted((p for p in images_dir().glob(f"{stem}-*.tar")
                           if re.fullmatch(rf"{re.escape(stem)}-[0-9a-f]{{16}}", p.stem)),
                          key=lambda p: p.stat().st_mtime, reverse=True)
        for old in archives[KEEP_ARCHIVES:]:
            if old == keep:
                continue
            digest = old.stem.removeprefix(f"{stem}-")
            subprocess.run([*buildah_cmd(), "rmi", f"{name}:{digest}"],
                           capture_output=True, timeout=300)
            old.unlink(missing_ok=True)
    subprocess.run([*buildah_cmd(), "rmi", "--prune"], capture_output=True, timeout=600)


def build_image(target: str = "sidecar", digest: str | None = None) -> ImageArtifact:
    """The image of one Dockerfile target (``sidecar``, ``sidecar-sqlserver`` or
    ``operator``), as a docker-archive tar and its ref. ``digest``: tag it so (another
    target's digest, so one ref names the others even if the sources changed between
    the builds).

    Cached on a hash of its inputs: a second call returns in well under a second.
    Raises ImageError (why, and the log's path) if it cannot be built.
    """
    reason = unavailable_reason()
    if reason:
        raise ImageError(reason)
    recipe = base_recipe()
    digest = digest or image_digest(recipe.ref)
    final = _archive_path(digest, target)
    ref = f"{TARGETS[target]}:{digest}"
    if final.exists():
        return ImageArtifact(final, ref)
    with _locked(_build_lock()):
        if final.exists():  # another process built it while we waited
            return ImageArtifact(final, ref)
        started = time.monotonic()
        base_ref = _ensure_base_locked(recipe)
        _clean_working_containers()
        workdir = images_dir() / "build" / f"lease-{target}-{digest}"
        workdir.mkdir(parents=True, exist_ok=True)
        logfile = workdir / "build.log"
        logfile.write_text("")
        path = _build_image(base_ref, digest, workdir, logfile, target)
        _prune(keep=path)
        size = path.stat().st_size / 1e6
        log(f"image {ref}: built in {time.monotonic() - started:.0f}s, {size:.0f} MB "
            f"-> {path}")
        return ImageArtifact(path, ref)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv) or ["build"]
    started = time.monotonic()
    try:
        if args == ["check"]:
            reason = unavailable_reason()
            print(reason or "ok")
            return 1 if reason else 0
        if args == ["base"]:
            print(f"base\t{ensure_base()}", flush=True)
        elif args[:1] == ["build"] and len(args) <= 2 and set(args[1:]) <= set(TARGETS):
            target = args[1] if len(args) == 2 else "sidecar"
            artifact = build_image(target)
            print(f"lease-{target}\t{artifact.path}\t{artifact.ref}", flush=True)
        else:
            log("usage: python -m testkit.testbed.image "
                "[build [sidecar|sidecar-sqlserver|operator]|base|check]")
            return 2
    except (ImageError, subprocess.TimeoutExpired) as exc:
        log(f"ERROR: {exc}")
        return 1
    log(f"done in {time.monotonic() - started:.1f}s (cache: {images_dir()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
