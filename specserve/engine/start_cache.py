"""What a start keeps for the next one: where (`--weight-cache`), how much (`--weight-cache-max-gib`),
and the speculation cost model's prior as an earlier start timed it, kept beside the packed weights
(models/packed_cache.py).

Timing the prior (executor/warmup.py: a dozen synthetic steps) costs seconds per start on a large
model, and it depends only on the model file, the packing code, the engine's flags and the machine.
So a start that timed it writes it next to the packed weights (`--weight-cache`), and a later start
with the same key reads it instead; the adaptive policy's cost model goes on learning from the
steps it sees either way (speculative/cost_model.py). `--weight-cache off` times it at every start."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import os
from typing import Any, Callable, Optional

import torch

from specserve import envs
from specserve.args import DEFAULT_WEIGHT_CACHE_MAX_GIB, ServerArgs
from specserve.engine.memory import GIB
from specserve.executor import warmup
from specserve.executor.faulty_runner import ModelRunner
from specserve.executor.warmup import measure_cost_prior
from specserve.models.layers import TPContext
from specserve.models.packed_cache import PackedWeightCache, file_identity, kernel_machine, packing_fingerprint
from specserve.speculative import cost_model
from specserve.speculative.cost_model import FEATURES

logger = logging.getLogger(__name__)


def cache_directory(setting: str) -> Optional[str]:
    """The `--weight-cache` setting as a folder: 'off' -> None, 'auto' -> SPECSERVE_WEIGHT_CACHE_DIR
    where set (`off` there too), else `packed` under the specserve cache root
    (SPECSERVE_KERNEL_CACHE_DIR, else ~/.cache/specserve)."""
    if setting == "off":
        return None
    if setting != "auto":
        return setting
    if os.environ.get(envs.WEIGHT_CACHE_DIR):  # a folder, or `off` (the test suite's default)
        return None if os.environ[envs.WEIGHT_CACHE_DIR] == "off" else os.environ[envs.WEIGHT_CACHE_DIR]
    root = os.environ.get(envs.KERNEL_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "specserve")
    return os.path.join(root, "packed")


def _timing_fingerprint() -> str:
    """A digest of what a prior means: the warm-up that times it and the cost model's features."""
    digest = hashlib.sha256(json.dumps(list(FEATURES)).encode())
    for module in (warmup, cost_model):
        with open(str(module.__file__), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def _file_identity(path: Optional[str]) -> Optional[list[Any]]:
    return list(file_identity(path)) if path and os.path.exists(path) else None


class RecordedCostPrior:
    """One cost prior on disk, keyed by everything it was timed under."""

    def __init__(self, directory: str, model_path: str, args: ServerArgs, gamma: int):
        self.identity = {
            "model": _file_identity(model_path),
            "drafter": _file_identity(args.speculative_draft_model_path),
            "packing": packing_fingerprint(),
            "args": json.loads(json.dumps(dataclasses.asdict(args), default=str)),
            "gamma": gamma,
            "threads": torch.get_num_threads(),
            "machine": kernel_machine(),
            "timing": _timing_fingerprint(),  # the warm-up's steps and the model's features
        }
        key = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:16]
        self.path = os.path.join(directory, f"cost-prior-{os.path.basename(model_path)}-{key}.json")

    def load(self) -> Optional[list[float]]:
        """The recorded coefficients, or None where there is no matching, readable record."""
        try:
            with open(self.path) as f:
                record = json.load(f)
            if record["identity"] != self.identity:
                return None
            prior = [float(v) for v in record["prior"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        logger.info("speculation cost prior read from %s (timed %s)", self.path, record.get("timed_at", "?"))
        return prior

    def save(self, prior: list[float]) -> None:
        """Keep the coefficients for the next start (atomically; a disk error only logs)."""
        import datetime

        record = {"identity": self.identity, "prior": [float(v) for v in prior],
                  "timed_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}  # fmt: skip
        temporary = f"{self.path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(temporary, "w") as f:
                json.dump(record, f)
            os.replace(temporary, self.path)
        except OSError as exc:
            logger.warning("speculation cost prior not kept in %s: %s", self.path, exc)
            if os.path.exists(temporary):
                os.remove(temporary)


def weight_cache(
    args: ServerArgs, path: str, codes: Any, packs_codes: bool, tp: TPContext, dtype: torch.dtype
) -> Optional[PackedWeightCache]:
    """Where this rank's packed weights are kept between starts: a GGUF's codes packed for the CPU
    kernels, unless `--weight-cache off`."""
    directory = cache_directory(args.weight_cache)
    if directory is None or not codes or not packs_codes or not path.endswith(".gguf"):
        return None
    return PackedWeightCache(directory, path, tp.rank, tp.size, dtype, weight_cache_max_bytes(args))


def weight_cache_max_bytes(args: ServerArgs) -> int:
    """The cap on the cache folder's packed weights: `--weight-cache-max-gib`, else
    SPECSERVE_WEIGHT_CACHE_MAX_GIB, else the default (args.py says why that size)."""
    gib = args.weight_cache_max_gib
    if gib is None:
        gib = envs.env_optional_float(envs.WEIGHT_CACHE_MAX_GIB)
    return int((DEFAULT_WEIGHT_CACHE_MAX_GIB if gib is None else gib) * GIB)


def weight_cache_report(args: ServerArgs, cache: Optional[PackedWeightCache]) -> dict[str, Any]:
    """What the start-up block says of this rank's packed-weight cache (server/startup.py): its
    state (off, mapped, writing, not kept), entry path, bytes, the cap, and why it keeps none."""
    if cache_directory(args.weight_cache) is None:
        switch = "--weight-cache off" if args.weight_cache == "off" else f"{envs.WEIGHT_CACHE_DIR}=off"
        return {"state": "off", "reason": switch}
    if cache is None or cache.outcome is None:  # weight_cache() above made none for this model
        why = "only a GGUF's quantized weights packed for the CPU kernels are kept"
        return {"state": "not kept", "reason": why}
    outcome = cache.outcome
    return {
        "state": outcome.state,
        "path": cache.path,
        "bytes": outcome.nbytes,
        "max_bytes": cache.max_bytes,
        "reason": outcome.reason,
    }


def cost_prior(args: ServerArgs, model_path: str, timing_runner: Callable[[], ModelRunner], gamma: int) -> list[float]:
    """The cost model's prior: recorded by an earlier start with the same key, else timed on
    `timing_runner()` now (and recorded, unless `--weight-cache off`). Under TP every rank times
    it: ranks deciding apart (one reads a record, another times steps with collectives) would hang.
    A first start's packed-weight save is not running yet: the builder starts it after this, so its
    disk writes never share the timing."""
    directory = cache_directory(args.weight_cache) if args.tp_size == 1 else None
    record = RecordedCostPrior(directory, model_path, args, gamma) if directory else None
    prior = record.load() if record is not None else None
    if prior is None:
        prior = _timed_prior(timing_runner, gamma)
        if record is not None:
            record.save(prior)
    return prior


def _timed_prior(timing_runner: Callable[[], ModelRunner], gamma: int) -> list[float]:
    runner = timing_runner()
    try:
        return measure_cost_prior(runner, gamma)
    finally:
        runner.discard_captured()
        del runner
        gc.collect()  # a captured step refers to itself (its graph's body): its memory goes now
