"""`python -m benchmarks report`: the figures of the README and the drafter corpus's README, rendered
from the committed result files (the renderers live in `benchmarks/render/`).

A rendered part of a document sits between two markers (indented alike inside a list item):

    <!-- render: NAME -->
    ...text made by RENDERERS[NAME] from bench_results/...
    <!-- /render -->

`python -m benchmarks report` rewrites every such part from the files; `--check` rewrites nothing and
exits 1 with a diff where the README and the files disagree (tests/unit/test_report.py runs it, so
a figure typed by hand, or a result file changed without its text, fails the suite). Each part
names its file and the file's provenance (machine; commit and date where the file records them).
"""

from __future__ import annotations

import argparse
import difflib
import glob
import os
import re
import sys
from typing import Callable, Optional

from specserve.errors import ConfigError
from specserve.bench.provenance import drafter_checksum  # noqa: F401  (re-exported for tests)
from benchmarks.render import cuda, drafter, engine, headline, serving, speculation
from benchmarks.render.common import REPO, SHIPPED_DRAFTER, provenance  # noqa: F401

README = os.path.join(REPO, "README.md")
CORPUS_README = os.path.join(REPO, "data", "drafter", "README.md")
DOCS = os.path.join(REPO, "docs")
# Every document with rendered parts: the README, each page of docs/, the drafter corpus's README.
DOCUMENTS = (README, *sorted(glob.glob(os.path.join(DOCS, "*.md"))), CORPUS_README)
RESULTS = os.path.join(REPO, "bench_results")
BLOCK = re.compile(r"^(?P<indent> *)(?P<open><!-- render: (?P<name>[\w-]+) -->\n)(?P<body>.*?)^(?P=indent)<!-- /render -->",
                   re.S | re.M)


RENDERERS: dict[str, Callable[[str], str]] = {
    "grammar": serving.render_grammar, "grammar-engine": serving.render_grammar_engine,
    "router": serving.render_router, "serving": serving.render_serving,
    "serving-multiturn": lambda r: serving.render_serving(r, "serving_multiturn.json"), "serving-1-5b": lambda r: serving.render_serving(r, "serving_1.5b.json"), "serving-7b": lambda r: serving.render_serving(r, "serving_7b.json"), "load-soak-idle-trim": lambda r: serving.render_load(r, "load_1.5b_20min_idle_trim.json"), "load-soak-no-trim": lambda r: serving.render_load(r, "load_1.5b_20min_no_trim.json"), "load-soak": lambda r: serving.render_load(r, "load_1.5b_20min.json"), "hicache": serving.render_hicache,
    "spec-policy": speculation.render_spec_policy, "spec-policy-notes": speculation.render_spec_policy_notes,
    "spec-ready": speculation.render_spec_ready, "spec-workloads": speculation.render_spec_workloads,
    "spec-workloads-qwen": lambda r: speculation.render_spec_workloads(r, "spec_workloads_qwen.json"),
    "spec-workloads-default": lambda r: speculation.render_spec_workloads(r, "spec_workloads_default.json"),
    "spec-workloads-qwen-batched": lambda r: speculation.render_spec_workloads(r, "spec_workloads_qwen_batched.json"),
    "standalone-cost": speculation.render_standalone_cost, "dspark-step": speculation.render_dspark_step, "prefetch": speculation.render_prefetch, "overlap": speculation.render_overlap,
    "kernel-paths-avx2": lambda r: engine.kernel_paths_table(r, "kernel_paths.json"),
    "kernel-paths-avx512": lambda r: engine.kernel_paths_table(r, "kernel_paths_avx512.json"),
    "offline": engine.render_offline, "models": engine.render_models, "models-at-size": engine.render_models_at_size, "models-vs-ik": engine.render_models_vs_ik, "models-vs-ik-prefetch": lambda r: engine.render_models_vs_ik(r, "models_vs_ik_prefetch.json"), "long-context": engine.render_long_context, "long-context-groups": lambda r: engine.render_long_context(r, "models_long_context_groups.json"), "models-vs-peers": lambda r: engine.render_models_vs_ik(r, "models_vs_peers.json"), "models-moe-vs-ik": lambda r: engine.render_models_vs_ik(r, "models_moe_vs_ik.json"), "models-moe-vs-ik-in-memory": lambda r: engine.render_models_vs_ik(r, "models_moe_vs_ik_in_memory.json"), "models-gpt-oss-vs-ik": lambda r: engine.render_models_vs_ik(r, "models_gpt_oss_vs_ik.json"), "batched": engine.render_batched, "models-7b-vs-peers": lambda r: engine.render_models_vs_ik(r, "models_7b_vs_peers.json"), "batched-7b": lambda r: engine.render_batched(r, "models_7b_vs_peers.json"), "arithmetic-7b": lambda r: engine.render_arithmetic(r, "models_7b_vs_peers.json"), "models-vs-peers-probed": lambda r: engine.render_models_vs_ik(r, "models_vs_peers_probed.json"), "batched-probed": lambda r: engine.render_batched(r, "models_vs_peers_probed.json"), "arithmetic-probed": lambda r: engine.render_arithmetic(r, "models_vs_peers_probed.json"), "arithmetic": engine.render_arithmetic, "models-moe": engine.render_models_moe, "moe-routing": engine.render_moe_routing, "startup": engine.render_startup, "startup-moe": lambda r: engine.render_startup(r, "startup_moe.json"), "models-small-native": engine.render_models_small_native, "weight-stream": engine.render_weight_stream, "step-profile": engine.render_step_profile, "quality": engine.render_quality, "quality-top1": engine.render_quality_top1,
    "linear-rows": engine.render_linear_rows,
    "stale-accept": engine.render_stale_accept, "soak": engine.render_soak, "tp-cost": engine.render_tp_cost,
    "cuda-check": cuda.render_cuda_check, "cuda-threaded": cuda.render_cuda_threaded, "drafter-line": drafter.render_drafter_line, "drafter-shapes": drafter.render_drafter_shapes,
    "train-speed": drafter.render_train_speed, "corpus-costs": drafter.render_corpus_costs,
    "headline": headline.render_headline}


