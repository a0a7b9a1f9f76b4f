#!/usr/bin/env bash
# Download, here (PyPI reachable), what the GPU device machine lacks to run
# scripts/gpu_check.sh: it has CUDA, PyTorch (cu130), pytest and numpy, no network, and an
# unknown Python (3.10-3.13). Everything lands in gpu_wheels/ (git-ignored), which a device
# call carries next to the working tree; the two together must stay under 64 MiB.
#
#   bash scripts/fetch_gpu_wheels.sh            # -> gpu_wheels/, sizes printed
#
# What goes in, and why it fits:
#   * TensorHub's run-time dependencies (pyproject.toml): pydantic (+pydantic-core), fastapi
#     (+starlette), uvicorn (plain: the coordinator runs without uvloop/httptools/watchfiles,
#     which only speed it up), httpx (+httpcore, h11, anyio, idna, certifi), prometheus_client,
#     xxhash; compiled ones once per CPython 3.10-3.13, manylinux x86_64. numpy: on the device.
#   * Mooncake's Transfer Engine built for CUDA 13 (mooncake-transfer-engine-cuda13, the same
#     release as the CPU build the tests use). Its PyPI wheel is 93 MiB per Python version
#     (store, process-group and EP libraries, benchmarks); the data plane needs only
#     mooncake/engine.so (per Python version) and the libraries it links from the wheel
#     (Python-independent). So this keeps, per version, a slim wheel (same name and version,
#     RECORD rewritten) with engine.so, __init__.py and buffer_pool.py, and once, the bundled
#     libraries as mooncake-libs-<version>.tar.gz, which gpu_check.sh unpacks next to them.
#     engine.so also links system libraries (libibverbs, libmlx5, libnuma, libcurl) and CUDA's
#     libcudart.so.13 / libcuda.so.1: torch cu130 and the driver bring the CUDA ones; for the
#     others, syslibs-<distro>.tar.gz holds this machine's copies (and what they link, glibc
#     excepted), which gpu_check.sh uses only for those the device lacks.
#
# Measured 2026-12-01 (0.3.13.post1, CPython 3.10-3.13): mooncake libs 11.8 MiB, slim engine
# wheels 4 x 1.4 MiB, pydantic-core 4 x 2.2 MiB, system libraries 7.1 MiB, xxhash 4 x 0.45 MiB,
# the pure-Python rest 1.9 MiB: 36.9 MiB, 38.2 MiB with the working tree.
#
# Environment: PYTHON (default .venv/bin/python, else python3), DEST (default gpu_wheels),
# PY_VERSIONS (default "3.10 3.11 3.12 3.13"),
# MAX_MIB (default 55: the carried total, working tree included, must stay below it).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}
DEST=${DEST:-gpu_wheels}
PY_VERSIONS=${PY_VERSIONS:-"3.10 3.11 3.12 3.13"}
MAX_MIB=${MAX_MIB:-55}
# What TensorHub imports at run time and the Mooncake pin: one list, in benchmarks/_gpu_carry.py
# (which checks the folder against it and installs from it on the device).
mapfile -t REQS < <("$PYTHON" benchmarks/gpu_check.py requirements)
MOONCAKE_PIN=$("$PYTHON" benchmarks/gpu_check.py requirements --mooncake)
MOONCAKE_DIST=${MOONCAKE_PIN%%==*}
MOONCAKE_VERSION=${MOONCAKE_PIN#*==}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)

rm -rf "$DEST"  # a fresh set: files of an earlier pin would travel too
mkdir -p "$DEST"
RAW=$(mktemp -d "${TMPDIR:-/tmp}/tensorhub-gpu-wheels.XXXXXX")
trap 'rm -rf "$RAW"' EXIT

# pip download, without the warnings this machine's pip config adds (file:// indexes that
# may not exist); its exit status is pip's.
pipdl() {
    "$PYTHON" -m pip download -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }
    return "${PIPESTATUS[0]}"
}

for v in $PY_VERSIONS; do
    tag="cp${v/./}"
    echo "== Python $v: dependencies"
    pipdl --only-binary=:all: --python-version "$v" \
        --implementation cp --abi "$tag" "${PLATFORMS[@]}" -d "$DEST" "${REQS[@]}"
    echo "== Python $v: $MOONCAKE_DIST==$MOONCAKE_VERSION (full wheel to $RAW, slimmed into $DEST)"
    pipdl --no-deps --only-binary=:all: --python-version "$v" \
        --implementation cp --abi "$tag" --platform manylinux_2_28_x86_64 -d "$RAW" \
        "$MOONCAKE_PIN"
done

# Slim the Mooncake wheels: engine.so + __init__.py per version, the linked libraries once.
"$PYTHON" - "$RAW" "$DEST" "$MOONCAKE_VERSION" <<'PY'
import base64, hashlib, io, sys, tarfile, zipfile
from pathlib import Path

raw, dest, version = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
wheels = sorted(raw.glob(f"mooncake_transfer_engine_cuda13-{version}-*.whl"))
if not wheels:
    sys.exit(f"no mooncake_transfer_engine_cuda13-{version} wheel was downloaded")
# __init__.py imports buffer_pool.py (which tolerates the absent store extension).
KEEP = {"mooncake/__init__.py", "mooncake/buffer_pool.py", "mooncake/engine.so", "mooncake/engine.pyi",
        "mooncake/py.typed"}
