"""What the GPU check carries to the device and how it finds it there (benchmarks/gpu_check.py).

* :data:`REQUIREMENTS` and the Mooncake pin: what scripts/fetch_gpu_wheels.sh downloads into
  ``gpu_wheels/`` and scripts/gpu_check.sh installs from it, offline.
* :func:`check_wheels`: that folder resolves, offline, for every CPython the device may have.
* :func:`library_path`: the LD_LIBRARY_PATH entries Mooncake's CUDA engine.so needs there.

Standard library only: the scripts call it before anything is installed.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any, Optional

#: What TensorHub imports at run time (pyproject.toml), minus numpy (the device has it) and
#: uvicorn's [standard] extras (speed only); scripts/fetch_gpu_wheels.sh downloads these.
REQUIREMENTS = ["pydantic>=2.6", "fastapi>=0.110", "uvicorn>=0.29", "httpx>=0.27", "prometheus_client>=0.17",
                "xxhash>=3.0"]
MOONCAKE_DIST = "mooncake-transfer-engine-cuda13"
MOONCAKE_VERSION = "0.3.13.post1"  # the release of the CPU build the test suite runs
PY_VERSIONS = ["3.10", "3.11", "3.12", "3.13"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
#: Libraries the device supplies itself (driver, CUDA runtime of torch cu130).
CUDA_LIBS = {"libcuda.so.1", "libcudart.so.13"}


class CheckFailed(Exception):
    pass


def require(cond: bool, what: str) -> None:
    if not cond:
        raise CheckFailed(what)


# ---------------------------------------------------------------------------- libraries
def ldd_missing(path: Path, env: dict) -> list[str]:
    out = subprocess.run(["ldd", str(path)], capture_output=True, text=True, env=env).stdout
    return sorted({line.split()[0] for line in out.splitlines() if "not found" in line})


def cudart_dir() -> Optional[str]:
    """Where torch cu130's CUDA runtime lies (pip's nvidia packages or torch/lib)."""
    for root in sys.path:
        for pattern in ("nvidia/cu13/lib/libcudart.so.13*", "nvidia/cuda_runtime/lib/libcudart.so.13*",
                        "torch/lib/libcudart.so.13*"):
            hits = glob.glob(os.path.join(root, pattern))
            if hits:
                return os.path.dirname(hits[0])
    return None


def library_path(site: Path, wheels: Path, work: Path) -> tuple[list[str], list[str]]:
    """Directories to put on LD_LIBRARY_PATH so that ``site``'s mooncake/engine.so loads: the
    CUDA runtime's, and for each system library the machine lacks, this project's fallback
    copy (syslibs-*.tar.gz). Returns (directories, names still missing)."""
    dirs = [d for d in [cudart_dir()] if d]
    engine = site / "mooncake" / "engine.so"
    if not engine.exists() or shutil.which("ldd") is None:
        return dirs, []
    fallback, chosen = work / "syslibs-all", work / "syslibs"
    for tarball in sorted(wheels.glob("syslibs-*.tar.gz")):
        fallback.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tarball) as tar:
            tar.extractall(fallback)
    chosen.mkdir(parents=True, exist_ok=True)
    missing: list[str] = []
    for _ in range(8):  # ldd lists the whole tree: what an added library needs shows up next round
        env = dict(os.environ, LD_LIBRARY_PATH=":".join(dirs + [str(chosen)] + [os.environ.get("LD_LIBRARY_PATH", "")]))
        missing = ldd_missing(engine, env)
        added = False
        for name in missing:
            src = fallback / "syslibs" / name
            if src.exists() and not (chosen / name).exists():
                (chosen / name).symlink_to(src)
                added = True
        if not added:
            break
    if any(chosen.iterdir()):
        dirs.append(str(chosen))
    return dirs, missing


# ---------------------------------------------------------------------------- wheels
def check_wheels(wheels: Path, work: Path) -> dict:
    """The carried folder is complete: pip resolves everything offline from it for every
    CPython the device may have, and this Python's slim Mooncake wheel unpacks to an
    engine.so whose libraries are all there but CUDA's (and the system fallback's)."""
    if not wheels.is_dir():
        return {"checked": False, "reason": f"{wheels}/ absent (run scripts/fetch_gpu_wheels.sh to make it)"}
    res: dict[str, Any] = {"checked": True, "versions": {}}
    for v in PY_VERSIONS:
        tag = "cp" + v.replace(".", "")
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-index", "--find-links",
               str(wheels), "--only-binary=:all:", "--python-version", v, "--implementation", "cp", "--abi", tag,
               "--target", str(work / "dry-target"), "--ignore-installed", "--report", "-",
               "--disable-pip-version-check"]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        r = subprocess.run(cmd + REQUIREMENTS + [f"{MOONCAKE_DIST}=={MOONCAKE_VERSION}"], capture_output=True, text=True,
                           env=dict(os.environ, PIP_CONSTRAINT="", PIP_FIND_LINKS=""))
        if r.returncode != 0 and "no such option" in r.stderr:  # pip < 22.2: no --dry-run / --report
            return {"checked": False, "reason": f"this pip cannot resolve without installing: {r.stderr.strip()[-200:]}"}
        require(r.returncode == 0, f"gpu_wheels/ does not hold everything for Python {v}: {r.stderr.strip()[-800:]}")
        got = {i["metadata"]["name"].lower().replace("_", "-") for i in json.loads(r.stdout)["install"]}
        want = {"pydantic", "pydantic-core", "fastapi", "starlette", "uvicorn", "httpx", "httpcore", "h11", "anyio",
                "idna", "certifi", "prometheus-client", "xxhash", MOONCAKE_DIST}
        require(want <= got, f"Python {v}: pip would not install {sorted(want - got)} from gpu_wheels/")
        res["versions"][v] = len(got)
    libs = sorted(wheels.glob(f"mooncake-libs-{MOONCAKE_VERSION}.tar.gz"))
    require(bool(libs), f"gpu_wheels/mooncake-libs-{MOONCAKE_VERSION}.tar.gz is missing")
    here = "cp%d%d" % sys.version_info[:2]
    slim = sorted(wheels.glob(f"{MOONCAKE_DIST.replace('-', '_')}-{MOONCAKE_VERSION}-{here}-*.whl"))
    if slim and shutil.which("ldd"):
        site = work / "slim-site"
        shutil.rmtree(site, ignore_errors=True)
        with zipfile.ZipFile(slim[0]) as z:
            z.extractall(site)
        with tarfile.open(libs[0]) as tar:
            tar.extractall(site)
        r = subprocess.run([sys.executable, "-c", "import mooncake, sys; print(mooncake.__file__)"],
                           capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(site)))
        require(r.returncode == 0 and str(site) in r.stdout, f"the slim Mooncake package does not import: {r.stderr[-500:]}")
        dirs, missing = library_path(site, wheels, work / "ldd")
        unexpected = sorted(set(missing) - CUDA_LIBS)
        require(not unexpected, f"mooncake/engine.so (CUDA build) links libraries nobody supplies: {unexpected}")
        res["engine_so"] = {"python": here, "missing_here": missing, "fallback_dirs": dirs}
    res["ok"] = True
    return res
