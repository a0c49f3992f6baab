"""Host-wait detector: counts every point where the host would wait on the device inside `launch`.

The overlap loop pays only if launching step N+1 never waits for step N (or for step N+1 itself):
the host must queue the whole step and return, and read its results once, late, from the copy
stream's owned host copies. On CUDA a wait hides in ordinary code (`.item()`, `.tolist()`, `if t`,
`.cpu()`, a boolean mask, `nonzero`), and `torch.cuda.set_sync_debug_mode("error")` raises at it.
On CPU nothing ever waits, so this detector makes the same waits visible there: a
TorchFunctionMode that tags each tensor device- or host-resident by provenance, the way CUDA would
place it, and records a wait wherever the host needs a device tensor's values:

- placement: a tensor made outside the detector (weights, K/V, the future map, captured buffers)
  is device-resident; a factory call is host-resident unless it names a device; `.cpu()` and
  `.numpy()` give host tensors; `.to(device)` gives a device tensor; any other op's result is on
  the device if any of its tensor inputs is.
- a wait: a device tensor's value read (`item`, `tolist`, `bool`, `int`, `float`, `index`,
  formatting), its copy to the host (`.cpu()`, `.numpy()`, a host tensor written from it), an op
  whose output size depends on its values (`nonzero`, boolean-mask indexing, `unique`, ...), a
  blocking copy of host values to the device (`torch.tensor(values, device=...)`, `.to(device)`
  of a host tensor without `non_blocking`: on CUDA they synchronise the stream; runtime/stream.py's `staged`
  queues them instead), and an explicit `Event.synchronize` / `Stream.synchronize`.

Work on the copy stream is exempt: its device-to-host copy is the one the design allows (pinned
and non-blocking on CUDA). What is not a wait: launching kernels, a non-blocking copy to the
device, reading a host tensor. `mode="error"` raises HostWaitError at the first wait (CUDA's sync
debug mode); `mode="count"` records them all, with their call sites.
"""

from __future__ import annotations

import threading
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from specserve import envs
from specserve.runtime import stream as streams

_HOST_TAG = "_specserve_host_resident"
_kernel = threading.local()  # per thread: inside a CPU kernel's own code (device_code)
_SKIP_FRAMES = ("torch/", "specserve/runtime/host_waits.py", "specserve/runtime/stream.py", "contextlib.py")

# Reads of a tensor's values into Python: on CUDA each is a device-to-host copy and a stream sync.
_VALUE_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "__format__"}
_VALUE_READS |= {"__repr__", "__str__", "__array__", "numpy", "equal", "allclose", "is_nonzero", "__contains__"}
# Ops whose output shape depends on the input's values: the host must learn a count first.
_DATA_DEPENDENT = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"}
_DATA_DEPENDENT |= {"nonzero_static_fallback"}
_FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "rand", "randn"}
_FACTORIES |= {"randint", "eye", "from_numpy", "empty_strided", "scalar_tensor"}


class HostWaitError(RuntimeError):
    """The host waited on the device inside a step's launch (mode "error")."""


@dataclass(frozen=True)
class HostWait:
    """One wait: what the host did, and where."""

    op: str
    site: str


class HostWaitDetector:
    """Counts (or refuses) host waits while `watching()`; one per runner, usable from any thread.

    `exempt` streams (the copy stream) run their work unwatched: their device-to-host copy is
    asynchronous on CUDA. On CUDA `watching()` also turns on torch's sync debug mode, so a wait the
    provenance rules miss is still caught there."""

    @staticmethod
    def from_env(exempt: tuple[Any, ...] = ()) -> Optional["HostWaitDetector"]:
        """The detector SPECSERVE_HOST_WAITS asks for ("count" or "error"), or None when unset."""
        mode = envs.env_choice(envs.HOST_WAITS, ("count", "error"))
        return HostWaitDetector(mode, exempt) if mode else None

    def __init__(self, mode: str = "count", exempt: tuple[Any, ...] = ()):
        if mode not in ("count", "error"):
            raise ValueError(f"host-wait mode must be 'count' or 'error', not {mode!r}")
        self.mode = mode
        self.exempt_ids = {s.id for s in exempt}
        self.waits: list[HostWait] = []
        self._lock = threading.Lock()
        self._tls = threading.local()

    @contextmanager
    def watching(self, cuda: bool = False) -> Iterator[None]:
        """Watch this thread's tensor work inside the block (re-entrant)."""
        depth = getattr(self._tls, "depth", 0)
        self._tls.depth = depth + 1
        if depth:
            try:
                yield
            finally:
                self._tls.depth = depth
            return
        previous = torch.cuda.get_sync_debug_mode() if cuda else 0
        caught: list[warnings.WarningMessage] = []
        try:
            if cuda:
                torch.cuda.set_sync_debug_mode("error" if self.mode == "error" else "warn")
            with warnings.catch_warnings(record=True) as caught, _Mode(self), streams.observe_host_waits(self.record):
                warnings.simplefilter("always")
                yield
        finally:
            self._tls.depth = 0
            if cuda:
                torch.cuda.set_sync_debug_mode(previous)
            self._count_sync_warnings(caught)

    def _count_sync_warnings(self, caught: list[warnings.WarningMessage]) -> None:
        """In count mode CUDA's sync debug mode warns: each such warning is a wait; others pass on."""
        for w in caught:
            if "synchroniz" in str(w.message):
                self.record(f"CUDA: {str(w.message)[:80]}")
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def record(self, op: str) -> None:
        in_kernel: int = getattr(_kernel, "depth", 0)
        if in_kernel or streams.current_stream().id in self.exempt_ids:
            return
        wait = HostWait(op, _user_frame())
        with self._lock:
            self.waits.append(wait)
        if self.mode == "error":
            raise HostWaitError(f"the host waits on the device inside a step's launch: {op} at {wait.site}")

    def reset(self) -> list[HostWait]:
        """The waits recorded so far, forgetting them."""
        with self._lock:
            out, self.waits = self.waits, []
        return out


