"""`python -m benchmarks train-speed`: drafter training throughput (positions/s) by batch shape, and where a step goes.

It times real training steps of the drafter on the corpus's cached teacher data (built if
missing), for each `seqs x anchors` shape: batch assembly, the forward to the block states
(context K/V over whole sequences plus the draft layer), the loss (the draft-vocabulary head and its
softmax), the backward pass and the optimizer. A position is one scored draft slot.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from specserve.train.corpus_cli import DEFAULT_DATA_DIR


def add_train_speed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", default=DEFAULT_DATA_DIR)
    p.add_argument("--cache", default=None, help="teacher cache (default: DATA/cache)")
    p.add_argument("--drafter", default=None, help="drafter directory to train (default: the shipped one)")
    p.add_argument("--shapes", default="16x12,8x48,8x96,4x0", help="comma-separated SEQSxANCHORS (0: every position)")
    p.add_argument("--steps", type=int, default=12, help="timed steps per shape (after 2 untimed)")
    p.add_argument("--shards", default=None, help="only these corpus shards, e.g. 0 (default: all)")
    p.add_argument("--dtypes", default=None, help="comma-separated training precisions to time side by side, "
                                                  "bfloat16 (autocast) and/or float32 (default: the one training uses)")
    p.add_argument("--out", default=None, help="JSON results")


def run_train_speed(ns: argparse.Namespace) -> int:
    from specserve.assets import default_drafter_path
    from specserve.models.loader import load_model
    from specserve.train.corpus_store import CorpusStore
    from specserve.train.run import build_teacher_cache, load_drafter_weights, select_shards
    from specserve.train.teacher import TeacherCache, TeacherCorpus
    from specserve.models.dspark import DsparkDrafter
    from specserve.models.dspark_checkpoint import read_drafter_config
    from specserve.kernels.dispatch import machine_description
    from specserve.train.trainer import DrafterLoss, training_dtype

    path = ns.drafter or default_drafter_path()
    cfg = read_drafter_config(path)
    store = CorpusStore(ns.data)
    cache = TeacherCache(ns.cache or f"{ns.data}/cache", cfg.target_layer_ids, 16, "SmolLM2-135M-Instruct.Q4_1.gguf")
    shards = select_shards(store, None, ns.shards)
    build_teacher_cache(cache, store, shards, None)
    corpus = TeacherCorpus([cache.load(s) for s in shards], cfg.target_layer_ids, 16)
    loaded = load_model(None)
    drafter = DsparkDrafter(cfg, max_positions=4096)
    load_drafter_weights(drafter, path)
    results = []
    dtypes = ns.dtypes.split(",") if ns.dtypes else [str(training_dtype()).removeprefix("torch.")]
    for dtype in dtypes:
        head = loaded.weights["model.embed_tokens.weight"].to(getattr(torch, dtype))
        loss = DrafterLoss(drafter, head, head)
        for shape in ns.shapes.split(","):
            seqs, anchors = (int(x) for x in shape.lower().split("x"))
            results.append({"dtype": dtype, **time_shape(drafter, loss, corpus, seqs, anchors, ns.steps)})
            print(json.dumps(results[-1]), flush=True)
    report = {"machine": machine_description(), "threads": torch.get_num_threads(), "matmul_gflops": matmul_gflops(),
              "results": results}
    print(json.dumps({"matmul_gflops": report["matmul_gflops"]}), flush=True)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def time_shape(drafter, loss, corpus, seqs: int, anchors: int, steps: int) -> dict:
    from specserve.train.trainer import make_blocks

    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    rng = random.Random(0)
    parts = {"batch": 0.0, "forward": 0.0, "loss": 0.0, "backward": 0.0, "optimizer": 0.0}
    positions = 0
    g, mask_id = drafter.config.block_size, drafter.config.mask_token_id
    for step in range(steps + 2):
        t = [time.perf_counter()]
        blk = make_blocks([corpus.sequence(i) for i in rng.sample(range(len(corpus)), seqs)], g, anchors, mask_id, rng)
        t.append(time.perf_counter())
        with loss.autocast():
            hidden = loss.block_hidden(blk)
            t.append(time.perf_counter())
            value, info = loss(blk, hidden=hidden)
        t.append(time.perf_counter())
        opt.zero_grad(set_to_none=True)
        value.backward()
        t.append(time.perf_counter())
        opt.step()
        t.append(time.perf_counter())
        if step >= 2:
            for name, a, b in zip(parts, t, t[1:]):
                parts[name] += b - a
            positions += info["positions"]
    total = sum(parts.values())
    return {"shape": f"{seqs}x{anchors}", "positions_per_step": positions // steps,
            "positions_per_s": round(positions / total, 1), "step_s": round(total / steps, 3),
            "share": {k: round(v / total, 3) for k, v in parts.items()}}


def matmul_gflops(m: int = 512, k: int = 576, n: int = 1536, repeats: int = 3) -> dict[str, float]:
    """torch's matmul speed on this CPU in float32 and bf16 at a drafter-sized shape: why training
    runs in float32 where the CPU has no native bf16 (`trainer.training_dtype`)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    speeds = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(dtype), b.to(dtype)
        x @ y  # warm-up
        started = time.perf_counter()
        for _ in range(repeats):
            x @ y
        speeds[str(dtype).removeprefix("torch.")] = round(2 * m * k * n * repeats / (time.perf_counter() - started) / 1e9, 1)
    return speeds
