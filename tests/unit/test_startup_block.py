"""The start-up block's text from the engine's ready info (the live check is tests/server/test_startup.py)."""

from __future__ import annotations

from specserve.models.summary import describe_parameters
from specserve.server.startup import startup_block

INFO = {"model": {"architecture": "qwen2", "parameters": 494_032_768, "weights": {"Q8_0": 169, "F32": 121}},
        "model_path": "/models/qwen2.5-coder-0.5b-instruct-q8_0.gguf", "dtype": "float32", "device": "cpu",
        "kernel_path": None, "threads": 2, "tp_size": 2, "kv_total_tokens": 12345, "context_length": 32768,
        "max_running_requests": 16, "speculative_policy": None, "speculative_drafters": [], "num_draft_tokens": 0,
        "speculative_draft_model_path": None, "pid": 42, "cpu_activations": "bf16", "quantized_linears": True}


def test_block_names_the_model_compute_cache_speculation_and_address():
    block = startup_block("qwen", INFO, "http://0.0.0.0:8000", 3.25).splitlines()
    assert block == [
        "serving qwen",
        "  model        qwen2.5-coder-0.5b-instruct-q8_0.gguf: qwen2, 494.0M parameters; weights Q8_0 x169, F32 x121",
        "  compute      float32 on cpu, torch ops, 2 threads, TP 2",
        "  KV cache     12,345 tokens; context 32,768; up to 16 running requests",
        "  speculation  off",
        "  engine       pid 42, up after 3.2 s",
        "  address      http://0.0.0.0:8000 (OpenAI API under /v1; /health, /metrics)",
    ]


def test_speculation_line_names_the_policy_and_the_drafters():
    info = {**INFO, "speculative_policy": "fixed", "speculative_drafters": ["DSPARK"], "num_draft_tokens": 5,
            "speculative_draft_model_path": "/drafters/smollm2-135m-instruct/"}
    assert "  speculation  fixed policy over DSPARK (smollm2-135m-instruct), up to 5 drafts a step" in \
        startup_block("m", info, "http://h:1", 1.0)


def test_compute_line_names_the_quantized_linears_activations_on_the_cpu_kernels():
    info = {**INFO, "dtype": "bfloat16", "kernel_path": "avx512_bf16", "cpu_activations": "int8"}
    assert "  compute      bfloat16 on cpu, avx512_bf16 kernels, int8 activations, 2 threads, TP 2" in \
        startup_block("m", info, "http://h:1", 1.0)
    dense = startup_block("m", {**info, "quantized_linears": False}, "http://h:1", 1.0)
    assert "  compute      bfloat16 on cpu, avx512_bf16 kernels, 2 threads, TP 2" in dense


def test_parameter_counts_read_as_people_write_them():
    assert [describe_parameters(n) for n in (134_515_008, 1_500_000_000, 270_000, 999)] == ["134.5M", "1.5B", "270.0K", "999"]
