"""Accept for verify windows: AcceptOuts, the persistent epilogue buffers and the accept kernels.

A verify step reaches this module once, through `VerifyEpilogue.accept(windows)`: the
accept kernels write the buffers (unless the captured step folded the greedy accept in), then
under tensor parallelism rank 0's results replace this rank's, then `read_accept` hands back
owned copies. The runner never touches a buffer itself.

Ownership: the six `*_buf` tensors belong to the VerifyEpilogue.
A captured or replayed verify step rewrites them every time it runs, so
- writers reach them only through `accept_buffers(bs)` (views, used as write targets), and
- readers get `read_accept(bs)`: clones made on the forward stream right after the step.
No view of a `*_buf` may outlive the step: not in a result, a batch's `seq_lens`, a FutureMap
slot, an async device-to-host copy or a log line: a late reader would see the next step's values.

Shapes: bs requests, a window of W = gamma + 1 verify rows per request: ids `[anchor, d_1..d_g]`
at positions S..S+g. Target row j predicts position S+j+1, so draft d_{j+1} is checked against
row j, and row `correct_len` provides the bonus token.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Optional, Sequence

import torch

from specserve.errors import InternalError
from specserve.runtime.stream import staged
from specserve.sampler import counter_uniforms, draw_counter, filtered_probs, inverse_cdf, seeds_tensor, token_counter
from specserve.sampling_params import SamplingParams

# Rank 0's values of these int64 CPU tensors, as owned copies, on every rank (TPDecisions.agree).
Agree = Callable[[list[torch.Tensor], str], list[torch.Tensor]]

BUFFER_FIELDS = ("correct_len", "bonus", "cap_trim_lens", "commit_lens", "new_seq_lens", "out_tokens")


@dataclass
class AcceptOuts:
    """Results of one verify step (all int64, `[bs]` except `out_tokens` `[bs, W]`).

    correct_len: accepted drafts (bonus excluded) after the verify-length cap
    bonus: the target's token at row correct_len (the next anchor)
    cap_trim_lens: matches lost to the cap, uncapped - min(uncapped, verify_len - 1)
    commit_lens: correct_len + 1 (tokens committed this step)
    new_seq_lens: prefix_lens + commit_lens
    out_tokens: drafts in columns 0..g-1 with the bonus written at column correct_len;
                only the first commit_lens entries of a row are valid
    """

    correct_len: torch.Tensor
    bonus: torch.Tensor
    cap_trim_lens: torch.Tensor
    commit_lens: torch.Tensor
    new_seq_lens: torch.Tensor
    out_tokens: torch.Tensor

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "AcceptOuts":
        return AcceptOuts(**{f.name: fn(getattr(self, f.name)) for f in fields(self)})

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]


@dataclass
class VerifyWindows:
    """What the accept of one verify step reads (shapes: see `accept_windows`)."""

    ids: torch.Tensor  # [bs, W]: the anchor, then the drafts
    logits: torch.Tensor  # the target's shaped logits of the computed rows
    prefix: torch.Tensor  # [bs]: each window's first position
    out_lens: torch.Tensor  # [bs]: output tokens before the window (the uniforms' counters)
    params: Sequence[SamplingParams]
    seeds: Sequence[int]
    draft_probs: Callable[[int], torch.Tensor]  # vocab -> q [bs, gamma, V]
    verify_lens: Optional[list[int]]  # rows verified per window (None: every row)
    keep: Optional[torch.Tensor] = None  # [bs, W] the computed rows when `logits` holds only those
    folded: bool = False  # the captured step already ran the greedy accept into the buffers

    @property
    def size(self) -> int:
        return self.ids.shape[0]


class VerifyEpilogue:
    """Owns the six persistent accept buffers and runs the accept kernels into them.

    `agree` (tensor parallelism): how this rank takes rank 0's accept results, so that every rank
    commits the same tokens whatever floating-point noise its own logits carry."""

    def __init__(
        self, max_bs: int, num_verify_tokens: int, device: str | torch.device = "cpu", agree: Optional[Agree] = None
    ):
        if max_bs < 1 or num_verify_tokens < 2:
            raise InternalError(
                f"VerifyEpilogue: need max_bs >= 1 and num_verify_tokens >= 2, got {max_bs}, {num_verify_tokens}"
            )
        self.max_bs = max_bs
        self.num_verify_tokens = num_verify_tokens
        self.agree = agree
        i64: dict[str, Any] = dict(dtype=torch.int64, device=device)
        self.correct_len_buf = torch.zeros(max_bs, **i64)
        self.bonus_buf = torch.zeros(max_bs, **i64)
        self.cap_trim_lens_buf = torch.zeros(max_bs, **i64)
        self.commit_lens_buf = torch.zeros(max_bs, **i64)
        self.new_seq_lens_buf = torch.zeros(max_bs, **i64)
        self.out_tokens_buf = torch.zeros(max_bs, num_verify_tokens, **i64)

    # ------------------------------------------------------------ one verify step's accept

    def accept(self, windows: VerifyWindows) -> AcceptOuts:
        """The step's accept, in one call: the kernels into the buffers (unless folded into the
        captured step), rank 0's results under tensor parallelism, then owned copies."""
        bs = windows.size
        if not windows.folded:
            accept_windows(
                self,
                windows.ids,
                windows.logits,
                windows.prefix,
                windows.out_lens,
                windows.params,
                windows.seeds,
                windows.draft_probs,
                windows.verify_lens,
                windows.keep,
            )
        if self.agree is not None:
            bufs = self.accept_buffers(bs).tensors()
            for buf, agreed in zip(bufs, self.agree([b.cpu() for b in bufs], "runner.accept")):
                buf.copy_(agreed)
        return self.read_accept(bs)  # owned: nothing after the step reads the *_buf tensors

    # ------------------------------------------------------------ ownership

    def buffers(self) -> list[torch.Tensor]:
        return [getattr(self, f"{name}_buf") for name in BUFFER_FIELDS]

    def accept_buffers(self, bs: int) -> AcceptOuts:
        """Views of the first bs rows: write targets for the accept kernels, never to be kept."""
        self._check_bs(bs)
        return AcceptOuts(*(buf[:bs] for buf in self.buffers()))

    def read_accept(self, bs: int) -> AcceptOuts:
        """Owned copies of this step's results. Call on the forward stream right after the step,
        before anything can replay it; the clones are then safe to hand to another stream."""
        self._check_bs(bs)
        return AcceptOuts(*(buf[:bs].clone() for buf in self.buffers()))

    def _check_bs(self, bs: int) -> None:
        if not 1 <= bs <= self.max_bs:
            raise InternalError(f"batch size {bs} outside 1..{self.max_bs} of this verify epilogue")

    # ------------------------------------------------------------ accept kernels

    def accept_greedy(
        self,
        bs: int,
        verify_ids: torch.Tensor,
        target_logits: torch.Tensor,
        prefix_lens: torch.Tensor,
        verify_lens: Optional[torch.Tensor] = None,
    ) -> None:
        """Greedy accept: a draft survives while it equals the target's argmax at the row before it."""
        self.accept_greedy_ids(
            bs, verify_ids, target_logits.view(bs, self.num_verify_tokens, -1).argmax(-1), prefix_lens, verify_lens
        )

    def accept_greedy_ids(
        self,
        bs: int,
        verify_ids: torch.Tensor,
        target: torch.Tensor,
        prefix_lens: torch.Tensor,
        verify_lens: Optional[torch.Tensor] = None,
    ) -> None:
        """Greedy accept from the target's argmax ids [bs, W] (rows past a verify length unread)."""
        width = self.num_verify_tokens
        ids = verify_ids.view(bs, width).long()
        matches = ids[:, 1:] == target[:, :-1]
        self._commit(bs, ids, matches, prefix_lens, verify_lens, lambda correct, cap: target.gather(1, correct))

    def accept_sampling(
        self,
        bs: int,
        verify_ids: torch.Tensor,
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor,
        uniforms: torch.Tensor,
        prefix_lens: torch.Tensor,
        verify_lens: Optional[torch.Tensor] = None,
        drawn: Optional[torch.Tensor] = None,
    ) -> None:
        """Exact chain rejection sampling, or for the rows `drawn` gives, the coupled accept.

        target_probs `[bs, W, V]`: the target's distribution p at each row, after each request's
        temperature / top-k / top-p (a greedy request passes the one-hot of its argmax).
        draft_probs `[bs, g, V]`: the Markov-corrected draft distribution q that proposed d_1..d_g
        (one-hot for a greedy drafter). uniforms `[bs, W]`: column k < g decides d_{k+1}, column g
        samples the bonus; the caller derives them from (request seed, position) so every rank
        and every batch composition draws the same numbers.

        d_{k+1} is accepted if u_k < min(1, p_k(d) / q_k(d)); at the first rejection the bonus is
        drawn from normalize(max(p_k - q_k, 0)); after a full (or capped) run, from p at that row.

        drawn `[bs, W]` (-1 in the rows of requests that use rejection sampling): each row's own
        draw from p at the uniform plain decoding would use for that position (`coupled_draws`).
        There d_{k+1} is accepted iff it equals drawn[k] and the bonus is drawn[correct_len], so
        the committed tokens are plain decoding's whatever was drafted (a seeded request's
        promise); the accept rate is p(d), the same as rejection sampling's for a one-hot q.
        """
        width = self.num_verify_tokens
        gamma = width - 1
        ids = verify_ids.view(bs, width).long()
        drafts = ids[:, 1:].unsqueeze(-1)  # [bs, g, 1]
        p_d = target_probs[:, :gamma].gather(2, drafts).squeeze(-1)
        q_d = draft_probs.gather(2, drafts).squeeze(-1)
        ratio = torch.where(q_d > 0, p_d / q_d.clamp_min(1e-30), torch.zeros_like(p_d))
        accepted = uniforms[:, :gamma] < ratio.clamp(max=1.0)
        if drawn is not None:
            coupled = drawn[:, :1] >= 0
            accepted = torch.where(coupled, ids[:, 1:] == drawn[:, :gamma], accepted)

        def bonus(correct: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
            row = correct.squeeze(1)
            rows = torch.arange(bs, device=row.device)
            p_row = target_probs[rows, row]  # [bs, V]
            # Stopping before the cap means d_{row+1} was rejected: resample from the residual.
            # Stopping at the cap means every checked draft passed: sample from p itself.
            rejected = row < cap
            q_row = draft_probs[rows, row.clamp(max=gamma - 1)]
            residual = torch.where(rejected.unsqueeze(1), (p_row - q_row).clamp_min(0), p_row)
            # p == q makes the residual empty, but then rejection has probability 0; guard rounding.
            residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_row)
            sampled = inverse_cdf(residual, uniforms[:, gamma].double())
            if drawn is not None:
                sampled = torch.where(drawn[:, 0] >= 0, drawn.gather(1, correct).squeeze(1), sampled)
            return sampled.unsqueeze(1)

        self._commit(bs, ids, accepted, prefix_lens, verify_lens, bonus)

    # ------------------------------------------------------------ shared epilogue

    @staticmethod
    def _cap(bs: int, verify_lens: Optional[torch.Tensor], gamma: int, device) -> torch.Tensor:
        if verify_lens is None:
            return torch.full((bs,), gamma, dtype=torch.int64, device=device)
        return (verify_lens.long() - 1).clamp(0, gamma)

    def _commit(
        self,
        bs: int,
        ids: torch.Tensor,
        accepted: torch.Tensor,
        prefix_lens: torch.Tensor,
        verify_lens: Optional[torch.Tensor],
        bonus_fn,
    ) -> None:
        """Write all six buffers, through accept_buffers only."""
        out = self.accept_buffers(bs)
        gamma = self.num_verify_tokens - 1
        uncapped = accepted.long().cumprod(1).sum(1)
        cap = self._cap(bs, verify_lens, gamma, ids.device)
        torch.minimum(uncapped, cap, out=out.correct_len)
        torch.sub(uncapped, out.correct_len, out=out.cap_trim_lens)
        torch.add(out.correct_len, 1, out=out.commit_lens)
        torch.add(prefix_lens.long(), out.commit_lens, out=out.new_seq_lens)
        out.bonus.copy_(bonus_fn(out.correct_len.unsqueeze(1), cap).squeeze(1))
        out.out_tokens[:, :gamma].copy_(ids[:, 1:])
        out.out_tokens[:, gamma].zero_()
        out.out_tokens.scatter_(1, out.correct_len.unsqueeze(1), out.bonus.unsqueeze(1))


