"""The DSpark drafter's native drafting pass (models/dspark_native.py) on a tiny random bf16 drafter:
the block through the native decoder layer against the per-op block, the greedy Markov head in one
call against the per-op loop (bit for bit), batch invariance, the fallback when the pool has no
block rows, and the fused linears it is built from."""

import pytest
import torch

from specserve.kernels.linear import BLOCK, concat_columns, pack_bf16
from specserve.kv.pool import KVPool
from specserve.models import dspark_native
from specserve.models.backend import select_backend
from specserve.models.config import ModelConfig
from specserve.models.dspark import DsparkConfig, DsparkDrafter
from specserve.models.dspark_checkpoint import init_drafter
from specserve.models.quant import Q8Weight
from specserve.sampling_params import SamplingParams

V, H = 96, 64
TARGET = ModelConfig(hidden_size=H, intermediate_size=96, num_layers=6, num_heads=2, num_kv_heads=1, head_dim=32,
                     vocab_size=V, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=256,
                     tie_word_embeddings=True)
GREEDY = SamplingParams(temperature=0.0)
G = 4  # block size


class Head:
    """A target LM head: float32 logits, and its rows for a reduced draft vocabulary."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, h: torch.Tensor) -> torch.Tensor:  # row by row: a row's logits never depend on the others
        return torch.cat([h[i : i + 1].float() @ self.weight.T for i in range(h.shape[0])])

    def rows(self, index: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.weight[index].to(dtype or torch.bfloat16)


def make_drafter(per_op: bool, q8: bool = True, draft_vocab: int | None = None, block_rows: int = 4 * G):
    cfg = DsparkConfig.for_target(TARGET, num_layers=2, block_size=G, markov_rank=32, mask_token_id=3)
    cfg.draft_vocab_size = draft_vocab
    model = DsparkDrafter(cfg, max_positions=256)
    model.load_state_dict(init_drafter(cfg, 0, std=0.3), strict=False)
    if draft_vocab is not None:
        model.draft_to_target.copy_(torch.randperm(V, generator=torch.Generator().manual_seed(5))[:draft_vocab])
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    if q8:
        model.quantize_weights()
    model.use_backend(select_backend("cpu", torch.bfloat16, per_op_layers=per_op))
    g = torch.Generator().manual_seed(1)
    embed_rows = torch.randn(V, H, generator=g).bfloat16()
    model.attach_target(lambda ids: embed_rows[ids], Head(torch.randn(V, H, generator=g) * 0.3))
    kv = KVPool(64, 2, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, block_rows=block_rows)
    context = torch.randn(40, len(cfg.target_layer_ids) * H, generator=g)
    model.inject(context, torch.arange(40), torch.arange(1, 41), kv)
    return model, kv


def test_the_native_drafter_is_built_only_where_it_runs():
    native, _ = make_drafter(per_op=False)
    per_op, _ = make_drafter(per_op=True)
    assert native.native is not None and native.native.markov_w2 is not None
    assert per_op.native is None
    cfg = DsparkConfig.for_target(TARGET, num_layers=2, block_size=G, markov_rank=32)
    fp32 = DsparkDrafter(cfg, max_positions=256)
    fp32.use_backend(select_backend("cpu", torch.float32))  # stock torch ops: no native pass
    assert fp32.native is None
    native.use_backend(select_backend("cpu", torch.bfloat16, per_op_layers=True))  # a later backend wins
    assert native.native is None


def fp32_block(anchors, lens, slots):
    """The block's states in float32 through stock torch ops, on the bf16 drafter's weights."""
    cfg = DsparkConfig.for_target(TARGET, num_layers=2, block_size=G, markov_rank=32, mask_token_id=3)
    model = DsparkDrafter(cfg, max_positions=256)
    model.load_state_dict(init_drafter(cfg, 0, std=0.3), strict=False)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16).float()
    g = torch.Generator().manual_seed(1)
    embed_rows = torch.randn(V, H, generator=g).bfloat16().float()
    model.attach_target(lambda ids: embed_rows[ids], lambda h: h)
    kv = KVPool(64, 2, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    torch.randn(V, H, generator=g)  # the head's draw in make_drafter
    model.inject(torch.randn(40, len(cfg.target_layer_ids) * H, generator=g), torch.arange(40), torch.arange(1, 41), kv)
    return model.block_hidden(anchors, lens, slots, kv).detach()


def test_native_block_is_as_close_to_fp32_as_the_per_op_block(monkeypatch):
    """Same weights, same context: the native block (kernel RoPE and attention) is no further from
    the float32 block than the per-op bf16 block (bf16 RoPE, SDPA) is; a native block whose rows
    saw the block causally (a planted mask bug) is far from both."""
    native, kv_n = make_drafter(per_op=False, q8=False)
    per_op, kv_p = make_drafter(per_op=True, q8=False)
    anchors, lens = torch.tensor([5, 9]), torch.tensor([40, 23])
    slots = torch.arange(1, 41).repeat(2, 1)
    want = fp32_block(anchors, lens, slots)
    error = lambda h: float((h.float() - want).norm() / want.norm())  # noqa: E731
    per_op_error = error(per_op.block_hidden(anchors, lens, slots, kv_p))
    assert per_op_error < 0.05
    assert error(native.block_hidden(anchors, lens, slots, kv_n)) <= 1.25 * per_op_error

    causal = lambda lens, g: (lens.long().unsqueeze(1) + torch.arange(1, g + 1)).reshape(-1)  # noqa: E731
    monkeypatch.setattr(dspark_native, "block_row_lens", causal)
    assert error(native.block_hidden(anchors, lens, slots, kv_n)) > 0.2


@pytest.mark.parametrize("draft_vocab", [None, 48])
def test_native_markov_head_is_the_loop_bit_for_bit(draft_vocab):
    """Greedy picks, the W1 rows and the confidences equal the per-op loop's on the same inputs,
    with ties (the first maximum wins) and a NaN (it wins) planted in the base logits."""
    model, _ = make_drafter(per_op=False, draft_vocab=draft_vocab)
    vocab = model.draft_vocab_size
    g = torch.Generator().manual_seed(7)
    base = torch.randn(3, G, vocab, generator=g)
    base[0, 0, 10] = base[0, 0, 30] = 1e30  # a tie (the Markov term is far below 1e30's spacing): 10 wins
    base[1, 2, 17] = float("nan")
    hidden = torch.randn(3, G, H, generator=g).bfloat16()
    anchors = torch.tensor([1, 50, 95])
    native = model.markov_decode(anchors, hidden, base, [GREEDY] * 3, [0] * 3, [0] * 3)
    block, model.native = model.native, None
    loop = model.markov_decode(anchors, hidden, base, [GREEDY] * 3, [0] * 3, [0] * 3)
    model.native = block
    assert torch.equal(native.tokens, loop.tokens)
    assert torch.equal(native.confidence, loop.confidence)
    assert int(native.tokens[0, 0]) == int(model.to_target(torch.tensor(10)))
    assert int(native.tokens[1, 2]) == int(model.to_target(torch.tensor(17)))


@pytest.mark.parametrize("vocab", [16, 45, 300])
def test_markov_head_picks_the_same_on_every_kernel_path(vocab):
    """The greedy pick (the first largest of base + W2 e, a NaN first of all) is the same index on
    the portable scan and on each vector path: ties inside and across 16-lane groups, an all-zero
    row, a NaN late in the row, rows all -inf, and vocabularies with a partial last group."""
    from specserve.kernels.build import load
    from specserve.kernels.dispatch import PATHS, available_paths

    if available_paths() == ("generic",):
        pytest.skip("this CPU has neither AVX512-BF16 nor AVX2: only the portable path")

    g = torch.Generator().manual_seed(vocab)
    rank, bs, slots = 32, 6, 3
    w1 = torch.randn(vocab, rank, generator=g).bfloat16()  # every pick is a valid next row
    w2 = pack_bf16(torch.zeros(vocab, rank).bfloat16()).native()  # the sums are the base logits alone
    base = torch.randn(bs, slots, vocab, generator=g).round()  # integers: ties are common
    base[0, 0, vocab - 1] = base[0, 0].max() + 1  # the maximum in the last (partial) group
    base[1, 0, :] = 0.0  # all tie: the first (index 0) wins
    base[2, 1, vocab // 2] = float("nan")
    base[2, 1, vocab - 1] = float("nan")
    base[3, 2, :] = float("-inf")
    base[4, 0, 1] = base[4, 0, vocab - 2] = base[4, 0].max() + 5  # a tie across groups: 1 wins
    anchors = torch.arange(bs)
    picks = {p: load().markov_greedy(base, w1, w2, anchors, None, PATHS[p])[0] for p in available_paths()}
    generic = picks.pop("generic")
    assert generic[0, 0] == vocab - 1 and generic[1, 0] == 0 and generic[2, 1] == vocab // 2
    assert generic[3, 2] == 0 and generic[4, 0] == 1
    for path, tokens in picks.items():
        assert torch.equal(tokens, generic), path


def test_native_markov_head_leaves_sampled_batches_to_the_loop():
    model, _ = make_drafter(per_op=False)
    calls = []
    real = model.native.markov_greedy
    model.native.markov_greedy = lambda *a: calls.append(1) or real(*a)
    base, hidden = torch.randn(2, G, V), torch.randn(2, G, H).bfloat16()
    hot = SamplingParams(temperature=1.0)
    model.markov_decode(torch.tensor([1, 2]), hidden, base, [GREEDY, hot], [0, 1], [0, 0])
    assert calls == []
    model.markov_decode(torch.tensor([1, 2]), hidden, base, [GREEDY, GREEDY], [0, 1], [0, 0])
    assert calls == [1]


def test_native_drafts_do_not_depend_on_the_batch():
    model, kv = make_drafter(per_op=False)
    slots = torch.arange(1, 41).repeat(3, 1)
    both = model.propose(torch.tensor([5, 6, 7]), torch.tensor([40, 13, 27]), slots, kv, [GREEDY] * 3, [0] * 3, [0] * 3)
    for i, (a, s) in enumerate([(5, 40), (6, 13), (7, 27)]):
        alone = model.propose(torch.tensor([a]), torch.tensor([s]), slots[:1, :s], kv, [GREEDY], [0], [0])
        assert torch.equal(both.tokens[i], alone.tokens[0])
        assert torch.equal(both.confidence[i], alone.confidence[0])


@pytest.mark.parametrize("per_op", [False, True])
def test_the_first_k_drafts_are_the_whole_blocks_first_k(per_op):
    """A window that verifies k drafts gets the first k of the whole block's drafts (the block
    attends as a whole; the heads and the Markov head stop after k), greedy and sampled, and the
    worker fills the window out to gamma with what no verify reads (the last draft, one-hot)."""
    from specserve.speculative.dspark_worker import DsparkWorker
    from specserve.speculative.worker import DraftInput

    model, kv = make_drafter(per_op=per_op)
    anchors, lens, slots = torch.tensor([5, 6]), torch.tensor([40, 27]), torch.arange(1, 41).repeat(2, 1)
    params, seeds, counters = [GREEDY, SamplingParams(temperature=1.0)], [0, 11], [3, 8]
    whole = model.propose(anchors, lens, slots, kv, params, seeds, counters)
    table = torch.zeros(4, 48, dtype=torch.int64)
    table[:2, :40] = slots
    worker = DsparkWorker(model, kv, table)
    for k in range(1, G + 1):
        first = model.propose(anchors, lens, slots, kv, params, seeds, counters, drafts=k)
        assert torch.equal(first.tokens, whole.tokens[:, :k])
        assert torch.equal(first.probs, whole.probs[:, :k]) and torch.equal(first.confidence, whole.confidence[:, :k])
        out = worker.draft(DraftInput(torch.tensor([0, 1]), anchors, lens, torch.tensor(counters), params, seeds, G, k))
        assert torch.equal(out.tokens[:, :k], first.tokens) and torch.equal(out.probs[:, :k], first.probs)
        assert (out.tokens[:, k:] == first.tokens[:, -1:]).all() and out.confidence.shape == (2, G)
        assert torch.equal(out.probs[:, k:].argmax(-1), out.tokens[:, k:]) and (out.probs[:, k:].sum(-1) == 1).all()


def test_a_pool_without_block_rows_drafts_op_by_op():
    native, kv_n = make_drafter(per_op=False, block_rows=G)  # room for one request's block
    per_op, kv_p = make_drafter(per_op=True, block_rows=G)
    anchors, lens, slots = torch.tensor([5, 9]), torch.tensor([40, 23]), torch.arange(1, 41).repeat(2, 1)
    assert torch.equal(native.block_hidden(anchors, lens, slots, kv_n), per_op.block_hidden(anchors, lens, slots, kv_p))
    assert kv_n.block_slots(G).tolist() == list(range(65, 65 + G)) and kv_n.block_slots(G + 1) is None


def test_fused_columns_give_each_parts_outputs_and_hold_the_codes_once():
    g = torch.Generator().manual_seed(3)
    parts = [Q8Weight.from_dense(torch.randn(n, 64, generator=g)).packed() for n in (32, 16, 48)]
    x = torch.randn(5, 64, generator=g).bfloat16()
    alone = [p(x) for p in parts]
    fused = concat_columns(parts)
    assert fused is not None and fused.n == 96
    assert torch.equal(fused(x), torch.cat(alone, 1))
    for p, want in zip(parts, alone):  # re-pointed at the fused codes, same outputs
        assert torch.equal(p(x), want)
        assert fused.codes.untyped_storage().data_ptr() == p.codes.untyped_storage().data_ptr()
    assert concat_columns([parts[0], pack_bf16(torch.randn(32, 64).bfloat16())]) is None  # two layouts
    assert concat_columns([Q8Weight.from_dense(torch.randn(BLOCK + 8, 64)).packed()]) is None  # part of a block
