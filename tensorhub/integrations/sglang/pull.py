"""Hot-swap an SGLang engine to a TensorHub version: a ``--custom-weight-loader`` function.

Start the server with ``--custom-weight-loader tensorhub.integrations.sglang.pull.pull`` and
``--load-format tensorhub`` (whose settings name the coordinator and model), then
drive SGLang's own calls (``tensorhub follow --engine sglang+http://HOST:PORT`` does)::

    POST /pause_generation
    POST /begin_weight_update
    POST /update_weights_from_tensor  {"serialized_named_tensors": [payload(N)] * tp_size,
                                       "load_format": "tensorhub.integrations.sglang.pull.pull",
                                       "weight_version": "N"}
    POST /end_weight_update
    POST /continue_generation

The payload names the version only (:func:`payload`: one empty tensor named
``tensorhub:<N>`` or ``tensorhub:latest``; no bytes ride along, so it crosses HTTP).
SGLang calls :func:`pull` on every TP rank of every pipeline stage. The engine's root
(PP stage 0, TP rank 0) resolves the version (``latest`` included) and every rank of
every stage loads that number. Each rank:

1. fetches the version into new memory: its own native shard when the coordinator has
   the version complete in this engine's native layout, else the ``hf`` layout; the
   names, shapes and dtypes are checked before anything changes;
2. unpublishes the version it runs (both layouts), waiting up to ``drain_timeout`` for
   its readers; if they do not drain, or any rank of any stage failed step 1, no rank
   changes anything and the call fails naming the version the engine keeps serving;
3. loads it: an in-place copy into the parameters for the native layout, SGLang's
   ``model.load_weights`` (in ``bucket_bytes`` buckets) for ``hf``;
4. publishes the parameters in place as the new version's native shard; the serving
   rank keeps the fetched ``hf`` copy registered.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence, Union

from .._core import load, worker
from .._core.settings import SettingsError
from .._core.worker import WorkerState
from . import _native, _runtime

logger = logging.getLogger(__name__)

__all__ = ["pull", "payload", "LOAD_FORMAT"]

#: The value of ``--custom-weight-loader`` and of ``load_format`` in the update request.
LOAD_FORMAT = "tensorhub.integrations.sglang.pull.pull"
_PREFIX = "tensorhub:"


def payload(version: Union[int, str]) -> str:
    """One TP rank's ``serialized_named_tensors`` entry (base64) asking for ``version``:
    what SGLang's ``MultiprocessingSerializer.serialize(..., output_str=True)`` makes of
    ``[("tensorhub:<version>", torch.empty(0))]``, without importing SGLang (an empty
    tensor pickles without shared memory, so it crosses HTTP and hosts)."""
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing  # noqa: F401  (registers the tensor reductions SGLang uses)

    buf = io.BytesIO()
    ForkingPickler(buf).dump([(f"{_PREFIX}{version}", torch.empty(0))])
    return base64.b64encode(buf.getvalue()).decode()


def requested_version(named_tensors: Sequence[Any]) -> Union[int, str]:
    """The version a payload names; a one-line error for anything else."""
    names = [n for n, _ in named_tensors] if named_tensors else []
    if len(names) != 1 or not str(names[0]).startswith(_PREFIX):
        raise ValueError(f"tensorhub: the update payload must be tensorhub.integrations.sglang.pull.payload(version), "
                         f"got tensors named {names[:3]}")
    v = names[0][len(_PREFIX):]
    if v == "latest":
        return v
    if v.isdigit() and int(v) >= 1:
        return int(v)
    raise ValueError(f"tensorhub: the update payload names version {v!r}; want a positive integer or 'latest'")


def _state(model: Any) -> WorkerState:
    st = worker.get_state()
    if st is None:
        raise SettingsError("tensorhub: the pull function needs an engine started with --load-format tensorhub "
                            "(its --model-loader-extra-config names the coordinator and the model)")
    return st


def pull(model: Any, named_tensors: Sequence[Any]) -> None:
    """SGLang's custom weight loader: switch ``model`` to the version the payload names.
    Raises (SGLang answers the update with the message) and keeps the old weights when
    the version cannot be fetched or the old version's readers do not drain."""
    requested = requested_version(named_tensors)
    swap(_state(model), model, requested)


