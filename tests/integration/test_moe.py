"""Mixtures of experts (qwen3moe, qwen2moe, gpt-oss) on tiny random files: the routing and sums the
architecture test compares with transformers can fail when planted wrong (top-k weights left
unnormalised, the shared expert ungated; gpt-oss's sinks dropped, its softmax taken before the top
k, its SwiGLU unclamped), each token's MLP output is bitwise its own whatever rows
share the step (and a planted summation in the step's expert-load order breaks that), routing ties
go to the lower expert index, and a mixture under tensor parallelism is one clear error."""

from __future__ import annotations

import pytest
import torch
from tiny_gguf import GPT_OSS, GPT_OSS_TYPES, MOE_TYPES, QWEN2_MOE, QWEN3_MOE, transformers_reference, write_tiny_gguf

from specserve.engine import Engine
from specserve.errors import ConfigError
from specserve.kernels.build import load
from specserve.models import moe as moe_module
from specserve.models.attention import SdpaAttentionMetadata
from specserve.models.config import ModelConfig
from specserve.models.layers import TPContext
from specserve.models.moe import SparseMoeBlock, route

PROMPT = [(7 * i + 3) % 256 for i in range(24)]


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory) -> dict[str, str]:
    files = {}
    for name, spec in (("qwen3moe", QWEN3_MOE), ("qwen2moe", QWEN2_MOE), ("gpt-oss", GPT_OSS)):
        path = str(tmp_path_factory.mktemp(name) / "model.gguf")
        gpt_oss = name == "gpt-oss"
        write_tiny_gguf(path, spec, GPT_OSS_TYPES if gpt_oss else MOE_TYPES, seed=11, pre="gpt-4o" if gpt_oss else "qwen2")
        files[name] = path
    return files


def _logit_error(path: str) -> float:
    """Largest |ours - transformers| over the prompt's float32 logits."""
    from helpers import prefill_logits

    with Engine(model_path=path, dtype="float32", speculative_algorithm="NONE", max_total_tokens=256) as engine:
        ours = prefill_logits(engine.runner.model, PROMPT)
    with torch.no_grad():
        ref = transformers_reference(path)(torch.tensor([PROMPT])).logits[0]
    return (ours - ref).abs().max().item()


