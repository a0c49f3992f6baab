"""STANDALONE (a draft model) through the verify/accept path: lossless in fp32 greedy; the same file
as its own drafter accepts every draft, greedy and sampled (which shows the sampled drafts carry
the distribution they were drawn from); a different model's drafts are exactly its own greedy
continuation of the committed tokens, step after step (which is what the lazy draft K/V must give,
with planted bookkeeping faults caught); a draft model with another vocabulary is refused at start."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from helpers import policy_args
from tiny_gguf import TinySpec, write_tiny_gguf

from specserve import Engine
from specserve.errors import ConfigError
from specserve.models.loader import default_model_path
from specserve.models.forward_batch import ForwardBatch
from specserve.speculative import standalone_worker
from specserve.speculative.speculation import Speculation
from specserve.speculative.standalone_worker import StandaloneWorker
from test_ngram_spec import CONTENTS, GREEDY, prompts, reference  # noqa: F401 (the shared fixtures)

FIXED = {"speculative_algorithm": "STANDALONE", "speculative_policy": "fixed"}
TINY_PROMPTS = [[(13 * i + 5 * j) % 256 for i in range(12 + 3 * j)] for j in range(4)]
TINY_GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


def _self_drafting(gamma: int, **policy) -> Engine:
    """The embedded model drafting for itself."""
    return Engine(dtype="float32", max_total_tokens=8192, speculative_draft_model_path=default_model_path(),
                  speculative_num_steps=gamma, **(policy or FIXED))


def _drafts(info: dict) -> tuple[int, int]:
    """(drafts verified, drafts accepted) of one output, as its histograms say."""
    drafted = sum(k * n for k, n in info["spec_draft_len_histogram"].items())
    return drafted, info.get("spec_num_correct_drafts", 0)


def test_the_target_drafting_for_itself_is_lossless_and_accepts_every_draft(prompts, reference):
    spec = _self_drafting(4)
    batch = spec.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in batch] == reference
    for out in batch:
        info = out["meta_info"]
        steps = info["spec_draft_len_histogram"]
        # every window drafted 4 and accepted all 4, but the last, which a stop or the length limit may cut
        assert set(steps) == {4} and info["spec_accepted_drafts_per_step"][:-1] == [4] * (steps[4] - 1), info
    alone = spec.generate(input_ids=prompts[2], sampling_params=GREEDY)
    assert alone["output_ids"] == reference[2]
    spec.scheduler.check_integrity()


def test_the_adaptive_policy_with_a_draft_model_and_the_lookups_is_lossless(prompts, reference):
    spec = _self_drafting(5, speculative_algorithm="STANDALONE", **policy_args())
    assert spec.runner.speculation.policy.drafters == ("STANDALONE", "NGRAM", "SUFFIX")
    batch = spec.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in batch] == reference
    steps = {}
    for out in batch:
        for name, n in out["meta_info"].get("spec_drafter_steps", {}).items():
            steps[name] = steps.get(name, 0) + n
    assert steps.get("STANDALONE", 0) > 0, steps
    spec.scheduler.check_integrity()


def test_sampled_drafts_carry_their_distribution():
    """Drafting for itself, a sampling request's draft distribution q is the target's p, so
    rejection sampling accepts every draft (with q one-hot on the drafts it would reject most);
    the request's tokens are the same batched and alone."""
    params = {"temperature": 0.8, "top_p": 0.95, "seed": 11, "max_new_tokens": 32, "ignore_eos": True}
    spec = _self_drafting(4)
    prompt = spec.tokenizer.apply_chat_template([{"role": "user", "content": CONTENTS[5]}])
    batch = spec.generate(input_ids=[prompt, prompt[:-2]], sampling_params=[params, {**params, "seed": 3}])
    drafted, accepted = _drafts(batch[0]["meta_info"])
    assert drafted >= 16 and accepted >= drafted - 4, batch[0]["meta_info"]  # the last window may be cut
    alone = _self_drafting(4).generate(input_ids=prompt, sampling_params=params)
    assert alone["output_ids"] == batch[0]["output_ids"]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[str, str]:
    """A tiny target and a smaller, different tiny draft model with the same vocabulary."""
    folder = tmp_path_factory.mktemp("standalone")
    target, draft = str(folder / "target.gguf"), str(folder / "draft.gguf")
    write_tiny_gguf(target, TinySpec("qwen2", bias=True), {"attn_q": QType.Q8_0, "ffn_down": QType.Q4_K}, seed=3)
    write_tiny_gguf(draft, TinySpec("llama", layers=1), {"ffn_up": QType.Q8_0}, seed=4)
    return target, draft


