"""The packed-weight cache (models/packed_cache.py): a restart maps the weights the first start
packed, reads none of the file's codes and computes the same bits; a changed model file, a torn
cache file and `--weight-cache off` are each handled (a planted key without the file's identity
serves the old weights, and the check catches it)."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from tiny_gguf import TinySpec, write_tiny_gguf

import specserve.models.loader as loader
import specserve.models.packed_cache as packed_cache
from specserve.args import ServerArgs
from specserve.engine import Engine
from specserve.engine.start_cache import weight_cache_max_bytes
from specserve.models.backend import packed_states
from specserve.models.packed_cache_cap import describe_bytes

SPEC = TinySpec("qwen2", hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, bias=True)
TYPES = {n: QType.Q4_K for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", "token_embd")}
TYPES.update({"attn_v": QType.Q6_K, "ffn_down": QType.Q5_0})
PROMPT = list(range(3, 40))


def run(path: str, cache: str) -> tuple[list[int], dict[str, dict[str, torch.Tensor]]]:
    """Greedy tokens of one engine and its packed tensors (copied out: the engine goes)."""
    with Engine(model_path=path, weight_cache=cache, speculative_algorithm="NONE", max_total_tokens=256) as engine:
        out = engine.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
        kernels = packed_states(engine.runner.model)
        tensors = {name: {f: getattr(k, f).clone() for f in ("codes", "scale", "zero", "scale_super", "zero_super")}
                   for name, k in kernels.items()}  # fmt: skip
    return out["output_ids"], tensors


def entries(folder: str) -> list[str]:
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


@pytest.fixture
def model(tmp_path) -> str:
    path = str(tmp_path / "tiny-q4_k_m.gguf")
    write_tiny_gguf(path, SPEC, TYPES, seed=1)
    return path


def test_a_restart_maps_the_packed_weights_and_reads_no_codes(model, tmp_path, monkeypatch):
    folder = str(tmp_path / "cache")
    first_tokens, first = run(model, folder)
    assert len(entries(folder)) == 1
    assert first  # the model has packed linears to keep

    def no_codes(self, name):
        raise AssertionError(f"a restart read {name}'s codes from the file")

    monkeypatch.setattr(loader.GGUFCodes, "__getitem__", no_codes)
    tokens, again = run(model, folder)
    assert tokens == first_tokens
    assert again.keys() == first.keys()
    for name, tensors in first.items():
        for field, value in tensors.items():
            assert torch.equal(again[name][field], value), f"{name}.{field} differs after the restart"
    monkeypatch.undo()
    assert run(model, "off")[0] == first_tokens  # and both equal packing without any cache


def test_a_changed_model_file_is_repacked(model, tmp_path, monkeypatch):
    folder = str(tmp_path / "cache")
    old_tokens, _ = run(model, folder)
    write_tiny_gguf(model, SPEC, TYPES, seed=2)  # other weights, same path
    fresh_tokens, _ = run(model, "off")
    assert fresh_tokens != old_tokens
    assert run(model, folder)[0] == fresh_tokens
    assert len(entries(folder)) == 1  # the stale entry was replaced, not kept beside

    # Mutation: a key without the file's identity serves the old weights, and the same check fails.
    write_tiny_gguf(model, SPEC, TYPES, seed=1)
    real_init = packed_cache.PackedWeightCache.__init__

    def identity_without_the_file(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.identity = {k: v for k, v in self.identity.items() if k not in ("size", "mtime_ns")}
        self.path = f"{self._prefix}-planted.pt"

    monkeypatch.setattr(packed_cache.PackedWeightCache, "__init__", identity_without_the_file)
    assert run(model, folder)[0] == old_tokens  # seed 1: packed and kept under the planted key
    write_tiny_gguf(model, SPEC, TYPES, seed=2)
    assert run(model, folder)[0] != fresh_tokens  # the old weights, served for the new file


def test_a_torn_cache_file_is_repacked_and_replaced(model, tmp_path):
    folder = str(tmp_path / "cache")
    tokens, _ = run(model, folder)
    (name,) = entries(folder)
    with open(os.path.join(folder, name), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(folder, name)) // 2)
    assert run(model, folder)[0] == tokens
    assert entries(folder) == [name]
    cache = packed_cache.PackedWeightCache(folder, model, 0, 1, torch.bfloat16, weight_cache_max_bytes(ServerArgs()))
    assert cache.path == os.path.join(folder, name) and cache.load() is not None


def test_off_keeps_nothing_and_auto_uses_the_configured_folder(model, tmp_path, monkeypatch):
    from specserve import envs

    monkeypatch.setenv(envs.WEIGHT_CACHE_DIR, str(tmp_path / "auto"))
    run(model, "off")
    assert entries(str(tmp_path / "auto")) == []
    run(model, "auto")
    assert len(entries(str(tmp_path / "auto"))) == 1


def test_an_offline_first_start_says_in_one_line_it_sees_by_default_where_and_how_much_it_wrote(model, tmp_path, caplog):
    caplog.set_level(ServerArgs().log_level.upper())  # the offline Engine's default level (engine.py's basicConfig)
    folder = str(tmp_path / "cache")
    _, packed = run(model, folder)
    (name,) = entries(folder)
    size = sum(t.numel() * t.element_size() for tensors in packed.values() for t in tensors.values())
    shown = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert shown == [("WARNING", f"packed weights kept in {os.path.join(folder, name)} ({describe_bytes(size)}) for the next start")]
    caplog.clear()
    run(model, folder)
    assert caplog.records == []  # a restart maps it: nothing to say at that level
