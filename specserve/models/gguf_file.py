"""A GGUF file's metadata and tensor views, read in one pass over the header.

The `gguf` package's reader builds a numpy view per element of every array field, which costs
about 17 s on a 151k-token vocabulary here; this reader decodes the header with `struct` (strings
and arrays as Python values) and maps the tensor data without copying it. The `gguf` package
still supplies the tensor types and dequantization.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from specserve.errors import ConfigError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct format of one scalar (8: string, 9: array are read apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# numpy dtypes of the unquantized tensor types (others are blocks of bytes).
_PLAIN = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass
class GGUFTensor:
    """One tensor: `shape` in GGUF order (innermost first); `data` a read-only view of the file, rows
    outermost ([..., row] in the element type, or [..., bytes of a row] for a block type)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: list[int]
    n_elements: int
    data: np.ndarray


@dataclass(frozen=True)
class TensorInfo:
    """One entry of a GGUF tensor table: `dims` innermost first, `offset` from the data start."""

    name: str
    dims: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    offset: int


_U64 = struct.Struct("<Q")


class GGUFFile:
    """Fields (`fields[key]`: a Python value, lists for arrays) and tensors of one GGUF file.

    With `header_only` the tensors are not mapped (the file may be cut short after its header);
    `kv_entries` holds each field's raw bytes (key, type and value) and `infos` the tensor table,
    so a file with this exact header can be written again (bench/synth_model.py)."""

    def __init__(self, path: str, header_only: bool = False):
        self.path = path
        self._mm = np.memmap(path, dtype=np.uint8, mode="r")
        self._buf = self._mm.data  # a memoryview of the mapped file
        self._pos = 0
        if bytes(self._buf[:4]) != MAGIC:
            raise ConfigError(f"model_path: {path!r} is not a GGUF file")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", self._buf, 4)
        if version not in (2, 3):
            raise ConfigError(f"model_path: GGUF version {version} of {path!r} is not supported (2, 3)")
        self._pos = 24
        self.version = version
        self.fields: dict[str, Any] = {}
        self.kv_entries: list[bytes] = []
        for _ in range(kv_count):
            begin = self._pos
            key = self._string()
            self.fields[key] = self._value(self._u32())
            self.kv_entries.append(bytes(self._buf[begin : self._pos]))
        self.infos = [TensorInfo(*self._tensor_info()) for _ in range(tensor_count)]
        self.alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        self.data_start = -(-self._pos // self.alignment) * self.alignment
        self.tensors = [] if header_only else [self._tensor(self.data_start, info) for info in self.infos]

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _u32(self) -> int:
        return self._unpack("I")

    def _string(self) -> str:
        n = self._unpack("Q")
        self._pos += n
        return str(self._buf[self._pos - n : self._pos], "utf-8")

    def _strings(self, count: int) -> list[str]:
        """An array of strings (a vocabulary, its merges: ~300k for Qwen) in one tight loop."""
        buf, pos, out = self._buf, self._pos, []
        length = _U64.unpack_from
        for _ in range(count):
            (n,) = length(buf, pos)
            out.append(str(buf[pos + 8 : pos + 8 + n], "utf-8"))
            pos += 8 + n
        self._pos = pos
        return out

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._u32(), self._unpack("Q")
            if item in _SCALARS:  # one unpack for the whole array
                fmt = f"<{count}{_SCALARS[item]}"
                values = list(struct.unpack_from(fmt, self._buf, self._pos))
                self._pos += struct.calcsize(fmt)
                return values
            if item == _STRING:
                return self._strings(count)
            return [self._value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ConfigError(f"model_path: GGUF value type {kind} in {self.path!r} is unknown")
        return self._unpack(_SCALARS[kind])

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        dims = tuple(self._unpack("Q") for _ in range(self._u32()))
        kind = self._u32()
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise ConfigError(f"model_path: tensor {name!r} has GGML type {kind}, unknown to the gguf package") from None
        return name, dims, qtype, self._unpack("Q")

    def _tensor(self, start: int, info: TensorInfo) -> GGUFTensor:
        name, dims, qtype, offset = info.name, list(info.dims), info.tensor_type, info.offset
        n = int(np.prod(dims)) if dims else 1
        outer = [int(d) for d in reversed(dims[1:])]
        if qtype in _PLAIN:
            dtype = np.dtype(_PLAIN[qtype])
            data = self._mm[start + offset : start + offset + n * dtype.itemsize].view(dtype).reshape(*outer, dims[0])
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            row = dims[0] // block * size
            data = self._mm[start + offset : start + offset + n // block * size].reshape(*outer, row)
        return GGUFTensor(name, qtype, dims, n, data)

    def release(self, data: np.ndarray) -> None:
        """Unmap this process's pages of a tensor's bytes (`data`: its GGUFTensor.data, or a part of
        it such as one expert's) once they have been copied out: they stay in the page cache, and a
        later read maps them again. Without it a loaded model's resident memory counts the whole
        file on top of its packed weights until the reader goes."""
        raw = getattr(self._mm, "_mmap", None)  # numpy's mmap.mmap of the whole file
        if raw is None or not hasattr(raw, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return  # not Linux (or an older numpy): the pages stay until the reader goes
        start = data.ctypes.data - self._mm.ctypes.data
        page = start // mmap.PAGESIZE * mmap.PAGESIZE
        raw.madvise(mmap.MADV_DONTNEED, page, start + data.nbytes - page)
