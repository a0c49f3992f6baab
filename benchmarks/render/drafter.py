"""Rendered parts about the drafter: the extension line (served accept lengths, dev, the held-out
teacher-forced score on one set for the whole line), the shape ablations, training speed and what
the corpus cost to generate. The line's promoted extensions come from the shipped drafter's
`train_state.json`, the ones not promoted from their `bench_results/drafter_extension*.json`."""

from __future__ import annotations

import os
import re
from typing import Any, Optional

from benchmarks.render.common import REPO, SHIPPED_DRAFTER, load, provenance, table

STATE = os.path.join(SHIPPED_DRAFTER, "train_state.json")


def _number(note: str, index: int) -> int:
    found = re.match(r"\s*(?:extension|run)\s+(\d+)", note, re.I)
    return int(found.group(1)) if found else index


def line_entries(results: str) -> list[dict[str, Any]]:
    """Every extension of the line in order: {number, promoted, record, served (set -> figures)}."""
    state = load(REPO, STATE)
    entries = [{"number": _number(e.get("note", ""), i), "promoted": True, "record": e, "served": e.get("served", {})}
               for i, e in enumerate(state["extensions"])]
    for name in sorted(os.listdir(results)):
        found = re.fullmatch(r"drafter_extension(\d+)\.json", name)
        if not found:
            continue
        data = load(results, name)
        served = {"mt-bench": _served(data.get("mt_bench")), "heldout": _served(data.get("heldout_chat"))}
        promoted = data["extension"].get("dev", {}).get("promoted", False)
        if not promoted:  # a promoted one is in the state already
            entries.append({"number": int(found.group(1)), "promoted": False, "record": data["extension"],
                            "served": {k: v for k, v in served.items() if v}, "file": name})
    return sorted(entries, key=lambda e: e["number"])


def _served(report: Optional[dict]) -> Optional[dict]:
    if not report:
        return None
    s = report["served"]
    return {"accept_length": s["accept_length"], "first_draft_accepted": s["first_draft_accepted"]}


def _dev(entries: list[dict], i: int) -> str:
    dev = entries[i]["record"].get("dev")
    if dev:
        return f"{dev['new_dev_accept_length']:.3f}"
    later = next((e["record"].get("dev") for e in entries[i + 1:] if e["record"].get("dev")), None)
    return f"{later['shipped_dev_accept_length']:.3f}" if later else "-"  # run 0, measured by the run after it


def _trained_on(r: dict[str, Any]) -> str:
    args = r.get("args") or {}
    shards = f", shards {args['shards']}" if args.get("shards") else ""
    lr = f", lr {args['lr']:g}" if args.get("lr") else ""
    return f"{r['train_answer_tokens'] / 1e3:.0f}k answer tokens{shards}, {r['train_minutes']:.0f} min{lr}"


def _teacher_forced(r: dict[str, Any]) -> str:
    tf = r["held_out_teacher_forced"]
    after = tf["after"]
    before = tf.get("before") or {}
    if before.get("accept_length") and before.get("blocks") == after.get("blocks"):
        return f"{before['accept_length']:.3f} -> {after['accept_length']:.3f} ({after['blocks']} blocks)"
    return f"{after['accept_length']:.3f} ({after['blocks']} blocks)"


def render_drafter_line(results: str) -> str:
    entries = line_entries(results)
    rows = []
    for i, e in enumerate(entries):
        r, mt, held = e["record"], e["served"].get("mt-bench"), e["served"].get("heldout")
        label = "run 0" if e["number"] == 0 else f"extension {e['number']}"
        label += "" if e["promoted"] else " (not promoted)"
        line = r.get("held_out_line")
        rows.append([label, _trained_on(r), f"{mt['accept_length']:.3f}" if mt else "-",
                     f"{mt['first_draft_accepted']:.1%}" if mt else "-", _dev(entries, i),
                     f"{held['accept_length']:.3f}" if held else "-", _teacher_forced(r),
                     f"{line['accept_length']:.3f}" if line else "-"])
    shipped = max(i for i, e in enumerate(entries) if e["promoted"])
    rows[shipped][0] += " (shipped)"
    header = ["drafter", "trained on (this run)", "MT-Bench (80)", "first draft", "dev (64)", "held-out chat (64)",
              "held-out TF of its run: before -> after", "held-out TF, the line's set"]
    blocks = {e["record"]["held_out_line"]["blocks"] for e in entries if e["record"].get("held_out_line")}
    line_set = (f"the line's set is {'/'.join(map(str, sorted(blocks)))} blocks of the held-out sequences recorded in "
                f"`train_state.json`, the same for every row" if blocks else "the line's set was not scored")
    return table(header, rows) + (
        f"\n\nServed figures: bf16, DSPARK fixed, static verify, block 5, greedy, 256 new tokens (`specserve "
        f"eval-drafter`). The teacher-forced column of a run compares its drafter before and after on that run's "
        f"own held-out blocks (rows with different block counts used different sets); {line_set}. From "
        f"`{STATE}` and `bench_results/drafter_extension*.json` (the runs not promoted).\n")


