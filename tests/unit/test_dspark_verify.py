"""Accept kernels and buffer ownership of VerifyEpilogue (the stale-accept fix's unit tests and more)."""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch

import specserve.speculative.accept as accept_module
from specserve.errors import InternalError
from specserve.sampling_params import SamplingParams
from specserve.speculative.accept import VerifyEpilogue, accept_windows

V = 10


def logits_with_argmax(rows: list[list[int]]) -> torch.Tensor:
    """[bs*W, V] logits whose argmax at row (r, j) is rows[r][j]."""
    t = torch.tensor(rows)
    logits = torch.zeros(t.numel(), V)
    logits[torch.arange(t.numel()), t.flatten()] = 5.0
    return logits


def run_greedy(ids, targets, prefix, verify_lens=None, dtype=torch.int64):
    bs, width = len(ids), len(ids[0])
    epi = VerifyEpilogue(max_bs=8, num_verify_tokens=width)
    vl = None if verify_lens is None else torch.tensor(verify_lens, dtype=dtype)
    epi.accept_greedy(bs, torch.tensor(ids, dtype=dtype), logits_with_argmax(targets),
                      torch.tensor(prefix, dtype=dtype), vl)
    return epi.read_accept(bs)


# ------------------------------------------------------------------ hand-built greedy cases

@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_greedy_none_some_all(dtype):
    ids = [[7, 1, 2, 3],   # target says 9 after the anchor: nothing accepted
           [7, 1, 2, 3],   # 1, 2 accepted, 3 rejected (target wants 8)
           [7, 1, 2, 3]]   # all accepted; bonus from the last row
    targets = [[9, 2, 3, 4],
               [1, 2, 8, 4],
               [1, 2, 3, 6]]
    out = run_greedy(ids, targets, prefix=[10, 20, 30], dtype=dtype)
    assert out.correct_len.tolist() == [0, 2, 3]
    assert out.bonus.tolist() == [9, 8, 6]
    assert out.commit_lens.tolist() == [1, 3, 4]
    assert out.new_seq_lens.tolist() == [11, 23, 34]
    assert out.cap_trim_lens.tolist() == [0, 0, 0]
    # drafts in columns 0..g-1, bonus at column correct_len; only commit_lens entries valid
    assert out.out_tokens[0, :1].tolist() == [9]
    assert out.out_tokens[1, :3].tolist() == [1, 2, 8]
    assert out.out_tokens[2].tolist() == [1, 2, 3, 6]
    assert all(t.dtype == torch.int64 for t in out.tensors())


def test_greedy_cap_trims_matches():
    ids = [[7, 1, 2, 3], [7, 1, 2, 3]]
    targets = [[1, 2, 3, 6], [1, 5, 3, 6]]
    out = run_greedy(ids, targets, prefix=[0, 0], verify_lens=[2, 3])
    # row 0: 3 matches, only verify_len - 1 = 1 counted; row 1: 1 match, cap 2 not reached
    assert out.correct_len.tolist() == [1, 1]
    assert out.cap_trim_lens.tolist() == [2, 0]
    assert out.bonus.tolist() == [2, 5]  # the target's token at row correct_len
    assert out.commit_lens.tolist() == [2, 2]


def test_a_match_after_a_mismatch_does_not_count():
    out = run_greedy([[7, 1, 2, 3]], [[5, 2, 3, 6]], prefix=[4])
    assert out.correct_len.tolist() == [0]
    assert out.bonus.tolist() == [5]


# ------------------------------------------------------------------ ownership

def _fill(epi: VerifyEpilogue, bs: int, value: int) -> None:
    for t in epi.accept_buffers(bs).tensors():
        t.fill_(value)


def reads_survive_overwrite(epi: VerifyEpilogue, bs: int = 3) -> bool:
    """The stale-accept fix's check: values read after step N are still step N's after step N+1 runs."""
    _fill(epi, bs, 11)
    first = epi.read_accept(bs)
    _fill(epi, bs, 22)
    return all(bool((t == 11).all()) for t in first.tensors())


