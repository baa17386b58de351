"""The images' sizes: per Dockerfile target, and what each part of the sidecar adds.

    python -m bench.bench_image

Builds the three targets (``sidecar``, ``sidecar-sqlserver``, ``operator``) with the image
test bed, or takes them from its cache (testkit/testbed/image.py: the Dockerfile, built by
buildah on the locally made Debian base), and reads each docker-archive: its size (what
``docker save`` writes; issue 20's 403 MB was this figure) and its files, merged over the
layers and grouped by what they are for:

- **python**: the interpreter, its standard library (usr/lib/python3.*), and everything
  else outside the virtualenv (shared libraries, /etc);
- one line per installed distribution of the virtualenv, from its own ``RECORD``;
- **backends**: what each one adds to the image that carries it: postgres and
  postgres-row the asyncpg distribution, sqlite the ``_sqlite3`` module and libsqlite3,
  kubernetes nothing beyond the core (aiohttp talks to the apiserver); sqlserver is the
  difference between the ``sidecar-sqlserver`` and ``sidecar`` images, split into pyodbc,
  glibc's character-set converters (gconv) and unixODBC, FreeTDS and the libraries they
  load.

Sizes are MB (10^6 bytes) of regular files (a symlink counts 0). Prints a table and writes
results/image.json (``python -m bench.report`` puts it in docs/operator.md).
"""

from __future__ import annotations

import csv
import io
import json
import posixpath
import re
import sys
import tarfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench import record
from testkit.testbed import image

TARGETS = ("sidecar", "sidecar-sqlserver", "operator")
SITE = re.compile(r"^opt/lease-sidecar/lib/python3\.\d+/site-packages/")
STDLIB = re.compile(r"^usr/(local/)?lib/python3\.\d+/")


def _mb(size: float) -> float:
    return round(size / 1e6, 1)


def read_files(archive: Path) -> dict[str, tuple[int, bytes | None]]:
    """path -> (size, content for dist-info RECORD files), the layers merged as a
    runtime would (later layers win; ``.wh.`` whiteouts delete)."""
    files: dict[str, tuple[int, bytes | None]] = {}
    with tarfile.open(archive) as outer:
        manifest = json.load(outer.extractfile("manifest.json"))  # type: ignore[arg-type]  # a file member
        for layer in manifest[0]["Layers"]:
            member = outer.extractfile(layer)
            assert member is not None, layer
            with tarfile.open(fileobj=io.BytesIO(member.read())) as tar:
                for entry in tar:
                    path = entry.name.removeprefix("./")
                    name = path.rsplit("/", 1)[-1]
                    if name.startswith(".wh."):
                        gone = path[:-len(name)] + name.removeprefix(".wh.")
                        for key in [k for k in files if k == gone or k.startswith(gone + "/")]:
                            del files[key]
                        continue
                    if not entry.isfile():
                        files.pop(path, None)
                        continue
                    content = None
                    if SITE.match(path) and path.endswith(".dist-info/RECORD"):
                        fh = tar.extractfile(entry)
                        content = fh.read() if fh else None
                    files[path] = (entry.size, content)
    return files


def distributions(files: dict[str, tuple[int, bytes | None]]) -> dict[str, int]:
    """Installed distribution -> bytes of its files in the image, from each RECORD."""
    sizes: dict[str, int] = defaultdict(int)
    owned: set[str] = set()
    for path, (_, rec) in files.items():
        if rec is None:
            continue
        site = SITE.match(path)
        assert site is not None
        dist = path[site.end():].split("/", 1)[0].removesuffix(".dist-info")
        name = dist.rsplit("-", 1)[0].lower().replace("_", "-")
        for row in csv.reader(io.StringIO(rec.decode())):
            if not row:
                continue
            rel = posixpath.normpath(site.group(0) + row[0])  # bin/ is ../../../bin
            if rel in files and rel not in owned:
                owned.add(rel)
                sizes[name] += files[rel][0]
    # Bytecode pip wrote for a distribution's modules is in its RECORD too; what is left
    # in site-packages is unowned (e.g. a removed installer's leftovers).
    rest = sum(size for path, (size, _) in files.items()
               if SITE.match(path) and path not in owned)
    if rest:
        sizes["(site-packages, no RECORD)"] = rest
    return dict(sizes)


def target_figures(target: str) -> dict[str, Any]:
    artifact = image.build_image(target)
    files = read_files(artifact.path)
    dists = distributions(files)
    total = sum(size for size, _ in files.values())
    stdlib = sum(size for path, (size, _) in files.items() if STDLIB.match(path))
    outside = sum(size for path, (size, _) in files.items()
                  if not SITE.match(path) and not STDLIB.match(path)
                  and not path.startswith("opt/lease-sidecar/"))
    return {
        "ref": artifact.ref,
        "archive_mb": _mb(artifact.path.stat().st_size),
        "files_mb": _mb(total),
        "stdlib_mb": _mb(stdlib),
        "system_mb": _mb(outside),
        "distributions_mb": {name: _mb(size) for name, size in
                             sorted(dists.items(), key=lambda kv: -kv[1])},
        "_files": files,
    }


def sqlserver_addition(sidecar: dict[str, Any], sqlserver: dict[str, Any]) -> dict[str, float]:
    base, more = sidecar["_files"], sqlserver["_files"]
    added = {path: size for path, (size, _) in more.items()
             if path not in base or base[path][0] != size}
    pyodbc = sum(s for p, s in added.items() if SITE.match(p))
    gconv = sum(s for p, s in added.items() if "/gconv/" in p)
    return {"pyodbc_mb": _mb(pyodbc), "gconv_mb": _mb(gconv),
            "odbc_driver_and_libraries_mb": _mb(sum(added.values()) - pyodbc - gconv),
            "files_mb": _mb(sum(added.values())),
            "archive_mb": round(sqlserver["archive_mb"] - sidecar["archive_mb"], 1)}


def main() -> int:
    reason = image.unavailable_reason()
    if reason:
        print(f"bench_image: {reason}", file=sys.stderr)
        return 1
    started = time.monotonic()
    meta = record.start(1)
    figures = {target: target_figures(target) for target in TARGETS}
    side = figures["sidecar"]
    sqlite = sum(size for path, (size, _) in side["_files"].items()
                 if re.search(r"(_sqlite3\.cpython|libsqlite3\.so)", path))
    backends = {
        "kubernetes_mb": 0.0,
        "postgres_and_postgres_row_mb": side["distributions_mb"].get("asyncpg", 0.0),
        "sqlite_mb": _mb(sqlite),
        "sqlserver": sqlserver_addition(side, figures["sidecar-sqlserver"]),
    }
    result = {
        "built_with": "testkit/testbed/image.py (buildah, the local Debian bookworm base)",
        "targets": {t: {k: v for k, v in f.items() if k != "_files"}
                    for t, f in figures.items()},
        "backends": backends,
    }
    print(f"{'target':<20}{'archive MB':>12}{'files MB':>10}{'stdlib':>8}{'system':>8}")
    for target, f in result["targets"].items():
        print(f"{target:<20}{f['archive_mb']:>12}{f['files_mb']:>10}{f['stdlib_mb']:>8}"
              f"{f['system_mb']:>8}")
        top = list(f["distributions_mb"].items())[:6]
        print("    " + ", ".join(f"{name} {mb}" for name, mb in top))
    print("backends:", json.dumps(backends))
    out = record.write("image.json", meta, result)
    print(f"wrote {out} ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
