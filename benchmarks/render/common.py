"""What every renderer shares: reading a result file (under its name or an older one), the provenance line under a part, and how a
few runs' spread and a ratio's noise are written."""

from __future__ import annotations

import json
import os
from typing import Any

from specserve.bench.provenance import drafter_checksum

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED_DRAFTER = os.path.join("specserve", "assets", "drafters", "smollm2-135m-instruct")


def load(results: str, name: str) -> dict[str, Any]:
    with open(os.path.join(results, name)) as f:
        return json.load(f)


def load_renamed(results: str, name: str, old_name: str) -> tuple[dict[str, Any], str]:
    """A result file and the name it was read under: `name`, else the `old_name` a run before the
    file was renamed wrote."""
    old = not os.path.exists(os.path.join(results, name)) and os.path.exists(os.path.join(results, old_name))
    found = old_name if old else name
    return load(results, found), found


def machine_text(data: dict[str, Any]) -> str:
    m = data.get("machine") or {}
    if isinstance(m, str):  # older files: dispatch.machine_description()
        return m
    if "cpu" in m and "model" not in m:  # spec_policy.json's older field name
        m = {**m, "model": m["cpu"]}
    return m.get("description") or ", ".join(
        [m.get("model", "machine not recorded")] + ([f"{m['threads']} threads"] if "threads" in m else [])
        + (["AVX512-BF16"] if m.get("avx512_bf16") else []) + (["AMX"] if m.get("amx") else ["no AMX"] if m else []))


def provenance(data: dict[str, Any], file: str) -> str:
    """`bench_results/F` (machine; commit and date when recorded; the drafter, marked when it is
    not the shipped one): the line under a rendered part. A record from a commit with uncommitted
    changes ('-dirty') is refused: nobody could rebuild what measured it."""
    if str(data.get("commit", "")).endswith("-dirty"):
        raise ValueError(f"{file}: measured at {data['commit']}, a tree with uncommitted changes; measure it again "
                         "from a clean commit before a document cites it")
    when = ", ".join(f"{k} {data[k]}" for k in ("commit", "date") if data.get(k)) or "commit and date not recorded"
    drafter = ""
    if data.get("drafter"):
        shipped = drafter_checksum(os.path.join(REPO, SHIPPED_DRAFTER))
        drafter = ("; the shipped drafter" if data["drafter"].get("sha256") == shipped else
                   f"; **drafter {data['drafter'].get('path')} is not the shipped one**")
    where = file if "/" in file else f"bench_results/{file}"
    return f"From `{where}` ({machine_text(data)}; {when}{drafter})."


def span(values: list[float], unit: str) -> str:
    """'median unit (min a, max b, n runs)' of a few runs."""
    ordered = sorted(values)
    return f"{ordered[len(ordered) // 2]:g} {unit} (min {ordered[0]:g}, max {ordered[-1]:g}, {len(values)} runs)"


def versus(ratio: float, runs: list[float], base: list[float]) -> str:
    """A ratio called a gain (bold) or a loss only when the two sets of runs do not overlap."""
    if min(runs) > max(base):
        return f"**{ratio:.2f}x**"
    if max(runs) < min(base):
        return f"{ratio:.2f}x"
    return f"{ratio:.2f}x, within noise"


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])
