"""Training and serving compute the same drafter: the training batch (every block of a sequence
side by side over one shared context) gives each block the hidden states and the logits that the
serving path (`DsparkDrafter.inject` + `block_hidden`, one block at a time) gives it."""

import random

import torch

from specserve.train.corpus import Sequence
from specserve.train.trainer import DrafterLoss, make_blocks
from tests.unit.test_dspark_drafter import H, V, make_drafter


def _sequence(n: int, prompt_len: int, layers: int, seed: int) -> Sequence:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, V, (n,), generator=g)
    top_ids = torch.randint(0, V, (n - 1 - prompt_len, 3), generator=g)
    top_probs = torch.softmax(torch.randn(n - 1 - prompt_len, 3, generator=g), -1)
    return Sequence(ids, prompt_len, torch.randn(n, layers * H, generator=g), top_ids, top_probs)


def test_grouped_training_blocks_equal_serving_blocks():
    model, kv = make_drafter(block_size=4, layers=2)
    seqs = [_sequence(30, 6, len(model.config.target_layer_ids), 1), _sequence(22, 9, len(model.config.target_layer_ids), 2)]
    loss = DrafterLoss(model, model.embed.weight.detach(), torch.zeros(V, H))
    blk = make_blocks(seqs, 4, 0, model.config.mask_token_id, random.Random(0))  # every answer position
    assert blk.anchors.shape == (2, 23)  # 30 - 1 - 6 anchors in the longer sequence
    trained = loss.block_hidden(blk)
    for b, s in enumerate(seqs):
        kv.k[0].zero_(), kv.v[0].zero_(), kv.k[1].zero_(), kv.v[1].zero_()
        model.inject(s.hidden, torch.arange(len(s.ids)), torch.arange(1, len(s.ids) + 1), kv)
        slots = torch.arange(1, len(s.ids) + 1).unsqueeze(0)
        for a in range(int(blk.valid[b, :, 0].sum())):
            S = int(blk.anchors[b, a])
            served = model.block_hidden(s.ids[S:S + 1], torch.tensor([S]), slots, kv)[0]
            assert torch.allclose(trained[b, a], served, atol=1e-5), (b, a, S)
            assert int(blk.block_ids[b, a, 0]) == int(s.ids[S])
            m = min(4, len(s.ids) - 1 - S)
            assert blk.labels[b, a, :m].tolist() == s.ids[S + 1:S + 1 + m].tolist()
            assert blk.valid[b, a].tolist() == [True] * m + [False] * (4 - m)
            assert torch.equal(blk.top_ids[b, a, :m], s.top_ids[S - s.prompt_len:S - s.prompt_len + m])
    assert not blk.valid[1, 15:].any()  # the shorter sequence's padding blocks carry no label


def test_loss_runs_on_grouped_blocks_and_counts_valid_positions():
    model, _ = make_drafter(block_size=4, layers=1)
    seqs = [_sequence(30, 6, len(model.config.target_layer_ids), 3), _sequence(12, 5, len(model.config.target_layer_ids), 4)]
    loss = DrafterLoss(model, model.embed.weight.detach(), torch.randn(V, H))
    blk = make_blocks(seqs, 4, 5, model.config.mask_token_id, random.Random(1))
    value, parts = loss(blk)
    value.backward()
    assert parts["positions"] == int(blk.valid.sum()) and torch.isfinite(value)
    assert model.fc.weight.grad is not None and model.fc.weight.grad.abs().sum() > 0


def test_float32_training_takes_the_bf16_teacher_states_without_autocast():
    """Where the CPU lacks native bf16 matmuls the loss runs in float32 throughout: the teacher's
    cached bf16 states are cast on the way in, and no autocast is entered."""
    model, _ = make_drafter(block_size=4, layers=1)
    seqs = [_sequence(30, 6, len(model.config.target_layer_ids), 5)]
    for s in seqs:
        s.hidden = s.hidden.bfloat16()  # as the teacher cache stores them
    loss = DrafterLoss(model, model.embed.weight.detach(), torch.randn(V, H))
    assert loss.dtype == torch.float32 and not loss.autocast()._enabled
    blk = make_blocks(seqs, 4, 5, model.config.mask_token_id, random.Random(2))
    with loss.autocast():
        value, parts = loss(blk)
    value.backward()
    assert torch.isfinite(value) and model.fc.weight.grad.abs().sum() > 0
    bf16 = DrafterLoss(model, model.embed.weight.detach().bfloat16(), torch.randn(V, H).bfloat16())
    assert bf16.autocast()._enabled  # the bf16 line keeps autocast


def test_training_precision_follows_the_cpu():
    from specserve.kernels.dispatch import available_paths
    from specserve.train.trainer import training_dtype

    native = "avx512_bf16" in available_paths()
    assert training_dtype() == (torch.bfloat16 if native else torch.float32)
