"""The speculation cost model's prior as an earlier start timed it, kept beside the packed weights.

Timing the prior (executor/warmup.py: a dozen synthetic steps) costs seconds per start on a large
model, and it depends only on the model file, the packing code, the engine's flags and the machine.
So a start that timed it writes it next to the packed weights (`--weight-cache`), and a later start
with the same key reads it instead; the adaptive policy's cost model goes on learning from the
steps it sees either way (speculative/cost_model.py). `--weight-cache off` times it at every start."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any, Optional

import torch

from specserve.args import ServerArgs
from specserve.kernels.dispatch import machine_description, path_name
from specserve.models.packed_cache import packing_fingerprint

logger = logging.getLogger(__name__)


def _file_identity(path: Optional[str]) -> Optional[list[Any]]:
    if not path or not os.path.exists(path):
        return None
    real = os.path.realpath(path)
    st = os.stat(real)
    return [real, st.st_size, st.st_mtime_ns]


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
            "machine": machine_description(),
            "kernel_path": path_name(),
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
