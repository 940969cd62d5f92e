#!/usr/bin/env bash
# Regenerates the Python stubs of protos/ into kvroute/v1/ (committed, so users need no protoc).
# `scripts/gen_protos.sh --check` fails if the committed stubs are stale: it compares the schema
# (scripts/check_protos.py), not the generator's output byte for byte, so a newer grpcio-tools
# alone cannot fail it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if [[ "${1:-}" == "--check" ]]; then
  exec "$PY" scripts/check_protos.py
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$PY" -m grpc_tools.protoc -Iprotos --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" protos/kvroute/v1/*.proto
cp "$out"/kvroute/v1/* kvroute/v1/
echo "regenerated kvroute/v1 stubs"
