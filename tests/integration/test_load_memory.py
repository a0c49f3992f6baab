"""Loading at size (docs/models.md "Loading"): a GGUF's weights are packed one (fused) tensor at a
time, so the resident memory that loading adds stays near the file's size; a planted loader that
keeps every parsed tensor fails the same check. A model that cannot fit fails at start, in one
line naming the sizes, before anything is packed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as QType
from tiny_gguf import TinySpec, write_tiny_gguf

import specserve.engine.builder as builder
import specserve.engine.memory as memory
import specserve.models.loader as loader
from specserve.args import ServerArgs
from specserve.engine import Engine
from specserve.errors import ConfigError

# Big enough that the parsed codes (a byte per weight, float32 scales: ~2.4x the file) dwarf the
# noise; K-quant blocks are random bytes, so writing it takes about a second.
SPEC = TinySpec("qwen2", hidden=768, intermediate=3072, layers=6, heads=12, kv_heads=4, context=512)
TYPES = {n: QType.Q4_K for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", "token_embd")}
TYPES.update({"attn_v": QType.Q6_K, "ffn_down": QType.Q6_K})  # as a Q4_K_M file mixes them
# What loading may add beyond the file (32 MiB): the packed weights' few percent more than their
# blocks, one fused weight's unpacked codes with the packing's temporaries (~25 MiB here), the
# tokenizer and the allocator's slack; measured ~34 MiB. Keeping every parsed tensor adds ~60 MiB
# more (measured ~90 MiB over the file), so the check sits between the two.
MARGIN_MIB = 56


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key + ":"))


def _load_growth_mib(path: str, kept: dict) -> float:
    """Peak resident memory that loading the target (the engine's own path) adds, in MiB; `kept`
    (what a planted regression holds) is emptied after the warm-up load."""
    # weight cache off: a restart mapping the packed weights would read no codes to keep
    args = ServerArgs.from_kwargs(model_path=path, speculative_algorithm="NONE", max_total_tokens=64, weight_cache="off")
    builder._load_target(args, None, 0)  # warm: the kernels' library, the tokenizer's imports
    kept.clear()
    builder.return_freed_memory()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM starts again from the current resident size
    target = builder._load_target(args, None, 0)
    growth = _status("VmHWM") - before
    del target
    builder.return_freed_memory()
    return growth


@pytest.fixture(scope="module")
def thin_gguf(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("thin") / "thin-q4_k_m.gguf")
    write_tiny_gguf(path, SPEC, TYPES)
    return path


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's /proc/self/clear_refs")
def test_loading_grows_resident_memory_by_about_the_file_size(thin_gguf, monkeypatch):
    file_mib = os.path.getsize(thin_gguf) / 2**20
    kept: dict = {}
    growth = _load_growth_mib(thin_gguf, kept)
    assert growth <= file_mib + MARGIN_MIB, f"loading a {file_mib:.0f} MiB file added {growth:.0f} MiB"

    # The planted regression: every parsed tensor kept (the old loader's dict) fails the same check.
    parse = loader.GGUFCodes.__getitem__
    monkeypatch.setattr(loader.GGUFCodes, "__getitem__", lambda codes, name: kept.setdefault(name, parse(codes, name)))
    growth_kept = _load_growth_mib(thin_gguf, kept)
    assert growth_kept > file_mib + MARGIN_MIB, f"keeping every parsed tensor added only {growth_kept:.0f} MiB"


def test_a_model_that_cannot_fit_fails_at_start_in_one_line(thin_gguf, monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda: 16 << 20)
    packed = []
    monkeypatch.setattr(loader.GGUFCodes, "__getitem__", lambda self, name: packed.append(name))
    with pytest.raises(ConfigError) as err:
        Engine(model_path=thin_gguf, speculative_algorithm="NONE")
    message = str(err.value)
    assert "\n" not in message
    file_gib = os.path.getsize(thin_gguf) / 2**30
    assert f"{file_gib:.2f} GiB (file)" in message and "GiB (KV pool)" in message
    assert "only 0.02 GiB of memory is available" in message
    assert packed == []  # failed before reading a single weight


def test_the_default_kv_pool_leaves_room_for_the_model(thin_gguf, monkeypatch):
    """What the model leaves (less the headroom) caps the default pool; an explicit size is taken as given."""
    per_token = 2 * SPEC.layers * SPEC.kv_heads * (SPEC.hidden // SPEC.heads) * 2  # bfloat16 K and V
    file_bytes = os.path.getsize(thin_gguf)
    available = file_bytes + memory.HEADROOM_BYTES + 5000 * per_token
    monkeypatch.setattr(memory, "available_memory", lambda: available)
    req = memory.KVRequest(per_token, max_useful_tokens=10**9, context_tokens=512, model_bytes=file_bytes)
    assert memory.cpu_kv_tokens(req, None, None) == 5000
    assert memory.cpu_kv_tokens(memory.KVRequest(per_token, 3000, 512, file_bytes), None, None) == 3000
    assert memory.cpu_kv_tokens(req, None, 4000) == 4000
    with pytest.raises(ConfigError, match="GiB \\(KV pool\\)"):
        memory.cpu_kv_tokens(req, None, 10**6)


def test_serve_names_the_sizes_in_one_line_and_exits_2(thin_gguf):
    """The same check through `specserve serve` (its engine process): argparse's one line, exit 2."""
    with socket.socket() as sock:  # a free port (the server never binds it: the engine fails first)
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    proc = subprocess.run(
        [sys.executable, "-m", "specserve.cli", "serve", "--model-path", thin_gguf, "--port", port,
         "--speculative-algorithm", "NONE", "--max-total-tokens", str(10**9)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specserve serve: error: engine failed to start: memory: "), lines
    assert "GiB (file) + " in lines[0] and "GiB (KV pool) but only" in lines[0]