class _Recorder:
    """Each STANDALONE draft call's committed context and drafts, per request."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[list[int], list[int]]] = []
        original = StandaloneWorker.draft

        def recording(worker, inp):
            contexts = [r.tokens[:p] + [a] for r, p, a in
                        zip(inp.requests, inp.prefix_lens.tolist(), inp.anchors.tolist())]
            out = original(worker, inp)
            k = min(inp.needed or inp.gamma, inp.gamma)
            self.calls += [(c, t[:k]) for c, t in zip(contexts, out.tokens.tolist())]
            return out

        monkeypatch.setattr(StandaloneWorker, "draft", recording)


def _draft_model_continuations(draft: str, calls: list[tuple[list[int], list[int]]]) -> list[list[int]]:
    with Engine(model_path=draft, dtype="float32", speculative_algorithm="NONE", max_total_tokens=4096) as engine:
        return [engine.generate(input_ids=c, sampling_params={**TINY_GREEDY, "max_new_tokens": len(d)})["output_ids"]
                for c, d in calls]


def _run_tiny(target: str, draft: str, monkeypatch) -> tuple[list[dict], _Recorder]:
    recorder = _Recorder(monkeypatch)
    with Engine(model_path=target, dtype="float32", max_total_tokens=4096, speculative_draft_model_path=draft,
                speculative_num_steps=3, **FIXED) as spec:
        first = spec.generate(input_ids=TINY_PROMPTS, sampling_params=TINY_GREEDY)
        again = spec.generate(input_ids=TINY_PROMPTS[::-1], sampling_params=TINY_GREEDY)  # slots and cached prefixes reused
        spec.scheduler.check_integrity()
    return first + again[::-1], recorder


def test_a_different_draft_model_is_lossless_and_drafts_its_own_greedy_continuation(tiny_pair, monkeypatch):
    target, draft = tiny_pair
    outputs, recorder = _run_tiny(target, draft, monkeypatch)
    with Engine(model_path=target, dtype="float32", speculative_algorithm="NONE", max_total_tokens=4096) as plain:
        reference = [o["output_ids"] for o in plain.generate(input_ids=TINY_PROMPTS, sampling_params=TINY_GREEDY)]
    assert [o["output_ids"] for o in outputs] == reference * 2
    drafted, accepted = map(sum, zip(*(_drafts(o["meta_info"]) for o in outputs)))
    assert drafted > 100 and accepted < drafted / 2, (drafted, accepted)  # two random models: most rejected
    assert len(recorder.calls) > 40
    assert [d for _, d in recorder.calls] == _draft_model_continuations(draft, recorder.calls)


class _ContextHash:
    """A stand-in draft model that shows which K/V a draft read: it stores each row's token id in
    its K/V at the row's slot, and each logit row names one token, a hash of the token ids its
    request's K/V hold at positions 0..the row's. A draft then equals the hash of the committed
    context exactly when every draft K/V it read is that context's."""

    def __init__(self, worker: StandaloneWorker):
        self.ops, self.table, self.vocab = worker.model.ops, worker.table, worker.target_vocab

    def __call__(self, fb, kv) -> torch.Tensor:
        store = kv.k[0][:, 0, 0]
        store[fb.out_cache_loc] = fb.input_ids.to(store.dtype)
        picks = []
        for row, flat in zip(fb.request_rows, fb.logit_rows.tolist()):
            context = store[self.table[row, : int(fb.positions[flat]) + 1]].long().tolist()
            picks.append(context_hash(context, self.vocab))
        return torch.nn.functional.one_hot(torch.tensor(picks), self.vocab).float()


