"""How much of specserve one steady step enters (issue 71): `sys.setprofile` records every
specserve function called while the overlap loop runs one step (which launches step N and
processes step N-1), on the embedded model with the default settings (bf16, the adaptive policy
over the shipped DSpark drafter and the lookup drafters).

The model's forward counts as one unit, "the model": every module under `specserve.models` and
`specserve.kernels` (layers, attention, the op backend, the C++ kernels' bindings) is one thing a
reader of the step follows into, as nano-vllm's step counts "the model" once. The budgets below
are ceilings a step may not exceed; they come down as the step is simplified (docs/architecture.md
states the counts)."""

from __future__ import annotations

import collections
import sys
from dataclasses import dataclass, field

import pytest

from specserve import Engine
from specserve.scheduler import loops

MODEL_PACKAGES = ("specserve.models", "specserve.kernels")
# Ceilings, module units per step (the model as one), lowered as the step is simplified. Before
# issue 71 (3991294): 39 for a decode and for a verify step under the adaptive default (246 and
# 280-285 functions), 32 for a fixed-policy DSpark verify step (225 functions).
DECODE_BUDGET = 20
VERIFY_BUDGET = 23
DSPARK_VERIFY_BUDGET = 21


@dataclass
class StepTrace:
    """The specserve functions one loop step entered: (module, qualified name)."""

    functions: set[tuple[str, str]] = field(default_factory=set)

    @property
    def units(self) -> set[str]:
        """The modules entered, every model module counted as one `the model`."""
        return {"the model" if m.startswith(MODEL_PACKAGES) else m for m, _ in self.functions}

    @property
    def kind(self) -> str:
        names = {q for _, q in self.functions}
        return "verify" if "ModelRunner._verify" in names else "decode" if "ModelRunner._decode" in names else "other"

    @property
    def drafters(self) -> set[str]:
        return {m.rsplit(".", 1)[1] for m, q in self.functions if m.endswith("_worker") and q.endswith(".draft")}


def trace_steps(engine: Engine, prompt: list[int], new_tokens: int, monkeypatch) -> list[StepTrace]:
    """One StepTrace per overlap-loop step of a greedy request (after a warm-up request)."""
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    engine.generate(input_ids=prompt, sampling_params=params)  # warm: captured steps, epilogue, cost table
    steps: list[StepTrace] = []

    def record(frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        if event == "call" and module.startswith("specserve"):
            steps[-1].functions.add((module, frame.f_code.co_qualname))

    step = loops.OverlapLoop.step

    def traced(self):
        steps.append(StepTrace())
        sys.setprofile(record)
        try:
            return step(self)
        finally:
            sys.setprofile(None)

    monkeypatch.setattr(loops.OverlapLoop, "step", traced)
    engine.generate(input_ids=prompt, sampling_params=params)
    return steps[2:-2]  # past the prefill and its first decode step, before the last ones


def _report(steps: list[StepTrace]) -> str:
    return "\n".join(f"{s.kind} {sorted(s.drafters)}: {len(s.units)} units {sorted(s.units)}" for s in steps)


# Fixed step-cost tables, frozen, so which steps verify depends on the tokens alone, not on the
# machine's speed at start-up: drafting pays (10 ms a step, 1 ms a request, 0.5 ms a verified draft
# row, 0.5 ms to run a drafting model at all), or never does (a verified draft row costs a second).
PAYS = [1e-2, 1e-3, 5e-4, 5e-4, 1e-5, 1e-5, 0.0]
NEVER_PAYS = [1e-2, 1e-3, 1.0, 1.0, 1e-5, 1e-5, 0.0]


def engine_with_costs(table: list[float], folder) -> Engine:
    """The default engine (the adaptive policy over every drafter it has) with this frozen cost table."""
    from specserve.speculative.cost_model import StepCostModel

    path = str(folder / "cost_table.json")
    StepCostModel(table).save(path)
    return Engine(max_total_tokens=2048, speculative_cost_table_path=path, speculative_freeze_cost_table=True)


@pytest.fixture(scope="module")
def default_engine(tmp_path_factory):
    with engine_with_costs(NEVER_PAYS, tmp_path_factory.mktemp("never_pays")) as engine:
        yield engine


def test_a_steady_decode_step_enters_at_most_its_budget_of_modules(default_engine, monkeypatch):
    """The default engine where no draft pays: every step is planned, and decodes plainly."""
    steps = trace_steps(default_engine, list(range(100, 164)), 24, monkeypatch)
    assert steps and all(s.kind == "decode" for s in steps), _report(steps)
    assert max(len(s.units) for s in steps) <= DECODE_BUDGET, _report(steps)


def test_a_steady_verify_step_enters_at_most_its_budget_of_modules(monkeypatch, tmp_path):
    """The default engine where drafts pay, on a prompt the lookup drafters draft for (the model's
    own output repeats itself): its steps verify NGRAM's or SUFFIX's drafts."""
    with engine_with_costs(PAYS, tmp_path) as engine:
        steps = trace_steps(engine, list(range(100, 164)), 40, monkeypatch)
    verify = [s for s in steps if s.kind == "verify"]
    assert verify, _report(steps)
    assert max(len(s.units) for s in verify) <= VERIFY_BUDGET, _report(verify)


def test_a_dspark_verify_step_enters_at_most_its_budget_of_modules(monkeypatch):
    with Engine(max_total_tokens=2048, speculative_algorithm="DSPARK", speculative_policy="fixed") as engine:
        steps = trace_steps(engine, [3, 1, 4, 1, 5, 9, 2, 6] * 4, 24, monkeypatch)
    verify = [s for s in steps if s.kind == "verify" and s.drafters == {"dspark_worker"}]
    assert verify, _report(steps)
    assert max(len(s.units) for s in verify) <= DSPARK_VERIFY_BUDGET, _report(verify)


def test_the_trace_sees_a_module_a_step_newly_enters(default_engine, monkeypatch, tmp_path):
    """The counter is not blind: a step that calls into one more specserve module counts one more."""
    from specserve import paths

    baseline = trace_steps(default_engine, list(range(100, 132)), 16, monkeypatch)
    monkeypatch.undo()
    launch = default_engine.runner.launch

    def launch_and_look(step):
        paths.check_writable_dir("planted", str(tmp_path))  # a module no step enters
        return launch(step)

    monkeypatch.setattr(default_engine.runner, "launch", launch_and_look)
    planted = trace_steps(default_engine, list(range(100, 132)), 16, monkeypatch)
    assert all("specserve.paths" not in s.units for s in baseline)
    assert planted and all("specserve.paths" in s.units for s in planted if s.kind != "other"), _report(planted)


def test_the_architecture_page_states_these_ceilings():
    """docs/architecture.md's table of what a step touches is these ceilings, not numbers of its own."""
    import pathlib
    import re

    page = (pathlib.Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
    rows = dict(re.findall(r"^\| (a [^|]*?) \| (\d+) \|$", page, re.M))
    assert rows == {
        "a plain decode step (adaptive policy, no draft pays)": str(DECODE_BUDGET),
        "a verify step of NGRAM's or SUFFIX's drafts (adaptive policy)": str(VERIFY_BUDGET),
        "a DSpark verify step (fixed policy)": str(DSPARK_VERIFY_BUDGET),
    }, rows
    assert f"A decode step touches {DECODE_BUDGET} modules" in page