def render_drafter_shapes(results: str) -> str:
    data = load(results, "drafter_shapes.json")
    rows, plain = [], data["plain_runs"]
    for name, a in data["arms"].items():
        b = a["batch1"]
        rows.append([name, f"`{a['flags'] or '(shipped shape)'}`", a["plain_run"], a["steps"], a["positions_per_s"],
                     f"{a['teacher_forced']:.3f}", f"{a['dev_accept_length']:.3f}", f"{a['dev_first_draft']:.1%}",
                     b["drafting_ms"], b["verify_step_ms"], f"{b['tokens_per_s']} ({a['batch1_speedup_vs_none']}x)"])
    header = ["arm", "flags", "run", f"steps in {data['minutes']:g} min", "positions/s", "held-out TF", "dev accept",
              "dev first draft", "drafting ms / verify step", "verify step ms", "batch-1 tok/s (vs NONE)"]
    cost = []
    for name in ("base", "block8"):
        a = data["arms"].get(name)
        if a:
            decode = plain[a["plain_run"]]["decode_step_ms"]
            cost.append(f"{name}: a verify step costs {a['batch1']['verify_step_ms'] / decode:.2f} decode steps "
                        f"({a['batch1']['verify_step_ms']} against {decode} ms), "
                        f"{a['batch1']['drafting_ms'] / a['batch1']['verify_step_ms']:.1%} of it drafting")
    nones = ", ".join(f"{p['tokens_per_s']}" for p in plain)
    return table(header, rows) + (
        f"\n\nNONE in the same runs: {nones} tok/s (the shared host's speed moved between runs, so compare arms by "
        f"their ratios). {'; '.join(cost)}. {provenance(data, 'drafter_shapes.json')}\n")


def render_train_speed(results: str) -> str:
    now, before, avx2 = (load(results, f) for f in ("train_speed.json", "train_speed_before.json",
                                                    "train_speed_avx2.json"))
    pos = lambda d, shape, dtype=None: next(r["positions_per_s"] for r in d["results"]  # noqa: E731
                                            if r["shape"] == shape and r.get("dtype", dtype) == dtype)
    line = line_entries(results)
    first = next(e["record"] for e in line if e["number"] == 1)
    return (f"On {avx2['machine']}, torch's bf16 matmul runs at {avx2['matmul_gflops']['bfloat16']:g} GFLOPS against "
            f"{avx2['matmul_gflops']['float32']:g} in float32, and a training step at 8x48 gives "
            f"{pos(avx2, '8x48', 'bfloat16'):g} positions/s in bf16 autocast against {pos(avx2, '8x48', 'float32'):g} "
            f"in float32 (`python -m benchmarks train-speed --shards 0 --dtypes float32,bfloat16 --shapes 8x48 --steps 2`, "
            f"`bench_results/train_speed_avx2.json`). On {now['machine']} with cached data (`python -m benchmarks "
            f"train-speed --shapes 16x12,8x48,8x96,4x0` against `python -m benchmarks.train_speed_before --shapes 16x12,8x48`, "
            f"the trainer before the grouped blocks and the chunked loss, revision {before['trainer_revision']}): "
            f"{pos(now, '8x48'):,.0f} positions/s at the default 8x48 against {pos(before, '8x48'):,.0f} for the old "
            f"trainer at 8x48 and {pos(before, '16x12'):,.0f} at its own default of 16x12 "
            f"(`bench_results/train_speed*.json`, one run each); extension 1 averaged "
            f"{first['positions_per_s']:,.0f} over its {first['train_minutes']:.0f} minutes.\n")


def render_corpus_costs(results: str) -> str:
    manifest = load(REPO, os.path.join("data", "drafter", "manifest.json"))
    rows = []
    for i, s in enumerate(manifest["shards"]):
        rate = s["answer_tokens"] / s["seconds"] if s.get("seconds") else None
        rows.append([i, s["source"], f"{s['answer_tokens']:,}", f"{s['seconds']:,.0f}" if s.get("seconds") else "-",
                     f"{rate:.0f}" if rate else "-", s.get("machine", "-")])
    teacher = [f"extension {e['number']} {e['record']['teacher_minutes']:.0f} min (shards "
               f"{(e['record'].get('args') or {}).get('shards') or 'all'})" for e in line_entries(results)
               if e["record"].get("teacher_minutes")]
    return table(["shard", "source", "answer tokens", "seconds", "answer tokens/s", "machine"], rows) + (
        f"\n\nGeneration time per shard as `manifest.json` records it (batch 128; a shard generated while tests "
        f"shared the cores is slower). Teacher prefill, as the line's runs record it (`teacher_minutes`, shards whose "
        f"cache the run had to build): {'; '.join(teacher)}.\n")