@contextmanager
def device_code() -> Iterator[None]:
    """A CPU kernel's own code: on CPU the kernels are the device, and a kernel reading its inputs
    is no host wait. Only for branches that run on CPU alone (CUDA runs a device kernel instead)."""
    _kernel.depth = getattr(_kernel, "depth", 0) + 1
    try:
        yield
    finally:
        _kernel.depth -= 1


def host_resident(tensor: torch.Tensor) -> torch.Tensor:
    """Mark a tensor made outside the detector as host memory (a pinned staging buffer, a host-side
    table): reading it is no wait."""
    setattr(tensor, _HOST_TAG, True)
    return tensor


def _on_device(t: torch.Tensor) -> bool:
    return not getattr(t, _HOST_TAG, False)


class _Mode(TorchFunctionMode):
    def __init__(self, detector: HostWaitDetector):
        super().__init__()
        self.detector = detector

    def __torch_function__(self, func: Callable, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = any(_on_device(t) for t in tensors)
        if on_device and _waits(name, args, tensors):
            self.detector.record(f"{name}()")
        elif _copies_up(name, args, kwargs, on_device):
            self.detector.record(f"{name}() to the device, blocking")
        out = func(*args, **kwargs)
        if name == "to" and out is args[0] and not on_device:
            out = out.view_as(out)  # on CPU .to(device) returns its input: a new view carries the device tag
        _place(name, args, kwargs, tensors, on_device, out)
        return out


def _copies_up(name: str, args: tuple, kwargs: dict, on_device: bool) -> bool:
    """A blocking copy of host values to the device: on CUDA it synchronises the stream (see
    runtime/stream.py's `staged`, which queues the copy instead)."""
    if name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
        return not (args and isinstance(args[0], torch.Tensor))
    if name in ("to", "cuda") and not on_device and not kwargs.get("non_blocking", False):
        target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        return name == "cuda" or target is not None
    return False


def _waits(name: str, args: tuple, tensors: list[torch.Tensor]) -> bool:
    """Whether this call on (some) device tensors makes the host wait for them."""
    if name in _VALUE_READS or name in _DATA_DEPENDENT or name == "cpu":
        return True
    if (
        name == "where"
        and len(args) == 1
        or name == "repeat_interleave"
        and any(isinstance(a, torch.Tensor) and _on_device(a) for a in args[1:2])
    ):
        return True  # nonzero in disguise; repeats from the device: the output size is a device value
    if name == "__getitem__" or name == "__setitem__":
        index = args[1] if len(args) > 1 else None
        masks = [t for t in tree_flatten(index)[0] if isinstance(t, torch.Tensor) and t.dtype == torch.bool]
        if any(_on_device(m) for m in masks):
            return True  # a boolean mask: its count must reach the host first
        if name == "__setitem__" and not _on_device(args[0]):
            return True  # a host tensor written from device values: a device-to-host copy
    if name in ("copy_", "index_put_", "masked_scatter_") and not _on_device(args[0]):
        return True
    return False


def _place(name: str, args: tuple, kwargs: dict, inputs: list[torch.Tensor], on_device: bool, out: Any) -> None:
    """Tag the call's new tensors host- or device-resident (see the module docstring)."""
    if name in ("cpu", "numpy", "tolist", "item"):
        host = True
    elif name == "cuda":
        host = False
    elif name == "to" or name in _FACTORIES or name.endswith("_like"):
        target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        if target is not None:
            host = False
        elif name == "to" or name.endswith("_like"):
            host = not on_device
        else:
            host = True
    else:
        host = not on_device
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and not any(t is i for i in inputs):
            try:
                setattr(t, _HOST_TAG, host)
            except (AttributeError, RuntimeError):  # a tensor subclass that refuses attributes
                pass


def _user_frame() -> str:
    for frame in reversed(traceback.extract_stack(limit=40)):
        if not any(s in frame.filename for s in _SKIP_FRAMES):
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}"
    return "<unknown>"
