#!/usr/bin/env bash
# Builds native llama.cpp tools from the source vendored in the llama-cpp-python 0.3.36 sdist (the
# same source the Python peer runs), AMX off (its AMX path crashes on some of these CPUs), into
# WORK/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin. A tool already built is kept.
# Usage: bash scripts/llama_cpp_build.sh WORK TARGET...   (e.g. llama-bench llama-server; minutes each)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=$1
shift
mkdir -p "$WORK"
SRC="$WORK/llama_cpp_python-0.3.36/vendor/llama.cpp"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  .venv/bin/python -m pip download -q llama-cpp-python==0.3.36 --no-deps --no-binary llama-cpp-python -d "$WORK"  # its build tools as wheels
  tar xzf "$WORK/llama_cpp_python-0.3.36.tar.gz" -C "$WORK"
fi
if [ ! -f "$SRC/build/CMakeCache.txt" ]; then
  cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF \
    -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF > "$WORK/cmake.log"
fi
for target in "$@"; do
  [ -x "$SRC/build/bin/$target" ] || cmake --build "$SRC/build" --target "$target" -j2 > "$WORK/build-$target.log"
done
