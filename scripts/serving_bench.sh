#!/usr/bin/env bash
# specserve's server (the default speculation, and NONE) against native llama.cpp's `llama-server`
# with 16 parallel slots (continuous batching), all on the embedded GGUF and the same 2 cores:
# starts the three servers on free ports, runs `specserve bench serving` with llama-server as the
# baseline of the ratios, and stops them. llama-server is built as scripts/llama_cpp_build.sh says.
# With LLAMA_SPEC_TYPE set (e.g. ngram-mod), a fourth server: llama-server speculating with it.
# Usage: bash scripts/serving_bench.sh [OUT.json] [PLOT.png]   (extra bench flags in BENCH_FLAGS,
# e.g. BENCH_FLAGS="--dataset multiturn" for whole conversations). SERVE_MODEL=PATH serves another GGUF
# (e.g. a synthetic full-size file); SPECSERVE_ARMS="none" leaves out the default-speculation server
# (a file with random weights drafts nothing worth verifying).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench_results/serving_mtbench.json}
PLOT=${2:-${OUT%.json}.png}
WORK=${LLAMA_WORK:-/tmp/llama-bench}
bash scripts/llama_cpp_build.sh "$WORK" llama-server
SERVER="$WORK/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
MODEL=${SERVE_MODEL:-$(.venv/bin/python -c "from specserve.models.loader import default_model_path; print(default_model_path())")}
ARMS=${SPECSERVE_ARMS:-none default}
read -r P1 P2 P3 P4 < <(.venv/bin/python -c "
import socket
socks = [socket.socket() for _ in range(4)]
for s in socks: s.bind(('127.0.0.1', 0))
print(*[s.getsockname()[1] for s in socks])")
LOGS=$(mktemp -d)
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
"$SERVER" -m "$MODEL" -t 2 -tb 2 -np 16 -c 16384 --jinja --host 127.0.0.1 --port "$P1" > "$LOGS/llama-server.log" 2>&1 &
PIDS+=($!)
PORTS=("$P1")
TARGETS=(--target "llama-server=http://127.0.0.1:$P1")
for arm in $ARMS; do
  case $arm in
    none) port=$P2; flags=(--speculative-algorithm NONE) ;;
    default) port=$P3; flags=() ;;
    *) echo "unknown SPECSERVE_ARMS entry: $arm (none, default)" >&2; exit 2 ;;
  esac
  .venv/bin/specserve serve --model-path "$MODEL" --port "$port" ${flags[@]+"${flags[@]}"} > "$LOGS/$arm.log" 2>&1 &
  PIDS+=($!)
  PORTS+=("$port")
  TARGETS+=(--target "specserve-$arm=http://127.0.0.1:$port")
done
if [ -n "${LLAMA_SPEC_TYPE:-}" ]; then
  "$SERVER" -m "$MODEL" -t 2 -tb 2 -np 16 -c 16384 --jinja --spec-type "$LLAMA_SPEC_TYPE" --host 127.0.0.1 \
    --port "$P4" > "$LOGS/llama-server-spec.log" 2>&1 &
  PIDS+=($!)
  PORTS+=("$P4")
  TARGETS+=(--target "llama-server-$LLAMA_SPEC_TYPE=http://127.0.0.1:$P4")
fi
for port in "${PORTS[@]}"; do
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null && break
    sleep 1
  done
  curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null || { echo "server on $port did not start; logs in $LOGS" >&2; exit 1; }
done
# shellcheck disable=SC2086
.venv/bin/specserve bench serving "${TARGETS[@]}" \
  --num-prompts ${NUM_PROMPTS:-32} --max-tokens ${MAX_TOKENS:-128} --concurrency 1,4,16 --repeats 3 ${BENCH_FLAGS:-} \
  --out "$OUT" --plot "$PLOT"
