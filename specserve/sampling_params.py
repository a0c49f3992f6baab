"""SamplingParams: per-request decoding settings; a bad field raises InvalidRequestError naming it.

Every field is checked for its type and range before a request reaches the engine's step:
a value that would overflow a tensor (top_k 2^63), poison a softmax (temperature 1e-300, NaN)
or make the per-token host work unbounded (thousands of stop strings) is a 400, not a crash.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from specserve.errors import InvalidRequestError

DEFAULT_MAX_NEW_TOKENS = 128
MAX_NEW_TOKENS_LIMIT = 2**31 - 1  # the engine caps it at the context window anyway
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_TEMPERATURE = 100.0
GREEDY_TEMPERATURE = 1e-5  # below this, logits / temperature overflows float32: treated as greedy
SEED_LIMIT = 2**64  # seeds are 64-bit (the sampler hashes them as such)


@dataclass
class SamplingParams:
    """How one request decodes. temperature 0 (or below GREEDY_TEMPERATURE) means greedy."""

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
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise InvalidRequestError(f"sampling_params: must be an object, got {type(params).__name__}",
                                      param="sampling_params")
        params = dict(params)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise InvalidRequestError(f"sampling_params: unknown key(s) {unknown}; allowed: {sorted(known)}",
                                      param="sampling_params")
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]
        for name in ("stop", "stop_token_ids"):
            if params.get(name) is None and name in params:  # JSON null: the default
                del params[name]
        sp = cls(**params)
        sp.validate()
        return sp

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate(self, vocab_size: Optional[int] = None) -> None:
        """Raise InvalidRequestError naming the first bad field; with vocab_size, token ids and top_k too."""
        top_k_max = vocab_size if vocab_size is not None else MAX_NEW_TOKENS_LIMIT
        _check_int("max_new_tokens", self.max_new_tokens, f"in [0, {MAX_NEW_TOKENS_LIMIT}]",
                   lambda v: 0 <= v <= MAX_NEW_TOKENS_LIMIT)
        _check_num("temperature", self.temperature, f"in [0, {MAX_TEMPERATURE:g}]",
                   lambda v: 0 <= v <= MAX_TEMPERATURE)
        _check_num("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1)
        _check_int("top_k", self.top_k, f"-1 (off) or in [1, {top_k_max}]", lambda v: v == -1 or 1 <= v <= top_k_max)
        _check_num("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1)
        if self.seed is not None:
            _check_int("seed", self.seed, "in [0, 2^64)", lambda v: 0 <= v < SEED_LIMIT)
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        self._validate_stops(vocab_size)

    def _validate_stops(self, vocab_size: Optional[int]) -> None:
        if (not isinstance(self.stop, list) or len(self.stop) > MAX_STOP_STRINGS
                or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop)):
            raise InvalidRequestError(f"sampling_params.stop: must be a string or a list of at most {MAX_STOP_STRINGS} "
                                      f"strings of 1 to {MAX_STOP_STRING_CHARS} characters",
                                      param="sampling_params.stop")
        ids = self.stop_token_ids
        id_limit = vocab_size if vocab_size is not None else SEED_LIMIT
        if (not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS
                or not all(_is_int(t) and 0 <= t < id_limit for t in ids)):
            bound = f"[0, {vocab_size})" if vocab_size is not None else "non-negative"
            raise InvalidRequestError(f"sampling_params.stop_token_ids: must be a list of at most {MAX_STOP_TOKEN_IDS} "
                                      f"token ids, integers in {bound}", param="sampling_params.stop_token_ids")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, allowed: str, ok) -> None:
    if not _is_int(value) or not ok(value):
        raise InvalidRequestError(f"sampling_params.{name}: must be an integer {allowed}, got {_show(value)}",
                                  param=f"sampling_params.{name}")


def _check_num(name: str, value: Any, allowed: str, ok) -> None:
    finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not finite or not ok(value):
        raise InvalidRequestError(f"sampling_params.{name}: must be a number {allowed}, got {_show(value)}",
                                  param=f"sampling_params.{name}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"sampling_params.{name}: must be true or false, got {_show(value)}",
                                  param=f"sampling_params.{name}")


def _show(value: Any) -> str:
    """The offending value for a message, cut short: a hostile value must not make a huge error body."""
    text = repr(value)
    return text if len(text) <= 64 else text[:60] + "..."
