"""Log-probabilities of a few ids per row over the whole draft vocabulary, without a [P, V] fp32 graph.

The drafter's loss needs, per scored position, log q at the label and at the teacher's top-k ids,
and the argmax. Through autograd that is logits -> float -> log_softmax -> gather: a dozen full
[P, V] passes (conversions, the softmax and its backward, the zero-filled gather gradient), which
cost more than the head matmul itself on a 2-core CPU. This function computes the logits with one
matmul (the frozen head and the trainable Markov projection side by side, so no [P, V] add), then
works through them a few rows at a time in fp32 while they sit in cache; its backward forms the
logit gradient chunk by chunk the same way (softmax times the row's summed gradient, minus the
scattered gradients of the picked ids) and ends in one matmul per input. The mathematics is
log_softmax + gather; only the passes over memory change.
"""

from __future__ import annotations

import torch

from specserve.errors import InternalError

ROWS_PER_CHUNK = 32  # 32 x 16384 fp32 = 2 MiB: one chunk stays in a core's cache


class PickedLogProbs(torch.autograd.Function):
    """(h [P, H], e [P, R], w_head [V, H] frozen, w_markov [V, R], ids [P, J]) ->
    (log_softmax(h w_head^T + e w_markov^T)[p, ids[p, j]] as fp32 [P, J], argmax [P])."""

    @staticmethod
    def forward(ctx, h, e, w_head, w_markov, ids):
        dtype = w_head.dtype  # everything runs in the frozen head's dtype (bf16 in training), autocast or not
        x = torch.cat([h.to(dtype), e.to(dtype)], 1)
        weight = torch.cat([w_head, w_markov.to(dtype)], 1)
        logits = x @ weight.t()  # [P, V]
        rows = logits.shape[0]
        lse = torch.empty(rows)
        picked = torch.empty(ids.shape)
        top1 = torch.empty(rows, dtype=torch.int64)
        for s in range(0, rows, ROWS_PER_CHUNK):
            c = logits[s:s + ROWS_PER_CHUNK].float()
            lse[s:s + ROWS_PER_CHUNK] = torch.logsumexp(c, -1)
            picked[s:s + ROWS_PER_CHUNK] = c.gather(1, ids[s:s + ROWS_PER_CHUNK]) - lse[s:s + ROWS_PER_CHUNK, None]
            top1[s:s + ROWS_PER_CHUNK] = c.argmax(-1)
        ctx.save_for_backward(x, weight, logits, lse, ids)
        ctx.split = h.shape[1]
        ctx.mark_non_differentiable(top1)
        return picked, top1

    @staticmethod
    def backward(ctx, grad_picked, _grad_top1):
        x, weight, logits, lse, ids = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        grad_picked = grad_picked.float()
        row_sum = grad_picked.sum(1, keepdim=True)
        for s in range(0, logits.shape[0], ROWS_PER_CHUNK):
            # d/dz of sum_j g_j (z_{i_j} - lse(z)) = scatter(g) - softmax(z) * sum_j g_j
            p = (logits[s:s + ROWS_PER_CHUNK].float() - lse[s:s + ROWS_PER_CHUNK, None]).exp_()
            p.mul_(-row_sum[s:s + ROWS_PER_CHUNK])
            p.scatter_add_(1, ids[s:s + ROWS_PER_CHUNK], grad_picked[s:s + ROWS_PER_CHUNK])
            grad_logits[s:s + ROWS_PER_CHUNK] = p
        split = ctx.split
        grad_h = grad_e = grad_w_markov = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            grad_x = grad_logits @ weight
            grad_h, grad_e = grad_x[:, :split], grad_x[:, split:]
        if ctx.needs_input_grad[3]:
            grad_w_markov = grad_logits.t() @ x[:, split:]
        return grad_h, grad_e, None, grad_w_markov, None


def picked_log_probs(h: torch.Tensor, e: torch.Tensor, w_head: torch.Tensor, w_markov: torch.Tensor,
                     ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log q(ids) over the draft vocabulary and the argmax draft id; see the module docstring."""
    if ids.dtype != torch.int64 or (ids < 0).any():
        raise InternalError("ids must be int64 draft ids >= 0 (clamp out-of-vocabulary ids and mask them)")
    if w_head.requires_grad:
        raise InternalError("w_head is the frozen target LM head: no gradient is computed for it")
    return PickedLogProbs.apply(h, e, w_head, w_markov, ids)
