"""README.md beside a drafter's weights: what it is and every extension that made it."""

from __future__ import annotations

import json
import os


def write_model_card(out: str, state: dict) -> None:
    """The card is rebuilt from `train_state.json` (the extensions) and `config.json` (the shape)."""
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    lines = [
        f"# DSpark drafter for {cfg.get('extra', {}).get('target', 'the target')}",
        "",
        f"- Shape: {cfg['num_layers']} draft layer(s), width {cfg['hidden_size']}, block size {cfg['block_size']}, "
        f"Markov rank {cfg['markov_rank']}, draft vocabulary {cfg.get('draft_vocab_size') or cfg['vocab_size']} ids, "
        f"context from target layers {cfg['target_layer_ids']}; shares the target's embedding and LM head.",
        "- Loss: the DeepSpec recipe (0.1 CE + 0.9 TV against the target's top-k + 1.0 confidence BCE, slot "
        "weights exp(-k/4)), AdamW, bf16 autocast on CPU.",
        "- Data: the corpus in `data/drafter/` (token ids; `manifest.json` lists every shard's source and counts). "
        "The target's hidden states and top-k are recomputed from the ids for training.",
        "",
        "## Extensions",
        "",
        "Each row is one `specserve train-drafter` run. Steps are cumulative. *Held-out TF* is the teacher-forced "
        "accept length at random anchors on held-out corpus sequences. *Dev* is the served accept length on the "
        "development prompts (bf16, DSPARK fixed, greedy, 256 new tokens). Each run measures the drafter it "
        "replaces in the same run.",
        "",
        "| # | date | answer tokens trained on | steps | train min | teacher min | positions/s | held-out TF | dev (new / replaced) | promoted |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, e in enumerate(state.get("extensions", [])):
        dev = e.get("dev")
        dev_text = f"{dev['new_dev_accept_length']:.3f} / {dev['shipped_dev_accept_length']:.3f}" if dev else "-"
        promoted = ("yes" if dev["promoted"] else "no") if dev else e.get("promoted_note", "-")
        tf = e.get("held_out_teacher_forced", {}).get("after", {}).get("accept_length")
        lines.append(f"| {n} | {e.get('date', '-')} | {e.get('train_answer_tokens', '-')} | {e.get('steps', '-')} | "
                     f"{e.get('train_minutes', '-')} | {e.get('teacher_minutes', '-')} | {e.get('positions_per_s', '-')} | "
                     f"{'-' if tf is None else f'{tf:.3f}'} | {dev_text} | {promoted} |")
    notes = [e["note"] for e in state.get("extensions", []) if e.get("note")]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    lines += ["", "Served acceptance on MT-Bench: `eval.json` here when present (`specserve eval-acceptance`), "
              "and `specserve eval-drafter --prompts mt-bench`."]
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
