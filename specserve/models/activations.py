"""`--cpu-activations auto`: which activations the CPU kernels' quantized linears take, by one rule
on the weights' type, never by a per-file record.

The rule: on CPU, a linear over quantized GGUF codes (Q4_0 ... Q8_0, the K-quants, MXFP4) takes its
input rows as int8, each row quantized on its own per 32 columns (kernels/csrc/linear_int8.h);
float weights (F16, BF16, F32, or any file under `--quantization none`) keep bf16 rows, whose
kernels the packed float formats need anyway. llama.cpp computes every quantized type the same way
but coarser for the K-quants (Q8_K: one scale per 256 columns), and that is the quality every
llama.cpp user already runs: measured teacher-forced on the three real files the engine ships or
reads (`specserve bench quality --peer-llama-cpp`, docs/cpu-kernels.md "Against llama.cpp's own
8-bit activations"), specserve's int8 rows put fp32's token first at least as often as llama.cpp
does, with a perplexity at least as close to fp32's, on every one of them. bf16 activations stay
the exact mode (`--cpu-activations bf16`): within bf16 rounding of fp32 on every linear.
"""

from __future__ import annotations

from typing import Any

# Why `auto` chose what it chose: the start-up block's activations line (server/startup.py).
INT8_REASON = (
    "auto: quantized weights take 8-bit activation rows (per 32 columns; llama.cpp's own "
    "scheme or finer), at or above llama.cpp's agreement with fp32; --cpu-activations bf16 is exact"
)
OFF_CPU_REASON = "auto: off the CPU the flag does nothing"
DEQUANTIZED_REASON = "auto: --quantization none dequantizes the weights, and float weights take bf16 rows"


def choose_cpu_activations(choice: str, device: str, quantization: str) -> tuple[str, str]:
    """(bf16 or int8, why) for the flag's value on this device: an explicit choice as given,
    `auto` by the rule above."""
    if choice != "auto":
        return choice, f"--cpu-activations {choice}"
    if device.split(":")[0] != "cpu":
        return "bf16", OFF_CPU_REASON
    if quantization == "none":
        return "bf16", DEQUANTIZED_REASON
    return "int8", INT8_REASON


def with_resolved_activations(args: Any) -> Any:
    """ServerArgs with `auto` resolved (Engine: once on rank 0, before it starts the other ranks,
    so every rank computes alike)."""
    chosen, _ = choose_cpu_activations(args.cpu_activations, args.device, args.quantization)
    return args.replace(cpu_activations=chosen)
