"""The chunked picked-log-prob function equals log_softmax + gather, in value and in gradient."""

from __future__ import annotations

import pytest
import torch

from specserve.errors import InternalError
from specserve.train.vocab_loss import ROWS_PER_CHUNK, picked_log_probs


def reference(h, e, w_head, w_markov, ids):
    logits = h @ w_head.t() + e @ w_markov.t()
    return torch.log_softmax(logits, -1).gather(1, ids), logits.argmax(-1)


@pytest.mark.parametrize("rows", [1, ROWS_PER_CHUNK, 3 * ROWS_PER_CHUNK + 5])
def test_values_and_gradients_match_log_softmax(rows):
    gen = torch.Generator().manual_seed(rows)
    H, R, V, J = 24, 8, 300, 5
    h = torch.randn(rows, H, generator=gen, requires_grad=True)
    e = torch.randn(rows, R, generator=gen, requires_grad=True)
    w_head = torch.randn(V, H, generator=gen)
    w_markov = torch.randn(V, R, generator=gen, requires_grad=True)
    ids = torch.randint(0, V, (rows, J), generator=gen)
    ids[:, 1] = ids[:, 0]  # repeated ids accumulate their gradients
    upstream = torch.randn(rows, J, generator=gen)

    got, got_top1 = picked_log_probs(h, e, w_head, w_markov, ids)
    (got * upstream).sum().backward()
    grads = [t.grad.clone() for t in (h, e, w_markov)]
    for t in (h, e, w_markov):
        t.grad = None
    want, want_top1 = reference(h, e, w_head, w_markov, ids)
    (want * upstream).sum().backward()

    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_top1, want_top1)
    for mine, theirs in zip(grads, (h.grad, e.grad, w_markov.grad)):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


def test_bf16_inputs_keep_their_gradient_dtypes():
    h = torch.randn(40, 16, dtype=torch.bfloat16, requires_grad=True)
    e = torch.randn(40, 4, requires_grad=True)  # the Markov embedding stays fp32
    w_markov = torch.randn(64, 4, requires_grad=True)
    picked, _ = picked_log_probs(h, e, torch.randn(64, 16, dtype=torch.bfloat16), w_markov,
                                 torch.zeros(40, 3, dtype=torch.int64))
    assert picked.dtype == torch.float32
    picked.sum().backward()
    assert h.grad.dtype == torch.bfloat16 and e.grad.dtype == torch.float32 and w_markov.grad.dtype == torch.float32


def test_negative_ids_are_refused():
    with pytest.raises(InternalError, match="draft ids >= 0"):
        picked_log_probs(torch.zeros(2, 4), torch.zeros(2, 2), torch.zeros(8, 4), torch.zeros(8, 2),
                         torch.tensor([[0], [-1]]))


def test_under_autocast_it_matches_the_autograd_path_it_replaces():
    """The trainer's setting: bf16 autocast, a bf16 head, fp32 block states and Markov weights."""
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(70, 32, generator=gen, requires_grad=True)
    e = torch.randn(70, 8, generator=gen, requires_grad=True)
    w_head = (torch.randn(500, 32, generator=gen) / 4).to(torch.bfloat16)
    w_markov = torch.randn(500, 8, generator=gen, requires_grad=True)
    ids = torch.randint(0, 500, (70, 4), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = picked_log_probs(h, e, w_head, w_markov, ids)
        logits = torch.nn.functional.linear(h, w_head).float() + torch.nn.functional.linear(e, w_markov).float()
        want = torch.log_softmax(logits, -1).gather(1, ids)
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.05)  # one bf16 rounding of the logits each
    got.sum().backward()
    assert h.grad.dtype == torch.float32 and torch.isfinite(w_markov.grad).all() and w_markov.grad.abs().sum() > 0


def test_a_trainable_head_is_refused():
    with pytest.raises(InternalError, match="frozen"):
        picked_log_probs(torch.zeros(2, 4), torch.zeros(2, 2), torch.zeros(8, 4, requires_grad=True),
                         torch.zeros(8, 2), torch.zeros(2, 1, dtype=torch.int64))
