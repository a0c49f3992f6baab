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
MAX_PENALTY = 2.0  # presence and frequency penalties, OpenAI's range [-2, 2]
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0  # OpenAI's range [-100, 100]
MAX_TOP_LOGPROBS = 20
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "lark")
MAX_GRAMMAR_CHARS = 64 * 1024  # a schema or grammar larger than this is refused


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
    # On the target's logits, in every row (decode, prefill, each verify row); see specserve/logits/.
    presence_penalty: float = 0.0  # minus this for every token already in the output
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # a token of the prompt or output: logit / r if positive, else * r
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: bool = False  # return each output token's logprob
    top_logprobs: int = 0  # and the N most likely tokens' at each position (needs logprobs)
    prompt_logprobs: bool = False  # also each prompt token's (after the first): the prompt is computed, not cached
    # Structured output: at most one grammar the output must match (see specserve/logits/grammar.py).
    json_schema: Optional[str] = None  # a JSON schema, as JSON text
    regex: Optional[str] = None
    ebnf: Optional[str] = None  # GBNF (llama.cpp's grammar format)
    lark: Optional[str] = None  # llguidance's Lark dialect (may embed JSON schemas: `%json {...}`)

    def __post_init__(self) -> None:
        # JSON keys are strings: {"50256": -100} is token 50256 (validate rejects what is not an id)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}

    @classmethod
    def from_dict(cls, params: Optional[dict[str, Any]], vocab_size: Optional[int] = None) -> "SamplingParams":
        """Parse and validate a request's params (with vocab_size, its token ids and top_k too): done
        once, where a request comes in; what goes on to the engine and its ranks is the result."""
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise InvalidRequestError(
                f"sampling_params: must be an object, got {type(params).__name__}", param="sampling_params"
            )
        params = dict(params)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise InvalidRequestError(
                f"sampling_params: unknown key(s) {unknown}; allowed: {sorted(known)}", param="sampling_params"
            )
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]
        for name in ("stop", "stop_token_ids"):
            if params.get(name) is None and name in params:  # JSON null: the default
                del params[name]
        sp = cls(**params)
        sp.validate(vocab_size)
        return sp

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def seeded_sampling(self) -> bool:
        """Samples with a seed it gave: promised the same tokens whatever the batch, the cache and
        the speculation (verify windows use the coupled accept, speculative/accept.py)."""
        return self.seed is not None and not self.is_greedy

    @property
    def penalises(self) -> bool:
        """Penalties or a logit bias change its target logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias)

    @property
    def constrained(self) -> bool:
        """A grammar masks its target logits."""
        return any(getattr(self, name) is not None for name in GRAMMAR_FIELDS)

    @property
    def shapes_logits(self) -> bool:
        """Its target logits are changed before sampling and accept (penalties, bias or a grammar)."""
        return self.penalises or self.constrained

    def validate(self, vocab_size: Optional[int] = None) -> None:
        """Raise InvalidRequestError naming the first bad field; with vocab_size, token ids and top_k too."""
        top_k_max = vocab_size if vocab_size is not None else MAX_NEW_TOKENS_LIMIT
        _check_int(
            "max_new_tokens",
            self.max_new_tokens,
            f"in [0, {MAX_NEW_TOKENS_LIMIT}]",
            lambda v: 0 <= v <= MAX_NEW_TOKENS_LIMIT,
        )
        _check_num("temperature", self.temperature, f"in [0, {MAX_TEMPERATURE:g}]", lambda v: 0 <= v <= MAX_TEMPERATURE)
        _check_num("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1)
        _check_int("top_k", self.top_k, f"-1 (off) or in [1, {top_k_max}]", lambda v: v == -1 or 1 <= v <= top_k_max)
        _check_num("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1)
        if self.seed is not None:
            _check_int("seed", self.seed, "in [0, 2^64)", lambda v: 0 <= v < SEED_LIMIT)
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        self._validate_stops(vocab_size)
        self._validate_logits(vocab_size)

    def _validate_logits(self, vocab_size: Optional[int]) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            _check_num(
                name,
                getattr(self, name),
                f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
                lambda v: -MAX_PENALTY <= v <= MAX_PENALTY,
            )
        _check_num(
            "repetition_penalty",
            self.repetition_penalty,
            f"in (0, {MAX_REPETITION_PENALTY:g}]",
            lambda v: 0 < v <= MAX_REPETITION_PENALTY,
        )
        _check_bool("logprobs", self.logprobs)
        _check_bool("prompt_logprobs", self.prompt_logprobs)
        _check_int("top_logprobs", self.top_logprobs, f"in [0, {MAX_TOP_LOGPROBS}]", lambda v: 0 <= v <= MAX_TOP_LOGPROBS)
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("sampling_params.top_logprobs: needs logprobs", param="sampling_params.top_logprobs")
        bias, id_limit = self.logit_bias, vocab_size if vocab_size is not None else SEED_LIMIT
        ok = (
            isinstance(bias, dict)
            and len(bias) <= MAX_LOGIT_BIAS_ENTRIES
            and all(_is_int(k) and 0 <= k < id_limit for k in bias)
            and all(
                isinstance(v, (int, float))
                and not isinstance(v, bool)
                and math.isfinite(v)
                and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS
                for v in bias.values()
            )
        )
        for name in GRAMMAR_FIELDS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or len(value) > MAX_GRAMMAR_CHARS):
                raise InvalidRequestError(
                    f"sampling_params.{name}: must be a non-empty string of at most {MAX_GRAMMAR_CHARS} characters",
                    param=f"sampling_params.{name}",
                )
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise InvalidRequestError(
                f"sampling_params.{given[1]}: give at most one of {', '.join(GRAMMAR_FIELDS)}",
                param=f"sampling_params.{given[1]}",
            )
        if not ok:
            bound = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise InvalidRequestError(
                f"sampling_params.logit_bias: must map at most {MAX_LOGIT_BIAS_ENTRIES} token "
                f"ids (integers {bound}) to numbers in [-{MAX_LOGIT_BIAS:g}, "
                f"{MAX_LOGIT_BIAS:g}]",
                param="sampling_params.logit_bias",
            )

    def _validate_stops(self, vocab_size: Optional[int]) -> None:
        if (
            not isinstance(self.stop, list)
            or len(self.stop) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop)
        ):
            raise InvalidRequestError(
                f"sampling_params.stop: must be a string or a list of at most {MAX_STOP_STRINGS} "
                f"strings of 1 to {MAX_STOP_STRING_CHARS} characters",
                param="sampling_params.stop",
            )
        ids = self.stop_token_ids
        id_limit = vocab_size if vocab_size is not None else SEED_LIMIT
        if (
            not isinstance(ids, list)
            or len(ids) > MAX_STOP_TOKEN_IDS
            or not all(_is_int(t) and 0 <= t < id_limit for t in ids)
        ):
            bound = f"[0, {vocab_size})" if vocab_size is not None else "non-negative"
            raise InvalidRequestError(
                f"sampling_params.stop_token_ids: must be a list of at most {MAX_STOP_TOKEN_IDS} "
                f"token ids, integers in {bound}",
                param="sampling_params.stop_token_ids",
            )


def _token_key(key: Any) -> Any:
    digits = key.strip().lstrip("-") if isinstance(key, str) else ""
    if digits.isascii() and digits.isdigit() and len(key) <= 20:  # "²" is a digit to isdigit(), not to int()
        return int(key)
    return key


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, allowed: str, ok) -> None:
    if not _is_int(value) or not ok(value):
        raise InvalidRequestError(
            f"sampling_params.{name}: must be an integer {allowed}, got {_show(value)}", param=f"sampling_params.{name}"
        )


def _check_num(name: str, value: Any, allowed: str, ok) -> None:
    finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not finite or not ok(value):
        raise InvalidRequestError(
            f"sampling_params.{name}: must be a number {allowed}, got {_show(value)}", param=f"sampling_params.{name}"
        )


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidRequestError(
            f"sampling_params.{name}: must be true or false, got {_show(value)}", param=f"sampling_params.{name}"
        )


def _show(value: Any) -> str:
    """The offending value for a message, cut short: a hostile value must not make a huge error body."""
    text = repr(value)
    return text if len(text) <= 64 else text[:60] + "..."