def test_planted_unnormalised_top_k_is_caught(moe_files, monkeypatch):
    assert _logit_error(moe_files["qwen3moe"]) < 1e-3
    real = SparseMoeBlock.__init__

    def unnormalised(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.normalize = False

    monkeypatch.setattr(SparseMoeBlock, "__init__", unnormalised)
    assert _logit_error(moe_files["qwen3moe"]) > 1e-2


def test_planted_ungated_shared_expert_is_caught(moe_files, monkeypatch):
    assert _logit_error(moe_files["qwen2moe"]) < 1e-3

    def ungated(self, x, ops):
        return self.shared_expert(x, ops, torch.float32)

    monkeypatch.setattr(SparseMoeBlock, "shared", ungated)
    assert _logit_error(moe_files["qwen2moe"]) > 1e-2


def _sinks_dropped(monkeypatch):
    real = SdpaAttentionMetadata.attend
    monkeypatch.setattr(SdpaAttentionMetadata, "attend", lambda self, q, k, v, scale, window=0, sinks=None: real(self, q, k, v, scale, window))


def _softmax_before_top_k(monkeypatch):
    real = SparseMoeBlock.__init__

    def before(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.softmax_after_topk = False

    monkeypatch.setattr(SparseMoeBlock, "__init__", before)


def _swiglu_unclamped(monkeypatch):
    monkeypatch.setattr(moe_module, "SWIGLU_OAI_LIMIT", float("inf"))


@pytest.mark.parametrize("plant", [_sinks_dropped, _softmax_before_top_k, _swiglu_unclamped],
                         ids=["sinks-dropped", "softmax-before-top-k", "swiglu-unclamped"])  # fmt: skip
def test_planted_gpt_oss_bugs_are_caught(moe_files, monkeypatch, plant):
    assert _logit_error(moe_files["gpt-oss"]) < 1e-3
    plant(monkeypatch)
    assert _logit_error(moe_files["gpt-oss"]) > 1e-2


def _in_load_order(self, x, ops):
    """A planted summation: experts visited most-loaded first and added into each row as they come,
    so a row's order of additions depends on which other rows share the step."""
    weights, experts = route(self.router_logits(x), self.top_k, self.normalize, self.softmax_after_topk)
    out = torch.zeros(x.shape, dtype=torch.float32)
    active, counts = torch.unique(experts, return_counts=True)
    for e in active[torch.argsort(counts, descending=True, stable=True)].tolist():
        rows, slots = (experts == e).nonzero(as_tuple=True)
        out.index_add_(0, rows, self.experts[e](x[rows], ops, torch.float32) * weights[rows, slots].unsqueeze(1))
    shared = self.shared(x, ops)
    return out if shared is None else out + shared


def _row_mismatches(block, ops, x: torch.Tensor) -> int:
    """Rows whose float32 mixture (before its rounding to bf16) differs from the row's alone."""
    together = block.mix(x, ops)
    alone = torch.cat([block.mix(x[i : i + 1], ops) for i in range(x.shape[0])])
    return int((together.view(torch.int32) != alone.view(torch.int32)).any(dim=1).sum())


def test_each_rows_output_is_its_own_and_a_load_order_sum_is_caught(moe_files, monkeypatch):
    """bf16 on the CPU kernels: one layer's float32 mixture over 32 rows at once against each row
    alone, bitwise; then the planted load-order summation must differ on some row."""
    with Engine(model_path=moe_files["qwen3moe"], dtype="bfloat16", speculative_algorithm="NONE",
                max_total_tokens=256) as engine:  # fmt: skip
        model = engine.runner.model
        block, ops = model.layers[0].mlp, model.ops
        assert isinstance(block, SparseMoeBlock)
        x = torch.randn(32, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        assert _row_mismatches(block, ops, x) == 0
        monkeypatch.setattr(SparseMoeBlock, "mix", _in_load_order)
        assert _row_mismatches(block, ops, x) > 0


def test_routing_ties_go_to_the_lower_expert_index():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 2.0], [5.0, 5.0, 5.0, 5.0, 5.0, 5.0]])
    weights, experts = route(logits, 3, normalize=True)
    assert experts.tolist() == [[1, 3, 5], [0, 1, 2]]
    assert torch.allclose(weights, torch.full((2, 3), 1 / 3))
    unnormalised, _ = route(logits, 3, normalize=False)
    assert torch.allclose(unnormalised[1], torch.full((3,), 1 / 6))


def test_a_mixture_under_tensor_parallelism_is_one_error():
    cfg = ModelConfig(256, 0, 1, 4, 2, 64, 300, 1e4, 1e-6, 512, True, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=256)  # fmt: skip
    with pytest.raises(ConfigError, match="mixture-of-experts models run on one rank"):
        SparseMoeBlock(cfg, TPContext(rank=0, size=2), torch.bfloat16)


def test_the_kernels_mixture_matches_the_torch_one_and_is_each_rows_own(moe_files):
    """csrc/moe.cpp (what the bf16 engine runs) against models/moe.py's torch mixture on the same
    packed weights: within float32 rounding of the softmax, and bitwise each row's own."""
    for name in ("qwen3moe", "qwen2moe", "gpt-oss"):
        with Engine(model_path=moe_files[name], dtype="bfloat16", speculative_algorithm="NONE",
                    max_total_tokens=256) as engine:  # fmt: skip
            model = engine.runner.model
            block, ops = model.layers[1].mlp, model.ops
            x = torch.randn(16, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
            native = block(x, ops)
            reference = block.mix(x, ops)
            assert (native.float() - reference).abs().max().item() <= 1e-2 * reference.abs().max().item(), name
            alone = torch.cat([block(x[i : i + 1], ops) for i in range(x.shape[0])])
            assert torch.equal(native.view(torch.int16), alone.view(torch.int16)), name


def test_the_kernels_routing_breaks_ties_to_the_lower_index():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 2.0], [5.0, 5.0, 5.0, 5.0, 5.0, 5.0]])
    weights, experts = load().moe_route(logits, 3, True)
    assert experts.tolist() == [[1, 3, 5], [0, 1, 2]]
    assert torch.allclose(weights, torch.full((2, 3), 1 / 3))
    ours, theirs = load().moe_route(logits, 3, False)[0], route(logits, 3, normalize=False)[0]
    assert torch.allclose(ours, theirs)
    weights, experts = load().moe_route(logits, 3, False, True)  # gpt-oss: the softmax of the k largest logits
    assert experts.tolist() == [[1, 3, 5], [0, 1, 2]] and torch.allclose(weights, torch.full((2, 3), 1 / 3))
    assert torch.allclose(weights, route(logits, 3, False, softmax_after_topk=True)[0])


