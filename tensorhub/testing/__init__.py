"""Test helpers shipped with TensorHub, so users can test their own code without RDMA.

* :class:`InMemoryTransport` -- an in-process transport with kill / hang / resume and a
  bandwidth limit; passes the same contract tests as the Mooncake transport.
* :class:`Faults` -- kill (SIGKILL), hang (SIGSTOP) or slow (tc, in a network namespace) a
  source, a reader or the coordinator, at a chosen or random point of a transfer.
* :class:`Worker`, :class:`CoordinatorProcess` -- scriptable real processes (a Hub over real
  Mooncake; a restartable coordinator) for multi-process tests, soaks and benchmarks.

Importing this package loads neither torch nor Mooncake.
"""

from ._faults import Faults, Trigger
from ..transport._memory import InMemoryTransport
from ._workers import CoordinatorProcess, Worker, WorkerError, digest, enter_netns, make_weights

__all__ = [
    "InMemoryTransport",
    "Faults",
    "Trigger",
    "CoordinatorProcess",
    "Worker",
    "WorkerError",
    "make_weights",
    "digest",
    "enter_netns",
]
