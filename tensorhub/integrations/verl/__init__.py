"""TensorHub as a verl checkpoint engine (``checkpoint_engine.backend=tensorhub``).

The backend class lives in :mod:`tensorhub.integrations.verl.engine`, which imports verl; importing
this package imports neither verl nor torch. verl finds the backend through this
package's ``verl.plugins`` entry point (loaded on ``import verl``), or through
``checkpoint_engine.custom_backend_module=tensorhub.integrations.verl.engine``. Settings:
:mod:`tensorhub.integrations.verl.settings`; the trainer side: :mod:`._publisher`; the rollout side:
:mod:`._receiver`. See ``tensorhub/integrations/verl/README.md``.
"""

BACKEND = "tensorhub"

__all__ = ["BACKEND"]
