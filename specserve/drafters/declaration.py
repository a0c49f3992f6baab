"""What the engine knows of a drafter, declared in one place: its name, what it needs from a step,
how the cost model prices it, what the adaptive policy believes before any evidence, its own
flags' checks, and where its worker is made.

A declaration imports nothing heavy (no torch), so the command line checks a drafter's flags before
any model loads; its worker is named by a "module:function" path and imported only by an engine
that uses the drafter (engine/builder.py), which calls it with the rank's `DraftContext`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Optional


class Cost(str, Enum):
    """How a drafter's drafting shows in a step's time (speculative/cost_model.py): MODEL, a model of
    its own, a fixed part when it runs at all and a part per drafted row; LOOKUP, a host lookup,
    a part per request it drafts for (and no model: any target's default drafter)."""

    MODEL = "model"
    LOOKUP = "lookup"


class DraftModel(str, Enum):
    """What --speculative-draft-model-path holds for a drafter that runs a model: CHECKPOINT, a
    drafter directory loaded onto the target (it reads the target's hidden states, embeddings and
    head; models/dspark_checkpoint.py); MODEL_FILE, a model of its own (GGUF or a Hugging Face folder)."""

    CHECKPOINT = "checkpoint"
    MODEL_FILE = "model_file"


class Hints(str, Enum):
    """What the adaptive policy learns of a request before the step, from the drafter's worker
    (`worker.hints(requests, greedy)`: per request (rate bucket, most useful drafts)): NONE (one engine-wide
    rate), EVERY_STEP (cheap: asked each planned step) or ON_DEMAND (a lookup per request, asked only
    where the plan may depend on it)."""

    NONE = "none"
    EVERY_STEP = "every_step"
    ON_DEMAND = "on_demand"


@dataclass(frozen=True)
class Drafter:
    """One drafting algorithm, as every part of the engine reads it."""

    name: str  # the --speculative-algorithm value, the metrics label
    summary: str  # one line for errors and docs
    worker: str  # "module:function": function(ctx: DraftContext) -> the DraftWorker
    cost: Cost
    # Conditional acceptance per position before any evidence, one per rate bucket of its hints
    # (one bucket without hints).
    priors: tuple[float, ...]
    hints: Hints = Hints.NONE
    caps_drafts: bool = False  # its hint's second value bounds the drafts worth verifying
    # What --speculative-draft-model-path must name for it, in words and as a kind (None: no model).
    draft_model: Optional[str] = None
    draft_model_kind: Optional[DraftModel] = None
    # Its K/V sits at the target's token slots and is kept with the target's pages by the prefix
    # cache (and its file tier, whose pages then depend on the drafter too).
    kv_in_prefix_cache: bool = False
    needs_token_table: bool = False  # drafts from the request tokens on the device (speculative/committed.py)
    # The warm-up's measure of a model drafter: True, all drafts in one pass (a part per drafted row
    # from batch 1 against a batch); False, a pass per draft (from 1 draft against gamma).
    drafts_in_one_pass: bool = True
    check: Optional[Callable[[Any], None]] = None  # its own flags' checks on ServerArgs (a ConfigError each)

    def __post_init__(self) -> None:
        if not self.priors or (self.hints is Hints.NONE and len(self.priors) != 1):
            raise ValueError(f"drafter {self.name}: one prior per hint bucket (one without hints), got {self.priors}")
        names_model, has_kind = self.draft_model is not None, self.draft_model_kind is not None
        if names_model != has_kind or self.runs_a_model != names_model:
            raise ValueError(f"drafter {self.name}: a model drafter names its draft model and its kind, others neither")

    @classmethod
    def lookup(cls, name: str, summary: str, worker: str, priors: tuple[float, ...], hints: Hints, **more: Any) -> "Drafter":
        """A model-free drafter that looks its drafts up in the request tokens on the device (the
        table CommitPath writes), its rates kept per bucket of its hints."""
        return cls(name, summary, worker, Cost.LOOKUP, priors, hints, needs_token_table=True, **more)

    @property
    def runs_a_model(self) -> bool:
        return self.cost is Cost.MODEL

    def make_worker(self, ctx: Any) -> Any:
        """The drafter's worker for one engine rank (imports its module now)."""
        module, _, function = self.worker.partition(":")
        return getattr(importlib.import_module(module), function)(ctx)
