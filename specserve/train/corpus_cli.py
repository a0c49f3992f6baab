"""`specserve drafter-corpus`: extend the drafter's corpus (a new shard per chunk) or report on it."""

from __future__ import annotations

import argparse
import json
import os

# The corpus lives in the repository, beside the package (not inside it: it is not installed).
DEFAULT_DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "data", "drafter")


def add_corpus_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="corpus_command", required=True)
    ext = sub.add_parser("extend", help="append shards of a source's new sequences")
    ext.add_argument("--source", required=True, help="sharegpt-greedy, sharegpt-sampled or sharegpt-answers")
    ext.add_argument("--num-prompts", type=int, required=True, help="new prompts to answer (unused ones, in order)")
    ext.add_argument("--shard-prompts", type=int, default=512, help="prompts per shard (one shard per chunk)")
    ext.add_argument("--max-new-tokens", type=int, default=256)
    ext.add_argument("--max-prompt-tokens", type=int, default=768)
    ext.add_argument("--batch-size", type=int, default=128, help="requests the engine runs at once")
    ext.add_argument("--max-minutes", type=float, default=None, help="start no new shard after this long")
    for q in (ext, sub.add_parser("status", help="shards, sequences and tokens by source")):
        q.add_argument("--data", default=DEFAULT_DATA_DIR, help="the corpus folder (manifest.json, shards/)")
        q.add_argument("--model-path", default=None, help="target model (default: the embedded one)")


def run_drafter_corpus(ns: argparse.Namespace) -> int:
    from specserve.train.corpus_store import CorpusStore
    from specserve.train.sources import extend

    if ns.corpus_command == "extend":
        written = extend(ns.data, ns.source, ns.num_prompts, ns.shard_prompts, ns.max_new_tokens,
                         ns.max_prompt_tokens, ns.batch_size, ns.max_minutes, ns.model_path)
        print(json.dumps({"written": written}))
        return 0
    store = CorpusStore(ns.data)
    print(json.dumps({"data": ns.data, "bytes": store.total_bytes, "budget_bytes": store.budget_bytes,
                      "totals": store.counts(), "by_source": {s: store.counts(s) for s in store.sources()}}, indent=1))
    return 0
