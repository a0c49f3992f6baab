"""The overlap loop's launches never wait on the device (issue: the overlap loop pays on CUDA).

With SPECSERVE_HOST_WAITS=count every engine's runner counts the points inside `launch` where the
host would wait for the device (runtime/host_waits.py: value reads of device tensors, copies back,
data-dependent shapes, event waits). Here they must be zero on the real embedded model, overlap
loop, for NONE, NGRAM, SUFFIX drafting on the device, DSPARK with fixed windows (the shipped
drafter, so drafts are accepted) and DSPARK compact, greedy and sampled, with the same tokens as
the normal loop, also with penalties and a logit bias (their token counts kept on the device)
and with logprobs (computed on the device, read with the step's late copy). The runners take CUDA's verify choice (CaptureConfig.static_windows:
planned windows verified whole, the accept capped) since that is the path these zeros are for; on
CPU by default planned windows are packed, which reads the prefixes back (counted, and free there).
A planted `.item()` inside the step must be found, at its line, and refused in the error mode.
SUFFIX on the device drafts what it drafts on the host, token for token. The adaptive policy (the
default) plans with lagged plans on (opt-in), from the commits two launches back (speculative/lagged.py): both loops
then plan, draft and accept alike. Its engines serve one test each (FRESH_KINDS).
"""

from __future__ import annotations

import json

import pytest

from helpers import chat_prompts, policy_args

from specserve import Engine
from specserve.executor.model_runner import ModelRunner
from specserve.names import Algorithm
from specserve.speculative.dspark_worker import DsparkWorker

CONTENTS = ["Count from 1 to 20, separated by commas.", "What is the capital of France?",
            "List the days of the week.", "Write a haiku about rain."]
SAMPLED = [{"temperature": 0.8, "top_p": 0.9, "seed": 11, "max_new_tokens": 20},
           {"temperature": 1.0, "top_k": 20, "seed": 12, "max_new_tokens": 20},
           {"temperature": 0.7, "min_p": 0.05, "seed": 13, "max_new_tokens": 20},
           {"temperature": 0, "max_new_tokens": 20}]
GREEDY = [{"temperature": 0, "max_new_tokens": 24}] * len(CONTENTS)
PENALISED = [{"temperature": 0, "frequency_penalty": 0.5, "max_new_tokens": 20},
             {"temperature": 0.8, "seed": 5, "presence_penalty": 0.4, "repetition_penalty": 1.2, "max_new_tokens": 20},
             {"temperature": 0, "logit_bias": {"11": 2.0}, "max_new_tokens": 20},
             {"temperature": 0, "max_new_tokens": 20}]
KINDS = {"none": {"speculative_algorithm": "NONE"},
         "ngram": {"speculative_algorithm": "NGRAM", "speculative_policy": "fixed"},
         "suffix": {"speculative_algorithm": "SUFFIX", "speculative_policy": "fixed"},
         "dspark-static": {"speculative_algorithm": "DSPARK", "speculative_policy": "fixed"},
         "dspark-compact": {"speculative_algorithm": "DSPARK", "speculative_policy": "fixed",
                            "speculative_verify_mode": "compact"},
         "default": {}}  # the adaptive policy over DSPARK, NGRAM and SUFFIX, planning two launches late


def make_engine(kind: str, tmp_path_factory, overlap: bool = True) -> Engine:
    kw = dict(KINDS[kind])
    if kind == "dspark-compact":
        table = tmp_path_factory.mktemp("sps") / "sps.json"
        table.write_text(json.dumps({"tokens": [1, 10, 100], "steps_per_second": [100, 100, 5]}))
        kw["speculative_sps_table_path"] = str(table)
    if kind == "default":
        kw.update(policy_args())  # a frozen cost table: the plans may not depend on timings
    engine = Engine(dtype="float32", max_total_tokens=4096, disable_overlap_schedule=not overlap,
                    speculative_lagged_plans=True, **kw)  # the opt-in policy: plans from the commits two launches back
    engine.runner.capture.static_windows = True  # CUDA's verify choice (see the module docstring)
    speculation = engine.runner.speculation
    if Algorithm.SUFFIX in speculation.workers:  # CUDA's SUFFIX: drafts walked on the device
        speculation.workers[Algorithm.SUFFIX].drafts_on_device = True
    assert speculation.lagged_plans, "--speculative-lagged-plans reaches the speculation"
    return engine


