"""Everything is in pyproject.toml except one file: the wheel's ``tensorhub_ros_legacy.pth``,
which keeps the adapters' old module paths (``integrations.<engine>``) importing for one release
without a second top-level package (``tensorhub/integrations/_legacy.py`` says how)."""

import os
import runpy

from setuptools import setup
from setuptools.command.build_py import build_py

# The file is run on its own (it imports only the standard library): the build environment
# has none of tensorhub's dependencies.
_LEGACY = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "tensorhub", "integrations", "_legacy.py"))


class build_py_with_pth(build_py):
    """Also writes the ``.pth`` file at the top of the wheel (site-packages once installed)."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, _LEGACY["PTH_NAME"])
        os.makedirs(self.build_lib, exist_ok=True)
        with open(target, "w") as f:
            f.write(_LEGACY["PTH_LINE"])

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, _LEGACY["PTH_NAME"])]


setup(cmdclass={"build_py": build_py_with_pth})
