"""`specserve bench report`: the README's figures, rendered from the committed result files.

A rendered part of the README sits between two markers (indented alike inside a list item):

    <!-- render: NAME -->
    ...text made by RENDERERS[NAME] from bench_results/...
    <!-- /render -->

`specserve bench report` rewrites every such part from the files; `--check` rewrites nothing and
exits 1 with a diff where the README and the files disagree (tests/unit/test_report.py runs it, so
a figure typed by hand, or a result file changed without its text, fails the suite). Each part
names its file and the file's provenance (machine; commit and date where the file records them).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from typing import Any, Callable

from specserve.bench.provenance import drafter_checksum

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(REPO, "README.md")
RESULTS = os.path.join(REPO, "bench_results")
SHIPPED_DRAFTER = os.path.join("specserve", "assets", "drafters", "smollm2-135m-instruct")
BLOCK = re.compile(r"^(?P<indent> *)(?P<open><!-- render: (?P<name>[\w-]+) -->\n)(?P<body>.*?)^(?P=indent)<!-- /render -->",
                   re.S | re.M)


def load(results: str, name: str) -> dict[str, Any]:
    with open(os.path.join(results, name)) as f:
        return json.load(f)


def provenance(data: dict[str, Any], file: str) -> str:
    """`bench_results/F` (machine; commit and date when recorded; the drafter, marked when it is
    not the shipped one): the line under a rendered part."""
    m = data.get("machine") or {}
    if isinstance(m, str):  # older files: dispatch.machine_description()
        machine = m
    else:
        if "cpu" in m and "model" not in m:  # spec_policy.json's older field name
            m = {**m, "model": m["cpu"]}
        machine = m.get("description") or ", ".join(
            [m.get("model", "machine not recorded")] + ([f"{m['threads']} threads"] if "threads" in m else [])
            + (["AVX512-BF16"] if m.get("avx512_bf16") else []) + (["AMX"] if m.get("amx") else ["no AMX"] if m else []))
    when = ", ".join(f"{k} {data[k]}" for k in ("commit", "date") if data.get(k)) or "commit and date not recorded"
    drafter = ""
    if data.get("drafter"):
        shipped = drafter_checksum(os.path.join(REPO, SHIPPED_DRAFTER))
        drafter = ("; the shipped drafter" if data["drafter"].get("sha256") == shipped else
                   f"; **drafter {data['drafter'].get('path')} is not the shipped one**")
    return f"From `bench_results/{file}` ({machine}; {when}{drafter})."


def render_grammar(results: str) -> str:
    data = load(results, "grammar.json")
    llg, xgr = data["libraries"]["llguidance"], data["libraries"]["xgrammar"]
    return (f"In `bench_results/grammar.json` llguidance compiles the {data['schemas']} schemas in "
            f"{llg['compile_ms_median']:.3g} ms (median) against XGrammar's {xgr['compile_ms_median']:.3g} ms and "
            f"computes a mask in {llg['mask_ms_per_token']:.3g} ms per token against "
            f"{xgr['mask_ms_per_token']:.3g} ms; XGrammar accepts "
            f"{', '.join('`' + f + '`' for f in xgr['accepted_but_not_enforced'])} and does not enforce them, "
            f"where llguidance refuses them (a 400). {provenance(data, 'grammar.json')}\n")


def render_router(results: str) -> str:
    data = load(results, "router.json")
    rows = ["| router policy | second turns: prompt tokens from the prefix cache | second turns: TTFT mean / p50 "
            "| requests per replica |", "|---|---|---|---|"]
    for key, label in (("cache_aware", "cache-aware"), ("round_robin", "round-robin")):
        arm = data[key]
        rows.append(f"| {label} | {arm['second_turn_hit_rate']:.1%} | {arm['second_turn_ttft_ms_mean']:.0f} / "
                    f"{arm['second_turn_ttft_ms_p50']:.0f} ms | {' / '.join(map(str, arm['requests_per_replica']))} |")
    r, two, one = data["ratios"], data["two_replicas"], data["one_server"]
    return "\n".join(rows) + (
        f"\n\nThe cache-aware router serves {r['hit_rate_cache_aware_over_round_robin']:.2f}x as many second-turn "
        f"prompt tokens from the cache and cuts their time to first token "
        f"{r['ttft_round_robin_over_cache_aware']:.2f}x. Throughput of the same {two['requests']} first turns "
        f"({data['first_tokens']} tokens each, {data['concurrency']} at a time): 2 replicas "
        f"{two['output_tokens_per_s']:.1f} tokens/s, one server {one['output_tokens_per_s']:.1f} tokens/s, "
        f"{r['throughput_two_replicas_over_one_server']:.2f}x (one run each, no spread: not a measured gain). "
        f"{provenance(data, 'router.json')}\n")


def _span(values: list[float], unit: str) -> str:
    """'median (min-max) unit' of a few runs."""
    ordered = sorted(values)
    return f"{ordered[len(ordered) // 2]:g} {unit} (min {ordered[0]:g}, max {ordered[-1]:g}, {len(values)} runs)"


def render_seed_failure(results: str) -> str:
    data = load(results, "seed_failure.json")
    aliased, owned = data["aliased"], data["owned"]
    caught = [r for r in aliased if r["caught"]]
    sites = sorted({r["divergence"]["site"] for r in caught})
    agreed = [r["divergence"]["agreed"] for r in caught]
    late = [r["late_copies_rank1"] for r in owned]
    return (f"- The seed's failure (`specserve bench seed-failure`: `SPECSERVE_FAULT_ALIAS_ACCEPT_BUFFERS=1 "
            f"specserve soak {' '.join(data['soak_flags'])}`, rank 1's host copies a step late): caught in "
            f"{len(caught)} of {len(aliased)} runs (exit code 3, `Found rank divergence ...` first at site "
            f"{', '.join(repr(s) for s in sites)} after {_span(agreed, 'agreed events')}), "
            f"{_span([r['seconds'] for r in aliased], 's')} from process start (model loading included). The same "
            f"lag with the fix (owned accept results): exit code 0 in {sum(r['exit_code'] == 0 for r in owned)} of "
            f"{len(owned)} runs, {sum(r['rank_divergences'] or 0 for r in owned)} rank divergences, every event "
            f"checked in {sum(r['events_checked'] == r['events_recorded'] for r in owned)} of {len(owned)}, rank 1's "
            f"late copies "
            f"{_span(late, 'a run')}. {provenance(data, 'seed_failure.json')}\n")


def _kernel_paths_table(results: str, file: str) -> str:
    data = load(results, file)
    rows = ["| path | decode, batch 1 (tok/s) | prefill, 1,024 tokens (tok/s) |", "|---|---|---|"]
    for path, r in data["paths"].items():
        ratio = lambda key: f" ({r[key]:.2f}x generic)" if path != "generic" and key in r else ""  # noqa: E731
        rows.append(f"| {path} | {r['decode_tokens_per_s']:g}{ratio('decode_vs_generic')} | "
                    f"{r['prefill_tokens_per_s']:g}{ratio('prefill_vs_generic')} |")
    same = "the same on every path" if data["same_tokens_on_every_path"] else "**not the same on every path**"
    return "\n".join(rows) + f"\n\nTokens: {same} (one run; the bench fails otherwise). {provenance(data, file)}\n"


def _versus_none(row: dict[str, Any], none: dict[str, Any]) -> str:
    """A config's ratio to NONE, called a gain or a loss only when the run ranges do not overlap."""
    ratio = row.get("ratio_to_none") or row["tokens_per_s"] / none["tokens_per_s"]
    runs, base = row["runs_tokens_per_s"], none["runs_tokens_per_s"]
    if min(runs) > max(base):
        return f"**{ratio:.2f}x**"
    if max(runs) < min(base):
        return f"{ratio:.2f}x"
    return f"{ratio:.2f}x, within noise"


