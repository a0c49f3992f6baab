"""SamplingParams: per-request decoding settings; a bad field raises InvalidRequestError naming it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

from specserve.errors import InvalidRequestError

DEFAULT_MAX_NEW_TOKENS = 128


@dataclass
class SamplingParams:
    """How one request decodes. temperature 0 means greedy."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: Optional[int] = None
    skip_special_tokens: bool = True

    @classmethod
    def from_dict(cls, params: Optional[dict[str, Any]]) -> "SamplingParams":
        params = dict(params or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise InvalidRequestError(f"sampling_params: unknown key(s) {unknown}; allowed: {sorted(known)}",
                                      param="sampling_params")
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]
        sp = cls(**params)
        sp.validate()
        return sp

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: Optional[int] = None) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, ">= 0", lambda v: v >= 0)
        _check_num("temperature", self.temperature, ">= 0", lambda v: v >= 0)
        _check_num("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1)
        _check_int("top_k", self.top_k, "-1 (off) or >= 1", lambda v: v == -1 or v >= 1)
        _check_num("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1)
        if self.seed is not None:
            _check_int("seed", self.seed, ">= 0", lambda v: v >= 0)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError("sampling_params.stop: must be a non-empty string or a list of non-empty strings",
                                      param="sampling_params.stop")
        if not isinstance(self.stop_token_ids, list) or not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError("sampling_params.stop_token_ids: must be a list of non-negative integers",
                                      param="sampling_params.stop_token_ids")
        if vocab_size is not None and any(t >= vocab_size for t in self.stop_token_ids):
            raise InvalidRequestError(f"sampling_params.stop_token_ids: ids must be < vocab size {vocab_size}",
                                      param="sampling_params.stop_token_ids")


def _check_int(name: str, value: Any, allowed: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
        raise InvalidRequestError(f"sampling_params.{name}: must be an integer {allowed}, got {value!r}",
                                  param=f"sampling_params.{name}")


def _check_num(name: str, value: Any, allowed: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise InvalidRequestError(f"sampling_params.{name}: must be a number {allowed}, got {value!r}",
                                  param=f"sampling_params.{name}")