# What engine.so links from the wheel (its RPATH is $ORIGIN:$ORIGIN/../<dist>.libs): checked
# with readelf -d on 0.3.13.post1 and 0.3.14; gpu_check.sh reports anything still missing.
LIBS = ("mooncake/libasio.so", "mooncake/libetcd_wrapper.so")
LIBS_DIR = "mooncake_transfer_engine_cuda13.libs/"
SKIP_LIBS = ("libetcd_wrapper-",)  # the .libs copy serves store.so, which the data plane never loads

def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"

libs_done = False
for whl in wheels:
    out = dest / whl.name
    with zipfile.ZipFile(whl) as zin:
        names = zin.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        files, record = {}, []
        for n in names:
            if n in KEEP:
                files[n] = zin.read(n)
            elif n.startswith(info + "/") and not n.endswith("/RECORD"):
                data = zin.read(n)
                if n.endswith("/METADATA"):  # the slim wheel needs nothing else installed
                    data = b"".join(l for l in data.splitlines(keepends=True) if not l.startswith(b"Requires-Dist:"))
                files[n] = data
        if "mooncake/engine.so" not in files:
            sys.exit(f"{whl.name} has no mooncake/engine.so")
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
            for n, data in files.items():
                zout.writestr(n, data)
                record.append(record_line(n, data))
            record.append(f"{info}/RECORD,,")
            zout.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
        if not libs_done:
            tar_path = dest / f"mooncake-libs-{version}.tar.gz"
            with tarfile.open(tar_path, "w:gz", compresslevel=9) as tar:
                for n in names:
                    base = n.rsplit("/", 1)[-1]
                    if n in LIBS or (n.startswith(LIBS_DIR) and not base.startswith(SKIP_LIBS) and not n.endswith("/")):
                        data = zin.read(n)
                        ti = tarfile.TarInfo(n)
                        ti.size, ti.mode = len(data), 0o755
                        tar.addfile(ti, io.BytesIO(data))
            libs_done = True
    print(f"slim {out.name}: {out.stat().st_size / 2**20:.2f} MiB (from {whl.stat().st_size / 2**20:.1f} MiB)")
PY

# This machine's system libraries that engine.so links (and what they link, glibc excepted):
# a fallback for a device image without rdma-core / libnuma / libcurl.
if command -v ldd >/dev/null; then
    distro=$(. /etc/os-release 2>/dev/null && echo "${ID:-linux}${VERSION_ID:-}" || echo linux)
    tarball="$DEST/syslibs-$distro.tar.gz"
    "$PYTHON" - "$tarball" <<'PY'
import io, re, subprocess, sys, tarfile
from pathlib import Path

GLIBC = re.compile(r"^(libc|libm|libdl|libpthread|librt|libresolv|libutil|ld-linux.*|linux-vdso|libstdc\+\+|libgcc_s)\.so")
ROOTS = ["libibverbs.so.1", "libmlx5.so.1", "libnuma.so.1", "libcurl.so.4"]
cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
paths = {}
for root in ROOTS:
    m = re.search(rf"^\s*{re.escape(root)} \(.*x86-64.*\) => (\S+)$", cache, re.M)
    if not m:
        sys.exit(f"{root} is not installed here (apt-get install libibverbs1 ibverbs-providers libnuma1 libcurl4)")
    paths[root] = m.group(1)
    for line in subprocess.run(["ldd", m.group(1)], capture_output=True, text=True).stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "=>" and not GLIBC.match(parts[0]):
            paths[parts[0]] = parts[2]
with tarfile.open(sys.argv[1], "w:gz", compresslevel=9) as tar:
    for soname, path in sorted(paths.items()):
        data = Path(path).resolve().read_bytes()
        ti = tarfile.TarInfo(f"syslibs/{soname}")
        ti.size, ti.mode = len(data), 0o755
        tar.addfile(ti, io.BytesIO(data))
print(f"{Path(sys.argv[1]).name}: {len(paths)} libraries, {Path(sys.argv[1]).stat().st_size / 2**20:.2f} MiB")
PY
else
    echo "ldd not found: no syslibs fallback (the device must have libibverbs1, libnuma1, libcurl4)"
fi

# Sizes: the folder, and everything a device call carries (tracked + untracked-not-ignored files).
echo "== sizes"
"$PYTHON" - "$DEST" "$MAX_MIB" <<'PY'
import collections, os, subprocess, sys
from pathlib import Path

dest, limit = Path(sys.argv[1]), float(sys.argv[2])
groups = collections.defaultdict(int)
for p in sorted(dest.iterdir()):
    name = p.name
    key = ("mooncake (slim engine wheels)" if name.startswith("mooncake_transfer") else
           "mooncake libs" if name.startswith("mooncake-libs") else
           "system libs fallback" if name.startswith("syslibs") else
           name.split("-")[0].lower())
    groups[key] += p.stat().st_size
for key, n in sorted(groups.items(), key=lambda kv: -kv[1]):
    print(f"  {n / 2**20:7.2f} MiB  {key}")
wheels = sum(groups.values())
listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                        capture_output=True, check=True).stdout.split(b"\0")
tree = sum(os.path.getsize(f) for f in listed if f and os.path.isfile(f))
total = (wheels + tree) / 2**20
print(f"  {wheels / 2**20:7.2f} MiB  {dest}/ in all ({len(list(dest.iterdir()))} files)")
print(f"  {tree / 2**20:7.2f} MiB  working tree (git ls-files, untracked included)")
print(f"  {total:7.2f} MiB  carried in all (limit {limit:g} MiB of the 64 MiB a device call takes)")
if total > limit:
    sys.exit(f"too big: {total:.1f} MiB > {limit:g} MiB")
PY
