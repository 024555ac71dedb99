#!/usr/bin/env bash
# Fetch the cp312 wheels the GPU machine lacks, so GPU runs can be repeated (all folders git-ignored):
#   bash scripts/fetch_device_wheels.sh          # .whl/: the cuDNN frontend, megatron-core, transformers, torchtitan
#                                                #   (~48 MB)
#   bash scripts/fetch_device_wheels.sh fa4      # FlashAttention-4 in four carries that fit the 64 MiB limit
#                                                #   beside the ~37 MiB tree (counted in disk blocks): .fa4-stage1/ to
#                                                #   .fa4-stage3/ (25 MB parts of the 92 MB nvidia-cutlass-dsl-libs-cu13
#                                                #   wheel; the first holds a file `parts` saying how many), .fa4-stage4/
#                                                #   (the last part and the small wheels), and .whl-core/ (the cuDNN
#                                                #   frontend and megatron-core, whose GPU tests pytest -m gpu holds;
#                                                #   carried by the calls after stage 4; apache-tvm-ffi, which the
#                                                #   frontend needs too, comes with stage 4)
# scripts/device_run.sh installs what is carried: `.whl` or `.whl-core` at each call, and FA4 through its steps
# fa4-stage1 to fa4-stage4 (back-to-back calls on one warm machine).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.whl/' >> .git/info/exclude; }
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
download() { python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform any "$@"; }
CORE=("nvidia-cudnn-frontend==1.32.0" "apache-tvm-ffi==0.1.15.post2")
if [ "${1:-}" = fa4 ]; then
  # Tested together on the H200 (torch 2.11, CUDA 13): the attnselect[fa4] extra pins the same versions.
  rm -rf .fa4-stage* .whl-core && mkdir -p .whl-core
  tmp=$(mktemp -d)
  download -d "$tmp" "flash-attn-4==4.0.0b36" "nvidia-cutlass-dsl==4.8.1" "nvidia-cutlass-dsl-libs-base==4.8.1" \
    "nvidia-cutlass-dsl-libs-core==4.8.1" "nvidia-cutlass-dsl-libs-cu13==4.8.1" "quack-kernels==0.6.5" \
    "torch-c-dlpack-ext==0.1.5" "apache-tvm-ffi==0.1.15.post2"
  big=$(ls "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl)
  (cd "$tmp" && split -b 25000000 -a 2 "$(basename "$big")" "$(basename "$big").part-") && rm "$big"
  stage=0
  for part in "$tmp"/*.part-*; do   # one part a stage: 25 MB beside the tree
    stage=$((stage + 1)); mkdir -p ".fa4-stage$stage" && mv "$part" ".fa4-stage$stage/"
  done
  echo "$stage" > .fa4-stage1/parts
  mv "$tmp"/*.whl ".fa4-stage$stage/"   # the last part is the smallest
  download -d .whl-core "${CORE[0]}" "megatron-core==0.19.2"
  rm -rf "$tmp"
  du -sh .fa4-stage* .whl-core
  exit 0
fi
mkdir -p .whl
download -d .whl "${CORE[@]}" "megatron-core==0.19.2"
# torchtitan 0.3.0 and what its model code imports beyond the GPU image (benchmarks/torchtitan_steps.py)
download -d .whl "torchtitan==0.3.0" "spmd_types==0.2.3" "tyro==1.0.17" "docstring-parser==0.18.0" "typeguard==4.6.1"
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
