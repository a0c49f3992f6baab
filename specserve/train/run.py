"""`specserve train-drafter`: train (or extend) a DSpark drafter on the repository's corpus.

The corpus is the token-id shards of `specserve drafter-corpus` (`data/drafter/`). The target's
hidden states and top-k are recomputed for shards not yet in the local teacher cache, then the
drafter trains on every source's sequences. `--resume` continues OUT's run (its full local
checkpoint, or the committed weights-only one); `--init-from` starts from another drafter's weights.
`--promote DIR` measures this drafter and DIR's on the development prompts in one run and replaces
DIR only if the new one is accepted longer; the model card records every extension.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from dataclasses import asdict
from typing import Optional

import torch

from specserve.errors import ConfigError
from specserve.train.corpus_cli import DEFAULT_DATA_DIR
from specserve.train.model_card import STATE_FILE, read_train_state, save_train_state

TRAIN_DEFAULTS = dict(steps=1200, seqs_per_step=8, anchors_per_seq=48)
DEFAULT_TOPK = 16  # teacher probabilities kept per position (the cache is keyed by it)


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="drafter directory (config.json, model.safetensors, "
                                                "train_state.json; checkpoint.pt for a full local resume)")
    p.add_argument("--model-path", default=None, help="target model (default: the embedded one)")
    p.add_argument("--data", default=DEFAULT_DATA_DIR, help="corpus folder (manifest.json, shards/)")
    p.add_argument("--sources", default=None, help="comma-separated corpus sources (default: all)")
    p.add_argument("--shards", default=None, help="only these shard numbers, e.g. 0-4,6 (default: all)")
    p.add_argument("--cache", default=None, help="teacher cache folder (default: DATA/cache, not committed)")
    p.add_argument("--topk", type=int, default=DEFAULT_TOPK, help="teacher distribution kept per position")
    p.add_argument("--init-from", default=None, help="start from this drafter directory's weights and shape")
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--block-size", type=int, default=5)
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--num-context-layers", type=int, default=3)
    p.add_argument("--mask-token-id", type=int, default=0)
    p.add_argument("--draft-vocab-size", type=int, default=16384,
                   help="draft from the target's N most emitted ids (0: the full vocabulary)")
    p.add_argument("--steps", type=int, default=TRAIN_DEFAULTS["steps"], help="steps of this run")
    p.add_argument("--seqs-per-step", type=int, default=TRAIN_DEFAULTS["seqs_per_step"])
    p.add_argument("--anchors-per-seq", type=int, default=TRAIN_DEFAULTS["anchors_per_seq"],
                   help="blocks per sequence per step (0: every answer position)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-minutes", type=float, default=None, help="stop training after this long (budget)")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--held-out", type=int, default=48, help="corpus sequences kept for the teacher-forced score")
    p.add_argument("--resume", action="store_true", help="continue OUT's run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dev-prompts", type=int, default=64, help="dev prompts for --promote (0: all)")
    p.add_argument("--note", default=None, help="a line for the model card about this extension")
    p.add_argument("--promote", default=None, help="replace this drafter directory if the new drafter's dev accept "
                                                    "length is higher (both measured in this run)")


def run_train_drafter(ns: argparse.Namespace) -> int:
    from specserve.models.loader import load_model
    from specserve.train.corpus_store import CorpusStore
    from specserve.train.teacher import TeacherCache, TeacherCorpus

    if ns.resume and ns.init_from:
        raise ConfigError("--resume continues --out's own weights; --init-from starts a new line: give one of them")
    if ns.promote and os.path.realpath(ns.promote) == os.path.realpath(ns.out):
        raise ConfigError("--promote must name another directory than --out (the drafter it may replace is "
                         "measured against the new one)")
    os.makedirs(ns.out, exist_ok=True)
    torch.manual_seed(ns.seed)
    store = CorpusStore(ns.data)
    sources = [s.strip() for s in ns.sources.split(",")] if ns.sources else None
    if not store.shards:
        raise ConfigError(f"--data {ns.data}: no corpus shards (run `specserve drafter-corpus extend` first)")
    loaded = load_model(ns.model_path)
    state = read_train_state(ns.out) if ns.resume else {}
    if not ns.resume and ns.init_from and os.path.isfile(os.path.join(ns.init_from, STATE_FILE)):
        state = read_train_state(ns.init_from)  # the history it extends
    cfg = _drafter_config(ns, loaded.config, state)
    model_name = target_model_name(ns.model_path)
    cache = TeacherCache(ns.cache or os.path.join(ns.data, "cache"), cfg.target_layer_ids, ns.topk, model_name)
    chosen = select_shards(store, sources, ns.shards)
    teacher_s = build_teacher_cache(cache, store, chosen, ns.model_path)
    corpus = TeacherCorpus([cache.load(s) for s in chosen], cfg.target_layer_ids, ns.topk)
    train_set, held_out = split_for_line(corpus, store, chosen, state, ns.held_out)
    drafter, loss = _build_drafter(ns, cfg, loaded, train_set, held_out, state)
    del loaded
    summary = _train(ns, drafter, loss, train_set, held_out, state)
    summary.update(teacher_minutes=round(teacher_s / 60, 2), corpus=store.counts(),
                   corpus_by_source={s: store.counts(s) for s in store.sources() if sources is None or s in sources},
                   shards=[os.path.basename(s.file) for s in chosen])
    _save(ns.out, drafter, state, summary, model_name)
    if ns.promote:
        summary["promotion"] = promote(ns.out, ns.promote, ns.dev_prompts, ns.data, ns.model_path)
    print(json.dumps(summary))
    return 0


def _drafter_config(ns: argparse.Namespace, target_cfg, state: dict):
    from specserve.models.dspark_checkpoint import read_drafter_config
    from specserve.train.trainer import drafter_config_for

    source = ns.out if ns.resume else ns.init_from
    if source:
        cfg = read_drafter_config(source)
        cfg.validate_for(target_cfg)
        return cfg
    return drafter_config_for(target_cfg, ns.num_layers, ns.block_size, ns.markov_rank, ns.num_context_layers,
                              ns.mask_token_id)


def target_model_name(model_path: Optional[str]) -> str:
    """The target's file name, which keys the teacher cache (the embedded model's by default)."""
    return os.path.basename(model_path or "SmolLM2-135M-Instruct.Q4_1.gguf")


def select_shards(store, sources: Optional[list[str]], numbers: Optional[str]) -> list:
    """The shards of `sources` (all when None) whose numbers are in `numbers` ("0-4,6"; all when None)."""
    wanted = parse_shard_numbers(numbers) if numbers else None
    chosen = [s for s in store.shards if (sources is None or s.source in sources)
              and (wanted is None or shard_number(s) in wanted)]
    if not chosen:
        raise ConfigError(f"no corpus shard matches --sources {sources} --shards {numbers} "
                         f"(have: {', '.join(os.path.basename(s.file) for s in store.shards)})")
    return chosen


def shard_number(info) -> int:
    """A shard's number (the NNNNN of shards/NNNNN-SOURCE.npz)."""
    return int(os.path.basename(info.file).split("-", 1)[0])


