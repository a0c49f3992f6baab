"""The engine's own model of what a step costs, learned online from its steps.

A step's time is modelled as linear in its shape: a fixed part, a part per running request, a part
per verified draft row, a fixed part when a drafter that runs a model (Cost.MODEL in
drafters/declaration.py: DSPARK, STANDALONE) runs at all, a part per row it drafts, a part per
request a lookup drafter (Cost.LOOKUP: NGRAM, SUFFIX) drafts for and a fixed part for verifying
drafts at all (the step runs the verify path instead of a plain decode step). Linear is not exact
(on a CPU a verify row is nearly free while the weights stream from memory and costs a full row once
compute-bound), so the fit is local: it forgets old steps geometrically and follows the shapes the
engine actually runs.

The fit is least squares anchored to the prior: the prior counts as `prior_steps` steps of
nominal shape that are never forgotten. The engine's own steps rarely separate every feature
(with one-draft NGRAM windows, verified rows and lookup requests rise together), and plain
forgetting would let such directions drift anywhere; anchored, they stay at the prior until the
engine's steps say otherwise. `freeze()` stops learning, so tests, loop modes and ranks given
the same table make the same decisions.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from specserve import drafters as registry
from specserve.errors import ConfigError, InternalError

FEATURES = ("fixed", "requests", "verify_rows", "model_draft_step", "model_draft_rows", "lookup_requests", "verify_step")
# The features' names before issue 71 (they said DSpark and NGRAM, and counted every model and lookup
# drafter): cost tables recorded with them still load (read_coefficients), mapped here and only here.
OLD_FEATURE_NAMES = {
    "dspark_step": "model_draft_step",
    "dspark_rows": "model_draft_rows",
    "ngram_requests": "lookup_requests",
}
# A typical size of each feature: the prior's weight per feature is prior_steps * NOMINAL^2.
NOMINAL = (1.0, 4.0, 4.0, 1.0, 5.0, 2.0, 1.0)


@dataclass(frozen=True)
class StepShape:
    """What one step does."""

    requests: int  # running requests (one target row each)
    verify_rows: int = 0  # draft rows verified on top of one row per request
    model_draft_requests: int = 0  # requests a drafter that runs a model (Cost.MODEL) drafts for
    model_draft_rows: int = 0  # rows such drafters draft (a drafting request's k; DSpark's block is g rows)
    lookup_requests: int = 0  # requests whose drafts come from a lookup drafter (Cost.LOOKUP)

    @classmethod
    def of(cls, drafters: Sequence[Optional[str]], drafts: Sequence[int]) -> "StepShape":
        """The shape of a step whose request i drafts drafts[i] with drafters[i] (None: none), each
        drafter priced as its declaration says (specserve/drafters/)."""
        models, lookups = registry.MODELS, registry.LOOKUPS
        return cls(
            len(drafters),
            sum(drafts),
            sum(d in models for d in drafters),
            sum(k for d, k in zip(drafters, drafts) if d in models),
            sum(d in lookups for d in drafters),
        )

    def features(self) -> tuple[float, ...]:
        return (
            1.0,
            float(self.requests),
            float(self.verify_rows),
            float(self.model_draft_requests > 0),
            float(self.model_draft_rows),
            float(self.lookup_requests),
            float(self.verify_rows > 0),
        )


class StepCostModel:
    """Step seconds = theta . features(shape), fit by exponentially weighted least squares
    anchored to the prior (information form: a 7x7 solve).

    `prior` gives theta before any step (from a warm-up or an SPS table); `prior_steps` says how
    many steps of nominal shape it is worth. Predictions never go below `floor_s`. The fit is
    refreshed every `refit_every` steps, from the steps since in one batched update (the same sums
    as one update a step): a step then costs an append, where an update and a solve each step took
    about 2% of a 135M model's decode step (every small op runs on caches the weights just swept)."""

    def __init__(
        self,
        prior: Sequence[float],
        prior_steps: float = 20.0,
        forgetting: float = 0.995,
        floor_s: float = 1e-5,
        refit_every: int = 8,
    ):
        if len(prior) != len(FEATURES):
            raise InternalError(f"cost model: the prior needs {len(FEATURES)} coefficients {FEATURES}, got {len(prior)}")
        if not 0.5 < forgetting <= 1.0:
            raise InternalError(f"cost model: forgetting must be in (0.5, 1], got {forgetting}")
        self.prior = np.array(prior, dtype=np.float64)
        self._coef = self.prior.tolist()  # theta as plain floats: predict() runs many times per step
        self.anchor = np.diag(np.array(NOMINAL, dtype=np.float64) ** 2) * max(prior_steps, 1e-6)
        self._anchored_prior = self.anchor @ self.prior
        self.info = np.zeros((len(FEATURES), len(FEATURES)))  # sum of decayed x x^T
        self.moment = np.zeros(len(FEATURES))  # sum of decayed seconds * x
        self.forgetting = forgetting
        self.refit_every = max(1, refit_every)
        self._pending: list[tuple[tuple[float, ...], float]] = []  # (features, seconds) since the last fit
        self.floor_s = floor_s
        self.frozen = False
        self.version = 0  # bumped by every refit: a plan computed at one version holds until the next
        self.steps = 0
        self._abs_rel_residual = 0.0  # running mean of |observed - predicted| / observed

    def predict(self, shape: StepShape) -> float:
        return self.predict_totals(
            shape.requests, shape.verify_rows, shape.model_draft_requests, shape.model_draft_rows, shape.lookup_requests
        )

    def predict_totals(
        self, requests: int, verify_rows: float, model_draft_requests: float, model_draft_rows: float, lookup_requests: float
    ) -> float:
        """predict() without building a StepShape: the policy's search calls this thousands of times."""
        c = self._coef
        t = (
            c[0]
            + c[1] * requests
            + c[2] * verify_rows
            + c[3] * (model_draft_requests > 0)
            + c[4] * model_draft_rows
            + c[5] * lookup_requests
            + c[6] * (verify_rows > 0)
        )
        return max(t, self.floor_s)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Learn from one measured step (ignored when frozen or not a finite positive time)."""
        if not (math.isfinite(seconds) and seconds > 0):
            return
        predicted = self.predict(shape)
        self.steps += 1
        self._abs_rel_residual += (abs(seconds - predicted) / seconds - self._abs_rel_residual) / min(self.steps, 100)
        if self.frozen:
            return
        self._pending.append((shape.features(), seconds))
        if len(self._pending) >= self.refit_every:
            self._refit()

    def _refit(self) -> None:
        """Fold the pending steps into the decayed sums (the k-th of n weighs forgetting^(n-1-k)) and solve."""
        if not self._pending:
            return
        x = np.array([f for f, _ in self._pending])
        seconds = np.array([t for _, t in self._pending])
        n, self._pending = len(self._pending), []
        weights = self.forgetting ** np.arange(n - 1, -1, -1, dtype=np.float64)
        decay = self.forgetting**n
        self.info = decay * self.info + (x * weights[:, None]).T @ x
        self.moment = decay * self.moment + x.T @ (weights * seconds)
        self._coef = np.linalg.solve(self.info + self.anchor, self.moment + self._anchored_prior).tolist()
        self.version += 1

    @property
    def theta(self) -> torch.Tensor:
        """The coefficients, in FEATURES order."""
        return torch.tensor(self._coef, dtype=torch.float64)

    def freeze(self) -> None:
        """Stop learning: every later prediction depends only on the table as it is now (with
        every step observed so far in it)."""
        self._refit()
        self.frozen = True

    @property
    def mean_abs_relative_residual(self) -> float:
        """Mean |observed - predicted| / observed over recent steps (up to the last ~100)."""
        return self._abs_rel_residual

    def coefficients(self) -> dict[str, float]:
        return dict(zip(FEATURES, self._coef))

    def save(self, path: str) -> None:
        """The coefficients as JSON: a cost table for --speculative-cost-table-path."""
        self._refit()
        with open(path, "w") as f:
            json.dump({"coefficients_s": self.coefficients(), "steps": self.steps}, f, indent=2)

    @classmethod
    def load(cls, path: str, **kwargs) -> "StepCostModel":
        try:
            with open(path) as f:
                raw = json.load(f)["coefficients_s"]
            return cls(read_coefficients(raw), **kwargs)
        except (OSError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(
                f"speculative_cost_table_path: cannot read a cost table from {path!r} (a JSON object "
                f"with 'coefficients_s' for {list(FEATURES)}): {exc}"
            ) from exc

    @classmethod
    def from_sps(
        cls, tokens: Sequence[int], steps_per_second: Sequence[float], drafting: Optional[dict[str, float]] = None, **kwargs
    ) -> "StepCostModel":
        """A prior from a verify SPS table (rows -> steps/s): the line through its first and last
        points for the target; drafting coefficients from `drafting` (default 0)."""
        t0, t1 = 1.0 / steps_per_second[0], 1.0 / steps_per_second[-1]
        per_row = (t1 - t0) / max(tokens[-1] - tokens[0], 1)
        fixed = t0 - per_row * tokens[0]
        extra = drafting or {}
        prior = [fixed, per_row, per_row] + [extra.get(name, 0.0) for name in FEATURES[3:]]
        return cls(prior, **kwargs)


def read_coefficients(recorded: dict[str, float]) -> list[float]:
    """A recorded table's coefficients in FEATURES order, its features named now or as before
    issue 71 (OLD_FEATURE_NAMES); a KeyError where one is missing, a ValueError where one is
    named both ways."""
    named: dict[str, float] = {}
    for name, value in recorded.items():
        new = OLD_FEATURE_NAMES.get(name, name)
        if new in named:
            raise ValueError(f"feature {new!r} given twice (as {name!r} and under its other name)")
        named[new] = float(value)
    return [named[name] for name in FEATURES]