def swap(st: WorkerState, model: Any, requested: Union[int, str], *, what: str = "the update's version",
         on_missing: str = "error", publish: bool = True) -> tuple[Optional[int], str]:
    """Steps 1-4 of the module docstring on this rank (also the loader's start, where no
    version runs yet, and which publishes after SGLang's post-processing: ``publish=False``).
    Returns the version now running (None: nothing to load, ``on_missing="disk"``) and the
    layout read."""
    s = st.settings
    t0 = time.monotonic()
    st.wait_kept(s.fetch_timeout)  # a start in place still copying the running version: let it finish
    old_v = st.version
    got, layout, err, borrowed = None, "hf", None, None
    v: Optional[int] = None
    try:
        v = worker.resolve(st, requested, on_missing=on_missing, what=what)
        if v is not None and v != old_v:
            # Every rank of a stage reads the same layout: its TP rank 0 looks, the stage's
            # TP group follows (the native layout's name differs per stage).
            layout = _runtime.stage().broadcast(_choose(st, model, v))
            if layout == "hf" and old_v is None and not publish:
                # The start: a same-host holder's memory is loaded in place (no copy of our
                # own on the way); each rank on its own (None: it fetches, below).
                borrowed = load.borrow_into(st, model, v, s.bucket_bytes, keep=st.serving)
            if borrowed is not None:
                got = borrowed
            else:
                got = worker.fetch(st, v, layout, shard=st.rank)
            if layout == "hf":
                load.check_same_layout(st.specs, got, f"{s.model!r} v{v}")
            else:
                load.check_same_layout(load.specs_of(_native.native_tensors(model)), got,
                                       f"{s.model!r} v{v} ({layout})")
    except Exception as e:
        err = str(e).removeprefix("tensorhub: ")
    err = _all_or_none(st, err)
    if err is None and got is not None and old_v is not None:
        err = _all_or_none(st, _unpublish(st, old_v))
    if err is not None:
        if borrowed is not None:
            borrowed.release_quietly()
            st.version = None
        elif got is not None and layout == "hf" and st.serving:
            _drop(st, v)
        if old_v is None:
            raise SettingsError(f"tensorhub: {err}")
        raise RuntimeError(f"tensorhub: could not switch {s.model!r} to v{requested}: {err}; "
                           f"the engine keeps serving v{old_v}")
    if v is None or got is None:
        if v is not None:
            logger.info("tensorhub: already at %s v%d", s.model, v)
        return v, "none"
    t1 = time.monotonic()
    if borrowed is not None:  # loaded already, within the lease's bound: the parameters are good
        st.copy = None
        if st.serving:  # its hf copy is made from the borrowed memory once the engine is up (the loader)
            st.pending_borrow = borrowed
        else:
            borrowed.release_quietly()
    elif layout == "hf":
        load.load_into(model, got, s.bucket_bytes, st.hooks.groups)
        st.specs, st.copy = load.specs_of(got), (got if st.serving else None)
    else:
        load.copy_into(_native.native_tensors(model), got)
        st.copy = None
    st.version = v
    if publish:
        _native.publish(st, model, v)
    if borrowed is None:
        logger.info("tensorhub: %s %s v%d (%s): fetch %.2fs (%.1f MB from %s), apply %.2fs",
                    "swapped" if old_v is not None else "loaded", s.model, v, layout, t1 - t0, got.nbytes / 1e6,
                    got.sources, time.monotonic() - t1)
    return v, layout


def _choose(st: WorkerState, model: Any, version: int) -> Optional[str]:
    """This rank's say in its stage's layout broadcast: TP rank 0's choice, None elsewhere.
    Never raises (a rank raising here would leave its stage waiting in the broadcast): a
    fingerprint that cannot be computed means ``hf``."""
    try:
        if st.layout is None and st.settings.native:
            st.layout = _native.fingerprint(model, st)
    except Exception as e:
        logger.warning("tensorhub: cannot compute the native layout's name (%s); reading hf", e)
    return _native.choose_layout(st, version) if st.rank == 0 else None


def _all_or_none(st: WorkerState, err: Optional[str]) -> Optional[str]:
    """The first rank's error over the whole engine (every TP rank of every pipeline
    stage), naming the rank when there are several, the same on every rank."""
    failed = st.engine().first_error(err)
    if failed is None:
        return None
    where, why = failed
    return why + (f" ({where})" if where else "")


def _unpublish(st: WorkerState, version: int) -> Optional[str]:
    """Stop serving ``version`` (native and hf); None once its readers drained, else why not
    (a value: every rank still meets the next all-or-none)."""
    import tensorhub

    try:
        worker.withdraw(st, version)
    except tensorhub.TensorHubError as e:
        return f"v{version} is still being read ({e}); its memory stays untouched"
    return None


def _drop(st: WorkerState, version: Optional[int]) -> None:
    """Unregister an hf copy fetched for a swap that did not happen."""
    if version is None:
        return
    import tensorhub

    try:
        st.hub.unpublish(st.settings.model, version, timeout=st.settings.drain_timeout)
    except tensorhub.TensorHubError as e:
        logger.warning("tensorhub: could not drop the fetched %s v%d: %s", st.settings.model, version, e)
