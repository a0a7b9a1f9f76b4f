"""Everything is in pyproject.toml except one file: ``tensorhub_ros_legacy.pth``, in the wheel
and in an editable install alike, which keeps the adapters' old module paths
(``integrations.<engine>``) importing for one release without a second top-level package
(``tensorhub/integrations/_legacy.py`` says how)."""

import os
import runpy

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

# The file is run on its own (it imports only the standard library): the build environment
# has none of tensorhub's dependencies.
_LEGACY = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "tensorhub", "integrations", "_legacy.py"))


class build_py_with_pth(build_py):
    """Also writes the ``.pth`` file at the top of the wheel (site-packages once installed)."""

    def _pth(self):
        return os.path.join(self.build_lib, _LEGACY["PTH_NAME"])

    def run(self):
        super().run()
        os.makedirs(self.build_lib, exist_ok=True)
        with open(self._pth(), "w") as f:
            f.write(_LEGACY["PTH_LINE"])

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), self._pth()]


class _AndPth:
    """An editable install's strategy (how it points at the checkout), plus the ``.pth``
    file: a checkout installed with ``pip install -e .`` keeps the old paths as a wheel does."""

    def __init__(self, strategy):
        self.strategy = strategy

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self.strategy.__exit__(*exc)

    def __call__(self, wheel, files, mapping):
        self.strategy(wheel, files, mapping)
        wheel.writestr(_LEGACY["PTH_NAME"], _LEGACY["PTH_LINE"].encode())


class editable_wheel_with_pth(editable_wheel):
    def _select_strategy(self, *args, **kwargs):
        return _AndPth(super()._select_strategy(*args, **kwargs))


setup(cmdclass={"build_py": build_py_with_pth, "editable_wheel": editable_wheel_with_pth})
