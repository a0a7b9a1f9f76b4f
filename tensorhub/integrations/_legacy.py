"""The adapters' old module paths, ``integrations.<engine>...``, kept for one release.

Until 0.1 the wheel installed a second top-level package, ``integrations``: a generic name other
distributions use too. The adapters now live in ``tensorhub.integrations``; the module paths
users wrote in configs (``custom_backend_module=integrations.verl.engine``,
``--worker-extension-cls integrations.vllm.transfer.TensorHubWorkerExtension``,
``python -m integrations.sglang.seed``) still import, with a ``FutureWarning`` naming the new
path, and give the very same module objects (one class, one registry, never a second copy).

How: the wheel carries ``tensorhub_ros_legacy.pth`` (written by ``setup.py``), one line that
puts :func:`find_spec` first on ``sys.meta_path`` through a lambda that imports this module
only when a name under ``integrations`` is imported. A real ``integrations`` package on
``sys.path`` (another distribution's) wins: the alias answers only when none is found.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings

OLD = "integrations"
NEW = "tensorhub.integrations"
_warned: set[str] = set()


def new_name(name: str) -> str:
    """``integrations.vllm.transfer`` -> ``tensorhub.integrations.vllm.transfer``."""
    return NEW + name[len(OLD):]


def _ours(name: str) -> bool:
    """Is ``name`` one the alias answers? Not when another distribution's top-level
    ``integrations`` is on ``sys.path`` (or was imported): that one is the user's."""
    if name != OLD and not name.startswith(OLD + "."):
        return False
    top = sys.modules.get(OLD)
    if top is not None:
        return top is sys.modules.get(NEW)
    return importlib.machinery.PathFinder.find_spec(OLD) is None


class _Alias(importlib.abc.Loader):
    """Loads ``integrations.X`` as the module ``tensorhub.integrations.X`` itself (``real``:
    that module's spec)."""

    def __init__(self, new: str, real):
        self.new, self.real = new, real

    def create_module(self, spec):
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module) -> None:
        # importlib reads sys.modules[name] back after exec_module: the real module is what
        # ``import integrations.X`` binds, and there is one copy of it.
        sys.modules[module.__name__] = importlib.import_module(self.new)

    def get_code(self, name: str):
        """``python -m integrations.sglang.seed``: runpy runs the new module's code."""
        return self.real.loader.get_code(self.new)

    def is_package(self, name: str) -> bool:
        return self.real.submodule_search_locations is not None


def find_spec(name: str, path=None, target=None):
    """The meta-path hook (see the module's docstring). ``None`` for every other name."""
    if not _ours(name):
        return None
    new = new_name(name)
    real = importlib.util.find_spec(new)
    if real is None:
        return None
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"the module path {name!r} is deprecated and goes in the next release: "
                      f"use {new!r} (TensorHub's adapters moved into the tensorhub package)",
                      FutureWarning, stacklevel=2)
    spec = importlib.util.spec_from_loader(name, _Alias(new, real), origin=real.origin,
                                           is_package=real.submodule_search_locations is not None)
    if real.submodule_search_locations is not None:
        spec.submodule_search_locations = []  # submodules come through this finder too
    spec.has_location = real.has_location
    return spec


# The one line of the ``.pth`` file (setup.py writes it into the wheel and editable installs;
# tests/test_wheel.py runs both). Cheap for every other import: a prefix test.
PTH_LINE = ("import sys, types; sys.meta_path.insert(0, types.SimpleNamespace(find_spec=lambda name, "
            "path=None, target=None: __import__('tensorhub.integrations._legacy', fromlist=['_'])"
            ".find_spec(name) if name == 'integrations' or name.startswith('integrations.') else None))\n")
PTH_NAME = "tensorhub_ros_legacy.pth"