def test_a_batch_one_step_reads_a_tokens_share_of_the_experts(moe_files):
    """bench offline's bandwidth share counts k of E experts' weights per token, every other linear whole."""
    from specserve.bench.arithmetic import step_weight_bytes
    from specserve.kernels.linear import PackedLinear

    with Engine(model_path=moe_files["qwen3moe"], dtype="bfloat16", speculative_algorithm="NONE",
                max_total_tokens=256) as engine:  # fmt: skip
        model = engine.runner.model
        named = [(n, m.kernel) for n, m in model.named_modules() if isinstance(getattr(m, "kernel", None), PackedLinear)]
        experts = sum(k.nbytes() for n, k in named if ".experts." in n)
        others = sum(k.nbytes() for n, k in {id(k): (n, k) for n, k in named}.values() if ".experts." not in n)
        assert experts > 0 and step_weight_bytes(model) == int(others + experts * 4 / 8)


def test_the_step_profile_times_a_mixtures_block_as_one_part(moe_files):
    """bench offline's step profile names the mixture's block (router and experts) and nothing is
    counted twice (what is left for `other` stays >= 0)."""
    import argparse

    from specserve.bench.offline import step_shapes

    with Engine(model_path=moe_files["qwen3moe"], dtype="bfloat16", speculative_algorithm="NONE",
                max_total_tokens=256) as engine:  # fmt: skip
        shapes = step_shapes(engine, argparse.Namespace(window=3, prefix_len=16, prefill_len=32, repeats=1))
    for name in ("decode", "verify"):
        profile = shapes[f"{name}_profile_ms"]
        assert profile["moe"] > 0 and profile["other"] >= 0, (name, profile)


def test_a_verify_window_reads_more_experts_than_a_decode_row(moe_files):
    """bench offline's count of the experts a step reads: one row reads its k, a 4-row window of
    text-like ids more; the cost prior's synthetic rows are such ids (one token repeated would route
    every row alike and make a window look as cheap as a decode step)."""
    from specserve.bench.offline import distinct_experts
    from specserve.executor.warmup import spread_ids

    with Engine(model_path=moe_files["qwen3moe"], dtype="bfloat16", speculative_algorithm="NONE",
                max_total_tokens=256) as engine:  # fmt: skip
        k = engine.runner.model.config.num_experts_per_tok
        ids = spread_ids(4, engine.runner.model.config.vocab_size, "cpu").tolist()
        assert len(set(ids)) == 4
        assert distinct_experts(engine, ids[:1], 8) == k
        assert k < distinct_experts(engine, ids, 8) <= min(engine.runner.model.config.num_experts, 4 * k)
        assert distinct_experts(engine, ids[:1] * 4, 8) < distinct_experts(engine, ids, 8)


@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss"])
def test_speculation_is_lossless_on_a_mixture(moe_files, name):
    """bf16 greedy tokens with the default speculation (NGRAM under the adaptive policy, here on the
    tests' cheap cost table so that it drafts) equal plain decoding's, on repetitive prompts whose
    n-grams give drafts; some steps verified drafts."""
    from helpers import policy_args

    prompts = [PROMPT + PROMPT[:12], (PROMPT[:6] * 5)[:28]]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    with Engine(model_path=moe_files[name], dtype="bfloat16", speculative_algorithm="NONE", max_total_tokens=512) as engine:
        plain = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    with Engine(model_path=moe_files[name], dtype="bfloat16", max_total_tokens=512, **policy_args()) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == plain
    assert sum(sum(o["meta_info"].get("spec_drafter_steps", {}).values()) for o in outs) > 0, "no step drafted"