def writes_reach_readers(epi: VerifyEpilogue, bs: int = 3) -> bool:
    """The review's check: what writers put through accept_buffers is what read_accept returns."""
    target = epi.accept_buffers(bs)
    for i, t in enumerate(target.tensors()):
        t.copy_(torch.arange(t.numel()).view_as(t) + 100 * i)
    got = epi.read_accept(bs)
    return all(bool((t == torch.arange(t.numel()).view_as(t) + 100 * i).all()) for i, t in enumerate(got.tensors()))


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_read_accept_returns_owned_tensors():
    epi = VerifyEpilogue(max_bs=4, num_verify_tokens=6)
    for t in epi.read_accept(3).tensors():
        assert not any(shares_storage(t, buf) for buf in epi.buffers())
    for t in epi.accept_buffers(3).tensors():
        assert any(shares_storage(t, buf) for buf in epi.buffers())
    assert reads_survive_overwrite(epi)
    assert writes_reach_readers(epi)


def test_accept_greedy_writes_what_read_accept_returns():
    epi = VerifyEpilogue(max_bs=4, num_verify_tokens=4)
    epi.accept_greedy(2, torch.tensor([[7, 1, 2, 3], [7, 1, 2, 3]]), logits_with_argmax([[1, 2, 8, 4], [1, 2, 3, 6]]),
                      torch.tensor([5, 6]))
    got = epi.read_accept(2)
    assert got.correct_len.tolist() == [2, 3]
    assert epi.correct_len_buf[:2].tolist() == [2, 3]
    assert got.new_seq_lens.tolist() == [8, 10]


def test_mutation_read_accept_returning_views_is_caught(monkeypatch):
    epi = VerifyEpilogue(max_bs=4, num_verify_tokens=6)
    monkeypatch.setattr(epi, "read_accept", epi.accept_buffers)  # the stale-accept race's cause
    assert not reads_survive_overwrite(epi)


def test_mutation_writers_writing_into_clones_is_caught(monkeypatch):
    epi = VerifyEpilogue(max_bs=4, num_verify_tokens=4)
    real_read = epi.read_accept
    monkeypatch.setattr(epi, "accept_buffers", real_read)  # the refactor: out=self.read_accept(bs)
    assert not writes_reach_readers(epi)
    epi.accept_greedy(1, torch.tensor([[7, 1, 2, 3]]), logits_with_argmax([[1, 2, 3, 6]]), torch.tensor([0]))
    assert epi.read_accept(1).correct_len.tolist() != [3], "accept results went into throwaway clones"


def test_batch_size_is_checked():
    """A batch past the epilogue's buffers is the engine's bug (an internal error), never bad input."""
    epi = VerifyEpilogue(max_bs=2, num_verify_tokens=3)
    with pytest.raises(InternalError, match="batch size"):
        epi.read_accept(3)


# ------------------------------------------------------------------ sampling accept

def one_hot(idx: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(idx, vocab).float()


def test_sampling_with_one_hot_distributions_equals_greedy():
    ids = torch.tensor([[7, 1, 2, 3], [7, 1, 2, 3], [7, 1, 2, 3]])
    targets = torch.tensor([[9, 2, 3, 4], [1, 2, 8, 4], [1, 2, 3, 6]])
    greedy = run_greedy(ids.tolist(), targets.tolist(), prefix=[1, 2, 3])
    epi = VerifyEpilogue(max_bs=3, num_verify_tokens=4)
    p = one_hot(targets, V)
    q = one_hot(ids[:, 1:], V)
    epi.accept_sampling(3, ids, p, q, torch.rand(3, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([1, 2, 3]))
    got = epi.read_accept(3)
    for name in ("correct_len", "bonus", "cap_trim_lens", "commit_lens", "new_seq_lens"):
        assert torch.equal(getattr(got, name), getattr(greedy, name)), name
    for r, n in enumerate(got.commit_lens.tolist()):  # only the first commit_lens entries are valid
        assert got.out_tokens[r, :n].tolist() == greedy.out_tokens[r, :n].tolist()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


P = [0.35, 0.25, 0.15, 0.12, 0.08, 0.05]  # the target's distribution
Q = [0.05, 0.10, 0.40, 0.05, 0.30, 0.10]  # the drafter's: q != p, so some drafts are rejected
CHI2_CRITICAL = 20.52  # 5 degrees of freedom, p = 0.001


def first_tokens_through_the_engine_entry(gamma: int, n: int = 20_000, seed: int = 7):
    """n seeded verify windows through `accept_windows`, the entry the ModelRunner calls (which
    calls `VerifyEpilogue.accept_sampling`): windows of gamma drafts drawn from Q, a target
    sampling at temperature 1 from logits log(P). Returns the first emitted token of each window
    and the accept results."""
    vocab = len(P)
    p, q = torch.tensor(P), torch.tensor(Q)
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q.expand(n, vocab), gamma, replacement=True, generator=gen)
    ids = torch.cat([torch.zeros(n, 1, dtype=torch.int64), drafts], dim=1)
    logits = p.log().expand(n * (gamma + 1), vocab)
    epi = VerifyEpilogue(max_bs=n, num_verify_tokens=gamma + 1)
    params = [SamplingParams(temperature=1.0)] * n
    accept_windows(epi, ids, logits, torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), params,
                   [seed + i for i in range(n)], lambda v: q.expand(n, gamma, v), None)
    out = epi.read_accept(n)
    return out.out_tokens[:, 0], out


