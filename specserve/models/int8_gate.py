"""Where int8 activations are the default: the quality gate, its record, and `--cpu-activations auto`.

Integer activations (kernels/csrc/linear_int8.h) compute as llama.cpp does and are faster wherever
a step is bound by arithmetic (prefill, verify windows, large batches), but they round each
activation row to 8 bits, and whether a model keeps its quality under that rounding depends on the
model: the default SmolLM2-135M's greedy answers leave fp32's far more often than bf16's do, while
Qwen2.5-Coder-0.5B's and Gemma 3 270M's stay within noise of bf16's. So the choice is made per model file, from measurement:
`specserve bench quality --record` runs the gate on a file (perplexity within 0.3% of fp32, and
greedy outputs identical to fp32's no fewer than with bf16 activations, beyond noise) and writes
its verdict into `specserve/assets/quality/int8.json`, keyed by the file's size and sha256 (where
an fp32 run does not fit, `--reference bf16` gates int8 against bf16 on the file itself instead);
`auto` (the default) then picks int8 for exactly the files whose verdict passed, bf16 for every
other file, so a file nobody measured keeps bf16.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from typing import Any, Optional

from specserve.errors import ConfigError

RECORD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "quality", "int8.json")
PERPLEXITY_LIMIT = 1.003  # int8's perplexity over fp32's at most this
NOISE_SIGMAS = 2.0  # how far int8's matches may fall below bf16's (standard deviations of the paired difference)
MIN_RECORDED_PROMPTS = 32  # a verdict over fewer greedy prompts is too noisy to ship
MIN_BF16_PREFIX = 0.5  # the bf16-reference gate: int8's greedy outputs follow bf16's this far on average


def int8_verdict(report: dict[str, Any]) -> dict[str, Any]:
    """The gate on one `bench quality` report: int8's perplexity within 0.3% of fp32's, and its
    greedy outputs identical to fp32's on no fewer prompts than bf16's, beyond noise. The two
    variants answer the same prompts, so the test is paired (McNemar's): of the prompts where
    exactly one of them matches fp32, bf16-only (b) may exceed int8-only (c) by at most two
    standard deviations of b - c under no difference, 2 sqrt(b + c)."""
    bf16, int8 = report["bfloat16"], report["int8_activations"]
    pairs = list(zip(bf16["greedy_vs_fp32"]["identical_each"], int8["greedy_vs_fp32"]["identical_each"]))
    if not pairs:
        raise ConfigError("the int8 gate needs at least one greedy prompt")
    bf16_only = sum(a and not b for a, b in pairs)
    int8_only = sum(b and not a for a, b in pairs)
    noise = NOISE_SIGMAS * math.sqrt(bf16_only + int8_only)
    perplexity_ok = int8["over_fp32_perplexity"] <= PERPLEXITY_LIMIT
    greedy_ok = bf16_only - int8_only <= noise
    return {
        "int8": perplexity_ok and greedy_ok,
        "perplexity_ok": perplexity_ok,
        "greedy_ok": greedy_ok,
        "perplexity_over_fp32": {"bf16": bf16["over_fp32_perplexity"], "int8": int8["over_fp32_perplexity"]},
        "greedy_identical": {"bf16": sum(a for a, _ in pairs), "int8": sum(b for _, b in pairs)},
        "greedy_only": {"bf16": bf16_only, "int8": int8_only},
        "greedy_noise": noise,
        "prompts": len(pairs),
    }


def int8_verdict_vs_bf16(report: dict[str, Any]) -> dict[str, Any]:
    """The gate where an fp32 reference is unaffordable (a 7B file's fp32 weights alone exceed these
    machines' memory): int8 against bf16 activations on the same file. int8's perplexity within 0.3%
    of bf16's, and its greedy outputs following bf16's for at least MIN_BF16_PREFIX of their tokens
    on average before the first difference. A weaker test than the fp32 gate (bf16's own distance
    from fp32 is not measured), so its verdicts are recorded with their reference."""
    int8 = report["int8_activations"]
    ratio = int8["perplexity"] / report["bfloat16"]["perplexity"]
    prefix = int8["greedy_vs_bf16"]["mean_matching_prefix"]
    perplexity_ok, greedy_ok = ratio <= PERPLEXITY_LIMIT, prefix >= MIN_BF16_PREFIX
    return {
        "int8": perplexity_ok and greedy_ok,
        "reference": "bf16",
        "perplexity_ok": perplexity_ok,
        "greedy_ok": greedy_ok,
        "perplexity_over_bf16": ratio,
        "mean_matching_prefix": prefix,
        "greedy_identical": {"int8_vs_bf16": sum(int8["greedy_vs_bf16"]["identical_each"])},
        "prompts": len(int8["greedy_vs_bf16"]["identical_each"]),
    }


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_record(path: str = RECORD) -> list[dict[str, Any]]:
    """The recorded verdicts (none where the file is missing)."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return json.load(f)["files"]


def record_verdict(model_path: str, verdict: dict[str, Any], provenance: dict[str, Any], path: str = RECORD) -> None:
    """Write (or replace) the verdict of one model file."""
    if verdict["prompts"] < MIN_RECORDED_PROMPTS:
        raise ConfigError(f"--record needs --num-prompts >= {MIN_RECORDED_PROMPTS}, got {verdict['prompts']}")
    entry = {
        "file": os.path.basename(model_path),
        "bytes": os.path.getsize(model_path),
        "sha256": file_sha256(model_path),
        **verdict,
        **provenance,
    }
    files = [e for e in load_record(path) if e["sha256"] != entry["sha256"]] + [entry]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"files": sorted(files, key=lambda e: e["file"])}, f, indent=1)
        f.write("\n")


@functools.lru_cache(maxsize=8)
def _sha256_of(path: str, size: int, mtime_ns: int, inode: int) -> str:
    return file_sha256(path)  # a model file is hashed once per version of it


def passed_gate(model_path: str, record: str = RECORD) -> bool:
    """Whether the record (read afresh: it is small) holds a passing verdict for this very file;
    the file is hashed only when a passing verdict has its size."""
    if not os.path.isfile(model_path):
        return False
    stat = os.stat(model_path)
    candidates = {e["sha256"] for e in load_record(record) if e["int8"] and e["bytes"] == stat.st_size}
    return (
        bool(candidates)
        and _sha256_of(os.path.abspath(model_path), stat.st_size, stat.st_mtime_ns, stat.st_ino) in candidates
    )


def resolve_cpu_activations(choice: str, model_path: Optional[str], device: str, record: str = RECORD) -> str:
    """`auto` as bf16 or int8 for this model file (bf16 off the CPU, where the flag does nothing);
    an explicit choice as given."""
    if choice != "auto":
        return choice
    if device.split(":")[0] != "cpu":
        return "bf16"
    from specserve.models.loader import resolve_model_path  # torch and the GGUF reader: only for auto on CPU

    try:
        path = resolve_model_path(model_path)
    except ConfigError:  # no such model: the engine says so when it loads; nothing to choose for
        return "bf16"
    return "int8" if passed_gate(path, record) else "bf16"


def with_resolved_activations(args: Any) -> Any:
    """ServerArgs with `auto` resolved (Engine: once on rank 0, before it starts the other ranks)."""
    return args.replace(cpu_activations=resolve_cpu_activations(args.cpu_activations, args.model_path, args.device))
