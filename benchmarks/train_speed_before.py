"""Time the drafter trainer as it was before issue 17 (one context copy per block, autograd vocab loss).

    .venv/bin/python scripts/train_speed_before.py --shapes 16x12,8x48 --steps 12 --out before.json

The trainer module of revision REV (default f4b8494, the last one before the grouped blocks) is
loaded from git beside this checkout's package and timed on the same cached teacher data as
`python -m benchmarks train-speed` (whole steps: batch, forward, loss, backward, optimizer; 2 untimed
warm-up steps), so the two commands' positions/s compare like for like on one machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_trainer(rev: str):
    src = subprocess.run(["git", "-C", REPO, "show", f"{rev}:specserve/train/trainer.py"], capture_output=True,
                         text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "trainer_before.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("trainer_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["trainer_before"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def time_shape(old, drafter, loss, corpus, seqs: int, anchors: int, steps: int) -> dict:
    cfg = drafter.config
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-5)
    rng, total, positions = random.Random(0), 0.0, 0
    for step in range(steps + 2):
        t0 = time.perf_counter()
        blk = old.make_blocks([corpus.sequence(i) for i in rng.sample(range(len(corpus)), seqs)], cfg.block_size,
                              anchors, cfg.mask_token_id, rng)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            value, info = loss(blk)
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
        if step >= 2:
            total += time.perf_counter() - t0
            positions += info["positions"]
    return {"shape": f"{seqs}x{anchors}", "positions_per_s": round(positions / total, 1),
            "step_s": round(total / steps, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rev", default="f4b8494")
    p.add_argument("--data", default=os.path.join(REPO, "data", "drafter"))
    p.add_argument("--shapes", default="16x12,8x48")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default=None)
    ns = p.parse_args()

    from specserve.assets import default_drafter_path
    from specserve.models.dspark import DsparkDrafter
    from specserve.models.dspark_checkpoint import read_drafter_config
    from specserve.models.loader import load_model
    from specserve.train.corpus_store import CorpusStore
    from specserve.train.run import build_teacher_cache, load_drafter_weights
    from specserve.train.sources import machine_name
    from specserve.train.teacher import TeacherCache, TeacherCorpus

    old = load_trainer(ns.rev)
    path = default_drafter_path()
    cfg = read_drafter_config(path)
    store = CorpusStore(ns.data)
    cache = TeacherCache(os.path.join(ns.data, "cache"), cfg.target_layer_ids, 16, "SmolLM2-135M-Instruct.Q4_1.gguf")
    build_teacher_cache(cache, store, store.shards, None)
    corpus = TeacherCorpus([cache.load(s) for s in store.shards], cfg.target_layer_ids, 16)
    drafter = DsparkDrafter(cfg, max_positions=4096)
    load_drafter_weights(drafter, path)
    head = load_model(None).weights["model.embed_tokens.weight"].to(torch.bfloat16)
    loss = old.DrafterLoss(drafter, head, head)
    results = []
    for shape in ns.shapes.split(","):
        seqs, anchors = (int(x) for x in shape.lower().split("x"))
        results.append(time_shape(old, drafter, loss, corpus, seqs, anchors, ns.steps))
        print(json.dumps(results[-1]), flush=True)
    report = {"trainer_revision": ns.rev, "machine": machine_name(), "threads": torch.get_num_threads(),
              "results": results}
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
