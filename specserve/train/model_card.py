"""A drafter's history (`train_state.json`) and the README.md built from it: every extension that made it."""

from __future__ import annotations

import json
import os

from specserve.errors import ConfigError

STATE_FILE = "train_state.json"


def read_train_state(drafter_dir: str) -> dict:
    path = os.path.join(drafter_dir, STATE_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"{path} not found (train into --out first, or use --init-from)")
    with open(path) as f:
        return json.load(f)


def save_train_state(drafter_dir: str, state: dict) -> None:
    """Write the state and rebuild the card from it."""
    with open(os.path.join(drafter_dir, STATE_FILE), "w") as f:
        json.dump(state, f, indent=1)
    write_model_card(drafter_dir, state)


def record_served(drafter_dir: str, reports: dict[str, dict], settings: dict) -> None:
    """Add `specserve eval-drafter` figures (per prompt set) to the drafter's latest extension."""
    state = read_train_state(drafter_dir)
    served = state["extensions"][-1].setdefault("served", {})
    for name, rep in reports.items():
        served[name] = {"accept_length": round(rep["served"]["accept_length"], 4),
                        "first_draft_accepted": round(rep["served"]["first_draft_accepted"], 4),
                        "every_anchor_accept_length": round(rep["every_anchor"]["accept_length"], 4),
                        "prompts": rep["requests"], **settings}
    save_train_state(drafter_dir, state)


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
        "weights exp(-k/4)), AdamW, bf16 autocast on CPUs with AVX512-BF16, else float32.",
        "- Data: the corpus in `data/drafter/` (token ids; `manifest.json` lists every shard's source and counts). "
        "The target's hidden states and top-k are recomputed from the ids for training.",
        "",
        "## Extensions",
        "",
        "Each row is one `specserve train-drafter` run. Steps are cumulative. " + _held_out_text(state) + " "
        "*Dev* is the served accept length on the "
        "development prompts (bf16, DSPARK fixed, greedy, 256 new tokens). Each run measures the drafter it "
        "replaces in the same run.",
        "",
        f"| # | date | answer tokens trained on | steps | train min | teacher min | positions/s | {_held_out_header(state)} "
        "| dev (new / replaced) | promoted |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    blocks = _line_blocks(state)
    for n, e in enumerate(state.get("extensions", [])):
        dev = e.get("dev")
        dev_text = f"{dev['new_dev_accept_length']:.3f} / {dev['shipped_dev_accept_length']:.3f}" if dev else "-"
        promoted = ("yes" if dev["promoted"] else "no") if dev else e.get("promoted_note", "-")
        lines.append(f"| {n} | {e.get('date', '-')} | {e.get('train_answer_tokens', '-')} | {e.get('steps', '-')} | "
                     f"{e.get('train_minutes', '-')} | {e.get('teacher_minutes', '-')} | {e.get('positions_per_s', '-')} | "
                     f"{_held_out_cell(e, blocks)} | {dev_text} | {promoted} |")
    notes = [e["note"] for e in state.get("extensions", []) if e.get("note")]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    lines += _served_lines(state)
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def _line_records(state: dict) -> list[dict]:
    return [e["held_out_line"] for e in state.get("extensions", []) if e.get("held_out_line")]


def _line_blocks(state: dict):
    """The block count every line-wide figure shares (None if none is recorded or they differ)."""
    counts = {r["blocks"] for r in _line_records(state)}
    return counts.pop() if len(counts) == 1 else None


def _held_out_header(state: dict) -> str:
    blocks = _line_blocks(state)
    return f"held-out TF (line, {blocks} blocks)" if blocks else "held-out TF (line)"


def _held_out_cell(ext: dict, blocks) -> str:
    """The line-wide figure only: a run's own held-out score is on another set, so it never stands in."""
    rec = ext.get("held_out_line")
    if not rec or rec.get("accept_length") is None:
        return "-"
    return f"{rec['accept_length']:.3f}" + ("" if rec["blocks"] == blocks else f" ({rec['blocks']} blocks)")


def _held_out_text(state: dict) -> str:
    records = _line_records(state)
    text = ("*Held-out TF (line)* is the teacher-forced accept length of each row's weights on one held-out set for "
            "the whole line: the corpus sequences of the line's fixed held-out prompts (`held_out_keys`)")
    if records:
        r = records[-1]
        text += (f", {r['sequences']} sequences of {', '.join(r['sources'])} for {r['keys']} keys, "
                 f"{r['anchors_per_seq']} random anchors each (seed {r['seed']}), {r['precision']}")
    return text + (". Every row's weights are taken from the git commit that holds them and rescored by "
                   "`python -m benchmarks rescore-line` (`held_out_line` in `train_state.json`); '-' is a row "
                   "not rescored. A run's own before/after score (`held_out_teacher_forced`) is on the held-out "
                   "sequences of the shards that run chose, a set that differs between runs, and is not shown.")


def _served_lines(state: dict) -> list[str]:
    rows = [(n, name, r) for n, e in enumerate(state.get("extensions", [])) for name, r in e.get("served", {}).items()]
    lines = ["", "## Served acceptance", "",
             "Recorded by `specserve eval-drafter --record` (DSPARK fixed, static verify, greedy); *every anchor* is "
             "the mean over all anchors of the same responses, what a random-anchor training score converges to.", ""]
    if not rows:
        return lines + ["None recorded yet."]
    lines += ["| # | prompt set | prompts | new tokens | dtype | accept length | first draft accepted | every anchor |",
              "|---|---|---|---|---|---|---|---|"]
    for n, name, r in rows:
        lines.append(f"| {n} | {name} | {r['prompts']} | {r.get('max_new_tokens', '-')} | {r.get('dtype', '-')} | "
                     f"{r['accept_length']:.3f} | {100 * r['first_draft_accepted']:.1f}% | "
                     f"{r['every_anchor_accept_length']:.3f} |")
    return lines
