#!/usr/bin/env bash
# Native llama.cpp on the embedded GGUF: builds `llama-bench` (scripts/llama_cpp_build.sh) and runs
# it with 2 threads: pp512 (prefill) and tg128 (batch-1 decode) tokens/s.
# Usage: bash scripts/llama_bench.sh [work dir, default /tmp/llama-bench]   (about 6 minutes to build)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-/tmp/llama-bench}
bash scripts/llama_cpp_build.sh "$WORK" llama-bench
SRC="$WORK/llama_cpp_python-0.3.36/vendor/llama.cpp"
MODEL=$(.venv/bin/python -c "from specserve.models.loader import default_model_path; print(default_model_path())")
"$SRC/build/bin/llama-bench" -m "$MODEL" -t 2 -n 128 -p 512 -r 3