# Kinds whose engine serves one test only: with lagged plans a request that follows another on the
# same engine was seen to vary in acceptance (a sampled one in its tokens) between runs, cause not
# found (Speculation.lagged_plans), so a shared engine would make each case depend on the ones before.
FRESH_KINDS = {"default"}


class EnginesByKind:
    """An engine per kind, made when first asked for: shared by the module, except FRESH_KINDS',
    which last until `end_test`."""

    def __init__(self, make):
        self.make, self.shared, self.fresh = make, {}, {}

    def __getitem__(self, kind: str) -> Engine:
        held = self.fresh if kind in FRESH_KINDS else self.shared
        if kind not in held:
            held[kind] = self.make(kind)
        return held[kind]

    __call__ = __getitem__

    def end_test(self) -> None:
        for engine in self.fresh.values():
            engine.shutdown()
        self.fresh.clear()

    def close(self) -> None:
        self.end_test()
        for engine in self.shared.values():
            engine.shutdown()


def counting(kind: str, tmp_path_factory) -> Engine:
    """A counting engine, overlap loop (the switch is read when an engine is built)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSERVE_HOST_WAITS", "count")
        return make_engine(kind, tmp_path_factory)


@pytest.fixture(scope="module")
def all_counting_engines(tmp_path_factory):
    engines = EnginesByKind(lambda kind: counting(kind, tmp_path_factory))
    yield engines
    engines.close()


@pytest.fixture(scope="module")
def all_normal_engines(tmp_path_factory):
    engines = EnginesByKind(lambda kind: make_engine(kind, tmp_path_factory, overlap=False))
    yield engines
    engines.close()


@pytest.fixture
def counting_engines(all_counting_engines):
    """The overlap loop's counting engine per kind (`engines[kind]`)."""
    yield all_counting_engines
    all_counting_engines.end_test()


@pytest.fixture
def normal_engines(all_normal_engines):
    """The normal loop's engine per kind (`engines(kind)`)."""
    yield all_normal_engines
    all_normal_engines.end_test()


@pytest.fixture(scope="module")
def prompts(all_counting_engines):
    return chat_prompts(all_counting_engines["none"], CONTENTS)