@pytest.mark.parametrize("gamma", [1, 3])
def test_sampling_accept_is_exact(gamma):
    """First emitted token ~ p regardless of q (rejection sampling with residual resampling).

    20,000 seeded windows over a 6-token vocabulary; chi-square with 5 degrees of freedom against
    the 0.001 critical value. A broken residual (sampling from p instead) fails this: see the
    mutation test below.
    """
    first, out = first_tokens_through_the_engine_entry(gamma)
    counts = torch.bincount(first, minlength=len(P)).float()
    assert chi_square(counts, torch.tensor(P)) < CHI2_CRITICAL, counts / counts.sum()
    assert 0 < (out.correct_len == 0).float().mean() < 1  # some drafts rejected, some accepted


RESIDUAL = "(p_row - q_row).clamp_min(0)"


def accept_sampling_without_the_residual():
    """The real `VerifyEpilogue.accept_sampling`, recompiled from its own source with one
    change: after a rejection the bonus is drawn from p instead of normalize(max(p - q, 0))."""
    source = textwrap.dedent(inspect.getsource(VerifyEpilogue.accept_sampling))
    assert source.count(RESIDUAL) == 1, f"the residual {RESIDUAL!r} moved: update this mutation"
    namespace = dict(vars(accept_module))
    exec(compile(source.replace(RESIDUAL, "p_row"), inspect.getsourcefile(accept_module), "exec"), namespace)
    return namespace["accept_sampling"]


@pytest.mark.parametrize("gamma", [1, 3])
def test_mutation_sampling_the_bonus_from_p_after_a_rejection_is_caught(gamma, monkeypatch):
    """Mutation of the function the engine calls: patched on the class, reached through
    accept_windows exactly as ModelRunner._verify reaches it; the exactness check must fail."""
    mutant, calls = accept_sampling_without_the_residual(), []

    def counted(self, *args, **kwargs):
        calls.append(self)
        return mutant(self, *args, **kwargs)

    monkeypatch.setattr(VerifyEpilogue, "accept_sampling", counted)
    first, _ = first_tokens_through_the_engine_entry(gamma)
    assert len(calls) == 1, "accept_windows did not reach the patched accept_sampling"
    counts = torch.bincount(first, minlength=len(P)).float()
    assert chi_square(counts, torch.tensor(P)) > CHI2_CRITICAL, counts / counts.sum()


def seeded_windows(drafts_of, gamma: int, n: int = 400):
    """n seeded windows (output lengths 0..n-1, one seed each) through `accept_windows`, target P at
    every row and drafter Q, drafts from `drafts_of(seeds, out_lens, k)`. Returns the accept results
    and plain decoding's draws: the token each output position samples with no drafts at all."""
    from specserve.sampler import counter_uniforms, inverse_cdf, seeds_tensor, token_counter

    vocab, width = len(P), gamma + 1
    p, q = torch.tensor(P), torch.tensor(Q)
    seeds, out_lens = torch.arange(n) * 7919 + 3, torch.arange(n)
    ids = torch.zeros(n, width, dtype=torch.int64)
    for k in range(gamma):
        ids[:, k + 1] = drafts_of(seeds, out_lens, k)
    epi = VerifyEpilogue(max_bs=n, num_verify_tokens=width)
    params = [SamplingParams(temperature=1.0, seed=int(s)) for s in seeds]
    accept_windows(epi, ids, p.log().expand(n * width, vocab), torch.zeros(n, dtype=torch.int64), out_lens, params,
                   seeds.tolist(), lambda v: q.expand(n, gamma, v), None)
    positions = out_lens.unsqueeze(1) + torch.arange(width)
    u = counter_uniforms(seeds_tensor(seeds.tolist(), "cpu").unsqueeze(1), token_counter(positions))
    plain = inverse_cdf(p.expand(n * width, vocab), u.reshape(-1)).view(n, width)
    return epi.read_accept(n), plain


