"""TensorHub: Reference-Oriented Storage for LLM weights.

A weight version looks like a stored object any worker can fetch by (model, version),
yet TensorHub keeps no copy: a small coordinator records which workers hold which
version in memory, and readers pull the bytes straight from those holders over
Mooncake's Transfer Engine. Every finished reader becomes one more source.

>>> import tensorhub
>>> hub = tensorhub.connect("http://127.0.0.1:7777")        # doctest: +SKIP
>>> v = hub.publish("policy", model.state_dict())             # doctest: +SKIP
>>> weights = hub.fetch("policy")                             # doctest: +SKIP

Importing this package loads neither torch, Mooncake nor any engine.
"""

from ._exceptions import (
    ConfigError,
    ConflictError,
    CoordinatorError,
    CoordinatorUnavailableError,
    FetchError,
    HubClosedError,
    HubTimeoutError,
    InvalidRequestError,
    LeaseLapsedError,
    ManifestMismatchError,
    NotFoundError,
    RetentionError,
    TensorHubError,
    TensorMismatchError,
    TransferError,
    TransportUnavailableError,
    UnauthorizedError,
)
from ._metrics import FetchProgress, start_metrics_server
from .protocol import Locality, VersionMeta
from .config import HubConfig
from ._sliced import Slice
from .hub import Borrowed, Fetched, Hub, connect

__version__ = "0.1.0"

__all__ = [
    "connect",
    "Hub",
    "HubConfig",
    "Fetched",
    "Borrowed",
    "Slice",
    "FetchProgress",
    "Locality",
    "VersionMeta",
    "start_metrics_server",
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
    "__version__",
]