def render_spec_policy(results: str) -> str:
    data = load(results, "spec_policy.json")
    rows = {(r["workload"], r["batch_size"], r["config"]): r for r in data["table"]}
    sizes = sorted({bs for _, bs, _ in rows})
    configs = ["NONE", "NGRAM", "DSPARK", "DEFAULT"]
    lines = ["| tok/s: median (min-max of the runs), ratio to NONE | " + " | ".join(f"bs {b}" for b in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for workload, label in (("mtbench", "MT-Bench"), ("humaneval", "HumanEval")):
        for config in configs:
            cells = []
            for bs in sizes:
                row, none = rows[(workload, bs, config)], rows[(workload, bs, "NONE")]
                runs = row["runs_tokens_per_s"]
                cell = f"{row['tokens_per_s']:.1f} ({min(runs):.1f}-{max(runs):.1f})"
                cells.append(cell if config == "NONE" else f"{cell} {_versus_none(row, none)}")
            lines.append(f"| {label} {config} | " + " | ".join(cells) + " |")
    same = all(r["identical_to_none"] for r in data["table"])
    return "\n".join(lines) + (f"\n\nA ratio is bold only where every run of the configuration beat every run "
                                f"of NONE. Tokens equal NONE's in every run: {'yes' if same else '**no**'}. "
                                f"{provenance(data, 'spec_policy.json')}\n")


RENDERERS: dict[str, Callable[[str], str]] = {"grammar": render_grammar, "router": render_router,
                                              "seed-failure": render_seed_failure, "spec-policy": render_spec_policy,
                                              "kernel-paths-avx2": lambda r: _kernel_paths_table(r, "kernel_paths.json"),
                                              "kernel-paths-avx512": lambda r: _kernel_paths_table(r, "kernel_paths_avx512.json")}


def render_readme(text: str, results: str = RESULTS) -> str:
    """The README with every rendered part made anew; an unknown part name is an error."""
    def replace(match: re.Match) -> str:
        name, indent = match.group("name"), match.group("indent")
        if name not in RENDERERS:
            raise ValueError(f"README: no renderer for part {name!r} (known: {sorted(RENDERERS)})")
        body = "".join(indent + line if line.strip() else line for line in RENDERERS[name](results).splitlines(True))
        return indent + match.group("open") + body + indent + "<!-- /render -->"

    return BLOCK.sub(replace, text)


def differences(readme: str = README, results: str = RESULTS) -> str:
    """A unified diff of the README against its rendering ('' when they agree)."""
    with open(readme) as f:
        text = f.read()
    rendered = render_readme(text, results)
    return "".join(difflib.unified_diff(text.splitlines(True), rendered.splitlines(True), "README.md", "rendered"))


def add_report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 with a diff if the README is stale")
    p.add_argument("--readme", default=README)
    p.add_argument("--results", default=RESULTS, help="the folder of result files")


def run_report(ns: argparse.Namespace) -> int:
    diff = differences(ns.readme, ns.results)
    if ns.check:
        if diff:
            sys.stdout.write(diff)
            print("bench report: the README's rendered figures disagree with their result files", file=sys.stderr)
            return 1
        print("bench report: the README's rendered figures agree with their result files")
        return 0
    with open(ns.readme) as f:
        text = f.read()
    with open(ns.readme, "w") as f:
        f.write(render_readme(text, ns.results))
    print(f"bench report: {len(BLOCK.findall(text))} rendered parts written" + (" (changed)" if diff else ""))
    return 0