def parse_shard_numbers(spec: str) -> set[int]:
    """"0-4,6" as {0, 1, 2, 3, 4, 6}."""
    numbers: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            numbers.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ConfigError(f"--shards {spec!r}: expected shard numbers and ranges like 0-4,6") from None
    return numbers


def build_teacher_cache(cache, store, shards: list, model_path: Optional[str]) -> float:
    """Compute the teacher (hidden states, top-k) for those of `shards` `cache` lacks; the seconds it took."""
    missing = cache.missing(shards)
    if not missing:
        return 0.0
    from tqdm import tqdm

    from specserve.engine import Engine

    engine = Engine(model_path=model_path, speculative_algorithm="NONE", random_seed=0)
    try:
        return cache.build(store, engine.target_model, shards, log=tqdm.write)["seconds"]
    finally:
        engine.shutdown()


def split_for_line(corpus, store, chosen: list, state: dict, size: int):
    """(training set, held-out set) of the chosen shards' sequences for the line whose state is
    `state`; records the held-out keys in it (`held_out.py`: fixed once chosen, never trained on)."""
    from specserve.train.held_out import choose_held_out_keys, record_held_out_keys, trained_shards

    keys = [k for info in chosen for k in store.shard_keys(info)]
    shard_of = [os.path.basename(info.file) for info in chosen for _ in range(info.sequences)]
    seen = trained_shards(state)
    trained_keys = [k for info in store.shards if os.path.basename(info.file) in seen for k in store.shard_keys(info)]
    held_keys = choose_held_out_keys(keys, shard_of, state, size, trained_keys)
    if not held_keys:
        print("no held-out sequences: this drafter line trained on every chosen prompt (no teacher-forced score)")
    record_held_out_keys(state, held_keys)
    held = [k for k, key in enumerate(keys) if key in held_keys]
    train = [k for k, key in enumerate(keys) if key not in held_keys]
    return corpus.subset(train), corpus.subset(held).materialise()


