"""DSPARK end to end on the real model: lossless greedy output, draft-KV injection, compact verify.

A randomly initialised drafter accepts almost nothing (greedy output would then equal the
reference trivially), so the tests plant an oracle: the runner's drafts are replaced by the true
greedy continuation, which makes long accepted runs (and stops inside them) happen through the
real verify, accept, commit and injection path; or by a partly wrong one, so that every verify
step accepts some drafts and rejects others.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

from helpers import chat_prompts, policy_args

from specserve import Engine
from specserve.args_checks import MAX_DRAFT_TOKENS
from specserve.models.dspark_checkpoint import read_drafter_config
from specserve.sampling_params import SamplingParams
from specserve.scheduler.loops import NormalLoop

CONTENTS = ["What is the capital of France?", "Count from 1 to 20, separated by commas.",
            "Write a haiku about rain.", "List the days of the week.", "Explain what a CPU does.",
            "Spell the word 'banana' letter by letter.", "Name three primary colors.", "What is 12 times 12?"]
GREEDY = {"temperature": 0, "max_new_tokens": 24}


@pytest.fixture(scope="module")
def prompts(fp32_engine):
    return chat_prompts(fp32_engine, CONTENTS)


@pytest.fixture(scope="module")
def long_reference(fp32_engine, prompts):
    """Greedy continuations a window past GREEDY's max_new_tokens: drafts beyond the checked
    output are then the true tokens too, so every rejection comes from a planted wrong one."""
    fp32_engine.scheduler.ledger.tree.reset()
    params = {**GREEDY, "max_new_tokens": GREEDY["max_new_tokens"] + MAX_DRAFT_TOKENS}
    return [o["output_ids"] for o in fp32_engine.generate(input_ids=prompts, sampling_params=params)]


@pytest.fixture(scope="module")
def reference(long_reference):
    return [out[:GREEDY["max_new_tokens"]] for out in long_reference]


@pytest.fixture(autouse=True)
def free_engines():
    """Each test builds its own engines: free them (weights, KV pools) before the next one builds."""
    yield
    gc.collect()


def dspark_engine(drafter_dir: str, **kwargs) -> Engine:
    """The adaptive policy (on a frozen table where drafting pays) unless kwargs turn it off."""
    policy = {} if kwargs.get("speculative_policy") == "fixed" else policy_args()
    return Engine(dtype="float32", max_total_tokens=4096, speculative_algorithm="DSPARK",
                  speculative_draft_model_path=drafter_dir, **policy, **kwargs)


def plant_oracle(engine: Engine, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    """Replace the drafter's tokens by the true greedy continuation (0 past its end)."""
    runner = engine.runner
    truth = {tuple(p): o for p, o in zip(prompts, outputs)}
    original = runner._draft

    def oracle_draft(spec, rows, ids, prefix, out_lens, **kwargs):
        draft = original(spec, rows, ids, prefix, out_lens, **kwargs)
        gamma = ids.shape[1] - 1
        by_row = {r.req_pool_idx: r for r in engine.scheduler.live_requests()}
        for i, (row, n) in enumerate(zip(spec.rows, out_lens.tolist())):
            if row not in by_row:  # finished while this (overlap) step was in flight: dropped anyway
                continue
            out = truth[tuple(by_row[row].input_ids)]
            ids[i, 1:] = torch.tensor((out[n:n + gamma] + [0] * gamma)[:gamma])
        return draft

    runner._draft = oracle_draft


WRONG_PERIOD = 6


def partly_wrong(outputs: list[list[int]]) -> list[list[int]]:
    """The true continuations with two consecutive tokens of every WRONG_PERIOD replaced by other
    ids (a different phase per request). As drafts: right runs of WRONG_PERIOD - 2 tokens, then a
    miss that some window must test: a wrong token skipped as a step's bonus position is followed
    by another, at the next window's first draft."""
    return [[t ^ 1 if (m + i) % WRONG_PERIOD >= WRONG_PERIOD - 2 else t for m, t in enumerate(out)]
            for i, out in enumerate(outputs)]


