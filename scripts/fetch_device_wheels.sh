#!/usr/bin/env bash
# Fetch the cp312 wheels the GPU machine lacks into .whl/ (git-ignored), so GPU runs can be repeated:
#   bash scripts/fetch_device_wheels.sh
# then, in the device command (with `.whl` carried):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
# nvidia-cudnn-frontend's cudnn.sdpa_torch op serves the cudnn_frontend backend; transformers (and the
# dependencies the GPU image lacks) serves tests/integrations/test_transformers.py and benchmarks/hf_deepseek.py. Its dependency
# nvidia-cutlass-dsl (the CuTe DSL kernels) is too large for a 64 MiB carry and is left out; the H200
# research measurements ran the op with the frontend wheel alone.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "nvidia-cudnn-frontend==1.32.0" "apache-tvm-ffi>=0.1.11" "megatron-core==0.19.2"
# transformers with its dependency closure, less what the GPU image has (torch and its stack, numpy).
tmp=$(mktemp -d)
python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  --platform any -d "$tmp" "transformers==5.24.0"
for wheel in "$tmp"/*.whl; do
  case "$(basename "$wheel")" in
    torch-*|numpy-*|nvidia_*|triton-*|sympy-*|mpmath-*|networkx-*|jinja2-*|MarkupSafe-*|markupsafe-*|setuptools-*) ;;
    *) cp "$wheel" .whl/ ;;
  esac
done
rm -rf "$tmp"
ls -la .whl