def _build_drafter(ns, cfg, loaded, train_set, held_out, state: dict):
    from specserve.models.dspark import DsparkDrafter
    from specserve.models.loader import head_weight
    from specserve.train.trainer import DrafterLoss, choose_draft_vocab, init_from_target, training_dtype

    max_len = max(int(sh.seq_offsets[i + 1] - sh.seq_offsets[i]) for sh in train_set.shards
                  for i in range(len(sh))) + cfg.block_size + 1
    max_len = max(max_len, max((len(s.ids) for s in held_out.sequences), default=0) + cfg.block_size + 1)
    start = ns.out if ns.resume else ns.init_from
    if start is None and ns.draft_vocab_size:
        ids, coverage = choose_draft_vocab(train_set, cfg.vocab_size, ns.draft_vocab_size,
                                           always=(ns.mask_token_id, 1, 2), held_out=held_out)
        cfg.draft_vocab_size = len(ids)
        print(f"draft vocabulary: {len(ids)} ids cover {coverage:.4f} of held-out answer tokens")
    drafter = DsparkDrafter(cfg, max_positions=max_len)
    if start is not None:
        load_drafter_weights(drafter, start)
    else:
        from specserve.models.dspark_checkpoint import init_drafter

        drafter.load_state_dict(init_drafter(cfg, seed=ns.seed), strict=False)
        if ns.draft_vocab_size:
            drafter.draft_to_target.copy_(ids)
        init_from_target(drafter, loaded.weights, layer=loaded.config.num_layers - 1)
    dtype = training_dtype()
    embed = loaded.weights["model.embed_tokens.weight"].to(dtype)
    head = head_weight(loaded.weights).to(dtype)
    return drafter, DrafterLoss(drafter, embed, head)


def load_drafter_weights(drafter, path: str) -> None:
    """Load a drafter directory's (bf16) weights into `drafter` as fp32 for training."""
    from safetensors.torch import load_file

    from specserve.models.dspark_checkpoint import WEIGHTS_FILE

    weights = load_file(os.path.join(path, WEIGHTS_FILE))
    missing, unexpected = drafter.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                   for k, v in weights.items()}, strict=False)
    if [m for m in missing if not m.startswith("rope.")] or unexpected:
        raise ConfigError(f"{path}: weights do not match its config (missing {missing}, unexpected {unexpected})")


def _train(ns, drafter, loss, train_set, held_out, state: dict) -> dict:
    from tqdm import tqdm

    from specserve.train.trainer import TrainConfig, teacher_forced_accept_length, train

    g, mask_id = drafter.config.block_size, drafter.config.mask_token_id
    checkpoint = _resumable_checkpoint(ns.out, int(state.get("steps", 0))) if ns.resume else None
    if checkpoint is not None:  # "before" scores the weights this run starts from: the checkpoint's, not the card's
        drafter.load_state_dict(checkpoint["drafter"], strict=False)
    before = teacher_forced_accept_length(loss, held_out, g, mask_id)
    tcfg = TrainConfig(steps=ns.steps, seqs_per_step=ns.seqs_per_step, anchors_per_seq=ns.anchors_per_seq, lr=ns.lr,
                       seed=ns.seed + len(state.get("extensions", [])), checkpoint_every=ns.checkpoint_every,
                       max_minutes=ns.max_minutes)
    bar = tqdm(total=ns.steps, desc="train-drafter", unit="step")
    started, history = time.perf_counter(), []

    def on_step(step: int, parts: dict, lr: float) -> None:
        history.append({"step": step, **parts})
        rate = sum(h["positions"] for h in history) / (time.perf_counter() - started)
        bar.n = step
        bar.set_postfix(loss=f"{parts['loss']:.3f}", top1=f"{parts['top1']:.2f}", pos_s=f"{rate:.0f}", lr=f"{lr:.1e}")
        bar.refresh()

    last = train(drafter, loss, train_set, tcfg, ns.out, on_step, resume_from=checkpoint,
                 start_step=int(state.get("steps", 0)))
    bar.close()
    seconds = time.perf_counter() - started
    after = teacher_forced_accept_length(loss, held_out, g, mask_id)
    positions = sum(h["positions"] for h in history)
    return {"steps": last, "run_steps": len(history), "train_minutes": round(seconds / 60, 2),
            "positions": positions, "positions_per_s": round(positions / max(seconds, 1e-9), 1),
            "precision": str(loss.dtype).removeprefix("torch."), "first_loss": history[0]["loss"] if history else None, "last_loss": _mean_tail(history, "loss"),
            "train_sequences": len(train_set), "train_answer_tokens": train_set.answer_tokens,
            "held_out_teacher_forced": {"before": before, "after": after}, "history": history,
            "started_from": ("checkpoint.pt" if checkpoint is not None else "weights") if ns.resume else
            ("init-from" if ns.init_from else "scratch"),
            "args": _jsonable(vars(ns))}