def test_block_size_defaults_to_the_checkpoint_and_the_flag_overrides_it(drafter_dir):
    assert read_drafter_config(drafter_dir).block_size == 4
    engine = dspark_engine(drafter_dir)
    assert engine.scheduler.window == 5
    engine = dspark_engine(drafter_dir, speculative_num_steps=2)
    assert engine.scheduler.window == 3


def assert_accept_identity(info: dict) -> None:
    """completion = the prefill's token + per verify step its accepted drafts and a bonus, less at
    most the bonus a stop inside the last run cut off."""
    bonuses = info["completion_tokens"] - 1 - info.get("spec_num_correct_drafts", 0)
    steps = sum(info["spec_draft_len_histogram"].values())  # decode steps, with drafts or without
    assert bonuses in (steps, steps - 1), info
    assert info.get("spec_verify_ct", 0) == steps - info["spec_draft_len_histogram"].get(0, 0), info


def check_lossless_and_partly_accepted(engine: Engine, prompts, reference, params: dict, gamma: int,
                                       static: bool) -> list[dict]:
    """With partly right drafts planted (`partly_wrong`): the output equals the reference, and
    the equality is not the trivial one of a drafter whose drafts are all rejected: every request
    accepts drafts, and (static windows, where the cap is gamma) a step accepting fewer than gamma
    drafts rejected one."""
    assert engine.scheduler.window == gamma + 1
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == reference
    for out in outs:
        info = out["meta_info"]
        assert info["spec_num_correct_drafts"] > 0, info
        assert_accept_identity(info)
        assert max(info["spec_correct_drafts_histogram"]) <= gamma, info  # at most gamma drafts per step
        if static:
            assert min(info["spec_correct_drafts_histogram"]) < gamma, info
    return outs


@pytest.mark.parametrize("mode", ["static", "compact", "policy"])
@pytest.mark.parametrize("gamma", [1, 3, 5, 7])
def test_dspark_greedy_is_lossless(drafter_dir, prompts, reference, long_reference, gamma, mode, tmp_path):
    """Static and compact verify (the policy turned off) and the adaptive policy, with drafts
    partly right by construction."""
    table = tmp_path / "sps.json"  # flat up to 20 rows, then slower: compact picks partial windows
    table.write_text(json.dumps({"tokens": [1, 20, 200], "steps_per_second": [100, 100, 5]}))
    fixed = {} if mode == "policy" else {"speculative_policy": "fixed", "speculative_verify_mode": mode,
                                         "speculative_sps_table_path": str(table)}
    with dspark_engine(drafter_dir, speculative_num_steps=gamma, **fixed) as engine:
        plant_oracle(engine, prompts, partly_wrong(long_reference))  # into the real verify and accept
        check_lossless_and_partly_accepted(engine, prompts, reference, GREEDY, gamma, mode == "static")
        check_lossless_and_partly_accepted(engine, prompts[1:2], reference[1:2], GREEDY, gamma, mode == "static")
        engine.scheduler.check_integrity()
        engine.scheduler.ledger.tree.reset()
        assert engine.scheduler.ledger.allocator.available == engine.scheduler.ledger.allocator.size


@pytest.mark.parametrize("gamma", [g for g in range(1, MAX_DRAFT_TOKENS + 1) if g not in (1, 3, 5, 7)])
def test_every_other_block_size_is_lossless_with_partly_right_drafts(drafter_dir, prompts, reference, long_reference,
                                                                      gamma):
    """The block sizes the test above leaves out (together: every size the flag accepts), on a
    smaller batch: static windows, three requests, 16 tokens."""
    short = [out[:16] for out in reference[:3]]
    with dspark_engine(drafter_dir, speculative_num_steps=gamma) as engine:
        plant_oracle(engine, prompts[:3], partly_wrong(long_reference[:3]))
        check_lossless_and_partly_accepted(engine, prompts[:3], short, {**GREEDY, "max_new_tokens": 16}, gamma, True)
        engine.scheduler.check_integrity()


