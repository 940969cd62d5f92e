#!/usr/bin/env bash
# Regenerates the Python stubs of protos/ into kvroute/v1/ (committed, so users need no protoc).
# `scripts/gen_protos.sh --check` fails if the committed stubs are stale.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$PY" -m grpc_tools.protoc -Iprotos --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" protos/kvroute/v1/*.proto
if [[ "${1:-}" == "--check" ]]; then
  for f in "$out"/kvroute/v1/*; do
    if ! cmp -s "$f" "kvroute/v1/$(basename "$f")"; then
      echo "stale generated stub: kvroute/v1/$(basename "$f") (run: make protos)" >&2
      exit 1
    fi
  done
  echo "generated stubs are up to date"
else
  cp "$out"/kvroute/v1/* kvroute/v1/
  echo "regenerated kvroute/v1 stubs"
fi
