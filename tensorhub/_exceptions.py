"""TensorHub's exception tree.

Every error a user can see is one of these; transports and the HTTP client map
their own failures (Mooncake's negative return codes, HTTP status codes, socket
errors) into this tree at the one place that calls them.

::

    TensorHubError
    ├── ConfigError                      bad argument / setting (also ValueError)
    ├── TransportUnavailableError        Mooncake or libibverbs missing (also ImportError)
    ├── HubClosedError                   a Hub method called after close()
    ├── HubTimeoutError                  a wait (version, drain) ran out (also TimeoutError)
    ├── CoordinatorError(msg, code)      the coordinator refused a request
    │   ├── UnauthorizedError            401: missing or wrong token
    │   ├── NotFoundError                404: unknown model / version / replica / lease
    │   ├── ConflictError                409: the request contradicts durable state
    │   │   ├── ManifestMismatchError    manifest differs from the first registered one
    │   │   └── RetentionError           would drop the last replica of the newest version
    │   ├── InvalidRequestError          400 / 413 / 422: malformed or oversized request
    │   └── CoordinatorUnavailableError  unreachable, or 5xx, after retries
    ├── TensorMismatchError              ``into`` / published tensors do not fit (also ValueError)
    ├── TransferError(op, peer, code)    a data-plane call failed
    └── FetchError                       a fetch could not complete (no replica left, deadline)
        └── LeaseLapsedError             the read lease expired before release; bytes discarded
"""

from __future__ import annotations

__all__ = [
    "TensorHubError",
    "ConfigError",
    "TransportUnavailableError",
    "HubClosedError",
    "HubTimeoutError",
    "CoordinatorError",
    "UnauthorizedError",
    "NotFoundError",
    "ConflictError",
    "ManifestMismatchError",
    "RetentionError",
    "InvalidRequestError",
    "CoordinatorUnavailableError",
    "TensorMismatchError",
    "TransferError",
    "FetchError",
    "LeaseLapsedError",
]


class TensorHubError(Exception):
    """Base class of every error TensorHub raises on purpose."""


class ConfigError(TensorHubError, ValueError):
    """A setting or argument has an invalid value."""


class TransportUnavailableError(TensorHubError, ImportError):
    """The data-plane library cannot be loaded; the message names the fix."""


class HubClosedError(TensorHubError, RuntimeError):
    """A Hub method was called after ``close()``."""


class HubTimeoutError(TensorHubError, TimeoutError):
    """Waiting for a version, or for readers to drain, took longer than the timeout."""


class CoordinatorError(TensorHubError):
    """The coordinator answered with an error.

    ``status`` is the HTTP status (0 when no answer came, and on the coordinator's own
    decisions before its HTTP shell answers them), ``code`` a short machine-readable
    reason (e.g. ``"manifest_mismatch"``), ``message`` the human-readable text.

    Built as ``CoordinatorError(message, code, status=...)``; the 0.1 form
    ``CoordinatorError(status, message, code)`` is still accepted.
    """

    def __init__(self, message: "str | int", code: str = "", status: "int | str" = 0) -> None:
        if isinstance(message, int):  # the 0.1 positional form: (status, message, code)
            message, code, status = code, (status if isinstance(status, str) else ""), message
        status = int(status or 0)
        super().__init__(f"coordinator answered {status}: {message}" if status else message)
        self.status = status
        self.code = code
        self.message = message


class UnauthorizedError(CoordinatorError):
    """Missing or wrong token (HTTP 401)."""


class NotFoundError(CoordinatorError):
    """Unknown model, version, replica, worker or lease (HTTP 404)."""


class ConflictError(CoordinatorError):
    """The request contradicts the coordinator's durable state (HTTP 409)."""


class ManifestMismatchError(ConflictError):
    """A manifest differs from the first one registered for (model, version, layout, shard)."""


class RetentionError(ConflictError):
    """Unpublishing would drop the last replica of a model's newest complete version."""


class InvalidRequestError(CoordinatorError):
    """Malformed or oversized request (HTTP 400, 413 or 422)."""


class CoordinatorUnavailableError(CoordinatorError):
    """The coordinator could not be reached (or kept failing) within the retry budget."""


class TensorMismatchError(TensorHubError, ValueError):
    """Tensors do not match a manifest; the message names the first mismatching tensor."""


class TransferError(TensorHubError):
    """A data-plane operation failed.

    ``op`` is the operation (``"read"``, ``"register"``, ...), ``peer`` the remote
    endpoint (or ``""``), ``code`` the transport's return code.
    """

    def __init__(self, op: str, peer: str, code: int, detail: str = "") -> None:
        msg = f"transfer {op} from {peer or 'local'} failed with code {code}"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)
        self.op = op
        self.peer = peer
        self.code = code


class FetchError(TensorHubError):
    """A fetch could not complete (no replica left, deadline passed)."""


class LeaseLapsedError(FetchError):
    """A read lease expired before it was released; the bytes read under it were discarded."""


class ReadSlices(FetchError):
    """(Not public.) The coordinator's word, in a lease's answer (``LeaseGrant.layout`` is
    ``hf.slices``) or an older coordinator's ``read_slices`` refusal, that this ``hf`` version
    was published as slices and no assembled copy serves: ``Hub.fetch`` reads the slices
    (``_sliced``). ``num_shards``: the sliced layout's, when the answer said it."""

    def __init__(self, message: str, num_shards: "int | None" = None) -> None:
        super().__init__(message)
        self.num_shards = num_shards
