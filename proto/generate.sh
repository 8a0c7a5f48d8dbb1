#!/usr/bin/env bash
# Generates the Python protobuf, grpcio and grpclib modules of the contracts into OUT
# (default: beside the .proto files). With --check, generates into a scratch folder and fails
# when the committed modules differ.
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python}
check=0
if [[ ${1:-} == --check ]]; then check=1; shift; fi
out=${1:-.}
if (( check )); then out=$(mktemp -d); trap 'rm -rf "$out"' EXIT; fi
mkdir -p "$out/meshlet/api"
messages=(meshlet/api/*.proto)
services=(meshlet/api/destination.proto meshlet/api/identity.proto meshlet/api/inbound.proto meshlet/api/outbound.proto
    meshlet/api/tap.proto)
"$python" -m grpc_tools.protoc -I . --python_out="$out" --mypy_out="$out" "${messages[@]}"
"$python" -m grpc_tools.protoc -I . --grpc_python_out="$out" --mypy_grpc_out="$out" --grpclib_python_out="$out" \
    "${services[@]}"
if (( check )); then
    status=0
    for generated in "$out"/meshlet/api/*.py "$out"/meshlet/api/*.pyi; do
        committed=meshlet/api/$(basename "$generated")
        if ! diff -u "$committed" "$generated" >/dev/null 2>&1; then
            echo "proto-check: $committed is out of date with the .proto files; run 'make proto'" >&2
            status=1
        fi
    done
    exit $status
fi
