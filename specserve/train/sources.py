"""Where the drafter's training sequences come from, and the prompt sets kept out of training.

Sources (the shard names in the corpus store):
- `sharegpt-greedy`: on-policy. The target answers ShareGPT V3 first turns greedily, batched
  through specserve's own engine, with the same weights and kernels that serve the drafter.
- `sharegpt-sampled`: on-policy. The same prompts answered with temperature 0.7 and top-p 0.95;
  different paths through the target's distribution.
- `sharegpt-answers`: off-policy. ShareGPT's own assistant answers to those first turns. They cost
  no generation at all; the target's view of them comes from a prefill at training time.

The evaluation prompts are kept out of every source: MT-Bench (both turns), HumanEval, and the
corpus's own fixed development and held-out chat sets. The development set decides whether a new
drafter replaces the shipped one. Both sets are ShareGPT first turns, taken from the tail of one
fixed shuffle and frozen in the data folder. De-duplication is by prompt key, within a source.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Callable, Optional

from specserve.errors import ConfigError
from specserve.datasets import humaneval_prompts, mtbench_questions, sharegpt_first_exchanges
from specserve.kernels.dispatch import machine_description
from specserve.train.corpus_store import CorpusStore, Pair, prompt_key

POOL_SEED = 0  # the pool's fixed shuffle (its tail is the dev and held-out sets)
DEV_FILE, HELDOUT_FILE = "dev_prompts.jsonl", "heldout_prompts.jsonl"
SET_SIZE = 64
MAX_PROMPT_CHARS = 2000
SOURCES = ("sharegpt-greedy", "sharegpt-sampled", "sharegpt-answers")
SAMPLED_PARAMS = {"temperature": 0.7, "top_p": 0.95}


def sharegpt_pool() -> list[tuple[str, str]]:
    """(first human turn, first assistant answer) for every usable ShareGPT V3 conversation, in
    the fixed shuffled order, with the benchmark prompts removed."""
    excluded = benchmark_keys()
    pool, seen = [], set()
    for human, answer in sharegpt_first_exchanges():
        key = prompt_key(human)
        if 8 <= len(human) <= MAX_PROMPT_CHARS and key not in excluded and key not in seen:
            seen.add(key)
            pool.append((human, answer))
    random.Random(POOL_SEED).shuffle(pool)
    return pool


def benchmark_keys() -> set[int]:
    keys = {prompt_key(t) for q in mtbench_questions() for t in q["turns"]}
    for q in humaneval_prompts():
        keys.add(prompt_key(q["prompt"]))
        keys.add(prompt_key(q["prompt"].split("\n\n", 1)[1]))  # the bare function, as a user might paste it
    return keys


def evaluation_sets(root: str, pool: Optional[list[tuple[str, str]]] = None) -> dict[str, list[str]]:
    """The frozen development and held-out prompt sets (written on first use from the pool's tail)."""
    paths = {"dev": os.path.join(root, DEV_FILE), "heldout": os.path.join(root, HELDOUT_FILE)}
    present = [os.path.isfile(p) for p in paths.values()]
    if any(present) and not all(present):  # rewriting the other would unfreeze a set
        raise ConfigError(f"{root}: one of {DEV_FILE} and {HELDOUT_FILE} is missing; restore it from git")
    if not any(present):
        pool = pool if pool is not None else sharegpt_pool()
        tail = [human for human, _ in pool[-2 * SET_SIZE:]]
        os.makedirs(root, exist_ok=True)
        for name, prompts in (("heldout", tail[:SET_SIZE]), ("dev", tail[SET_SIZE:])):
            with open(paths[name], "w") as f:
                f.writelines(json.dumps({"category": name, "prompt": p}) + "\n" for p in prompts)
    out = {}
    for name, path in paths.items():
        with open(path) as f:
            out[name] = [json.loads(line)["prompt"] for line in f if line.strip()]
    return out


def training_prompts(root: str, store: CorpusStore, source: str) -> list[tuple[str, str]]:
    """The pool minus the evaluation sets and the prompts `source` already has, in pool order."""
    pool = sharegpt_pool()
    sets = evaluation_sets(root, pool)
    excluded = {prompt_key(p) for prompts in sets.values() for p in prompts} | store.used_keys(source)
    return [(h, a) for h, a in pool if prompt_key(h) not in excluded]


def extend(root: str, source: str, num_prompts: int, shard_prompts: int = 512, max_new_tokens: int = 256,
           max_prompt_tokens: int = 768, batch_size: int = 128, max_minutes: Optional[float] = None,
           model_path: Optional[str] = None, log: Callable[[str], None] = print) -> list[dict]:
    """Append up to `num_prompts` new sequences of `source`, one shard per `shard_prompts`."""
    if source not in SOURCES:
        raise ConfigError(f"--source must be one of {', '.join(SOURCES)}, got {source!r}")
    store = CorpusStore(root)
    todo = training_prompts(root, store, source)[:num_prompts]
    if not todo:
        log(f"{source}: no unused prompts left")
        return []
    engine = None
    if source != "sharegpt-answers":
        from specserve.engine import Engine

        engine = Engine(model_path=model_path, max_running_requests=batch_size, speculative_algorithm="NONE",
                        random_seed=0)
    tokenizer = engine.tokenizer if engine else _tokenizer(model_path)
    generator = {"model": os.path.basename(model_path or "SmolLM2-135M-Instruct.Q4_1.gguf"),
                 "max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens,
                 "batch_size": batch_size if engine else None,
                 "sampling": SAMPLED_PARAMS if source == "sharegpt-sampled" else ("greedy" if engine else None)}
    written, started = [], time.perf_counter()

    def write(pairs: list[Pair], seconds: float) -> None:
        info = store.append(source, pairs, generator, seconds, machine_description())
        rate = info.answer_tokens / info.seconds if info.seconds >= 0.1 else None  # tokenising only: no rate
        log(f"{info.file}: {info.sequences} sequences, {info.answer_tokens} answer tokens in {info.seconds} s"
            + (f" ({rate:.0f} tokens/s)" if rate else "") + f", {info.bytes} bytes; corpus {store.total_bytes} bytes")
        written.append({"file": info.file, "sequences": info.sequences, "answer_tokens": info.answer_tokens,
                        "seconds": info.seconds, "answer_tokens_per_s": None if rate is None else round(rate, 1)})

    deadline = None if max_minutes is None else started + max_minutes * 60
    try:
        if engine is None:
            for at in range(0, len(todo), shard_prompts):
                if deadline is not None and time.perf_counter() > deadline:
                    log("stopping at the time budget")
                    break
                t0 = time.perf_counter()
                pairs = _answer_pairs(todo[at:at + shard_prompts], tokenizer, max_new_tokens, max_prompt_tokens)
                if pairs:  # every answer of the chunk too short or its prompt too long: nothing to keep
                    write(pairs, time.perf_counter() - t0)
        else:
            params = {"max_new_tokens": max_new_tokens, "temperature": 0}
            if source == "sharegpt-sampled":
                params.update(SAMPLED_PARAMS)
            _generate_shards(engine, todo, params, max_prompt_tokens, shard_prompts, batch_size, deadline, write, log)
    finally:
        if engine is not None:
            engine.shutdown()
    return written


def _generate_shards(engine, todo: list[tuple[str, str]], params: dict, max_prompt_tokens: int, shard_prompts: int,
                     batch_size: int, deadline: Optional[float], write: Callable[[list[Pair], float], None],
                     log: Callable[[str], None]) -> None:
    """Keep the engine full: requests are submitted as others finish (no batch drains between
    shards), and every `shard_prompts` finished answers become a shard. After the deadline no
    new request is submitted; those in flight finish and are written."""
    queue = iter(todo)
    in_flight: dict[str, tuple[int, list[int]]] = {}
    done: list[Pair] = []
    shard_start = time.perf_counter()

    def submit_more() -> None:
        while len(in_flight) < 2 * batch_size and (deadline is None or time.perf_counter() < deadline):
            item = next(queue, None)
            if item is None:
                return
            ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": item[0]}])
            if len(ids) <= max_prompt_tokens:
                req = engine.submit(ids, params)
                in_flight[req.rid] = (prompt_key(item[0]), ids)

    submit_more()
    while in_flight:
        for req in engine.step().finished:
            if req.rid not in in_flight:
                continue
            key, ids = in_flight.pop(req.rid)
            if req.error is None and len(req.output_ids) >= 2:
                done.append(Pair(ids, list(req.output_ids), key))
        if len(done) >= shard_prompts:
            write(done[:shard_prompts], time.perf_counter() - shard_start)
            done, shard_start = done[shard_prompts:], time.perf_counter()
        submit_more()
    if deadline is not None and time.perf_counter() >= deadline:
        log("stopping at the time budget")
    if done:
        write(done, time.perf_counter() - shard_start)


def _answer_pairs(chunk: list[tuple[str, str]], tokenizer, max_new_tokens: int, max_prompt_tokens: int) -> list[Pair]:
    """Off-policy: ShareGPT's own answers, tokenized (a cut answer ends without its stop token)."""
    eos = tokenizer.eos_token_id
    out = []
    for human, answer in chunk:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": human}])
        ans = (tokenizer.encode(answer, add_special_tokens=False) + [eos])[:max_new_tokens]
        if len(ids) <= max_prompt_tokens and len(ans) >= 8:
            out.append(Pair(ids, ans, prompt_key(human)))
    return out


def _tokenizer(model_path: Optional[str]):
    from specserve.models.loader import resolve_model_path
    from specserve.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path(model_path))
