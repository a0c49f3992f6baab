"""models/gguf_file.py reads what the `gguf` package's reader reads: every field's value and every
tensor's name, type, shape and bytes, on the embedded model and on tiny files of every architecture
in K-quant, legacy-quant and float types."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from tiny_gguf import TinySpec, write_tiny_gguf

from specserve.models.gguf_file import GGUFFile

TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_0, "ffn_gate": Q.Q4_0,
         "ffn_up": Q.Q8_0, "ffn_down": Q.F16, "token_embd": Q.Q4_1, "output": Q.Q5_1}


def assert_reads_alike(path: str) -> None:
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == fields
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors):
        assert (mine.tensor_type, mine.shape, mine.n_elements) == (theirs.tensor_type, theirs.shape.tolist(),
                                                                    int(theirs.n_elements)), mine.name
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        assert np.array_equal(mine.data, theirs.data), mine.name


def test_embedded_model_reads_alike(model_path):
    assert_reads_alike(model_path)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_tiny_files_read_alike(arch, tmp_path):
    path = str(tmp_path / "m.gguf")
    spec = TinySpec(arch, tied=False, bias=arch == "qwen2", window=8 if arch == "gemma3" else 0,
                    sandwich=arch == "gemma3")
    write_tiny_gguf(path, spec, TYPES)
    assert_reads_alike(path)


def test_not_a_gguf_file_is_a_clear_error(tmp_path):
    from specserve.errors import ConfigError

    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ConfigError, match="is not a GGUF file"):
        GGUFFile(str(path))
