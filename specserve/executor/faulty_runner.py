"""The runner's planted faults (runtime/faults.py), in a subclass the fault flags select.

The plain ModelRunner has no fault branch in its hot path: `make_runner` builds a FaultyRunner
only when a runner fault is set, and the FaultyRunner plants it by overriding one seam each:
- SPECSERVE_FAULT_ALIAS_ACCEPT_BUFFERS: its verify epilogue's `read_accept` returns views of the
  persistent accept buffers (the stale-accept race's cause), so a late reader sees the next step's values;
- SPECSERVE_FAULT_COPY_LAG_MS: each step's host copy is held until the next step's forward has
  finished (`_queue_copy`), and let go when the host waits with no later step (`resolve`).
The detectors (the stream sanitizer, the loop-equivalence tests, the rank consensus checker)
are shown to catch them through this class.
"""

from __future__ import annotations

from typing import Any

from specserve.executor.model_runner import ModelRunner, StepHandle
from specserve.executor.step_io import StepOutcome
from specserve.runtime.faults import FaultConfig
from specserve.speculative.accept import AcceptOuts, VerifyEpilogue

__all__ = ["AliasedAcceptEpilogue", "FaultyRunner", "ModelRunner", "make_runner"]  # the builder imports both runners here


class AliasedAcceptEpilogue(VerifyEpilogue):
    """The stale-accept race's cause, on purpose: `read_accept` hands out views of the persistent buffers."""

    def read_accept(self, bs: int) -> AcceptOuts:
        return self.accept_buffers(bs)


class FaultyRunner(ModelRunner):
    """A ModelRunner with the runner faults of a FaultConfig planted (see the module docstring)."""

    def __init__(self, *args: Any, faults: FaultConfig, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.alias_accept_buffers = faults.alias_accept_buffers
        if faults.alias_accept_buffers:
            self.epilogue_class = AliasedAcceptEpilogue
        self.copy_lag = faults.copy_lag()
        self._lag_numbers: dict[int, int] = {}  # id(handle) -> the step's number for the copy lag

    def _queue_copy(self, handle: StepHandle) -> None:
        if self.copy_lag is not None:  # the copy waits for the next step's forward
            self._lag_numbers[id(handle)] = self.copy_lag.hold_copy(self.forward, self.copy)
        super()._queue_copy(handle)

    def resolve(self, handle: StepHandle) -> list[StepOutcome]:
        number = self._lag_numbers.pop(id(handle), None)
        if self.copy_lag is not None and number is not None:
            self.copy_lag.host_waits(number)
        return super().resolve(handle)


def runs_faults(faults: FaultConfig) -> bool:
    """Whether a fault of these flags is planted in the runner (stream delays are the streams')."""
    return faults.alias_accept_buffers or faults.copy_lag_ms > 0


def make_runner(*args: Any, faults: FaultConfig | None = None, **kwargs: Any) -> ModelRunner:
    """A ModelRunner (the arguments are its own), or a FaultyRunner where `faults` plants one."""
    if faults is not None and runs_faults(faults):
        return FaultyRunner(*args, faults=faults, **kwargs)
    return ModelRunner(*args, **kwargs)
