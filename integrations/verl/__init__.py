"""TensorHub as a verl checkpoint engine (``checkpoint_engine.backend=tensorhub``).

The backend class lives in :mod:`integrations.verl.engine`, which imports verl; importing
this package imports neither verl nor torch. verl finds the backend through this
package's ``verl.plugins`` entry point (loaded on ``import verl``), or through
``checkpoint_engine.custom_backend_module=integrations.verl.engine``. Settings:
:mod:`integrations.verl.settings`; the trainer side: :mod:`._publisher`; the rollout side:
:mod:`._receiver`. See ``integrations/verl/README.md``.
"""

BACKEND = "tensorhub"

__all__ = ["BACKEND"]