def tokens(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def run(engine: Engine, prompts, params) -> tuple[list[list[int]], list]:
    """The engine's tokens, and the waits its launches counted (prefills, decode and verify steps)."""
    engine.scheduler.ledger.tree.reset()
    engine.runner.host_waits.reset()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return tokens(outs), engine.runner.host_waits.reset()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("params", [GREEDY, SAMPLED, PENALISED], ids=["greedy", "sampled", "penalised"])
def test_overlap_launches_never_wait(kind, params, counting_engines, normal_engines, prompts):
    engine = counting_engines[kind]
    overlapped, verify = engine.loop.overlapped_steps, engine.scheduler.stats.verify_steps
    got, waits = run(engine, prompts, params)
    assert waits == [], f"{kind}: the host waited inside launch at {sorted({(w.op, w.site) for w in waits})}"
    assert engine.loop.overlapped_steps - overlapped > 10, "the overlap loop never overlapped"
    assert (engine.scheduler.stats.verify_steps > verify) == (kind != "none"), "a speculating engine verified nothing"
    normal = normal_engines(kind)
    normal.scheduler.ledger.tree.reset()
    assert tokens(normal.generate(input_ids=prompts, sampling_params=params)) == got


LOGPROBS = [{"temperature": 0, "logprobs": True, "top_logprobs": 2, "max_new_tokens": 16},
            {"temperature": 0.8, "seed": 9, "logprobs": True, "max_new_tokens": 16},
            {"temperature": 0, "max_new_tokens": 16}, {"temperature": 0, "logprobs": True, "max_new_tokens": 16}]


@pytest.mark.parametrize("kind", ["none", "dspark-static", "default"])
def test_logprobs_are_read_late(kind, counting_engines, normal_engines, prompts):
    """Logprobs are computed on the device and read with the step's late copy: no wait, and the
    same tokens and logprobs as the normal loop (a window's only for its committed tokens)."""
    def run_logprobs(engine):
        engine.scheduler.ledger.tree.reset()
        if engine.runner.host_waits is not None:  # the counting engine's
            engine.runner.host_waits.reset()
        outs = engine.generate(input_ids=prompts, sampling_params=LOGPROBS)
        return [(o["output_ids"], o["meta_info"].get("output_token_logprobs"), o["meta_info"].get("output_top_logprobs"))
                for o in outs]

    engine = counting_engines[kind]
    got = run_logprobs(engine)
    waits = engine.runner.host_waits.reset()
    assert waits == [], f"{kind}: the host waited inside launch at {sorted({(w.op, w.site) for w in waits})}"
    assert all(lps is not None and [t for _, t, _ in lps] == ids for ids, lps, _ in got[:2])
    assert got[2][1] is None and all(len(top) == 2 for top in got[0][2])
    normal = run_logprobs(normal_engines(kind))
    assert [g[0] for g in got] == [n[0] for n in normal]
    for (_, mine, _), (_, theirs, _) in zip(got, normal):
        if mine is not None:
            assert [lp for lp, _, _ in mine] == pytest.approx([lp for lp, _, _ in theirs], abs=1e-5)


def test_lagged_plans_accept_alike_in_both_loops(prompts, tmp_path_factory):
    """The adaptive policy planning from the commits two launches back plans each step of a request
    alike in both loops: the same sampled tokens, verify steps and accepted drafts (one request at
    a time: in a batch the overlap loop's extra step for a finished request joins the batch its
    plan prices, which the normal loop's does not; tokens stay exact samples either way)."""
    runs = []
    for overlap in (True, False):
        outs = []
        for p, s in zip(prompts[:2], SAMPLED[:2]):  # each the first request of its engine (see the note below)
            engine = make_engine("default", tmp_path_factory, overlap=overlap)
            try:
                outs.append(engine.generate(input_ids=p, sampling_params=s))
            finally:
                engine.shutdown()
        runs.append([(o["output_ids"], o["meta_info"]["spec_verify_ct"], o["meta_info"]["spec_num_correct_drafts"])
                     for o in outs])
    assert runs[0] == runs[1] and sum(r[2] for r in runs[0]) > 0
    # Not asserted: a request that follows another on the same engine. With lagged plans its
    # acceptance (and a sampled request's tokens) was seen to vary between runs of one loop; the
    # cause is not found yet, so lagged plans are off by default (Speculation.lagged_plans).


def test_a_commit_told_after_its_plan_is_refused(counting_engines, prompts, monkeypatch):
    """Mutation of the ordering lagged plans rely on: a host party telling step j's commit after
    launch j + 2 planned (a loop running two steps ahead) fails the request loudly."""
    from specserve.speculative.lagged import LaggedFeed

    original = LaggedFeed.put

    def late(self, launch, item):
        return original(self, launch - 3, item)  # as if it came three launches late

    monkeypatch.setattr(LaggedFeed, "put", late)
    engine = counting_engines["default"]
    with pytest.raises(Exception, match="arrived after launch"):
        engine.generate(input_ids=prompts[0], sampling_params={"temperature": 0, "max_new_tokens": 12})


@pytest.mark.parametrize("kind", ["dspark-static", "suffix"])
def test_verify_steps_accept_drafts(kind, counting_engines, prompts):
    """The zero above covers real verify steps: the drafts are accepted."""
    engine = counting_engines[kind]
    engine.scheduler.ledger.tree.reset()
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert sum(o["meta_info"]["spec_num_correct_drafts"] for o in outs) > 0


def test_suffix_drafts_on_the_device_as_on_the_host(normal_engines, prompts, tmp_path_factory):
    """Sampled requests draft from their own tokens only, so the device walk and the host walk
    must give each step the same drafts: the same tokens and the same accepted drafts, normal loop."""
    device_engine = normal_engines("suffix")
    host_engine = make_engine("suffix", tmp_path_factory, overlap=False)
    host_engine.runner.speculation.workers[Algorithm.SUFFIX].drafts_on_device = False
    try:
        runs = []
        for engine in (device_engine, host_engine):
            engine.scheduler.ledger.tree.reset()
            outs = engine.generate(input_ids=prompts[:3], sampling_params=SAMPLED[:3])
            runs.append([(o["output_ids"], o["meta_info"]["spec_num_correct_drafts"]) for o in outs])
    finally:
        host_engine.shutdown()
    assert runs[0] == runs[1] and sum(r[1] for r in runs[0]) > 0


def plant_item(monkeypatch, where: str) -> None:
    """The bug the detector exists for: one `.item()` inside the step (the decode's sampling, or
    the DSpark drafter's drafting)."""
    if where == "decode":
        original = ModelRunner._pick

        def planted_pick(self, handle, indices, logits, *args):
            logits[0, 0].item()  # planted wait
            return original(self, handle, indices, logits, *args)

        monkeypatch.setattr(ModelRunner, "_pick", planted_pick)
    else:
        original_draft = DsparkWorker.draft

        def planted_draft(self, inp):
            inp.prefix_lens.max().item()  # planted wait
            return original_draft(self, inp)

        monkeypatch.setattr(DsparkWorker, "draft", planted_draft)


@pytest.mark.parametrize("kind,where", [("none", "decode"), ("dspark-static", "draft")])
def test_a_planted_item_is_counted_at_its_line(kind, where, counting_engines, prompts, monkeypatch):
    plant_item(monkeypatch, where)
    _, waits = run(counting_engines[kind], prompts, GREEDY)
    planted = [w for w in waits if w.op == "item()" and "planted" in w.site]
    assert planted and len(planted) == len(waits), waits


def test_a_planted_item_fails_the_request_in_error_mode(prompts, monkeypatch, tmp_path_factory):
    monkeypatch.setenv("SPECSERVE_HOST_WAITS", "error")
    engine = make_engine("none", tmp_path_factory)
    try:
        plant_item(monkeypatch, "decode")
        with pytest.raises(Exception, match="the host waits on the device inside a step's launch: item"):
            engine.generate(input_ids=prompts[0], sampling_params=GREEDY[0])
    finally:
        engine.shutdown()


def test_static_windows_commit_and_inject_as_packed_rows(prompts):
    """Planned windows verified whole in the captured step (static_windows, CUDA's choice) accept and
    feed the drafter exactly as the packed rows do (CPU's choice), under the adaptive policy with
    the shipped drafter, where windows have planned lengths: the same tokens and accepted drafts."""
    from helpers import policy_args

    runs, planned = {}, {}
    for static in (True, False):
        engine = Engine(dtype="float32", max_total_tokens=4096, speculative_algorithm="DSPARK",
                        speculative_policy_drafters="DSPARK,NGRAM", **policy_args())
        engine.runner.capture.static_windows = static
        original, lens_seen = engine.runner._draft_windows, []

        def spy(*args, original=original, lens_seen=lens_seen):
            ids, proposal, verify_lens = original(*args)
            lens_seen.append(verify_lens is not None)
            return ids, proposal, verify_lens

        engine.runner._draft_windows = spy
        try:
            outs = engine.generate(input_ids=prompts, sampling_params=[{**GREEDY[0], "max_new_tokens": 40}] * len(prompts))
        finally:
            engine.shutdown()
        runs[static] = [(o["output_ids"], o["meta_info"]["spec_verify_ct"], o["meta_info"]["spec_num_correct_drafts"])
                        for o in outs]
        planned[static] = sum(lens_seen)
    assert planned[True] > 0 and planned[False] > 0, "no window had a planned length"
    assert sum(r[2] for r in runs[True]) > 0, "nothing accepted: the injection was not exercised"
    assert runs[True] == runs[False]
