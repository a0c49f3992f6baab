"""A start-up check of the built kernels on this CPU: results against a float64 reference and
row invariance (the same row alone and inside a larger batch), for every path the CPU allows.

`python -m specserve.kernels.self_test` builds the kernels (build.load) and runs it; scripts/setup.sh
does so. The entry point lives here, not in build.py: the check needs the packers (linear.py), which
need the built library, so build.py stays the leaf of the kernels package."""

from __future__ import annotations

from types import ModuleType

import torch

from specserve.kernels.build import build_dir, load
from specserve.kernels.dispatch import PATHS, vector_paths
from specserve.kernels.linear import Q4, Q8, pack_bf16, pack_q4, pack_q8

# Relative to the largest reference output: bf16 outputs carry 2^-8 rounding, fp32 sums far less.
TOLERANCE = {"q4": 1e-5, "q6_k": 1e-5, "q8": 1e-5, "bf16": 1e-2, "attention": 1e-2}


def _weights(n: int, k: int, g: torch.Generator) -> dict[str, tuple]:
    codes4 = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    offset = (-8 * scale + torch.randn(n, k // 32, generator=g) * 1e-3).half().float()
    codes8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    dense = torch.randn(n, k + 1, generator=g).bfloat16()  # odd K
    expand = lambda t: t.double().repeat_interleave(32, 1)  # noqa: E731
    # K-quant-like: int8 sub-scales times float16 super-scales per 256 columns, offsets -32 * scale
    top = (torch.rand(n, k // 256, generator=g) * 1e-3).half().float()
    scale_k = top.repeat_interleave(8, 1) * torch.randint(-127, 128, (n, k // 32), generator=g).float()
    return {
        "q4": (pack_q4(codes4, scale, offset), codes4.double() * expand(scale) + expand(offset)),
        "q6_k": (
            pack_q4(codes4 * 4, scale_k, -32 * scale_k, bits=6, supers=(top, -32 * top)),
            (codes4.double() * 4 - 32) * expand(scale_k),
        ),
        "q8": (pack_q8(codes8, scale), codes8.double() * expand(scale)),
        "bf16": (pack_bf16(dense), dense.double()),
    }


def _check(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    if not err <= TOLERANCE[name]:
        raise RuntimeError(f"kernel self-test: {name} is off the float64 reference by {err:.2e} (limit {TOLERANCE[name]})")
    return err


def self_test(module: ModuleType) -> str:
    """Run the checks; raise RuntimeError on any failure, else return a one-line summary."""
    g = torch.Generator().manual_seed(0)
    paths = ["generic", *vector_paths(module)]
    worst: dict[str, float] = {}
    for name, (packed, dense) in _weights(48, 256, g).items():
        x = torch.randn(7, packed.k, generator=g).bfloat16()
        outs = {}
        tables = dict(zip(("code_offset", "scale_super", "zero_super"), packed.table_args()))
        tables.update(group=packed.group, bits=packed.bits)
        codes = (packed.format, packed.codes, packed.scale, packed.zero, packed.n, packed.k, packed.format not in (Q4, Q8))
        for path in paths:
            y = module.linear(x, *codes, PATHS[path], *packed.exponents, **tables)
            alone = module.linear(x[3:4].contiguous(), *codes, PATHS[path], *packed.exponents, **tables)
            if not torch.equal(alone[0], y[3]):
                raise RuntimeError(f"kernel self-test: {name} ({path}) gives a row a different result alone than in a batch")
            worst[name] = max(worst.get(name, 0.0), _check(name, y, x.double() @ dense.T))
            outs[path] = y
        for path, y in outs.items():
            if not torch.equal(y, outs["generic"]):
                raise RuntimeError(f"kernel self-test: {name} differs between the generic and {path} paths")
    return f"self-test passed on paths {paths}; worst relative error " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())


def main() -> None:
    module = load()
    print(f"specserve kernels built in {build_dir()}")
    print(self_test(module))


if __name__ == "__main__":
    main()