def test_compact_mode_verifies_ragged_windows_losslessly(drafter_dir, prompts, reference, tmp_path):
    table = tmp_path / "sps.json"
    table.write_text(json.dumps({"tokens": [1, 20, 200], "steps_per_second": [100, 100, 5]}))
    engine = dspark_engine(drafter_dir, speculative_num_steps=5, speculative_verify_mode="compact",
                           speculative_sps_table_path=str(table), speculative_policy="fixed")
    plant_oracle(engine, prompts, reference)
    seen = []
    planner = engine.runner.speculation.planner
    original = planner.verify_lens
    planner.verify_lens = lambda conf: seen.append(original(conf)) or seen[-1]
    batch = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in batch] == reference
    lens = [n for step in seen for n in step]
    assert min(lens) < 6 and max(lens) > 1, f"planner never produced ragged windows: {seen}"
    # Perfect drafts, so every verified row is accepted: the cap is the only limit.
    trimmed = sum(o["meta_info"]["spec_num_correct_drafts"] for o in batch)
    assert trimmed > 0


def test_oracle_drafts_give_long_runs_and_the_metrics_identity(drafter_dir, prompts, reference):
    engine = dspark_engine(drafter_dir, speculative_num_steps=5)
    plant_oracle(engine, prompts, reference)
    batch = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in batch] == reference
    for out in batch:
        info = out["meta_info"]
        assert info["spec_accept_length"] > 3.0, info
        assert_accept_identity(info)
        assert sum(info["spec_correct_drafts_histogram"].values()) == info["spec_verify_ct"]


def test_stops_inside_an_accepted_dspark_run(drafter_dir, fp32_engine, prompts):
    prompt = prompts[1]
    full = fp32_engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 60})
    assert "9. 9" in full["text"], full["text"]
    engine = dspark_engine(drafter_dir, speculative_num_steps=7)
    plant_oracle(engine, [prompt], [full["output_ids"]])
    params = {"temperature": 0, "max_new_tokens": 60, "stop": ["9. 9"]}
    ours = engine.generate(input_ids=prompt, sampling_params=params)
    assert ours["text"] == full["text"][:full["text"].index("9. 9")]
    assert ours["meta_info"]["spec_accept_length"] > 3.0
    stop_id = full["output_ids"][11]
    ours = engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 60,
                                                              "stop_token_ids": [stop_id]})
    assert ours["output_ids"] == full["output_ids"][:full["output_ids"].index(stop_id) + 1]
    limited = engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 9})
    assert limited["output_ids"] == full["output_ids"][:9]
    engine.scheduler.check_integrity()
    engine.scheduler.ledger.tree.reset()
    assert engine.scheduler.ledger.allocator.available == engine.scheduler.ledger.allocator.size


def inject_every_row(runner):
    """Mutation: inject the whole window, rejected rows included."""
    def inject(hidden, out, prefix, window_slots, verify_lens):
        everything = out.map(torch.clone)
        everything.commit_lens.fill_(out.out_tokens.shape[1])
        return type(runner)._verified_rows(runner, hidden, everything, prefix, window_slots, verify_lens)
    runner._verified_rows = inject


def inject_one_position_late(runner):
    """Mutation: the right rows at RoPE positions shifted by one (the stale-accept race's acceptance symptom)."""
    def inject(hidden, out, prefix, window_slots, verify_lens):
        return type(runner)._verified_rows(runner, hidden, out, prefix + 1, window_slots, verify_lens)
    runner._verified_rows = inject


@pytest.mark.parametrize("mutation", [None, inject_every_row, inject_one_position_late])
def test_injection_writes_exactly_the_committed_rows(drafter_dir, prompts, reference, mutation):
    """After one verify step, the draft K/V at the window's committed slots are those computed from
    the target's hidden states at positions S..S+commit_len-1, and the other slots are untouched.
    The planted mutations must make this check fail."""
    if mutation is None:
        check_injection(drafter_dir, prompts, reference, None)
    else:
        with pytest.raises(AssertionError, match="draft (K|V)"):
            check_injection(drafter_dir, prompts, reference, mutation)


