"""Small container images made here, without a registry or a container engine.

* ``pause_image()``: the pod sandbox image containerd needs (``sandbox_image``): a static
  C program that sleeps until SIGINT/SIGTERM and reaps children, compiled with gcc.
* ``busybox_image()``: Debian's ``busybox-static`` with a link per applet, for test pods
  that only need a shell.

Both are written as a ``docker save`` archive (``manifest.json``, a config, one
uncompressed layer), which ``ctr images import`` reads.  Layers are built
deterministically (fixed mtimes and owners), so the image id only changes with its
inputs; archives are cached under ``<gobuild cache>/images``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from testkit.testbed import gobuild

PAUSE_C = r"""
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void done(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, 0, WNOHANG) > 0) {} }

int main(void) {
    signal(SIGINT, done);
    signal(SIGTERM, done);
    signal(SIGCHLD, reap);
    for (;;) pause();
}
"""

BUSYBOX = Path("/bin/busybox")


class ImageError(RuntimeError):
    """An image could not be made (a missing tool or package is named)."""


@dataclass(frozen=True)
class Image:
    archive: Path  # docker-archive tar for `ctr images import`
    ref: str  # the name pods use, with imagePullPolicy: Never


@dataclass(frozen=True)
class Entry:
    """One layer entry: a file (data), a directory (data None, no target) or a symlink."""

    path: str
    data: bytes | None = None
    mode: int = 0o755
    target: str | None = None


def _layer(entries: list[Entry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in sorted(entries, key=lambda e: e.path):
            info = tarfile.TarInfo(e.path.lstrip("/"))
            info.mtime = 0
            info.mode = e.mode
            if e.target is not None:
                info.type, info.linkname = tarfile.SYMTYPE, e.target
                tar.addfile(info)
            elif e.data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(e.data)
                tar.addfile(info, io.BytesIO(e.data))
    return buf.getvalue()


def write_archive(path: Path, ref: str, entries: list[Entry], config: dict) -> str:
    """Write a one-layer docker-archive; return the image id (config digest)."""
    layer = _layer(entries)
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    image_config = {
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "testkit/testbed/tinyimages.py"}],
    }
    config_bytes = json.dumps(image_config, sort_keys=True).encode()
    config_id = hashlib.sha256(config_bytes).hexdigest()
    manifest = [{"Config": f"{config_id}.json", "RepoTags": [ref], "Layers": ["layer.tar"]}]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tarfile.open(tmp, "w") as tar:
        for name, data in (
            (f"{config_id}.json", config_bytes),
            ("layer.tar", layer),
            ("manifest.json", json.dumps(manifest).encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, path)
    return config_id


def _cached(name: str, inputs: bytes, build: Callable[[Path, str], None]) -> Image:
    tag = hashlib.sha256(inputs).hexdigest()[:16]
    ref = f"localhost/lease-testbed/{name}:{tag}"
    directory = gobuild.cache_root() / "images"
    directory.mkdir(parents=True, exist_ok=True)
    archive = directory / f"{name}-{tag}.tar"
    if not archive.exists():
        build(archive, ref)
    return Image(archive, ref)


def pause_image() -> Image:
    gcc = shutil.which("gcc")
    if not gcc:
        raise ImageError("gcc not found: the pause image is compiled here (apt-get install gcc)")

    def build(archive: Path, ref: str) -> None:
        with tempfile.TemporaryDirectory(prefix="lease-pause-") as tmp:
            src, out = Path(tmp) / "pause.c", Path(tmp) / "pause"
            src.write_text(PAUSE_C)
            proc = subprocess.run(
                [gcc, "-static", "-Os", "-s", "-o", str(out), str(src)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if proc.returncode != 0:
                raise ImageError(f"compiling the pause program failed: {proc.stderr.strip()}")
            entries = [Entry("/pause", out.read_bytes())]
        write_archive(archive, ref, entries, {"Entrypoint": ["/pause"], "User": "65535:65535"})

    gcc_version = subprocess.run([gcc, "--version"], capture_output=True).stdout
    return _cached("pause", PAUSE_C.encode() + gcc_version, build)


def _is_static(binary: bytes) -> bool:
    """An ELF64 executable without a PT_INTERP header needs no loader or libraries."""
    if binary[:5] != b"\x7fELF\x02":
        return False
    phoff = int.from_bytes(binary[0x20:0x28], "little")
    size = int.from_bytes(binary[0x36:0x38], "little")
    count = int.from_bytes(binary[0x38:0x3A], "little")
    types = (int.from_bytes(binary[phoff + i * size:phoff + i * size + 4], "little")
             for i in range(count))
    return 3 not in types  # PT_INTERP


def busybox_image() -> Image:
    if not BUSYBOX.exists():
        raise ImageError(f"{BUSYBOX} not found (apt-get install busybox-static)")
    binary = BUSYBOX.read_bytes()
    if not _is_static(binary):
        raise ImageError(f"{BUSYBOX} is linked dynamically (apt-get install busybox-static)")

    def build(archive: Path, ref: str) -> None:
        applets = subprocess.run(
            [str(BUSYBOX), "--list"], capture_output=True, text=True, check=True
        ).stdout.split()
        entries = [
            Entry("/bin", None),
            Entry("/tmp", None, mode=0o1777),
            Entry("/bin/busybox", binary),
            *(Entry(f"/bin/{a}", target="busybox") for a in applets if a != "busybox"),
        ]
        config = {"Cmd": ["/bin/sh"], "Env": ["PATH=/bin"]}
        write_archive(archive, ref, entries, config)

    return _cached("busybox", hashlib.sha256(binary).digest(), build)
