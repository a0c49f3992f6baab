"""SamplingParams: per-request decoding settings, each field declared once; a bad field raises
InvalidRequestError naming it.

Every field is checked for its type and range before a request reaches the engine's step:
a value that would overflow a tensor (top_k 2^63), poison a softmax (temperature 1e-300, NaN)
or make the per-token host work unbounded (thousands of stop strings) is a 400, not a crash.

The declaration (`sampling(...)` on each dataclass field: its kind, bounds, help line, OpenAI name,
whether `specserve generate` has a flag for it) is the one place a field is described: `validate`
checks each field from it, and the server's request models (server/sampling_models.py), its error
names (server/routes.py) and the `generate` flags (cli.py) are generated from `SAMPLING_FIELDS`.
What spans fields (top_logprobs needs logprobs, at most one grammar) is checked explicitly below.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

from specserve.errors import InvalidRequestError

DEFAULT_MAX_NEW_TOKENS = 128
MAX_NEW_TOKENS_LIMIT = 2**31 - 1  # the engine caps it at the context window anyway
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_TEMPERATURE = 100.0
OPENAI_MAX_TEMPERATURE = 2  # OpenAI's range [0, 2]
GREEDY_TEMPERATURE = 1e-5  # below this, logits / temperature overflows float32: treated as greedy
SEED_LIMIT = 2**64  # seeds are 64-bit (the sampler hashes them as such)
OPENAI_SEED_LIMIT = 2**63  # OpenAI's seeds are signed 64-bit
MAX_PENALTY = 2.0  # presence and frequency penalties, OpenAI's range [-2, 2]
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0  # OpenAI's range [-100, 100]
MAX_TOP_LOGPROBS = 20
MAX_GRAMMAR_CHARS = 64 * 1024  # a schema or grammar larger than this is refused

# The kinds of field: what a value must be (checked below; the server maps each to a pydantic type).
Kind = Literal["integer", "number", "boolean", "text", "grammar", "stop", "token_ids", "token_bias"]
INTEGER: Kind = "integer"  # within [low, high] (or the `off` value); with `vocab`, high is the vocabulary size
NUMBER: Kind = "number"  # finite, within [low, high] (open ends as declared)
BOOLEAN: Kind = "boolean"
TEXT: Kind = "text"  # a non-empty string of at most max_chars characters
GRAMMAR: Kind = "grammar"  # text the output must match; a request gives at most one (GRAMMAR_FIELDS)
STOP: Kind = "stop"  # a string or a list of at most max_items strings of 1 to max_chars characters
TOKEN_IDS: Kind = "token_ids"  # a list of at most max_items token ids, [0, vocabulary size)
TOKEN_BIAS: Kind = "token_bias"  # token id -> a number in [low, high], at most max_items entries
NULL_IS_DEFAULT: frozenset[str] = frozenset({STOP, TOKEN_IDS})  # JSON null given: the field's default


@dataclass(frozen=True)
class SamplingField:
    """One sampling field's declaration: what the engine accepts, and how each surface names it.

    `name` and `default` are the dataclass field's (filled in by `declared`). OpenAI's chat and
    completions take a field of `openai_shared` under its `openai` name, default None (the
    engine's default), with `openai_high` as its upper bound where OpenAI's range is narrower; a
    field with an `openai` name but not shared is taken by each endpoint its own way (max_tokens,
    logprobs) and the name is what its errors say. `native`: /generate's sampling_params take it
    (`route_default`: null there too, the route filling in its default)."""

    kind: Kind
    help: str
    low: Optional[float] = None
    high: Optional[float] = None
    open_low: bool = False  # (low, ...: low itself is refused
    open_high: bool = False  # ..., high): high itself is refused
    off: Optional[int] = None  # a value below low that turns the field off (top_k -1)
    vocab: bool = False  # with the vocabulary known, high is its size (top_k)
    high_text: Optional[str] = None  # the upper bound as errors write it ("2^64")
    max_items: int = 0  # stop, token_ids, token_bias
    max_chars: int = 0  # stop (each string), text and grammar
    openai: Optional[str] = None
    openai_shared: bool = True
    openai_high: Optional[float] = None
    native: bool = True
    route_default: bool = False
    flag: bool = False  # `specserve generate --name`
    flag_default: Any = None  # the flag's default where it is not the field's (generate is greedy)
    name: str = ""
    default: Any = None

    def upper(self, vocab_size: Optional[int] = None) -> Optional[float]:
        return vocab_size if self.vocab and vocab_size is not None else self.high

    def holds(self, value: float, vocab_size: Optional[int] = None) -> bool:
        """Within the declared range (or the off value)."""
        if value == self.off:
            return True
        high = self.upper(vocab_size)
        low_ok = self.low is None or (value > self.low if self.open_low else value >= self.low)
        return low_ok and (high is None or (value < high if self.open_high else value <= high))

    def allowed(self, vocab_size: Optional[int] = None) -> str:
        """The range as errors write it: "in (0, 1]", "-1 (off) or in [1, 151936]", ">= 0"."""
        high = self.upper(vocab_size)
        high_text = self.high_text if self.high_text and high == self.high else _bound(high)
        if self.low is not None and high is not None:
            text = f"in {'(' if self.open_low else '['}{_bound(self.low)}, {high_text}{')' if self.open_high else ']'}"
        elif self.low is not None:
            text = f"{'>' if self.open_low else '>='} {_bound(self.low)}"
        else:
            text = "" if high is None else f"{'<' if self.open_high else '<='} {high_text}"
        return text if self.off is None else f"{self.off} (off) or {text}"

    @property
    def nullable(self) -> bool:
        return self.default is None


def sampling(default: Any, kind: Kind, help: str, **spec: Any) -> Any:
    """A SamplingParams field with its declaration (see SamplingField); a list or dict default is copied
    for each object. The field's name is SGLang's (the Engine's and /generate's)."""
    declaration = SamplingField(kind, help, **spec)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"sampling": declaration})
    return dataclasses.field(default=default, metadata={"sampling": declaration})


def declared(cls: type) -> tuple[SamplingField, ...]:
    """The declarations of a SamplingParams class's fields, in order, with their names and defaults."""
    if cls not in _DECLARED:
        out = []
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            out.append(dataclasses.replace(f.metadata["sampling"], name=f.name, default=default))
        _DECLARED[cls] = tuple(out)
    return _DECLARED[cls]


_DECLARED: dict[type, tuple[SamplingField, ...]] = {}


def _bound(value: Optional[float]) -> str:
    return str(value) if isinstance(value, int) or value is None else f"{value:g}"


@dataclass
class SamplingParams:
    """How one request decodes. temperature 0 (or below GREEDY_TEMPERATURE) means greedy."""

    max_new_tokens: int = sampling(DEFAULT_MAX_NEW_TOKENS, INTEGER, "most tokens to generate", low=0,
                                   high=MAX_NEW_TOKENS_LIMIT, openai="max_tokens", openai_shared=False,
                                   route_default=True, flag=True)  # fmt: skip
    temperature: float = sampling(1.0, NUMBER, "softmax temperature (0: greedy)", low=0, high=MAX_TEMPERATURE,
                                  openai="temperature", openai_high=OPENAI_MAX_TEMPERATURE,
                                  flag=True, flag_default=0.0)  # fmt: skip
    top_p: float = sampling(1.0, NUMBER, "nucleus: the smallest set of tokens with this much probability", low=0,
                            open_low=True, high=1, openai="top_p", flag=True)  # fmt: skip
    top_k: int = sampling(-1, INTEGER, "only the k most likely tokens (-1: all)", low=1, high=MAX_NEW_TOKENS_LIMIT,
                          off=-1, vocab=True, openai="top_k", flag=True)  # fmt: skip
    min_p: float = sampling(0.0, NUMBER, "only tokens at least this fraction of the most likely one's probability",
                            low=0, high=1, openai="min_p", flag=True)  # fmt: skip
    stop: list[str] = sampling([], STOP, "stop string", max_items=MAX_STOP_STRINGS, max_chars=MAX_STOP_STRING_CHARS,
                               openai="stop", flag=True)  # fmt: skip
    stop_token_ids: list[int] = sampling([], TOKEN_IDS, "token ids that end the output", max_items=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = sampling(False, BOOLEAN, "generate exactly max_new_tokens (benchmarks)", openai="ignore_eos")
    seed: Optional[int] = sampling(None, INTEGER, "RNG seed: the same tokens whatever the batch", low=0, high=SEED_LIMIT,
                                   open_high=True, high_text="2^64", openai="seed", openai_high=OPENAI_SEED_LIMIT,
                                   flag=True)  # fmt: skip
    skip_special_tokens: bool = sampling(True, BOOLEAN, "leave special tokens out of the text")
    # On the target's logits, in every row (decode, prefill, each verify row); see specserve/logits/.
    presence_penalty: float = sampling(0.0, NUMBER, "minus this for every token already in the output", low=-MAX_PENALTY,
                                       high=MAX_PENALTY, openai="presence_penalty")  # fmt: skip
    frequency_penalty: float = sampling(0.0, NUMBER, "minus this times the token's count in the output",
                                        low=-MAX_PENALTY, high=MAX_PENALTY, openai="frequency_penalty")  # fmt: skip
    repetition_penalty: float = sampling(1.0, NUMBER, "a token of the prompt or output: logit / r if positive, else * r",
                                         low=0, open_low=True, high=MAX_REPETITION_PENALTY,
                                         openai="repetition_penalty")  # fmt: skip
    logit_bias: dict[int, float] = sampling({}, TOKEN_BIAS, "token id -> added to its logit", low=-MAX_LOGIT_BIAS,
                                            high=MAX_LOGIT_BIAS, max_items=MAX_LOGIT_BIAS_ENTRIES,
                                            openai="logit_bias")  # fmt: skip
    logprobs: bool = sampling(False, BOOLEAN, "return each output token's logprob", openai="logprobs",
                              openai_shared=False, native=False)  # fmt: skip
    top_logprobs: int = sampling(0, INTEGER, "and the N most likely tokens' at each position (needs logprobs)", low=0,
                                 high=MAX_TOP_LOGPROBS, openai="top_logprobs", openai_shared=False,
                                 native=False)  # fmt: skip
    prompt_logprobs: bool = sampling(False, BOOLEAN, "also each prompt token's (after the first): the prompt is "
                                     "computed, not cached", native=False)  # fmt: skip
    # Structured output: at most one grammar the output must match (see specserve/logits/grammar.py).
    json_schema: Optional[str] = sampling(None, GRAMMAR, "a JSON schema, as JSON text", max_chars=MAX_GRAMMAR_CHARS)
    regex: Optional[str] = sampling(None, GRAMMAR, "a regular expression", max_chars=MAX_GRAMMAR_CHARS)
    ebnf: Optional[str] = sampling(None, GRAMMAR, "GBNF (llama.cpp's grammar format)", max_chars=MAX_GRAMMAR_CHARS)
    lark: Optional[str] = sampling(None, GRAMMAR, "llguidance's Lark dialect (may embed JSON schemas: `%json {...}`)",
                                   max_chars=MAX_GRAMMAR_CHARS)  # fmt: skip

    def __post_init__(self) -> None:
        # JSON keys are strings: {"50256": -100} is token 50256 (validate rejects what is not an id)
        for spec in declared(type(self)):
            bias = getattr(self, spec.name)
            if spec.kind == TOKEN_BIAS and isinstance(bias, dict):
                setattr(self, spec.name, {_token_key(k): v for k, v in bias.items()})
        self._derive_traits()

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
        specs = {spec.name: spec for spec in declared(cls)}
        unknown = sorted(set(params) - set(specs))
        if unknown:
            raise InvalidRequestError(
                f"sampling_params: unknown key(s) {unknown}; allowed: {sorted(specs)}", param="sampling_params"
            )
        for name, value in list(params.items()):
            if specs[name].kind == STOP and isinstance(value, str):
                params[name] = [value]
            elif specs[name].kind in NULL_IS_DEFAULT and value is None:  # JSON null: the default
                del params[name]
        sp = cls(**params)
        sp.validate(vocab_size)
        return sp

    # What every step reads of a request (is_greedy, seeded_sampling, penalises, constrained,
    # shapes_logits) is worked out once, as plain attributes (`_derive_traits`), not on each read.

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in _TRAIT_INPUTS and "is_greedy" in self.__dict__:  # changed after construction: they follow
            self._derive_traits()

    def _derive_traits(self) -> None:
        """is_greedy: temperature 0 (below GREEDY_TEMPERATURE) or top_k 1; seeded_sampling: samples
        with a seed it gave, promised the same tokens whatever the batch, the cache and the
        speculation (verify windows use the coupled accept, speculative/accept.py); penalises:
        penalties or a logit bias change its target logits; constrained: a grammar masks them;
        shapes_logits: either. A value of the wrong type (not validated yet) counts as neither
        greedy nor penalising: `validate` refuses it before any step reads these."""
        try:
            greedy = self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
            penalties = self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            penalises = bool(penalties or self.logit_bias)
        except TypeError:
            greedy = penalises = False
        self.is_greedy: bool = bool(greedy)
        self.seeded_sampling: bool = self.seed is not None and not self.is_greedy
        self.penalises: bool = penalises
        self.constrained: bool = any(getattr(self, name) is not None for name in GRAMMAR_FIELDS)
        self.shapes_logits: bool = self.penalises or self.constrained

    def validate(self, vocab_size: Optional[int] = None) -> None:
        """Raise InvalidRequestError naming the first bad field; with vocab_size, token ids and top_k too.
        Each field as its declaration says, in order; then what spans fields."""
        for spec in declared(type(self)):
            value = getattr(self, spec.name)
            if value is None and spec.nullable:
                continue
            problem = _CHECKS[spec.kind](spec, value, vocab_size)
            if problem is not None:
                raise InvalidRequestError(f"sampling_params.{spec.name}: {problem}", param=f"sampling_params.{spec.name}")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("sampling_params.top_logprobs: needs logprobs", param="sampling_params.top_logprobs")
        given = [spec.name for spec in declared(type(self)) if spec.kind == GRAMMAR and getattr(self, spec.name) is not None]
        if len(given) > 1:
            names = ", ".join(spec.name for spec in declared(type(self)) if spec.kind == GRAMMAR)
            raise InvalidRequestError(
                f"sampling_params.{given[1]}: give at most one of {names}", param=f"sampling_params.{given[1]}"
            )


# What each kind of field must be: None if `value` is one, else what it must be (for the error).
def _integer(spec: SamplingField, value: Any, vocab_size: Optional[int]) -> Optional[str]:
    if _is_int(value) and spec.holds(value, vocab_size):
        return None
    return f"must be an integer {spec.allowed(vocab_size)}".rstrip() + f", got {_show(value)}"


def _number(spec: SamplingField, value: Any, vocab_size: Optional[int]) -> Optional[str]:
    if _is_finite(value) and spec.holds(value, vocab_size):
        return None
    return f"must be a number {spec.allowed(vocab_size)}".rstrip() + f", got {_show(value)}"


def _boolean(spec: SamplingField, value: Any, vocab_size: Optional[int]) -> Optional[str]:
    return None if isinstance(value, bool) else f"must be true or false, got {_show(value)}"


def _text(spec: SamplingField, value: Any, vocab_size: Optional[int]) -> Optional[str]:
    if isinstance(value, str) and 0 < len(value) <= spec.max_chars:
        return None
    return f"must be a non-empty string of at most {spec.max_chars} characters"


def _stop(spec: SamplingField, value: Any, vocab_size: Optional[int]) -> Optional[str]:
    if (
        isinstance(value, list)
        and len(value) <= spec.max_items
        and all(isinstance(s, str) and 0 < len(s) <= spec.max_chars for s in value)
    ):
        return None
    return f"must be a string or a list of at most {spec.max_items} strings of 1 to {spec.max_chars} characters"


def _token_ids(spec: SamplingField, value: Any, vocab_size: Optional[int]) -> Optional[str]:
    if isinstance(value, list) and len(value) <= spec.max_items and all(_is_token(t, vocab_size) for t in value):
        return None
    bound = f"[0, {vocab_size})" if vocab_size is not None else "non-negative"
    return f"must be a list of at most {spec.max_items} token ids, integers in {bound}"


def _token_bias(spec: SamplingField, value: Any, vocab_size: Optional[int]) -> Optional[str]:
    if (
        isinstance(value, dict)
        and len(value) <= spec.max_items
        and all(_is_token(k, vocab_size) for k in value)
        and all(_is_finite(v) and spec.holds(v) for v in value.values())
    ):
        return None
    bound = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
    return f"must map at most {spec.max_items} token ids (integers {bound}) to numbers {spec.allowed()}".rstrip()


_CHECKS: dict[str, Callable[[SamplingField, Any, Optional[int]], Optional[str]]] = {
    INTEGER: _integer,
    NUMBER: _number,
    BOOLEAN: _boolean,
    TEXT: _text,
    GRAMMAR: _text,
    STOP: _stop,
    TOKEN_IDS: _token_ids,
    TOKEN_BIAS: _token_bias,
}
SAMPLING_FIELDS = declared(SamplingParams)
GRAMMAR_FIELDS = tuple(spec.name for spec in SAMPLING_FIELDS if spec.kind == GRAMMAR)
# The fields the derived traits follow (SamplingParams._derive_traits).
_TRAIT_INPUTS = frozenset(
    {"temperature", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"}
    | set(GRAMMAR_FIELDS)
)


def _token_key(key: Any) -> Any:
    digits = key.strip().lstrip("-") if isinstance(key, str) else ""
    if digits.isascii() and digits.isdigit() and len(key) <= 20:  # "²" is a digit to isdigit(), not to int()
        return int(key)
    return key


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_token(value: Any, vocab_size: Optional[int]) -> bool:
    return _is_int(value) and 0 <= value < (vocab_size if vocab_size is not None else SEED_LIMIT)


def _show(value: Any) -> str:
    """The offending value for a message, cut short: a hostile value must not make a huge error body."""
    text = repr(value)
    return text if len(text) <= 64 else text[:60] + "..."
