"""The image built from the project's own Dockerfile, checked by running it.

``build_image()`` builds the Dockerfile with buildah on a locally made Debian base (see
testkit/testbed/image.py). The checks below read the docker-archive that pods import and
run it the way a container runtime does: skopeo converts the archive to an OCI layout,
umoci unpacks it into an OCI bundle whose config it derives from the image's own config
(user, entrypoint, cmd, env), and runc runs that bundle with a read-only root and the two
writable emptyDirs the Helm chart gives the sidecar (/tmp, /run/lease: host directories,
mode 0777, bind-mounted, as the kubelet makes them).
Only the network namespace is left out, so the test reaches the sidecar on 127.0.0.1.

The context-hash tests run anywhere; the rest need root and the Debian tools, and skip
with one line saying which is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tarfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.procs import free_port
from testkit.support import REPO
from testkit.testbed import image

RUN_TOOLS = ("skopeo", "umoci", "runc")


def _skip_reason() -> str | None:
    reason = image.cannot_run_reason()
    if reason:
        return reason
    missing = [t for t in RUN_TOOLS if shutil.which(t) is None]
    return f"missing {', '.join(missing)} (apt-get install {' '.join(missing)})" if missing \
        else None


def _built(target: str) -> image.ImageArtifact:
    """The Dockerfile's ``target``, built (or found built); skips where it cannot run."""
    reason = _skip_reason()
    if reason:
        pytest.skip(f"image test bed: {reason}")
    return image.build_image(target)


@pytest.fixture(scope="module")
def artifact() -> image.ImageArtifact:
    return _built("sidecar")


@pytest.fixture(scope="module")
def archive_config(artifact: image.ImageArtifact) -> dict[str, Any]:
    """manifest.json and the image config, read from the archive itself."""
    with tarfile.open(artifact.path) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))  # type: ignore[arg-type]  # a file member
        assert len(manifest) == 1, manifest
        config = json.load(tar.extractfile(manifest[0]["Config"]))  # type: ignore[arg-type]  # a file member
    return {"manifest": manifest[0], "config": config["config"]}


@pytest.fixture(scope="module")
def operator_artifact() -> image.ImageArtifact:
    return _built("operator")


@pytest.fixture(scope="module")
def sqlserver_artifact() -> image.ImageArtifact:
    return _built("sidecar-sqlserver")


def _unpack(artifact: image.ImageArtifact, work: Path) -> Path:
    subprocess.run(["skopeo", "copy", "--quiet", f"docker-archive:{artifact.path}",
                    f"oci:{work / 'oci'}:img"], check=True, timeout=600)
    subprocess.run(["umoci", "unpack", "--image", f"{work / 'oci'}:img", str(work / "bundle")],
                   check=True, timeout=600, capture_output=True)
    shutil.rmtree(work / "oci")
    return work / "bundle"


