"""The messages of the engine: one set, from the serving front end to the engine and on to the ranks.

Commands go to the engine; events come back, one list per engine loop iteration. Every message
is a frozen dataclass of plain values and typed, validated sampling params, so it pickles across
multiprocessing queues; receivers dispatch on the class, never on a tag. Under tensor parallelism
rank 0 republishes the same commands to the other ranks, as JSON (engine/broadcast.py).

Per request the events are: zero or more `TokensOut`, then exactly one of `RequestDone`,
`RequestError` (the engine refused it: a client error) or `RequestFailed` (its own host work
failed: a server error for that request alone). `EngineFatal` ends every open request; no event follows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from specserve.logits.logprobs import TokenLogprob
from specserve.sampling_params import SamplingParams

# ------------------------------------------------------------------ commands (front end -> engine -> ranks)


@dataclass(frozen=True)
class AddRequest:
    """Queue one request whose params were parsed and validated where it came in (the server's
    routes or the offline `Engine` API); a rejection comes back as `RequestError`. Rank 0
    republishes it to the other ranks with `seed` set, so that every rank samples alike."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: Optional[int] = None  # None from a front end: rank 0 draws one unless params.seed is set


@dataclass(frozen=True)
class AbortRequest:
    """Stop a request; it then finishes with a `RequestDone` whose finish reason is "abort"."""

    rid: str


@dataclass(frozen=True)
class Drain:
    """Process the step still in flight (the overlap loop's last step of a generate call)."""


@dataclass(frozen=True)
class Shutdown:
    """Abort every open request, report their `RequestDone`, and exit (on every rank: a last
    consensus comparison first)."""


@dataclass(frozen=True)
class FlushCache:
    """Drop every cached prefix no request holds, on every rank; answered by `CacheFlushed` with the same token."""

    token: str


Command = Union[AddRequest, AbortRequest, Drain, Shutdown, FlushCache]

# ------------------------------------------------------------------ events (engine -> front end)


@dataclass(frozen=True)
class EngineReady:
    """The engine is built and serving: context_length, vocab_size, kv_total_tokens, pid, ..."""

    info: dict[str, Any]


@dataclass(frozen=True)
class TokensOut:
    """Tokens a request produced in one loop iteration (several with speculative decoding)."""

    rid: str
    token_ids: list[int]
    logprobs: Optional[list[TokenLogprob]] = None  # one per token, if the request asked for logprobs
    prompt_logprobs: Optional[list[TokenLogprob]] = None  # with a request's first tokens: its prompt's (from token 1)


@dataclass(frozen=True)
class RequestDone:
    """A request finished; `output` is the engine's output dict (text, output_ids, meta_info)."""

    rid: str
    output: dict[str, Any]


@dataclass(frozen=True)
class RequestError:
    """The engine rejected a request: `param` names the field, `code` is an OpenAI error code."""

    rid: str
    message: str
    param: Optional[str] = None
    code: Optional[str] = None


@dataclass(frozen=True)
class RequestFailed:
    """The engine failed this one request (e.g. detokenizing its output raised); the others go on."""

    rid: str
    message: str


@dataclass(frozen=True)
class LoadReport:
    """Queue and KV occupancy, sent when it changed (the keys of `Engine.load()`)."""

    load: dict[str, int]


@dataclass(frozen=True)
class CacheFlushed:
    """A `FlushCache` was applied: the KV slots it freed."""

    token: str
    freed_tokens: int


@dataclass(frozen=True)
class Heartbeat:
    """The engine process is alive (sent by a thread of its own, whatever the step is doing)."""


@dataclass(frozen=True)
class EngineFatal:
    """The engine cannot go on (failed to start, or a step raised): a one-line reason; the log has the rest."""

    message: str
    config: bool = False  # a bad flag, model or size (ConfigError): the CLI exits with its one line


Event = Union[
    EngineReady, TokensOut, RequestDone, RequestError, RequestFailed, LoadReport, CacheFlushed, Heartbeat, EngineFatal
]
