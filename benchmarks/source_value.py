"""`python -m benchmarks drafter-sources`: served accept length gained per machine-hour by each source of
teacher signal, so the corpus grows with the source that buys the most.

Each arm continues the same drafter (the shipped one by default) for the same training minutes on
one selection of corpus shards, then serves the dev prompts (DSPARK fixed policy, bf16, greedy,
static verify). An arm's cost is what its data cost to make on this machine (the generation time
from the manifest; the teacher prefill from its cache entry) plus its training time. Shards the
starting drafter was already trained on (`--seen`) cost nothing again: that arm measures more
training on old data, the baseline any new source has to beat. The figure per arm is the dev
accept-length gain over the starting drafter divided by the arm's cost in machine-hours (this
machine's cores all busy; CPU-hours are that times the core count).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from specserve.errors import ConfigError
from specserve.train.corpus_cli import DEFAULT_DATA_DIR

DEFAULT_ARMS = "seen:sharegpt-greedy:0-4,greedy:sharegpt-greedy:6,answers:sharegpt-answers:5"


def add_source_value_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arms", default=DEFAULT_ARMS, help="comma-separated NAME:SOURCE:SHARDS (SHARDS like 0-4 or 6)")
    p.add_argument("--seen", default="0-4", help="shard numbers the starting drafter already trained on")
    p.add_argument("--drafter", default=None, help="starting drafter directory (default: the shipped one)")
    p.add_argument("--minutes", type=float, default=6.0, help="training minutes per arm")
    p.add_argument("--dev-prompts", type=int, default=64, help="dev prompts served per drafter (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length on the dev prompts")
    p.add_argument("--data", default=DEFAULT_DATA_DIR)
    p.add_argument("--cache", default=None, help="teacher cache (default: DATA/cache)")
    p.add_argument("--work", default=None, help="folder for the arms' drafters (default: a temporary one)")
    p.add_argument("--out", default=None, help="JSON results")


def parse_arms(spec: str) -> list[tuple[str, str, str]]:
    """"NAME:SOURCE:SHARDS,..." as (name, source, shards) triples."""
    arms = []
    for part in spec.split(","):
        fields = part.strip().split(":")
        if len(fields) != 3 or not all(fields):
            raise ConfigError(f"--arms {spec!r}: each arm is NAME:SOURCE:SHARDS, e.g. greedy:sharegpt-greedy:6")
        arms.append((fields[0], fields[1], fields[2]))
    return arms


def arm_cost_seconds(shards: list, seen: set[int], cache, train_seconds: float) -> dict:
    """What an arm's data and training cost on this machine; shards in `seen` were paid for already."""
    from specserve.train.run import shard_number

    new = [s for s in shards if shard_number(s) not in seen]
    making = sum(float(s.seconds) for s in new)
    teacher_costs = [cache.cost(s) for s in new]
    if any(c is None for c in teacher_costs):
        raise ConfigError("a new shard's teacher cache has no recorded cost (built by an older version): "
                         "delete its entry under the cache folder so this run rebuilds and times it")
    teacher = sum(c["seconds"] for c in teacher_costs)
    return {"making_s": round(making, 1), "teacher_s": round(teacher, 1), "train_s": round(train_seconds, 1),
            "total_s": round(making + teacher + train_seconds, 1)}


def run_source_value(ns: argparse.Namespace) -> int:
    from specserve.assets import default_drafter_path
    from specserve.models.dspark_checkpoint import read_drafter_config
    from benchmarks.arms import dev_score, train_arm
    from specserve.train.corpus_store import CorpusStore
    from specserve.train.run import DEFAULT_TOPK, parse_shard_numbers, select_shards, target_model_name
    from specserve.kernels.dispatch import machine_description
    from specserve.train.teacher import TeacherCache

    start = ns.drafter or default_drafter_path()
    arms, seen = parse_arms(ns.arms), parse_shard_numbers(ns.seen) if ns.seen else set()
    store = CorpusStore(ns.data)
    # the arms train the starting drafter's shape, so their teacher entries are keyed by its layers
    cache = TeacherCache(ns.cache or os.path.join(ns.data, "cache"), read_drafter_config(start).target_layer_ids,
                         DEFAULT_TOPK, target_model_name(None))
    work = ns.work or tempfile.mkdtemp(prefix="drafter-sources-")

    def score(drafter: str) -> dict:
        return dev_score(drafter, ns.data, ns.dev_prompts, ns.max_new_tokens)

    results = {"start": score(start), "arms": {}}
    print(json.dumps({"start": results["start"]["served"]}), flush=True)
    for name, source, shards in arms:
        out = os.path.join(work, name)
        ext = train_arm(["--out", out, "--init-from", start, "--data", ns.data, "--sources", source, "--shards", shards,
                         "--max-minutes", str(ns.minutes), "--steps", "1000000", "--checkpoint-every", "1000000",
                         "--note", f"drafter-sources arm {name}"] + (["--cache", ns.cache] if ns.cache else []))
        chosen = select_shards(store, [source], shards)
        cost = arm_cost_seconds(chosen, seen, cache, ext["train_minutes"] * 60)
        dev = score(out)
        gain = round(dev["served"]["accept_length"] - results["start"]["served"]["accept_length"], 4)
        results["arms"][name] = {"source": source, "shards": [os.path.basename(s.file) for s in chosen],
                                 "answer_tokens": ext["train_answer_tokens"], "positions": ext["positions"],
                                 "cost": cost, "dev": dev, "dev_gain": gain,
                                 "gain_per_machine_hour": round(gain / (cost["total_s"] / 3600), 4)}
        print(json.dumps({name: {k: v for k, v in results["arms"][name].items() if k != "dev"}}), flush=True)
    results.update(minutes=ns.minutes, max_new_tokens=ns.max_new_tokens, seen=sorted(seen), machine=machine_description())
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0

