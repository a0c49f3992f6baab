#!/usr/bin/env bash
# Native llama.cpp on the embedded GGUF: builds `llama-bench` from the llama.cpp source vendored in
# the llama-cpp-python 0.3.36 sdist (AMX off: its AMX path crashes on some of these CPUs) and runs
# it with 2 threads: pp512 (prefill) and tg128 (batch-1 decode) tokens/s.
# Usage: bash scripts/llama_bench.sh [work dir, default /tmp/llama-bench]   (about 6 minutes to build)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-/tmp/llama-bench}
mkdir -p "$WORK"
SRC="$WORK/llama_cpp_python-0.3.36/vendor/llama.cpp"
if [ ! -x "$SRC/build/bin/llama-bench" ]; then
  .venv/bin/python -m pip download -q llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d "$WORK"
  tar xzf "$WORK/llama_cpp_python-0.3.36.tar.gz" -C "$WORK"
  cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF \
    -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF > "$WORK/cmake.log"
  cmake --build "$SRC/build" --target llama-bench -j2 > "$WORK/build.log"
fi
MODEL=$(.venv/bin/python -c "from specserve.models.loader import default_model_path; print(default_model_path())")
"$SRC/build/bin/llama-bench" -m "$MODEL" -t 2 -n 128 -p 512 -r 3
