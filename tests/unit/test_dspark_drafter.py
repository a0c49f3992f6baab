"""The DSpark drafter on a tiny random config: block attention, context masking, the Markov head,
the confidence head, sampled drafts and checkpoints."""

import pytest
import torch

from specserve.kv.pool import KVPool
from specserve.models.config import ModelConfig
from specserve.models.dspark import DsparkConfig, DsparkDrafter, spread_layers
from specserve.models.dspark_checkpoint import init_drafter, load_drafter, read_drafter_config, save_drafter
from specserve.sampling_params import SamplingParams

V, H = 40, 32
TARGET = ModelConfig(hidden_size=H, intermediate_size=64, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=8,
                     vocab_size=V, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=256,
                     tie_word_embeddings=True)
GREEDY = SamplingParams(temperature=0.0)


def make_drafter(block_size=4, seed=0, layers=2):
    cfg = DsparkConfig.for_target(TARGET, num_layers=layers, block_size=block_size, markov_rank=8, mask_token_id=3)
    model = DsparkDrafter(cfg, max_positions=256)
    model.load_state_dict(init_drafter(cfg, seed, std=0.3), strict=False)
    embed = torch.nn.Embedding(V, H)
    head = torch.nn.Linear(H, V, bias=False)
    torch.manual_seed(seed)
    torch.nn.init.normal_(embed.weight)
    torch.nn.init.normal_(head.weight, std=0.3)
    model.attach_target(embed, lambda h: head(h).float())
    kv = KVPool(64, layers, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    return model, kv


def inject_context(model, kv, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, len(model.config.target_layer_ids) * H, generator=g)
    model.inject(hidden, torch.arange(n), torch.arange(1, n + 1), kv)
    return torch.arange(1, n + 1).unsqueeze(0)  # ctx slots of one request


def test_spread_layers():
    assert spread_layers(30, 3) == [1, 14, 27]
    assert spread_layers(6, 1) == [3]


def test_slot_zero_sees_the_rest_of_the_block():
    """Bidirectional inside the block: the anchor slot's state depends on the mask slots."""
    model, kv = make_drafter()
    slots = inject_context(model, kv, 10)
    a = model.block_hidden(torch.tensor([5]), torch.tensor([10]), slots, kv)
    model.config.mask_token_id = 4
    b = model.block_hidden(torch.tensor([5]), torch.tensor([10]), slots, kv)
    assert not torch.allclose(a[0, 0], b[0, 0])


def test_context_at_or_past_s_is_ignored_and_before_s_is_read():
    model, kv = make_drafter()
    slots = inject_context(model, kv, 12)
    base = model.block_hidden(torch.tensor([5]), torch.tensor([8]), slots, kv)
    for layer in range(2):
        kv.k[layer][9:13] = 99.0  # positions 8..11: not context yet for S = 8
    assert torch.allclose(model.block_hidden(torch.tensor([5]), torch.tensor([8]), slots, kv), base)
    kv.k[0][3] += 1.0  # position 2 < S
    assert not torch.allclose(model.block_hidden(torch.tensor([5]), torch.tensor([8]), slots, kv), base)


def test_batched_drafting_equals_drafting_alone():
    model, kv = make_drafter()
    inject_context(model, kv, 20)
    slots = torch.arange(1, 21).unsqueeze(0).repeat(2, 1)
    both = model.propose(torch.tensor([5, 6]), torch.tensor([20, 13]), slots, kv, [GREEDY] * 2, [0, 0], [0, 0])
    alone = model.propose(torch.tensor([6]), torch.tensor([13]), slots[:1, :13], kv, [GREEDY], [0], [0])
    assert torch.equal(both.tokens[1], alone.tokens[0])
    assert torch.allclose(both.confidence[1], alone.confidence[0], atol=1e-6)
    assert both.probs is None


def test_markov_head_runs_left_to_right():
    """With zero base logits and a Markov head that maps x to x + 1, drafts count up from the anchor."""
    model, kv = make_drafter(block_size=5)
    slots = inject_context(model, kv, 4)
    model.lm_head = lambda h: torch.zeros(h.shape[0], V)
    r = model.config.markov_rank
    with torch.no_grad():
        model.markov_w1.weight.zero_()
        model.markov_w2.weight.zero_()
        for x in range(V):
            model.markov_w1.weight[x, x % r] = 1.0
        # W2 row y reads W1 column (y - 1) % r: B(x)[y] = 1 iff y == x + 1 (mod r) within the first r ids.
        for y in range(1, r):
            model.markov_w2.weight[y, y - 1] = 1.0
    out = model.propose(torch.tensor([1]), torch.tensor([4]), slots, kv, [GREEDY], [0], [0])
    assert out.tokens.tolist() == [[2, 3, 4, 5, 6]]
    assert ((out.confidence > 0) & (out.confidence < 1)).all()


def test_sampled_drafts_carry_their_distribution_and_are_reproducible():
    model, kv = make_drafter()
    slots = inject_context(model, kv, 6).repeat(2, 1)
    hot = SamplingParams(temperature=1.0, top_k=10)
    a = model.propose(torch.tensor([5, 5]), torch.tensor([6, 6]), slots, kv, [hot, GREEDY], [7, 7], [3, 3])
    b = model.propose(torch.tensor([5]), torch.tensor([6]), slots[:1], kv, [hot], [7], [3])
    assert torch.equal(a.tokens[0], b.tokens[0])
    q = a.probs[0]
    assert torch.allclose(q.sum(-1), torch.ones(4)) and ((q > 0).sum(-1) <= 10).all()
    assert (q.gather(1, a.tokens[0].unsqueeze(1)) > 0).all()
    assert torch.equal(a.probs[1], torch.nn.functional.one_hot(a.tokens[1], V).float())
    c = model.propose(torch.tensor([5]), torch.tensor([6]), slots[:1], kv, [hot], [8], [3])
    d = model.propose(torch.tensor([5]), torch.tensor([6]), slots[:1], kv, [hot], [7], [4])
    assert not (torch.equal(c.tokens, b.tokens) and torch.equal(d.tokens, b.tokens))


def test_checkpoint_round_trip_and_mismatch(tmp_path):
    cfg = DsparkConfig.for_target(TARGET, num_layers=1, block_size=3, markov_rank=8)
    state = init_drafter(cfg, seed=4)
    save_drafter(str(tmp_path), cfg, state)
    assert read_drafter_config(str(tmp_path)) == cfg
    model = load_drafter(str(tmp_path), TARGET, torch.float32, "cpu", 64, block_size=6)
    assert model.block_size == 6
    for name, tensor in model.state_dict().items():
        if name in state:
            assert torch.equal(tensor, state[name].float()), name
    other = ModelConfig(**{**TARGET.__dict__, "hidden_size": 64})
    with pytest.raises(ValueError, match="hidden_size"):
        load_drafter(str(tmp_path), other, torch.float32, "cpu", 64)
