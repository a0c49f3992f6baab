"""`python -m benchmarks rescore-line`: every drafter of a line scored on one held-out set.

Each `train-drafter` run scores its drafter teacher-forced on the held-out sequences of the shards
that run chose, so two runs on different shards report figures on different sets (extension 6's
192 blocks against extensions 1-3's 768) and the card's column could read a fall as a rise. This
scores every row's weights, as committed in git history (the row whose `steps` equals the
committed config's step count; the working tree's weights for a row not committed yet), on the
same set: every corpus sequence whose prompt key is in the line's `held_out_keys`, from the
sources the line trained on, in manifest order, at the same anchors (`teacher_forced_accept_length`'s
seed) and in one precision. Each extension gets `held_out_line` in `train_state.json`; the card shows
it. The teacher (the target's hidden states) is computed for those sequences only, not whole shards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from typing import Optional

import torch

from specserve.errors import ConfigError
from specserve.train.model_card import STATE_FILE, read_train_state, save_train_state

ANCHORS_PER_SEQ, SEED = 16, 1  # teacher_forced_accept_length's defaults, as every run used them
WEIGHTS, CONFIG = "model.safetensors", "config.json"


def _git(cwd: str, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _config_steps(cfg: dict) -> Optional[int]:
    """The cumulative training steps a drafter config records (run 0's older layout too)."""
    extra = cfg.get("extra", {})
    steps = extra.get("training_steps", extra.get("training", {}).get("steps"))
    return None if steps is None else int(steps)


def weight_versions(drafter_dir: str) -> list[dict]:
    """Every committed version of the drafter's weights, oldest first (renames followed):
    {"commit", "path" (of model.safetensors at that commit), "blob", "steps"}."""
    root = _git(drafter_dir, "rev-parse", "--show-toplevel").strip()
    rel = os.path.relpath(os.path.join(os.path.realpath(drafter_dir), WEIGHTS), os.path.realpath(root))
    log = _git(root, "log", "--follow", "--format=C %h", "--name-status", "--", rel)
    versions, commit = [], None
    for line in log.splitlines():
        if line.startswith("C "):
            commit = line[2:].strip()
        elif line.strip() and commit is not None and not line.startswith("D"):
            path = line.split("\t")[-1]
            cfg = json.loads(_git(root, "show", f"{commit}:{os.path.dirname(path)}/{CONFIG}"))
            versions.append({"commit": commit, "path": path, "blob": _git(root, "rev-parse", f"{commit}:{path}").strip(),
                             "steps": _config_steps(cfg)})
            commit = None
    return versions[::-1]


def match_rows(extensions: list[dict], versions: list[dict], worktree: Optional[dict]) -> list[Optional[dict]]:
    """The weights of each row: the last committed weights with the row's step count (from the
    commit that first had them), else the working tree's if its config has that count; else None."""
    out = []
    for ext in extensions:
        same = [v for v in versions if v["steps"] == ext.get("steps")]
        if same:
            blob = same[-1]["blob"]
            out.append(next(v for v in same if v["blob"] == blob))
        elif worktree is not None and worktree["steps"] == ext.get("steps"):
            out.append(worktree)
        else:
            out.append(None)
    return out


def line_sources(state: dict) -> Optional[set[str]]:
    """The corpus sources the line trained on (from the shard names its extensions record; None: all)."""
    names = {name for ext in state.get("extensions", []) for name in ext.get("shards", [])}
    return {name[:-4].split("-", 1)[1] for name in names} if names else None


def line_pairs(store, state: dict) -> tuple[list, list[str]]:
    """The line's held-out sequences (manifest order) and the sources they were taken from."""
    keys, sources = set(state.get("held_out_keys", ())), line_sources(state)
    pairs = [pair for info, pair in store.pairs(sorted(sources) if sources else None) if pair.key in keys]
    return pairs, sorted(sources) if sources else store.sources()


def teacher_for(pairs: list, layer_ids: list[int], model_path: Optional[str]):
    """The target's hidden states for `pairs` alone, as the teacher cache stores them (bf16)."""
    from specserve.engine import Engine
    from specserve.train.corpus import Corpus, capture
    from specserve.train.run import DEFAULT_TOPK
    from specserve.train.teacher import CAPTURE_GROUP

    engine = Engine(model_path=model_path, speculative_algorithm="NONE", random_seed=0)  # as build_teacher_cache
    try:
        seqs = []
        for at in range(0, len(pairs), CAPTURE_GROUP):
            group = [(p.prompt_ids, p.answer_ids) for p in pairs[at:at + CAPTURE_GROUP]]
            seqs += capture(engine.target_model, group, layer_ids, DEFAULT_TOPK)
    finally:
        engine.shutdown()
    for s in seqs:
        s.hidden = s.hidden.to(torch.bfloat16)
        s.top_probs = s.top_probs.to(torch.float16).float()
    return Corpus(seqs, list(layer_ids), DEFAULT_TOPK)


def score_weights(folder: str, held_out, loaded, dtype: torch.dtype) -> dict:
    """Teacher-forced accept length of the drafter in `folder` on `held_out`, as `_train` scores it."""
    from specserve.models.dspark import DsparkDrafter
    from specserve.models.dspark_checkpoint import read_drafter_config
    from specserve.models.loader import head_weight
    from specserve.train.run import load_drafter_weights
    from specserve.train.trainer import DrafterLoss, teacher_forced_accept_length

    cfg = read_drafter_config(folder)
    cfg.validate_for(loaded.config)
    drafter = DsparkDrafter(cfg, max_positions=max(len(s.ids) for s in held_out.sequences) + cfg.block_size + 1)
    load_drafter_weights(drafter, folder)
    embed = loaded.weights["model.embed_tokens.weight"].to(dtype)
    head = head_weight(loaded.weights).to(dtype)
    with torch.no_grad():
        return teacher_forced_accept_length(DrafterLoss(drafter, embed, head), held_out, cfg.block_size,
                                            cfg.mask_token_id, seed=SEED, anchors_per_seq=ANCHORS_PER_SEQ)


def _extract(root: str, version: dict, folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    for name in (WEIGHTS, CONFIG):
        path = f"{version['commit']}:{os.path.dirname(version['path'])}/{name}"
        with open(os.path.join(folder, name), "wb") as f:
            subprocess.run(["git", "show", path], cwd=root, check=True, stdout=f)


def rescore_line(drafter_dir: str, data: str, model_path: Optional[str], dtype: torch.dtype,
                 log=print) -> list[Optional[dict]]:
    """`held_out_line` for each extension of the line in `drafter_dir` (None where no weights match)."""
    from specserve.models.loader import load_model
    from specserve.train.corpus_store import CorpusStore

    started = time.perf_counter()
    state = read_train_state(drafter_dir)
    with open(os.path.join(drafter_dir, CONFIG)) as f:
        shipped_cfg = json.load(f)
    root = _git(drafter_dir, "rev-parse", "--show-toplevel").strip()
    work_blob = _git(root, "hash-object", os.path.join(os.path.realpath(drafter_dir), WEIGHTS)).strip()
    worktree = {"commit": "working tree", "blob": work_blob, "steps": _config_steps(shipped_cfg), "dir": drafter_dir}
    rows = match_rows(state["extensions"], weight_versions(drafter_dir), worktree)
    pairs, sources = line_pairs(CorpusStore(data), state)
    if not pairs:
        raise ConfigError(f"{drafter_dir}: none of the line's held_out_keys is in the corpus at {data}")
    held_out = teacher_for(pairs, shipped_cfg["target_layer_ids"], model_path)
    teacher_s = time.perf_counter() - started
    log(f"teacher for {len(pairs)} held-out sequences: {teacher_s:.0f} s")
    loaded = load_model(model_path)
    out: list[Optional[dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, version in enumerate(rows):
            if version is None:
                log(f"row {n}: no committed weights with {state['extensions'][n].get('steps')} steps; not scored")
                out.append(None)
                continue
            folder = version.get("dir") or os.path.join(tmp, version["commit"])
            if "dir" not in version:
                _extract(root, version, folder)
            score = score_weights(folder, held_out, loaded, dtype)
            out.append({"accept_length": round(score["accept_length"], 4), "blocks": score["blocks"],
                        "per_slot_survival": score["per_slot_survival"], "sequences": len(pairs),
                        "keys": len(state["held_out_keys"]), "sources": sources, "anchors_per_seq": ANCHORS_PER_SEQ,
                        "seed": SEED, "precision": str(dtype).removeprefix("torch."),
                        "weights": version["commit"], "weights_blob": version["blob"][:12]})
            log(f"row {n}: {out[-1]['accept_length']:.4f} on {score['blocks']} blocks (weights {version['commit']})")
            if "dir" not in version:
                shutil.rmtree(folder)
    log(f"rescored the line in {time.perf_counter() - started:.0f} s")
    return out


def record_line(drafter_dirs: list[str], records: list[Optional[dict]]) -> None:
    """Write each row's `held_out_line` into every copy of the line (their extensions must agree)."""
    states = [read_train_state(d) for d in drafter_dirs]
    for d, state in zip(drafter_dirs, states):
        if [e.get("steps") for e in state["extensions"]] != [e.get("steps") for e in states[0]["extensions"]]:
            raise ConfigError(f"{os.path.join(d, STATE_FILE)}: not the same line as {drafter_dirs[0]}'s")
    for d, state in zip(drafter_dirs, states):
        for ext, rec in zip(state["extensions"], records):
            if rec is None:
                ext.pop("held_out_line", None)  # a figure from another set must not stand in the column
            else:
                ext["held_out_line"] = rec
        save_train_state(d, state)


def add_rescore_line_args(p) -> None:
    p.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--data", default=None, help="corpus folder holding the line's held-out sequences")
    p.add_argument("--model-path", default=None)
    p.add_argument("--also-record", default=None, help="comma-separated other copies of the line "
                                                       "(e.g. data/drafter/checkpoint) that get the same records")


def run_rescore_line(ns) -> int:
    """Score every extension's weights (from git history) teacher-forced on the line's whole held-out
    set, at --dtype, and record it per extension (held_out_line) and on the card."""
    from specserve.assets import default_drafter_path
    from specserve.train.corpus_cli import DEFAULT_DATA_DIR

    drafter = ns.drafter or default_drafter_path()
    records = rescore_line(drafter, ns.data or DEFAULT_DATA_DIR, ns.model_path, getattr(torch, ns.dtype))
    record_line([drafter] + [d.strip() for d in (ns.also_record or "").split(",") if d.strip()], records)
    print(json.dumps({"drafter": drafter, "held_out_line": records}))
    return 0