def test_a_seeded_request_commits_plain_decodings_draws_whatever_was_drafted():
    """The coupled accept: drafts from Q (independent of the target's draws) are accepted exactly
    where they equal plain decoding's token, and the committed tokens are plain decoding's."""
    gen = torch.Generator().manual_seed(3)
    out, plain = seeded_windows(lambda s, n, k: torch.multinomial(torch.tensor(Q).expand(len(s), -1), 1,
                                                                  generator=gen).squeeze(1), gamma=3)
    for row, n in enumerate(out.commit_lens.tolist()):
        assert out.out_tokens[row, :n].tolist() == plain[row, :n].tolist()
    assert 0 < (out.correct_len == 0).float().mean() < 1  # some drafts rejected, some accepted


def test_drafts_on_the_tokens_own_draws_are_all_accepted_when_the_drafter_is_the_target():
    """draft_counter's coupling: a drafter whose distribution is the target's, drawing at the
    counters draft_counter gives a seeded request, proposes exactly the tokens the accept draws."""
    from specserve.sampler import counter_uniforms, draft_counter, inverse_cdf, seeds_tensor

    def target_as_drafter(seeds, out_lens, k):
        u = counter_uniforms(seeds_tensor(seeds.tolist(), "cpu"), draft_counter(out_lens, k, torch.tensor(True)))
        return inverse_cdf(torch.tensor(P).expand(len(seeds), -1), u)

    out, _ = seeded_windows(target_as_drafter, gamma=4)
    assert out.correct_len.tolist() == [4] * len(out.correct_len)


# ------------------------------------------------------------------ the one accept call of a verify step

def greedy_windows(ids, targets, prefix, folded=False):
    from specserve.speculative.accept import VerifyWindows

    bs = len(ids)
    return VerifyWindows(torch.tensor(ids), logits_with_argmax(targets), torch.tensor(prefix), torch.zeros(bs, dtype=torch.int64),
                         [SamplingParams(temperature=0)] * bs, [0] * bs, lambda vocab: torch.zeros(bs, 3, vocab), None,
                         folded=folded)


def test_accept_runs_the_kernels_and_returns_owned_copies():
    epi = VerifyEpilogue(max_bs=4, num_verify_tokens=4)
    got = epi.accept(greedy_windows([[7, 1, 2, 3], [7, 1, 2, 3]], [[1, 2, 8, 4], [1, 2, 3, 6]], [5, 6]))
    assert got.correct_len.tolist() == [2, 3] and got.new_seq_lens.tolist() == [8, 10]
    assert not any(shares_storage(t, buf) for t in got.tensors() for buf in epi.buffers())
    folded = epi.accept(greedy_windows([[7, 9, 9, 9]], [[1, 1, 1, 1]], [0], folded=True))  # the kernels ran already
    assert folded.correct_len.tolist() == [2]


def test_accept_takes_rank_0_results_through_agree_before_the_owned_copies():
    """Tensor parallelism: what `agree` returns (rank 0's values) is what every rank commits."""
    sites = []

    def agree(tensors, site):
        sites.append(site)
        return [torch.full_like(t, 1) for t in tensors]

    epi = VerifyEpilogue(max_bs=4, num_verify_tokens=4, agree=agree)
    got = epi.accept(greedy_windows([[7, 1, 2, 3]], [[1, 2, 8, 4]], [5]))
    assert sites == ["runner.accept"]
    assert all(t.eq(1).all() for t in got.tensors())
    assert not any(shares_storage(t, buf) for t in got.tensors() for buf in epi.buffers())


def test_the_alias_fault_lives_in_its_own_epilogue_and_runner():
    """SPECSERVE_FAULT_ALIAS_ACCEPT_BUFFERS: the faulty epilogue hands out views; the plain one never
    does, and only a fault flag makes `make_runner` build the FaultyRunner."""
    from specserve.executor.faulty_runner import AliasedAcceptEpilogue, runs_faults
    from specserve.runtime.faults import FaultConfig

    aliased = AliasedAcceptEpilogue(max_bs=4, num_verify_tokens=4)
    got = aliased.accept(greedy_windows([[7, 1, 2, 3]], [[1, 2, 8, 4]], [5]))
    assert all(any(shares_storage(t, buf) for buf in aliased.buffers()) for t in got.tensors())
    assert not runs_faults(FaultConfig()) and not runs_faults(FaultConfig(copy_delay_ms=5))
    assert runs_faults(FaultConfig(alias_accept_buffers=True)) and runs_faults(FaultConfig(copy_lag_ms=10))