def render_readme(text: str, results: str = RESULTS) -> str:
    """The README with every rendered part made anew; an unknown part name is an error."""
    def replace(match: re.Match) -> str:
        name, indent = match.group("name"), match.group("indent")
        if name not in RENDERERS:
            raise ConfigError(f"README: no renderer for part {name!r} (known: {sorted(RENDERERS)})")
        body = "".join(indent + line if line.strip() else line for line in RENDERERS[name](results).splitlines(True))
        return indent + match.group("open") + body + indent + "<!-- /render -->"

    return BLOCK.sub(replace, text)


def differences(readme: Optional[str] = None, results: str = RESULTS) -> str:
    """A unified diff of a document (default: every one in DOCUMENTS) against its rendering ('' when
    they agree)."""
    diff = []
    for path in ([readme] if readme else DOCUMENTS):
        with open(path) as f:
            text = f.read()
        name = os.path.relpath(path, REPO)
        diff += difflib.unified_diff(text.splitlines(True), render_readme(text, results).splitlines(True), name,
                                     f"{name} (rendered)")
    return "".join(diff)


def add_report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 with a diff if a document is stale")
    p.add_argument("--readme", action="append", default=None,
                   help="a document to render or check (repeatable; default: README.md and data/drafter/README.md)")
    p.add_argument("--results", default=RESULTS, help="the folder of result files")


def run_report(ns: argparse.Namespace) -> int:
    documents = ns.readme or list(DOCUMENTS)
    diff = "".join(differences(path, ns.results) for path in documents)
    if ns.check:
        if diff:
            sys.stdout.write(diff)
            print("bench report: the documents' rendered figures disagree with their result files", file=sys.stderr)
            return 1
        print("bench report: the documents' rendered figures agree with their result files")
        return 0
    parts = 0
    for path in documents:
        with open(path) as f:
            text = f.read()
        parts += len(BLOCK.findall(text))
        with open(path, "w") as f:
            f.write(render_readme(text, ns.results))
    print(f"bench report: {parts} rendered parts written to {len(documents)} documents" + (" (changed)" if diff else ""))
    return 0