def context_hash(tokens: list[int], vocab: int) -> int:
    h = 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return h % vocab


def _hashing_run(target: str, monkeypatch) -> list[tuple[list[int], list[int]]]:
    """Every STANDALONE draft of a run whose drafter is _ContextHash, under the adaptive policy
    with a drafter explored every few steps: windows rejected, steps drafted by NGRAM or by none in
    between, requests finishing and new ones in their slots, cached prefixes."""
    real = ForwardBatch.for_requests

    def for_requests(table, rows, *args, **kwargs):
        fb = real(table, rows, *args, **kwargs)
        fb.request_rows = list(rows)
        return fb

    monkeypatch.setattr(standalone_worker, "ForwardBatch", type("RowsFB", (), {"for_requests": staticmethod(for_requests)}))
    recorder = _Recorder(monkeypatch)
    with Engine(model_path=target, dtype="float32", max_total_tokens=4096, speculative_draft_model_path=target,
                speculative_algorithm="STANDALONE", speculative_num_steps=4, speculative_explore_interval=1,
                speculative_policy_drafters="STANDALONE,NGRAM", **policy_args()) as spec:
        worker = spec.runner.speculation.worker("STANDALONE")
        worker.model, worker.decode_steps = _ContextHash(worker), None
        longer = {**TINY_GREEDY, "max_new_tokens": 48}
        spec.generate(input_ids=TINY_PROMPTS, sampling_params=longer)
        spec.generate(input_ids=[p[:9] + [7, 7] + p[9:] for p in TINY_PROMPTS[::-1]], sampling_params=longer)
        spec.scheduler.check_integrity()
    return recorder.calls


def _hashes(calls: list[tuple[list[int], list[int]]], vocab: int) -> list[list[int]]:
    """What each call should have drafted: hashes of the committed context, then of it with the drafts."""
    out = []
    for context, drafts in calls:
        seq, expected = list(context), []
        for d in drafts:
            expected.append(context_hash(seq, vocab))
            seq.append(d)
        out.append(expected)
    return out


def test_every_draft_reads_exactly_the_committed_context(tiny_pair, monkeypatch):
    target, _ = tiny_pair
    calls = _hashing_run(target, monkeypatch)
    assert len(calls) > 30 and len({len(c) for c, _ in calls}) > 10
    assert [d for _, d in calls] == _hashes(calls, TinySpec("qwen2").vocab)


@pytest.mark.parametrize("fault", ["keeps_rejected_drafts", "keeps_state_across_requests"])
def test_planted_draft_cache_faults_are_caught(tiny_pair, monkeypatch, fault):
    """The check above fails when the lazy draft K/V go stale: a commit that keeps the rejected
    drafts' K/V, or a new request in a slot that trusts the last one's."""
    target, _ = tiny_pair
    if fault == "keeps_rejected_drafts":  # the commit trims nothing
        monkeypatch.setattr(StandaloneWorker, "commit_tokens", lambda worker, request, tokens: None)
    else:  # a slot's next request inherits the drafters' state of the last one
        original = Speculation.commit_tokens

        def inheriting(spec, row, tokens, restart=False, new=0, launch=0):
            last = spec.requests.get(row)
            original(spec, row, tokens, restart, new, launch)
            if restart and last is not None:
                spec.requests[row].drafters = last.drafters

        monkeypatch.setattr(Speculation, "commit_tokens", inheriting)
    calls = _hashing_run(target, monkeypatch)
    assert [d for _, d in calls] != _hashes(calls, TinySpec("qwen2").vocab)


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_pair):
    target, _ = tiny_pair
    with pytest.raises(ConfigError, match="another vocabulary than the target") as info:
        Engine(model_path=target, speculative_draft_model_path=default_model_path(), **FIXED)
    assert "\n" not in str(info.value)