def check_injection(drafter_dir, prompts, reference, mutation):
    # Static windows (the policy turned off): the mutations inject whole windows' rows.
    engine = dspark_engine(drafter_dir, speculative_num_steps=5, disable_radix_cache=True,
                           speculative_policy="fixed")
    if mutation is not None:
        mutation(engine.runner)
    plant_oracle(engine, prompts[:1], [reference[0][:3] + [7, 7, 7, 7, 7] + reference[0][3:]])  # 2 right drafts
    draft_kv, drafter = engine.runner.speculation.worker("DSPARK").kv, engine.runner.speculation.worker("DSPARK").drafter
    sched = engine.scheduler
    sched.add_request(engine._make_req(list(prompts[0]), engine._normalize_params(GREEDY, 1)[0]))
    NormalLoop(sched, engine.runner).step()  # prefill: injects the whole prompt
    req = sched.queues.running[0]
    prompt_len = len(prompts[0])
    assert req.kv_len == prompt_len
    before_k = [k.clone() for k in draft_kv.k]
    batch = sched.schedule()
    window = engine.runner.req_to_token.table[req.row, prompt_len:prompt_len + sched.window].tolist()  # the executor's view
    outcomes = engine.runner.run(batch.step_input())
    sched.process_result(batch, outcomes)
    commit = len(outcomes[0].tokens)
    assert commit == 3 and outcomes[0].tokens == reference[0][1:4]  # anchor + 2 accepted drafts, then the bonus
    # Recompute the target's hidden states for the whole committed sequence from scratch.
    seq = list(prompts[0]) + reference[0][:commit]
    fresh = Engine(dtype="float32", max_total_tokens=1024, speculative_algorithm="NONE")
    fb = _prefill(fresh, seq, drafter.config.target_layer_ids)
    hidden = fb.captured_hidden[prompt_len:prompt_len + commit]
    positions = torch.arange(prompt_len, prompt_len + commit)
    ctx = drafter.context(hidden)
    cos, sin = drafter.rope.cos_sin(positions, ctx.dtype)
    for i, layer in enumerate(drafter.layers):
        want_k, want_v = layer.context_kv(ctx, cos, sin)
        got_k = draft_kv.k[i][torch.tensor(window[:commit])]
        got_v = draft_kv.v[i][torch.tensor(window[:commit])]
        assert torch.allclose(got_k, want_k, atol=1e-4), f"draft K of committed rows: off by {(got_k - want_k).abs().max()}"
        assert torch.allclose(got_v, want_v, atol=1e-4), "draft V of committed rows"
        rejected = torch.tensor(window[commit:])
        assert torch.equal(draft_kv.k[i][rejected], before_k[i][rejected]), "draft K written past commit_len"
        # Nothing else moved either.
        others = torch.ones(draft_kv.k[i].shape[0], dtype=torch.bool)
        others[torch.tensor(window[:commit])] = False
        others[0] = False  # the scratch slot: the uncommitted rows of a fixed-shape injection go there
        assert torch.equal(draft_kv.k[i][others], before_k[i][others]), "draft K written outside the window"


def _prefill(engine: Engine, ids: list[int], layers):
    from specserve.models.forward_batch import ForwardBatch

    n = len(ids)
    engine.runner.req_to_token.table[0, :n] = torch.arange(1, n + 1)
    meta = engine.runner.model.ops.attention_metadata(engine.runner.req_to_token.table, [0], [n], [n], "cpu")
    fb = ForwardBatch(torch.tensor(ids), torch.arange(n), torch.arange(1, n + 1), meta, torch.tensor([n - 1]),
                      capture_layer_ids=tuple(layers))
    engine.runner.model(fb, engine.runner.kv)
    return fb


def test_dspark_sampling_is_seeded_and_batch_invariant(drafter_dir, prompts):
    engine = dspark_engine(drafter_dir, speculative_num_steps=3)
    params = {"temperature": 0.8, "top_p": 0.95, "seed": 11, "max_new_tokens": 20}
    mixed = engine.generate(input_ids=[prompts[0], prompts[2]], sampling_params=[params, {**params, "temperature": 0}])
    alone = engine.generate(input_ids=prompts[0], sampling_params=params)
    assert mixed[0]["output_ids"] == alone["output_ids"]
    assert alone["meta_info"]["spec_verify_ct"] > 0
    engine.scheduler.check_integrity()


SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 11, "max_new_tokens": 24}


