#!/usr/bin/env bash
# A new packing's first call, this tree against another checkout carried in .whl-before (its src and benchmarks),
# alternated ROUNDS times (default 2), training then inference (PHASES="training": one of them), on the device machine
# after FA4's stages where it is to be installed: bash scripts/new_packing_ab.sh -> $OUT/new_packing_ab.tar (each
# run's .json and .md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
rows='attention\(\)|aten|varlen_attn|recall|problem at|its class|select_packed \||packed_runner|self_check|remember|run \||backward|all stages'
for phase in ${PHASES:-training inference}; do
  args=$([ "$phase" = training ] && echo --training)
  for i in $(seq 1 "${ROUNDS:-2}"); do
    for side in after before; do
      if [ "$side" = before ]; then
        export LIBRARY_SRC=.whl-before/src BENCH_DIR=.whl-before/benchmarks
      else
        unset LIBRARY_SRC BENCH_DIR
      fi
      echo "== $phase $side $i"
      PARTS_NAME=${phase}_${side}_$i PARTS_ARGS=$args bash scripts/device_run.sh new-packing-parts | grep -E "$rows"
    done
  done
done
(cd "$OUT" && tar -cf new_packing_ab.tar h200_new_packing_parts_* && rm -f h200_new_packing_parts_*)
