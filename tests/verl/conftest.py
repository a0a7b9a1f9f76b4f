"""The verl backend's tests need verl (``pip install verl==0.9.1 --no-deps`` and the short list in
scripts/setup.sh); and verl must find the ``verl.plugins`` entry point this package declares.

An editable install made from another checkout carries that checkout's entry points; when the
installed metadata lacks ours, a one-file distribution declaring exactly the entry point of
this checkout's pyproject.toml is put on ``sys.path`` (and inherited by spawned workers), so
verl's real discovery (``importlib.metadata.entry_points(group="verl.plugins")``) is what
loads the backend either way.
"""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if importlib.util.find_spec("verl") is None:  # not imported here: verl discovers plug-ins on its first import
    pytest.skip("verl is not installed (scripts/setup.sh installs it)", allow_module_level=True)


def declared() -> dict:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data["project"]["entry-points"]["verl.plugins"]


@pytest.fixture(scope="session", autouse=True)
def verl_plugin(tmp_path_factory):
    eps = declared()
    installed = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    if all(installed.get(k) == v for k, v in eps.items()):
        yield "installed"
        return
    d = tmp_path_factory.mktemp("verl_ep")
    info = d / "tensorhub_verl_plugin-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tensorhub-verl-plugin\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[verl.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    sys.path.insert(0, str(d))
    try:
        yield "shim"
    finally:
        sys.path.remove(str(d))


@pytest.fixture
def coord(tmp_path):
    """A real coordinator process."""
    from tensorhub.testing import CoordinatorProcess

    c = CoordinatorProcess(tmp_path / "state")
    c.start()
    yield c
    c.stop()


@pytest.fixture
def model_dir(tmp_path):
    """A tiny Llama config directory (no weights), as tests/engine/_tiny.py makes it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from _tiny import make_model_dir

    d = tmp_path / "model"
    make_model_dir(d, 0, weights=False)
    return str(d)
