"""Penalties, bias and logprobs on logits: the math against hand-computed values, and the runner's
per-slot token histories with the drafts that precede each verify row."""

import math

import pytest
import torch

from specserve.executor.request_logits import RequestLogits, verify_row_layout
from specserve.logits.logprobs import TokenLogprob, token_logprobs
from specserve.logits.penalties import shape_logits
from specserve.sampling_params import SamplingParams


def test_each_rule_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0, logit_bias={3: -1.0})
    # token 0 in the prompt only; token 1 twice in the output; token 3 biased and once in the output
    out = shape_logits(logits, [p], prompts=[[0]], outputs=[[1, 1, 3]])
    expected = [2.0 / 2,  # repetition (prompt): positive / 2
                -1.0 * 2 - 0.25 * 2 - 0.5,  # repetition (negative: times 2), frequency 2x, presence
                0.5,  # untouched
                (3.0 - 1.0) / 2 - 0.25 - 0.5]  # bias first, then repetition, frequency, presence
    assert out[0].tolist() == pytest.approx(expected)


def test_neutral_rows_come_out_bit_identical():
    logits = torch.randn(3, 50)
    params = [SamplingParams(), SamplingParams(frequency_penalty=1.0), SamplingParams()]
    out = shape_logits(logits, params, [[1, 2]] * 3, [[4, 4, 5]] * 3)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert out[1, 4] == logits[1, 4] - 2.0 and out[1, 5] == logits[1, 5] - 1.0


def test_verify_rows_count_the_drafts_before_them():
    shaper = RequestLogits()
    p = SamplingParams(frequency_penalty=1.0)
    shaper.start(row=7, params=p, fill=[10, 11, 12, 3], out_len=1)  # prompt 10 11 12, output [3]
    shaper.shape(torch.zeros(1, 16), [7], [p])  # the first shaping makes the counts
    shaper.commit_counts([7], torch.tensor([[4, 6]]), torch.tensor([1]))  # commits 4 (6: past its length)
    logits = torch.zeros(3, 16)
    # the rows of one window [anchor=4, d1=5, d2=5]: row j follows d_1..d_j
    out = shaper.shape(logits, [7, 7, 7], [p] * 3, [[], [5], [5, 5]])
    assert out[:, 3].tolist() == [-1, -1, -1] and out[:, 4].tolist() == [-1, -1, -1]
    assert out[:, 5].tolist() == [0, -1, -2]
    assert torch.equal(logits, torch.zeros(3, 16))  # never written in place (a captured step's buffer)


@pytest.mark.parametrize("seed", range(4))
def test_device_counts_shape_as_the_host_histories(seed):
    """The counts kept on the device (committed window by window, drafts counted per verify row)
    shape every row bit for bit as shape_logits over the host token lists."""
    gen = torch.Generator().manual_seed(seed)
    vocab, gamma = 12, 3
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.3,
                             logit_bias={"2": 1.5}), SamplingParams(frequency_penalty=1.0)]
    shaper, prompts, outputs = RequestLogits(), [], []
    for row, p in enumerate(params):
        fill = torch.randint(vocab, (6,), generator=gen).tolist()
        shaper.start(row, p, fill, out_len=2)
        prompts.append(fill[:4]), outputs.append(fill[4:])
    shaper.shape(torch.zeros(2, vocab), [0, 1], params)
    for _ in range(3):
        window = torch.randint(vocab, (2, gamma + 1), generator=gen)
        lens = torch.randint(1, gamma + 2, (2,), generator=gen)
        shaper.commit_counts([0, 1], window, lens)
        for row in range(2):
            outputs[row] += window[row, : int(lens[row])].tolist()
    layout = [(i, j) for i in range(2) for j in range(gamma + 1)]
    ids = torch.randint(vocab, (2, gamma + 1), generator=gen)
    logits = torch.randn(len(layout), vocab, generator=gen)
    got = shaper.shape_windows(logits, [0, 1], params, ids, layout)
    drafts = ids[:, 1:].tolist()
    want = shape_logits(logits, [params[i] for i, _ in layout], [prompts[i] for i, _ in layout],
                        [outputs[i] + drafts[i][:j] for i, j in layout])
    assert torch.equal(got, want)