@pytest.fixture(scope="module")
def bundle(artifact: image.ImageArtifact, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The archive unpacked into an OCI runtime bundle (rootfs + config.json)."""
    return _unpack(artifact, tmp_path_factory.mktemp("image"))


@pytest.fixture(scope="module")
def sqlserver_bundle(sqlserver_artifact: image.ImageArtifact,
                     tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _unpack(sqlserver_artifact, tmp_path_factory.mktemp("sqlserver-image"))


@pytest.fixture(scope="module")
def operator_bundle(operator_artifact: image.ImageArtifact,
                    tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _unpack(operator_artifact, tmp_path_factory.mktemp("operator-image"))


def _runtime_config(bundle: Path, args: list[str] | None = None,
                    env: dict[str, str] | None = None) -> Path:
    """Rewrite config.json as a pod runs the sidecar: read-only root, and emptyDirs at
    /tmp and /run/lease (like the kubelet's: fresh host directories, mode 0777,
    bind-mounted); no terminal; the host's network namespace. Returns the host side of
    /run/lease."""
    path = bundle / "config.json"
    original = bundle / "config.image.json"
    if not original.exists():
        shutil.copy(path, original)
    config = json.loads(original.read_text())
    config["process"]["terminal"] = False
    if args is not None:
        config["process"]["args"] = args
    config["process"]["env"] += [f"{k}={v}" for k, v in (env or {}).items()]
    config["root"]["readonly"] = True
    volumes = bundle.parent / "volumes"
    shutil.rmtree(volumes, ignore_errors=True)
    for name, dest in (("tmp", "/tmp"), ("lease", "/run/lease")):
        (volumes / name).mkdir(parents=True)
        (volumes / name).chmod(0o777)
        config["mounts"].append({"destination": dest, "type": "bind",
                                 "source": str(volumes / name),
                                 "options": ["rbind", "rw", "nosuid", "nodev"]})
    config["linux"]["namespaces"] = [
        ns for ns in config["linux"]["namespaces"] if ns["type"] != "network"]
    path.write_text(json.dumps(config))
    return volumes / "lease"


@contextlib.contextmanager
def _container(bundle: Path, name: str) -> Iterator[list[str]]:
    """The runc command prefix for a private state dir; the container is killed and
    deleted afterwards whatever happened. ``name`` must come from _unique()."""
    runc = ["runc", "--root", str(bundle.parent / "runc-state")]
    try:
        yield runc
    finally:
        subprocess.run([*runc, "kill", name, "KILL"], capture_output=True, timeout=30)
        subprocess.run([*runc, "delete", "--force", name], capture_output=True, timeout=30)


def _unique(name: str) -> str:
    """A container name no concurrent test session uses: runc names the container's
    cgroups after it, and those are global to the machine."""
    return f"{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _run_once(bundle: Path, args: list[str], name: str) -> subprocess.CompletedProcess[str]:
    _runtime_config(bundle, args=args)
    name = _unique(name)
    with _container(bundle, name) as runc:
        return subprocess.run([*runc, "run", "--bundle", str(bundle), name],
                              capture_output=True, text=True, timeout=120)


# --------------------------------------------------------------------------- the archive


@pytest.mark.image
@pytest.mark.slow
def test_archive_is_tagged_with_its_ref(artifact: image.ImageArtifact,
                                        archive_config: dict[str, Any]) -> None:
    # `ctr images import` names the image after RepoTags; pods ask for exactly this ref.
    assert archive_config["manifest"]["RepoTags"] == [artifact.ref]
    assert artifact.ref.startswith("localhost/lease-sidecar:")


@pytest.mark.image
@pytest.mark.slow
def test_image_config_is_the_dockerfiles(archive_config: dict[str, Any]) -> None:
    config = archive_config["config"]
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["lease-sidecar"]
    assert config["Cmd"] == ["run"]
    assert set(config["ExposedPorts"]) == {"8099/tcp"}
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["PATH"].startswith("/opt/lease-sidecar/bin:")
    assert (env["PYTHONDONTWRITEBYTECODE"], env["PYTHONUNBUFFERED"], env["HOME"]) == (
        "1", "1", "/tmp")
    # The build's CA bundle and pip settings were bind mounts, not image settings.
    leaked = {k for k in env if k.startswith(("PIP_", "SSL_", "REQUESTS_", "CURL_"))}
    assert not leaked, leaked


@pytest.mark.image
@pytest.mark.slow
def test_build_mounts_left_nothing_in_the_image(bundle: Path) -> None:
    rootfs = bundle / "rootfs"
    # The base's mount targets for the host's pip settings are not even in the image:
    # it holds only what image-rootfs.sh gathered.
    assert not (rootfs / image.PIP_CONF.lstrip("/")).exists()
    assert not (rootfs / image.PIP_WHEELS.lstrip("/")).exists()
    # Only the venv came over from the build stage; the sources stayed there.
    assert not (rootfs / "src").exists()
    assert (rootfs / "opt/lease-sidecar/bin/lease-sidecar").is_file()
    # The image's own CA bundle (the base's, from its layers), not a mount point left
    # empty; OpenSSL's default file reaches it.
    assert (rootfs / "etc/ssl/certs/ca-certificates.crt").stat().st_size > 10_000
    assert os.readlink(rootfs / "usr/lib/ssl/cert.pem") == "/etc/ssl/certs/ca-certificates.crt"


@pytest.mark.image
@pytest.mark.slow
@pytest.mark.parametrize("which", ["sidecar", "sidecar-sqlserver"])
def test_sidecar_images_hold_only_what_runs(which: str, bundle: Path,
                                            sqlserver_bundle: Path) -> None:
    """No shell, package manager or installer; no unused standard library; bytecode
    for the whole library (the root is read-only, so nothing is compiled at start)."""
    rootfs = (bundle if which == "sidecar" else sqlserver_bundle) / "rootfs"
    for tool in ("bin/sh", "bin/bash", "usr/bin/apt-get", "usr/bin/dpkg", "usr/bin/perl",
                 "opt/lease-sidecar/bin/pip"):
        assert not os.path.lexists(rootfs / tool), tool
    site = rootfs / "opt/lease-sidecar/lib/python3.11/site-packages"
    assert not list(site.glob("pip*")) and not list(site.glob("setuptools*"))
    stdlib = rootfs / "usr/lib/python3.11"
    for unused in ("ensurepip", "idlelib", "tkinter", "test", "lib2to3", "pydoc_data"):
        assert not (stdlib / unused).exists(), unused
    assert (stdlib / "__pycache__" / "asyncio.cpython-311.pyc").exists() or \
        (stdlib / "asyncio" / "__pycache__" / "base_events.cpython-311.pyc").exists()
    assert not list(stdlib.rglob("*.opt-1.pyc"))
    odbc = list((rootfs / "usr/lib").rglob("libodbc.so*"))
    assert bool(odbc) == (which == "sidecar-sqlserver"), odbc


@pytest.mark.image
@pytest.mark.slow
def test_second_build_is_served_from_the_cache(artifact: image.ImageArtifact) -> None:
    started = time.monotonic()
    again = image.build_image()
    assert again == artifact
    assert time.monotonic() - started < 5


# --------------------------------------------------------------------------- running it


@pytest.mark.image
@pytest.mark.slow
def test_help_runs_as_the_image_user(bundle: Path) -> None:
    proc = _run_once(bundle, ["lease-sidecar", "--help"], "lease-image-help")
    assert proc.returncode == 0, proc.stderr
    assert "run" in proc.stdout and "exec" in proc.stdout


@pytest.mark.image
@pytest.mark.slow
def test_the_operator_image_runs_the_operator_and_the_sidecar_image_has_no_kopf(
        bundle: Path, operator_bundle: Path, artifact: image.ImageArtifact,
        operator_artifact: image.ImageArtifact) -> None:
    # The chart's injector Deployment runs the operator image with this command.
    proc = _run_once(operator_bundle, ["lease-sidecar", "operator", "--help"],
                     "lease-image-operator")
    assert proc.returncode == 0, proc.stderr
    assert "lease-sidecar operator" in proc.stdout
    # Everything the operator loads (the reconciler, the webhook's TLS), on its empty root.
    proc = _run_once(operator_bundle, [
        "python", "-c", "import kopf, kubernetes, cryptography, ssl, sidecar.operator.__main__, "
        "sidecar.operator.reconciler, sidecar.injector.webhook; "
        "assert ssl.create_default_context().cert_store_stats()['x509_ca'] > 100"],
        "lease-image-operator-extras")
    assert proc.returncode == 0, proc.stderr
    assert not os.path.lexists(operator_bundle / "rootfs/bin/sh")
    proc = _run_once(bundle, ["python", "-c", "import kopf"], "lease-image-no-kopf")
    assert proc.returncode != 0 and "No module named 'kopf'" in proc.stderr
    assert operator_artifact.ref.startswith("localhost/lease-sidecar-operator:")
    assert operator_artifact.ref.rsplit(":", 1)[1] == artifact.ref.rsplit(":", 1)[1]
    sizes = {"sidecar": _unpacked_mb(bundle), "operator": _unpacked_mb(operator_bundle)}
    print("image sizes (MB, unpacked):", sizes)
    # The sidecar image stays a third of the 403 MB it was (issue 20; figures per target
    # and per backend: bench/bench_image.py).
    assert artifact.path.stat().st_size <= 134e6, artifact.path.stat().st_size


def _unpacked_mb(bundle: Path) -> float:
    total = 0
    for dirpath, _, filenames in os.walk(bundle / "rootfs"):
        for name in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return round(total / 1e6, 1)


CHECK_EXTRAS = """
import errno, importlib.util, os, ssl
import aiohttp, asyncpg  # no kubernetes package in the sidecar images
import sidecar.cli, sidecar.lease.postgres_advisory, sidecar.lease.postgres_row
import sidecar.lease.kubernetes, sidecar.lease.sqlite
print("uid", os.getuid(), os.getgid())
print("pyodbc", importlib.util.find_spec("pyodbc") is not None)
print("ca", ssl.create_default_context().cert_store_stats()["x509_ca"] > 100)
try:
    open("/opt/lease-sidecar/x", "w")
except OSError as exc:
    print("root", errno.errorcode[exc.errno])
"""


@pytest.mark.image
@pytest.mark.slow
def test_extras_import_ca_bundle_loads_root_read_only(bundle: Path) -> None:
    proc = _run_once(bundle, ["python", "-c", CHECK_EXTRAS], "lease-image-extras")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "uid 10001 10001" in lines
    assert "pyodbc False" in lines  # the ODBC-free default image
    assert "ca True" in lines  # TLS to a database or apiserver finds the CA bundle
    assert "root EROFS" in lines  # the read-only root is in force for the next test


# SQL Server is the one backend with no real server here: the driver is checked up to a
# connection attempt that must fail with FreeTDS's own "unable to connect", which proves
# unixODBC found, loaded and ran the driver with its libraries in the minimal root.
CHECK_ODBC = """
import pyodbc, sidecar.lease.sqlserver
print("drivers", pyodbc.drivers())
try:
    pyodbc.connect("DRIVER={FreeTDS};SERVER=127.0.0.1;PORT=9;UID=u;PWD=p", timeout=2)
except pyodbc.Error as exc:
    print("connect", exc.args[0], "FreeTDS" in str(exc))
"""


@pytest.mark.image
@pytest.mark.slow
def test_sqlserver_image_freetds_registered_and_loads(sqlserver_bundle: Path) -> None:
    proc = _run_once(sqlserver_bundle, ["python", "-c", CHECK_ODBC], "lease-image-odbc-py")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "FreeTDS" in next(line for line in lines if line.startswith("drivers"))
    assert "connect 08S01 True" in lines, proc.stdout
    proc = _run_once(sqlserver_bundle, ["odbcinst", "-q", "-d", "-n", "FreeTDS"],
                     "lease-image-odbc")
    assert proc.returncode == 0 and "[FreeTDS]" in proc.stdout, proc.stdout + proc.stderr


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.image
@pytest.mark.slow
def test_run_on_sqlite_with_read_only_root_answers_leader(bundle: Path) -> None:
    """The image's own entrypoint and cmd (`lease-sidecar run`), unchanged."""
    port = free_port()
    # POD_NAME and POD_NAMESPACE as the chart sets them: only in a pod is a root-owned
    # 0777 volume an acceptable state dir (outside one, others could plant a leader file).
    lease_dir = _runtime_config(bundle, env={"LEASE_DSN": "/run/lease/leases.sqlite3",
                                 "LEASE_HTTP_ADDR": f"127.0.0.1:{port}",
                                 "LEASE_IDENTITY": "image-test", "POD_NAME": "image-test",
                                 "POD_NAMESPACE": "default", "LEASE_POD_LABEL": "off"})
    name = _unique("lease-image-run")
    with _container(bundle, name) as runc:
        proc = subprocess.Popen([*runc, "run", "--bundle", str(bundle), name],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 30
            status, body = 0, b""
            while time.monotonic() < deadline and proc.poll() is None:
                with contextlib.suppress(OSError):
                    status, body = _get(f"http://127.0.0.1:{port}/leader")
                    if status == 200:
                        break
                time.sleep(0.1)
            if status != 200:
                proc.kill()
                pytest.fail(f"no 200 from /leader: {status} {body!r}\n"
                            f"{proc.communicate(timeout=30)[0]}")
            # The leader file, in the emptyDir, as the app container would read it.
            leader = json.loads((lease_dir / "leader").read_text())
            assert leader["leader"] is True and leader["identity"] == "image-test"
            assert leader["valid_until"]
            assert (lease_dir / "leases.sqlite3").stat().st_uid == 10001
            subprocess.run([*runc, "kill", name, "TERM"], check=True, timeout=30)
            out, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    with pytest.raises(OSError):
        _get(f"http://127.0.0.1:{port}/leader")


# --------------------------------------------------------------------------- the cache key


def _copy_context(dest: Path) -> Path:
    for rel in ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md",
                "scripts/image-rootfs.sh"):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, dest / rel)
    shutil.copytree(REPO / "sidecar", dest / "sidecar",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "tests").mkdir()
    (dest / "tests" / "test_x.py").write_text("x = 1\n")
    return dest


