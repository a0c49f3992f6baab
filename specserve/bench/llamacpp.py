"""llama.cpp as a benchmark peer, through `llama-cpp-python` (an optional extra, never a test
dependency), driven with the same token ids as specserve so both see identical prompts.

Build it with its AMX path off (it crashes on some of these CPUs):
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX2=ON
-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF" pip install llama-cpp-python==0.3.36
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from specserve.errors import ConfigError

INSTALL = ('pip install llama-cpp-python==0.3.36 (with CMAKE_ARGS turning AMX off, see '
           'specserve/bench/llamacpp.py)')


def open_llama(model_path: str, threads: int, n_ctx: int = 4096, logits_all: bool = False):
    """logits_all keeps every position's logits (`Llama.scores`), not only the last one's."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise ConfigError(f"--peer llama.cpp needs llama-cpp-python: {INSTALL}") from None
    return Llama(model_path=model_path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                 logits_all=logits_all, verbose=False)


def teacher_forced_logits(model_path: str, threads: int, n_ctx: int):
    """A function from token ids to llama.cpp's float32 logits at every position (one sequence,
    evaluated from an empty cache): the peer's side of a teacher-forced quality comparison."""
    import torch

    llm = open_llama(model_path, threads, n_ctx, logits_all=True)

    def logits_of(ids: list[int]) -> torch.Tensor:
        llm.reset()
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))

    return logits_of


def greedy_outputs(model_path: str, threads: int, prompts: list[list[int]], new_tokens: int,
                   stop_ids: tuple[int, ...]) -> list[list[int]]:
    """llama.cpp's greedy answers to token-id prompts, as the engine decodes them: argmax of each
    step's logits, at most `new_tokens`, ending after an end-of-sequence token."""
    llm = open_llama(model_path, threads, n_ctx=max(len(p) for p in prompts) + new_tokens)
    outputs = []
    for prompt in prompts:
        llm.reset()
        llm.eval(prompt)
        tokens: list[int] = []
        while len(tokens) < new_tokens and not (tokens and tokens[-1] in stop_ids):
            tokens.append(int(np.argmax(last_logits(llm))))
            llm.eval(tokens[-1:])
        outputs.append(tokens)
    return outputs


# Batch-1 generations timed (median kept): one is a fraction of a second on a shared machine.
BATCH1_RUNS = 3


def _rewind(llm, n_tokens: int) -> None:
    """Forget every position from n_tokens on (K/V and the token history)."""
    llm.n_tokens = n_tokens
    llm._ctx.memory_seq_rm(-1, n_tokens, -1) if hasattr(llm._ctx, "memory_seq_rm") else llm._ctx.kv_cache_seq_rm(-1, n_tokens, -1)


def last_logits(llm) -> np.ndarray:
    """The logits of the last token evaluated. `Llama.scores` holds them only when the model was
    opened with logits_all (else its rows stay zero, and an argmax over them decodes token 0 at
    every step): read them from the context, whose last batch computed the last token's only."""
    if llm._logits_all:
        return llm.scores[llm.n_tokens - 1]
    return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))


def greedy_decode_tok_s(llm, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    """Prompt eval plus `new_tokens` greedy decode steps (argmax of the last logits): tokens/s, and
    the tokens decoded (so a caller can see the peer generated text, not a constant)."""
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    tokens = []
    for _ in range(new_tokens):
        tokens.append(int(np.argmax(last_logits(llm))))
        llm.eval(tokens[-1:])
    return new_tokens / (time.perf_counter() - start), tokens


def step_times_ms(llm, prefix: list[int], rows: list[int], repeats: int) -> dict[str, float]:
    """Median time of one forward over 1 new token and over `len(rows)` new tokens after `prefix`."""
    llm.reset()
    llm.eval(prefix)
    out = {}
    for name, tokens in (("decode_1_row_ms", rows[:1]), (f"verify_{len(rows)}_rows_ms", rows)):
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            llm.eval(tokens)
            times.append(time.perf_counter() - start)
            _rewind(llm, len(prefix))
        out[name] = 1e3 * statistics.median(times[1:])
    return out


def prefill_tok_s(llm, prompt: list[int], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        llm.reset()
        _rewind(llm, 0)
        start = time.perf_counter()
        llm.eval(prompt)
        times.append(time.perf_counter() - start)
    return len(prompt) / statistics.median(times)


def bench_llama_cpp(model_path: str, threads: int, prompt: list[int], new_tokens: int, prefix: list[int],
                    window: list[int], long_prompt: list[int], repeats: int) -> dict[str, Any]:
    import llama_cpp

    llm = open_llama(model_path, threads)
    greedy_decode_tok_s(llm, prompt, 8)  # warm-up
    timed = [greedy_decode_tok_s(llm, prompt, new_tokens) for _ in range(BATCH1_RUNS)]
    runs = [rate for rate, _ in timed]
    result: dict[str, Any] = {"version": llama_cpp.__version__, "batch1_tok_s": statistics.median(runs),
                              "batch1_tok_s_runs": runs, "batch1_output_ids": timed[0][1]}
    result.update(step_times_ms(llm, prefix, window, repeats))
    result["prefill_tok_s"] = prefill_tok_s(llm, long_prompt, repeats)
    llm.close()
    return result