def seeded_case(fp32_engine, prompts):
    """Plain decoding's seeded samples of four prompts, and the same continuations a window longer
    (for the planted drafts)."""
    fp32_engine.scheduler.ledger.tree.reset()
    longer = {**SEEDED, "max_new_tokens": SEEDED["max_new_tokens"] + MAX_DRAFT_TOKENS}
    long = [o["output_ids"] for o in fp32_engine.generate(input_ids=prompts[:4], sampling_params=longer)]
    return [out[:SEEDED["max_new_tokens"]] for out in long], long


@pytest.mark.parametrize("gamma", [1, 4])
def test_seeded_sampling_is_plain_decodings_whatever_was_drafted(drafter_dir, fp32_engine, prompts, gamma):
    """A seeded sampling request commits plain decoding's tokens through verify windows that
    accept some drafts and reject others (the coupled accept): its output cannot depend on what a
    run's speculation policy, which measures step times, chose to draft."""
    reference, long = seeded_case(fp32_engine, prompts)
    with dspark_engine(drafter_dir, speculative_num_steps=gamma) as engine:
        plant_oracle(engine, prompts[:4], partly_wrong(long))
        outs = engine.generate(input_ids=prompts[:4], sampling_params=SEEDED)
        assert [o["output_ids"] for o in outs] == reference
        assert all(o["meta_info"]["spec_num_correct_drafts"] > 0 for o in outs)
        engine.scheduler.check_integrity()


def test_mutation_seeded_sampling_by_rejection_depends_on_the_drafts(drafter_dir, fp32_engine, prompts, monkeypatch):
    """Mutation: seeded requests verified by rejection sampling (no coupled accept): the same
    planted drafts then change the sampled output, which the test above would catch."""
    reference, long = seeded_case(fp32_engine, prompts)
    derive = SamplingParams._derive_traits

    def unseeded(self):  # every request's params now say it is not a seeded sampling one
        derive(self)
        self.seeded_sampling = False

    monkeypatch.setattr(SamplingParams, "_derive_traits", unseeded)
    with dspark_engine(drafter_dir, speculative_num_steps=4) as engine:
        plant_oracle(engine, prompts[:4], partly_wrong(long))
        outs = engine.generate(input_ids=prompts[:4], sampling_params=SEEDED)
        assert [o["output_ids"] for o in outs] != reference


def test_dspark_flag_errors(drafter_dir, tmp_path):
    with pytest.raises(ValueError, match="speculative_draft_model_path"):  # another target: no default drafter
        Engine(model_path=str(tmp_path / "other.gguf"), speculative_algorithm="DSPARK")
    with pytest.raises(ValueError, match="no config.json"):
        Engine(speculative_algorithm="DSPARK", speculative_draft_model_path=str(tmp_path))
    with pytest.raises(ValueError, match="speculative_verify_mode"):
        Engine(speculative_algorithm="DSPARK", speculative_draft_model_path=drafter_dir,
               speculative_verify_mode="ragged")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="SPS table"):
        Engine(speculative_algorithm="DSPARK", speculative_draft_model_path=drafter_dir, speculative_policy="fixed",
               speculative_verify_mode="compact", speculative_sps_table_path=str(bad))
    with pytest.raises(ValueError, match="SPS table"):  # the adaptive policy's starting cost of the target
        Engine(speculative_algorithm="DSPARK", speculative_draft_model_path=drafter_dir,
               speculative_sps_table_path=str(bad))
    with pytest.raises(ValueError, match="cost table"):
        Engine(speculative_algorithm="DSPARK", speculative_draft_model_path=drafter_dir,
               speculative_cost_table_path=str(bad))
    with pytest.raises(ValueError, match="compact planner runs with --speculative-policy fixed"):
        Engine(speculative_algorithm="DSPARK", speculative_draft_model_path=drafter_dir,
               speculative_verify_mode="compact")
    with pytest.raises(ValueError, match="speculative_policy_drafters"):
        Engine(speculative_algorithm="DSPARK", speculative_draft_model_path=drafter_dir,
               speculative_policy_drafters="DSPARK,EAGLE")
    with pytest.raises(ValueError, match="DSPARK needs --speculative-algorithm DSPARK"):
        Engine(speculative_algorithm="NGRAM", speculative_policy_drafters="DSPARK")
    with pytest.raises(ValueError, match="speculative_policy must be one of"):
        Engine(speculative_algorithm="NGRAM", speculative_policy="greedy")