def test_context_is_what_dockerignore_lets_in() -> None:
    files = image.context_files()
    assert "pyproject.toml" in files and "README.md" in files
    assert "sidecar/cli/__init__.py" in files and "sidecar/lease/sqlite/store.py" in files
    assert "scripts/image-rootfs.sh" in files
    outside = [f for f in files if f not in ("pyproject.toml", "README.md",
                                             "scripts/image-rootfs.sh")
               and not f.startswith("sidecar/")]
    assert outside == []
    assert not any("__pycache__" in f or f.endswith(".pyc") for f in files)


def test_digest_follows_the_build_context_only(tmp_path: Path) -> None:
    repo = _copy_context(tmp_path)
    base = "localhost/lease-base:0123456789abcdef"
    first = image.image_digest(base, repo)
    assert image.image_digest(base, repo) == first
    # Outside the context, or excluded by .dockerignore: same image.
    (repo / "tests" / "test_x.py").write_text("x = 2\n")
    (repo / "sidecar" / "__pycache__").mkdir()
    (repo / "sidecar" / "__pycache__" / "cli.cpython-311.pyc").write_bytes(b"\0")
    assert image.image_digest(base, repo) == first
    # A source file, the Dockerfile or the base: a new image.
    cli = repo / "sidecar" / "cli" / "__init__.py"
    cli.write_text(cli.read_text() + "\n# changed\n")
    second = image.image_digest(base, repo)
    assert second != first
    assert image.image_digest(base.replace("0123", "9999"), repo) != second
    dockerfile = repo / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + "\n# changed\n")
    assert image.image_digest(base, repo) != second