def test_a_request_without_shaping_forgets_the_slot_history():
    shaper = RequestLogits()
    shaper.start(1, SamplingParams(presence_penalty=1.0), [1, 2], 1)
    shaper.start(1, SamplingParams(), [5, 6], 0)  # the slot is reused
    shaper.commit(1, [9])
    shaper.commit_counts([1], torch.tensor([[9]]), torch.tensor([1]))
    assert not shaper.counts_tokens
    logits = torch.randn(1, 10)
    assert shaper.shape(logits, [1], [SamplingParams()]) is logits


def test_logprobs_and_top_alternatives():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 5.0]])
    found = token_logprobs(logits, [0, 2], [2, 0])
    norm = math.log(math.exp(1) + math.exp(2) + math.exp(3))
    assert found[0].logprob == pytest.approx(1 - norm, abs=1e-6)
    assert [t for t, _ in found[0].top] == [2, 1] and found[0].top[0][1] == pytest.approx(3 - norm, abs=1e-6)
    assert found[1].top == () and found[1].token == 2
    params = [SamplingParams(), SamplingParams(logprobs=True, top_logprobs=1)]
    part = RequestLogits.record_logprobs([5, 6], logits, params, torch.tensor([0, 2]))  # requests 5 and 6
    assert part is not None and list(part.read(part.tensors)) == [6]
    assert part.read()[6] == [TokenLogprob(2, found[1].logprob, ((2, found[1].logprob),))]
    assert RequestLogits.record_logprobs([0, 1], logits, [SamplingParams()] * 2, torch.tensor([0, 2])) is None


def test_window_logprobs_keep_the_committed_columns():
    """A verify step's logprobs are computed for every row and read back late: a request keeps the
    columns below its commit length, each the logprob of the token committed there."""
    logits = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    layout = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    out_tokens = torch.tensor([[3, 1, 4], [2, 0, 0]])
    params = [SamplingParams(logprobs=True), SamplingParams(logprobs=True, top_logprobs=2)]
    part = RequestLogits.window_logprobs(params, logits, layout, out_tokens)
    got = part.read(commit_lens=[2, 3])
    logp = torch.log_softmax(logits, -1)
    assert [t.token for t in got[0]] == [3, 1] and [t.token for t in got[1]] == [2, 0, 0]
    assert got[0][1].logprob == pytest.approx(float(logp[1, 1])) and got[1][2].logprob == pytest.approx(float(logp[5, 0]))
    assert [tok for tok, _ in got[1][0].top] == logp[3].topk(2).indices.tolist() and got[0][0].top == ()


def test_verify_layout_of_packed_rows():
    keep = torch.tensor([[True, True, False], [True, False, False]])
    assert verify_row_layout(2, 3, keep) == [(0, 0), (0, 1), (1, 0)]
    assert verify_row_layout(1, 2, None) == [(0, 0), (0, 1)]


@pytest.mark.parametrize("bad, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"), ({"logit_bias": {str(i): 1 for i in range(2000)}}, "logit_bias"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"json_schema": "{" * 70000}, "json_schema"), ({"json_schema": "{}", "regex": "a+"}, "regex"),
    ({"ebnf": ""}, "ebnf"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_bad_settings_name_their_field(bad, field):
    from specserve.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict(bad)
    assert info.value.param == f"sampling_params.{field}"


def test_logit_bias_keys_are_token_ids_and_bounded_by_the_vocabulary():
    from specserve.errors import InvalidRequestError

    p = SamplingParams.from_dict({"logit_bias": {"5": -100}})
    assert p.logit_bias == {5: -100} and p.shapes_logits
    with pytest.raises(InvalidRequestError, match=r"\[0, 10\)"):
        SamplingParams.from_dict({"logit_bias": {"10": 1}}).validate(vocab_size=10)