def _resumable_checkpoint(out: str, committed_steps: int) -> Optional[dict]:
    """out's checkpoint.pt, loaded once, if it continues the line; else None. It continues the line
    only where it is the line's last step (optimizer state kept) or an interrupted run after it. A
    stale one from an earlier stretch would roll the drafter back; a finished run's checkpoint past
    the recorded steps belongs to an extension whose weights and record were reset, and continuing
    it would train from an unrecorded link."""
    from specserve.train.trainer import CHECKPOINT_FILE, load_checkpoint

    path = os.path.join(out, CHECKPOINT_FILE)
    if not os.path.isfile(path):
        return None
    ckpt = load_checkpoint(path)
    step = ckpt["step"]
    if step < committed_steps:
        print(f"ignoring {path}: step {step} is older than the committed weights' step {committed_steps}")
        return None
    if step > committed_steps and ckpt.get("finished", False):
        print(f"ignoring {path}: a finished run's step {step}, past the recorded line's step {committed_steps} "
              f"(that run's weights and record are not in {out})")
        return None
    return ckpt


def _save(out: str, drafter, state: dict, summary: dict, model_name: str) -> None:
    from specserve.models.dspark_checkpoint import save_drafter

    history = summary.pop("history")
    cfg = drafter.config
    ext = {k: v for k, v in summary.items()}
    ext["date"] = time.strftime("%Y-%m-%d", time.gmtime())
    if summary["args"].get("note"):
        ext["note"] = summary["args"]["note"]
    state.setdefault("extensions", []).append(ext)
    state["steps"] = summary["steps"]
    cfg.extra = {"target": model_name, "extensions": len(state["extensions"]),
                 "training_steps": summary["steps"], "train_answer_tokens": summary["train_answer_tokens"]}
    save_drafter(out, cfg, {k: v for k, v in drafter.state_dict().items() if not k.startswith("rope.")},
                 dtype=torch.bfloat16)
    with open(os.path.join(out, "train_history.json"), "w") as f:
        json.dump({"history": history, "config": asdict(cfg)}, f)
    save_train_state(out, state)


def promote(new: str, shipped: str, dev_prompts: int, data: str, model_path: Optional[str],
            max_new_tokens: int = 256) -> dict:
    """Measure both drafters on the dev prompts (bf16, DSPARK fixed, greedy); copy `new` over
    `shipped` only if it is accepted longer. Records the result in both states."""
    from specserve.engine import Engine
    from specserve.train.eval_drafter import evaluate_drafter, load_prompt_set

    prompts = load_prompt_set("dev", data)
    prompts = prompts[:dev_prompts] if dev_prompts else prompts
    scores = {}
    for name, path in (("new", new), ("shipped", shipped)):
        engine = Engine(model_path=model_path, speculative_algorithm="DSPARK", speculative_policy="fixed",
                        speculative_draft_model_path=path, max_running_requests=16, random_seed=0)
        try:
            scores[name] = evaluate_drafter(engine, prompts, max_new_tokens)
        finally:
            engine.shutdown()
    new_len = scores["new"]["served"]["accept_length"]
    old_len = scores["shipped"]["served"]["accept_length"]
    result = {"dev_prompts": len(prompts), "new_dev_accept_length": new_len, "shipped_dev_accept_length": old_len,
              "new_every_anchor": scores["new"]["every_anchor"]["accept_length"], "promoted": new_len > old_len}
    state = read_train_state(new)
    state["extensions"][-1]["dev"] = result
    save_train_state(new, state)
    with open(os.path.join(new, "dev_eval.json"), "w") as f:
        json.dump(scores, f, indent=1)
    if result["promoted"]:
        _replace_drafter(new, shipped)
    return result


def _replace_drafter(new: str, shipped: str) -> None:
    """Swap in `new`'s files as a whole directory, so an interruption never leaves weights and config
    of different drafters side by side. Figures measured on the replaced drafter (eval.json/png) go."""
    staging, retired = shipped.rstrip("/") + ".new", shipped.rstrip("/") + ".old"
    for path in (staging, retired):
        shutil.rmtree(path, ignore_errors=True)
    os.makedirs(staging)
    for name in ("config.json", "model.safetensors", STATE_FILE, "README.md", "dev_eval.json"):
        shutil.copy(os.path.join(new, name), os.path.join(staging, name))
    os.rename(shipped, retired)
    os.rename(staging, shipped)
    shutil.rmtree(retired)


def _mean_tail(history: list[dict], key: str, n: int = 20) -> Optional[float]:
    tail = [h[key] for h in history[-n:]]
    return sum(tail) / len(tail) if tail else None


def _jsonable(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool, type(None)))}