def accept_windows(
    epilogue: VerifyEpilogue,
    ids: torch.Tensor,
    logits: torch.Tensor,
    prefix: torch.Tensor,
    out_lens: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    draft_probs: Callable[[int], torch.Tensor],
    verify_lens: Optional[list[int]],
    keep: Optional[torch.Tensor] = None,
) -> None:
    """Accept every window of a step into the epilogue's buffers: greedy when every request is,
    else exact rejection sampling (a greedy request's target distribution is one-hot), except for
    the sampling requests that gave a seed: the coupled accept (`coupled_draws`).

    ids [bs, W]; logits [bs * W, V] (rows a compact verify did not compute are never read), or
    with `keep` [bs, W] (the computed rows) only the computed rows, packed: greedy accept then
    reads their argmax alone, without a [bs * W, V] tensor. draft_probs(V) gives q [bs, gamma, V].
    The uniforms derive from (request seed, output length, row), so every rank and every batch
    composition draws the same numbers."""
    bs, width = ids.shape
    lens = None if verify_lens is None else staged(verify_lens, torch.int64, ids.device)
    if all(p.is_greedy for p in params):
        if keep is None:
            epilogue.accept_greedy(bs, ids, logits, prefix, lens)
        else:
            target = torch.zeros(bs, width, dtype=torch.int64, device=ids.device)
            target[keep] = logits.argmax(-1)
            epilogue.accept_greedy_ids(bs, ids, target, prefix, lens)
        return
    if keep is not None:
        full = logits.new_zeros(bs * width, logits.shape[-1])
        full[keep.reshape(-1)] = logits
        logits = full
    target = verify_target_probs(logits.view(bs, width, -1), params)
    columns = torch.arange(width, dtype=torch.int64, device=logits.device).unsqueeze(0)
    out_lens = out_lens.to(logits.device).unsqueeze(1)  # on the device: no read back
    seed_bits = seeds_tensor(seeds, logits.device).unsqueeze(1)
    uniforms = counter_uniforms(seed_bits, draw_counter(out_lens, columns))
    coupled = [i for i, p in enumerate(params) if p.seeded_sampling]
    drawn = coupled_draws(target, out_lens + columns, seed_bits, coupled) if coupled else None
    epilogue.accept_sampling(bs, ids, target, draft_probs(target.shape[-1]), uniforms, prefix, lens, drawn)


def coupled_draws(target: torch.Tensor, positions: torch.Tensor, seed_bits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """[bs, W] each window row's draw from its target distribution at the uniform of its output
    position (`positions` [bs, W], through token_counter), for the requests in `rows` (-1
    elsewhere). A request that gave a seed is promised the same tokens whatever the batch, the
    cache or the speculation policy, which measures step times and so drafts differently from run
    to run: rejection sampling's tokens depend on what was drafted, these are the plain decoding's."""
    bs, width, vocab = target.shape
    index = staged(rows, torch.int64, target.device)
    u = counter_uniforms(seed_bits[index], token_counter(positions[index]))
    picked = inverse_cdf(target[index].reshape(-1, vocab), u.reshape(-1)).view(len(rows), width)
    return torch.full((bs, width), -1, dtype=torch.int64, device=target.device).index_copy(0, index, picked)


def verify_target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[bs, W, V] target distribution per window row: one-hot argmax for greedy requests."""
    bs, width, vocab = logits.shape
    probs = torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if sampled:
        rows = logits[sampled].reshape(-1, vocab)
        repeated = [params[i] for i in sampled for _ in range(width)]
        probs[sampled] = filtered_probs(rows, repeated).view(len(sampled), width, vocab)
    return probs
