"""A step's arithmetic against the machine's: the core clock and the int8 multiply-add's peak,
measured on every thread at once (csrc/probe.cpp), and the multiply-adds one row of a step does in
the linears, so that a step time becomes multiply-adds per cycle per core and a share of that peak.

The peak is VPDPBUSD's (64 int8 multiply-adds an instruction) in independent chains with nothing
else in flight: the kernels also unpack codes, broadcast activations and scale sums in the same
instruction stream, so no step comes near it; the share says how much of the arithmetic is the
multiply-adds themselves."""

from __future__ import annotations

from typing import Any

CLOCK_ADDS = 400_000_000  # about 0.1 s a thread at 4 GHz
DOT_STEPS = 50_000_000  # 12 chains: about 75 ms a thread at two VPDPBUSD a cycle and 4 GHz
PROBE_REPEATS = 3  # best of
MACS_PER_DOT = 64  # VPDPBUSD on 512 bits: 16 lanes of 4 u8 x s8 products


def machine_arithmetic() -> dict[str, Any]:
    """The threads' mean clock (GHz) and VPDPBUSD's peak (instructions/s over all threads, and
    int8 multiply-adds per cycle per core); the peak is None off the AVX-512 path. The clock is
    taken under a scalar load: on CPUs that lower it for AVX-512 code (some Intel parts, not AMD
    Zen 4 or 5) the per-cycle figures mix two clocks."""
    import torch

    from specserve.kernels.build import load
    from specserve.kernels.dispatch import path_id

    kernels = load()
    ghz = max(kernels.clock_ghz(CLOCK_ADDS) for _ in range(PROBE_REPEATS))
    dots = max(kernels.int8_dot_per_second(path_id(), DOT_STEPS) for _ in range(PROBE_REPEATS))
    threads = torch.get_num_threads()
    peak = dots * MACS_PER_DOT / (ghz * 1e9 * threads) if dots and ghz else None
    return {"clock_ghz": ghz or None, "int8_dot_per_s": dots or None, "int8_macs_per_cycle_per_core_peak": peak,
            "probe_threads": threads}


def packed_kernels(model) -> list[tuple[Any, float]]:
    """Each packed weight a step reads, once (a tied head is the embedding's), with the share of it
    one row reads: 1, or for a mixture's experts k of E."""
    from specserve.kernels.linear import PackedLinear

    cfg = model.config
    routed = cfg.num_experts_per_tok / cfg.num_experts if cfg.is_moe else 1.0
    kernels = {id(m.kernel): (m.kernel, routed if ".experts." in name else 1.0) for name, m in model.named_modules()
               if isinstance(getattr(m, "kernel", None), PackedLinear)}  # fmt: skip
    return list(kernels.values())


def row_macs(model) -> int:
    """Multiply-adds one row of a step does in the linears: every packed weight's n x k times the
    share a row reads (packed_kernels); the embedding lookup none."""
    return int(sum(k.n * k.k * share for k, share in packed_kernels(model)))


def head_macs(model) -> int:
    """Of row_macs, the output head's: a prefill computes it for its last row only."""
    from specserve.kernels.linear import PackedLinear

    head = getattr(getattr(model, "lm_head", None), "kernel", None)
    return head.n * head.k if isinstance(head, PackedLinear) else 0


def macs_per_cycle_per_core(macs_per_s: float, machine: dict[str, Any]) -> float:
    return macs_per_s / (machine["clock_ghz"] * 1e9 * machine["probe_threads"])


def share_of_int8_peak(macs_per_s: float, machine: dict[str, Any]) -> float:
    return macs_per_s / (machine["int8_dot_per_s"] * MACS_PER_DOT)


def step_weight_bytes(model) -> int:
    """Bytes of weights a batch-1 step reads: every linear's packed weight (an embedding lookup reads
    a row, not the table; of a mixture's experts, the share a token routes to: k of E), or the
    parameters of a model without packed kernels."""
    kernels = packed_kernels(model)
    if kernels:
        return int(sum(k.nbytes() * share for k, share in kernels))
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "embed" not in name)
