"""The start-up block's text from the engine's ready info (the live check is tests/server/test_startup.py)."""

from __future__ import annotations

import torch

import specserve.models.packed_cache as packed_cache
from specserve.args import ServerArgs
from specserve.engine.start_cache import weight_cache_max_bytes, weight_cache_report
from specserve.kernels.linear import Q8, PackedLinear
from specserve.models.activations import INT8_REASON
from specserve.models.packed_cache_cap import describe_bytes
from specserve.models.summary import describe_parameters
from specserve.server.startup import startup_block

ENTRY = "/cache/packed/qwen2.5-coder-0.5b-instruct-q8_0.gguf-1a2b3c4d-tp0of2-0123456789abcdef.pt"

INFO = {"model": {"architecture": "qwen2", "parameters": 494_032_768, "weights": {"Q8_0": 169, "F32": 121}},
        "model_path": "/models/qwen2.5-coder-0.5b-instruct-q8_0.gguf", "dtype": "float32", "device": "cpu",
        "kernel_path": None, "threads": 2, "tp_size": 2, "kv_total_tokens": 12345, "context_length": 32768,
        "max_running_requests": 16, "speculative_policy": None, "speculative_drafters": [], "num_draft_tokens": 0,
        "speculative_draft_model_path": None, "pid": 42, "cpu_activations": "bf16", "quantized_linears": True,
        "weight_cache": {"state": "writing", "path": ENTRY, "bytes": 3 << 29, "max_bytes": 64 << 30, "reason": ""}}


def test_block_names_the_model_compute_cache_speculation_and_address():
    block = startup_block("qwen", INFO, "http://0.0.0.0:8000", 3.25).splitlines()
    assert block == [
        "serving qwen",
        "  model        qwen2.5-coder-0.5b-instruct-q8_0.gguf: qwen2, 494.0M parameters; weights Q8_0 x169, F32 x121",
        "  compute      float32 on cpu, torch ops, 2 threads, TP 2",
        "  KV cache     12,345 tokens; context 32,768; up to 16 running requests",
        f"  weight cache writing 1.50 GiB to {ENTRY} (cap 64.00 GiB over all models, least recently used evicted first)"
        "; each of the 2 TP ranks keeps its own",
        "  speculation  off",
        "  engine       pid 42, up after 3.2 s",
        "  address      http://0.0.0.0:8000 (OpenAI API under /v1; /health, /metrics)",
    ]


def test_speculation_line_names_the_policy_and_the_drafters():
    info = {**INFO, "speculative_policy": "fixed", "speculative_drafters": ["DSPARK"], "num_draft_tokens": 5,
            "speculative_draft_model_path": "/drafters/smollm2-135m-instruct/"}
    assert "  speculation  fixed policy over DSPARK (smollm2-135m-instruct), up to 5 drafts a step" in \
        startup_block("m", info, "http://h:1", 1.0)


def test_activations_line_names_the_quantized_linears_activations_and_why_on_the_cpu_kernels():
    info = {**INFO, "dtype": "bfloat16", "kernel_path": "avx512_bf16", "cpu_activations": "int8",
            "cpu_activations_reason": INT8_REASON}
    block = startup_block("m", info, "http://h:1", 1.0).splitlines()
    assert "  compute      bfloat16 on cpu, avx512_bf16 kernels, 2 threads, TP 2" in block
    assert f"  activations  int8 for the quantized linears ({INT8_REASON})" in block
    assert block.index("  activations  int8 for the quantized linears (" + INT8_REASON + ")") == 3  # after compute
    for quiet in ({**info, "quantized_linears": False}, {**info, "kernel_path": None}):  # nothing the flag sets
        assert "activations" not in startup_block("m", quiet, "http://h:1", 1.0)


def test_parameter_counts_read_as_people_write_them():
    assert [describe_parameters(n) for n in (134_515_008, 1_500_000_000, 270_000, 999)] == ["134.5M", "1.5B", "270.0K", "999"]


def weight_cache_line(cache: dict, tp_size: int = 1) -> str:
    block = startup_block("m", {**INFO, "weight_cache": cache, "tp_size": tp_size}, "http://h:1", 1.0)
    [line] = [ln for ln in block.splitlines() if ln.startswith("  weight cache ")]
    return line


def test_weight_cache_line_says_reused_off_or_not_kept_and_why():
    assert weight_cache_line({"state": "mapped", "path": ENTRY, "bytes": 500 << 20, "max_bytes": 1 << 30, "reason": ""}) \
        == f"  weight cache reused: {ENTRY} (500.0 MiB) mapped, nothing written"
    assert weight_cache_line({"state": "off", "reason": "--weight-cache off"}) == "  weight cache off (--weight-cache off)"
    why = "80.00 GiB of packed weights is over the 64.00 GiB cap (--weight-cache-max-gib)"
    assert weight_cache_line({"state": "not kept", "path": ENTRY, "bytes": 80 << 30, "max_bytes": 64 << 30, "reason": why}) \
        == f"  weight cache not kept: {why}"


def test_weight_cache_line_names_the_entry_and_bytes_this_start_writes(tmp_path, monkeypatch):
    """From a real cache's decision (engine/start_cache.py's report), not a planted dict."""
    monkeypatch.setattr(packed_cache, "HEADROOM_BYTES", 0)  # the test disk's free space does not decide
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF")
    args = ServerArgs(weight_cache=str(tmp_path / "packed"), weight_cache_max_gib=1)
    cache = packed_cache.PackedWeightCache(args.weight_cache, str(model), 0, 1, torch.bfloat16, weight_cache_max_bytes(args))
    codes = torch.zeros(3 << 20, dtype=torch.uint8)
    empty = torch.empty(0, dtype=torch.float16)
    cache.save_later({"lm_head": PackedLinear(format=Q8, codes=codes, scale=empty, zero=empty, n=1, k=1)})
    cache.save_in_background()  # as the engine builder starts it: the block is read meanwhile
    line = weight_cache_line(weight_cache_report(args, cache))
    cache.finish()
    assert line == f"  weight cache writing {describe_bytes(codes.numel())} to {cache.path} " \
        f"(cap {describe_bytes(1 << 30)} over all models, least recently used evicted first)"
    assert cache.path.startswith(str(tmp_path / "packed" / "tiny.gguf-")) and describe_bytes(codes.numel()) == "3.0 MiB"
    off = weight_cache_line(weight_cache_report(args.replace(weight_cache="off"), None))
    assert off == "  weight cache off (--weight-cache off)"
