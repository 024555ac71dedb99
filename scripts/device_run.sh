#!/usr/bin/env bash
# Steps of the GPU work, for the device tool; several run in order (`device_run.sh tests bench`), and on a
# machine of two GPUs two invocations can run side by side under CUDA_VISIBLE_DEVICES=0 and =1:
#   bash scripts/device_run.sh tests   # pytest -m gpu, verbose log            -> $OUT/h200_gpu_tests.txt
#                                      # (TEST_PATHS=... TEST_PART=name: some of the tests -> h200_gpu_tests_name.txt)
#   bash scripts/device_run.sh grid    # rules grid, resuming the committed rows -> $OUT/h200_rules_grid.jsonl
#                                      # (GRID_DEADLINE seconds, default 500)
#   bash scripts/device_run.sh correctness # benchmarks/correctness_grid.py, GRID_WORKERS processes (default 12), resuming
#                                      # results/h200_correctness_grid_rows.jsonl where present (GRID_DEADLINE s, default
#                                      # 480; GRID_ARGS adds arguments) -> $OUT/h200_correctness_grid_rows.jsonl, _meta.json
#   bash scripts/device_run.sh checks # after `correctness` on the same warm machine, FA4 installed: the grid's report
#                                      # (package data included), pytest -m gpu -n 5 with FA4 and without (TEST_TIMEOUT),
#                                      # benchmarks/peer_sweep.py under ATTNSELECT_STRICT=1 with and without (SWEEP_DEADLINE)
#   bash scripts/device_run.sh suite  # pytest -m gpu -n 6 beside benchmarks/peer_sweep.py under ATTNSELECT_STRICT=1,
#                                      # with FA4 where installed (NO_FA4=1: without) -> $OUT/h200_gpu_tests[_fa4].txt,
#                                      # $OUT/h200_peer_sweep[_fa4].* (TEST_TIMEOUT, SWEEP_DEADLINE)
#   bash scripts/device_run.sh sweep  # the peer sweep alone (SWEEP_WORKERS, default 6)  -> $OUT/h200_peer_sweep[_fa4].*
#   bash scripts/device_run.sh self-check-cost # benchmarks/self_check_cost.py       -> $OUT/h200_self_check_cost.*
#   bash scripts/device_run.sh flex-probe # benchmarks/flex_probe.py                  -> $OUT/h200_flex_probe.*
#   bash scripts/device_run.sh flex-hooks # benchmarks/flex_hooks_probe.py            -> $OUT/h200_flex_hooks_probe.*
#   bash scripts/device_run.sh ladder  # benchmarks/ladder.py (LADDER_ARGS, LADDER_DEADLINE; LADDER_ONLY="thd 2048;thd
#                                      # 8192": the rungs whose names hold one of these; a process for each layout,
#                                      # head-dim pair and phase, LADDER_GROUP= one for each rung), resuming this machine's or the
#                                      # committed rungs -> $OUT/h200_ladder[_$LADDER_PART][_fa4].{json,md} (FA4 where installed)
#   bash scripts/device_run.sh calibrate-host # results/<gpu>_calibration.json's host times measured again (FA4's
#                                      # replayed too)                            -> $OUT/<gpu>_calibration.*
#   bash scripts/device_run.sh new-packing-host # benchmarks/new_packing_host.py, on a GPU without a calibration too
#                                      #                     -> $OUT/<gpu>_new_packing_host.*
#   bash scripts/device_run.sh calibrate-first-calls # its first calls' costs measured again (start-up left out,
#                                      # an empty compile cache)                  -> $OUT/<gpu>_calibration.*
#   bash scripts/device_run.sh package-calibration # $OUT/<gpu>_calibration.json as this tree's package data (the
#                                      # steps after it rank by it)  -> $OUT/calibration_<arch>_<gpu>.json
#   bash scripts/device_run.sh calibrate # benchmarks/calibrate.py (CALIBRATE_ARGS="--pairs 192/128,128/128",
#                                      # CALIBRATE_PART=name)          -> $OUT/<gpu>_calibration${CALIBRATE_PART:+_name}.*
#   bash scripts/device_run.sh pytest  # pytest $PYTEST_ARGS, the whole log  -> $OUT/h200_pytest_$TEST_PART.txt
#                                      # (NO_FA4=1 leaves an installed FA4 off the path, for any step)
#   bash scripts/device_run.sh grid-odd # its head dims below 16 and not multiples of 8, every backend but FA4,
#                                      # resuming $OUT's rows where an earlier step of this call wrote them
#   bash scripts/device_run.sh bench   # packed (thd) benchmark                -> $OUT/h200_thd_bench.{json,md}
#   bash scripts/device_run.sh bench-short # its short-document packing alone, merged -> $OUT/h200_thd_bench.*
#   bash scripts/device_run.sh crossover # short equal documents, fast candidates -> $OUT/h200_thd_crossover.*
#   bash scripts/device_run.sh models  # attnselect bench, resuming results/h200_bench.json -> $OUT/h200_bench.*
#                                      # (MODELS_DEADLINE seconds, default 480); with SHARD=K/N one shard of
#                                      # the suite, resuming results/h200_bench_partK-of-N.json -> $OUT/h200_bench_partK-of-N.*
#                                      # (join: attnselect bench --out results/h200_bench --merge results/h200_bench_part*.json)
#                                      # The full suite took 1440 GPU-seconds at 4bdf09b, settling near-ties
#                                      # included; on nvidia-h200-x2, two shards side by side, K counting from 0
#                                      # (K/N: every N-th from the K-th):
#                                      #   for g in 0 1; do (CUDA_VISIBLE_DEVICES=$g SHARD=$g/2 MODELS_DEADLINE=470 bash ... models) & done; wait
#                                      # then the same again to resume what the deadline left (shard 0: 791 s,
#                                      # shard 1: 649 s; two calls of 543 and 291 s wall)
#   bash scripts/device_run.sh settle-check # attnselect bench --only the two 16k training problems -> $OUT/h200_bench_settle_check.*
#   bash scripts/device_run.sh noise   # benchmarks/noise_floor.py (one kernel as two steps, sessions, spin or not)
#                                      #                                                -> $OUT/h200_noise_floor.*
#   bash scripts/device_run.sh convergence # benchmarks/median_convergence.py (bench rounds, then 8x) -> $OUT/h200_median_convergence.*
#   bash scripts/device_run.sh hf      # transformers DeepSeek-V3 geometry, tokens/s     -> $OUT/h200_hf_deepseek.*
#   bash scripts/device_run.sh megatron # megatron-core MLA layer tests, then stock pad vs native V -> $OUT/h200_megatron_mla.*
#   bash scripts/device_run.sh loop    # benchmarks/training_loop.py, a new packing every step -> $OUT/h200_training_loop.*
#                                      # (LOOP_ROWS="row;row", LOOP_ROUNDS, LOOP_PART=name, LOOP_TIMEOUT seconds)
#   bash scripts/device_run.sh cp      # the context-parallel GPU test, with each rank's chunk choices and errors
#                                      #                                                -> $OUT/h200_context_parallel.txt
#   bash scripts/device_run.sh hot-path # benchmarks/hot_path.py: host time of repeated small calls -> $OUT/h200_hot_path.*
#                                      # (HOT_PATH_PART=name -> $OUT/h200_hot_path_name.*)
#   bash scripts/device_run.sh new-packing-parts # benchmarks/new_packing_parts.py: a new packing's first call, stage
#                                      # by stage (PARTS_NAME=name -> $OUT/h200_new_packing_parts_name.*; PARTS_ARGS:
#                                      # its arguments, e.g. --training)
#   bash scripts/device_run.sh sdpa-training-gap # benchmarks/sdpa_training_gap.py: sdpa_cudnn through attnselect
#                                      # against F.sdpa's default in training, with each row's CUDA kernels -> $OUT/sdpa_training_gap.*
#   bash scripts/device_run.sh small-calls # benchmarks/small_calls_probe.py: small dense calls, each SDPA kernel through
#                                      # attnselect and torch alone: host, latency, stack -> $OUT/h200_small_calls_probe.*
#                                      # (SMALL_CALLS_ARGS="--shapes 1x4096x192x128 --phases inference", SMALL_CALLS_PART)
#   bash scripts/device_run.sh first-calls # benchmarks/first_calls_probe.py: each backend's first calls in a fresh
#                                      # process: start-up, a new configuration, a new size -> $OUT/h200_first_calls_probe.*
#   bash scripts/device_run.sh new-lengths # benchmarks/new_lengths.py: dense calls of ever new lengths, first
#                                      # calls included, fresh processes    -> $OUT/h200_new_lengths[_fa4].*
#   bash scripts/device_run.sh hot-path-parts # benchmarks/hot_path_parts.py: that dense call's host time, part by
#                                      # part                                       -> $OUT/h200_hot_path_parts.*
#   bash scripts/device_run.sh overhead # benchmarks/packed_overhead.py (with FA4 where installed) -> $OUT/h200_packed_overhead.*
#   bash scripts/device_run.sh thd-inference # benchmarks/thd_inference.py: packed inference, a new packing a step,
#                                      # host time included (THD_TIMEOUT seconds, default 400) -> $OUT/h200_thd_inference.*
#   bash scripts/device_run.sh torchtitan # benchmarks/torchtitan_steps.py (carry .whl: torchtitan; TITAN_ARGS)
#                                      # -> $OUT/h200_torchtitan_steps[_fa4].{json,md}
#   bash scripts/device_run.sh pack-crossover # benchmarks/pack_crossover.py: varlen_fa2 against the cuDNN frontend,
#                                      # packing by packing, equal head dims   -> $OUT/h200_pack_crossover.*
#   bash scripts/device_run.sh buckets # benchmarks/packing_buckets.py (BUCKET_SCHEMES=...) -> $OUT/h200_packing_buckets.*
#   FlashAttention-4 (scripts/fetch_device_wheels.sh fa4), in four calls back to back on one warm machine (it is
#   kept about 30 s after a call), each under the 64 MiB carry beside the ~37 MiB tree: carry .fa4-stage1 and run
#   `fa4-stage1` (its files go to /tmp), then .fa4-stage2 and .fa4-stage3 alike, then carry .fa4-stage4 and run
#   `fa4-stage4 STEP...`, which joins the parts and installs FA4 for the steps after it (.whl-core, the cuDNN
#   frontend, no longer fits beside stage 4: carry it from the next call on):
#   bash scripts/device_run.sh fa4-tests    # tests/backends/test_flash_attn4.py and every FA4 case of the GPU tests
#   bash scripts/device_run.sh fa4-loop     # the training loop's FA4 rows (forced, direct) beside the default and torch's
#   bash scripts/device_run.sh fa4-compile  # benchmarks/fa4_compile_cost.py           -> $OUT/h200_fa4_compile.*
#   bash scripts/device_run.sh fa4-replay   # benchmarks/fa4_forward_replay.py: FA4's dense forward replayed against
#                                      # its flash_attn_func, bit for bit and timed -> $OUT/h200_fa4_forward_replay.*
#   bash scripts/device_run.sh fa4-packed-gap # benchmarks/fa4_packed_gap.py: packed FA4 through attnselect and direct
#                                      # (GAP_ARGS="--tokens 8192 --training", GAP_PART=name) -> $OUT/h200_fa4_packed_gap*
#   bash scripts/device_run.sh fa4-grid     # the rules grid's FA4 section (FA4 rows only) -> $OUT/h200_rules_grid.jsonl
#   bash scripts/device_run.sh fa4-bench    # attnselect bench on the suite's 4k problems  -> $OUT/h200_bench_fa4.*
# Carry `.whl` (scripts/fetch_device_wheels.sh) to include the cudnn_frontend backend, megatron-core, transformers and
# torchtitan (or `.whl-core`: the frontend and megatron-core).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
gpu=${CUDA_VISIBLE_DEVICES:-all}
export ATTNSELECT_CACHE_DIR=/tmp/attnselect-cache-$gpu   # side-by-side runs keep separate decision caches
wheels=$(ls .whl/*.whl 2>/dev/null || ls .whl-core/*.whl 2>/dev/null)   # .whl holds .whl-core's wheels too
if [ -n "$wheels" ]; then   # once per machine and wheel set; invocations side by side wait for the first
  ( flock 9; [ "$(cat "/tmp/site-$gpu/.wheels" 2>/dev/null)" = "$wheels" ] && exit 0
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "/tmp/site-$gpu" \
      $wheels && echo "$wheels" > "/tmp/site-$gpu/.wheels" ) 9>"/tmp/site-$gpu.lock" || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site-$gpu SITE=/tmp/site-$gpu
fi
FA4_WHEELS=/tmp/fa4-wheels FA4_SITE=/tmp/fa4-site
if [ -d "$FA4_SITE/flash_attn" ] && [ -z "${NO_FA4:-}" ]; then   # installed by an earlier call's last fa4 stage here
  export PYTHONPATH=$FA4_SITE:$FA4_SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
fi
grid_rows() {   # the rules grid, resuming this call's rows if an earlier step wrote them, else the committed ones
  local rows=results/h200_rules_grid.jsonl; [ -f "$OUT/h200_rules_grid.jsonl" ] && rows=$OUT/h200_rules_grid.jsonl
  timeout "$1" python3 benchmarks/rules_grid.py --resume "$rows" --out "$OUT/h200_rules_grid.jsonl" "${@:2}" 2>&1 \
    | grep -E "DISAGREE|rows|deadline" | cut -c1-400
}
gpu_model() {   # h200, h100, b200 or a100, as results' file names spell it (gpu where none matches)
  local name; name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -i -E 'H100|H200|B200|A100')
  echo "${name:-gpu}" | tr 'A-Z' 'a-z'
}
need_fa4() {
  python3 -c 'import flash_attn.cute' 2>/dev/null && return 0
  echo "FlashAttention-4 is not installed on this machine: run fa4-stage1 to fa4-stage4 (each carrying its folder)"
  echo "back to back while the machine is warm; a machine given back in between"
  echo "has lost the earlier stages' files in $FA4_WHEELS."
  return 1
}
# LIBRARY_SRC: the library's source folder (default src, relative to the tree or absolute); another checkout's src,
# carried in an ignored folder (.whl-before/src), times that version with this tree's benchmarks, or with its own
# (BENCH_DIR=.whl-before/benchmarks: the hot-path and new-packing-parts steps, whose replay mirrors its library)
library_src=${LIBRARY_SRC:-src}; [ "${library_src#/}" = "$library_src" ] && library_src=$PWD/$library_src
export PYTHONPATH=$library_src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c 'import attnselect; print(attnselect.Target.current().describe())'
for step in "$@"; do
started=$SECONDS
case "$step" in
  tests)
    { echo "# pytest -m gpu -v on $(python3 -c 'import attnselect; print(attnselect.Target.current().describe())'), $(date -u +%F)"
      timeout ${TEST_TIMEOUT:-540} python3 -m pytest -m gpu -v -p no:cacheprovider -W ignore ${TEST_PATHS:-tests} 2>&1 \
        | grep -E "PASSED|FAILED|ERROR|passed|failed|^E "
    } | tee "$OUT/h200_gpu_tests${TEST_PART:+_$TEST_PART}.txt" | tail -40 ;;
  grid)
    grid_rows 560 --deadline "${GRID_DEADLINE:-500}" ;;
  grid-odd)
    grid_rows 300 --section odd --skip flash_attn4 --deadline "${GRID_DEADLINE:-240}" ;;
  correctness)
    dir=/tmp/correctness-grid; mkdir -p "$dir"
    rows=results/h200_correctness_grid.jsonl
    [ -f "$rows" ] && [ ! -f "$dir/rows-earlier.jsonl" ] && cp "$rows" "$dir/rows-earlier.jsonl"   # resume: kept
    timeout $((${GRID_DEADLINE:-480} + 90)) python3 benchmarks/correctness_grid.py --out "$dir" \
      --workers "${GRID_WORKERS:-12}" --deadline "${GRID_DEADLINE:-480}" ${GRID_ARGS:-} > "$OUT/correctness_grid.log" 2>&1
    pkill -9 -f "correctness_grid.py --worker" && echo "workers left running were killed"   # none may outlive the step
    cat "$dir"/rows-*.jsonl > "$OUT/h200_correctness_grid_rows.jsonl"; cp "$dir/meta.json" "$OUT/h200_correctness_grid_meta.json"
    grep -v " ok$" "$OUT/correctness_grid.log" | grep -v -i warn | cut -c1-220 | tail -45 ;;
  checks)
    # the report with the committed meta (the rules grid's young-kernel rows counted, as the package data is made)
    if ls /tmp/correctness-grid/rows-*.jsonl >/dev/null 2>&1; then   # after `correctness` only: else the package data stays
      python3 benchmarks/correctness_grid.py --report /tmp/correctness-grid --earlier \
        --meta results/h200_correctness_grid.jsonl.meta.json | tail -1
      cp results/h200_correctness_grid.jsonl results/h200_correctness_grid.jsonl.meta.json "$OUT/"
    fi
    export TORCHINDUCTOR_COMPILE_THREADS=1   # flex's compiles: one thread each, or 24 processes start 16 each
    with=$PYTHONPATH without=$PWD/src${SITE:+:$SITE}   # the frontend, not FA4
    run_tests() { echo "# pytest -m gpu -n ${TEST_WORKERS:-5} on $(PYTHONPATH=$1 python3 -c 'import attnselect; print(attnselect.Target.current().describe())'), $(date -u +%F)"
      PYTHONPATH=$1 timeout ${TEST_TIMEOUT:-520} python3 -m pytest -m gpu -n ${TEST_WORKERS:-5} -v -p no:cacheprovider \
        -W ignore tests 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | cut -c1-400; }
    run_tests "$with" > "$OUT/h200_gpu_tests_fa4.txt" 2>&1 &
    run_tests "$without" > "$OUT/h200_gpu_tests.txt" 2>&1 &
    ATTNSELECT_STRICT=1 PYTHONPATH=$with timeout $((${SWEEP_DEADLINE:-480} + 60)) python3 benchmarks/peer_sweep.py \
      --deadline ${SWEEP_DEADLINE:-480} --workers 4 --out "$OUT/h200_peer_sweep_fa4" > /tmp/peer_fa4.log 2>&1 &
    ATTNSELECT_STRICT=1 PYTHONPATH=$without timeout $((${SWEEP_DEADLINE:-480} + 60)) python3 benchmarks/peer_sweep.py \
      --deadline ${SWEEP_DEADLINE:-480} --workers 4 --out "$OUT/h200_peer_sweep" > /tmp/peer.log 2>&1 &
    wait
    tail -4 /tmp/peer_fa4.log /tmp/peer.log 2>/dev/null
    for f in "$OUT"/h200_gpu_tests*.txt; do echo "== $f"; grep -E "FAILED|ERROR|passed|failed" "$f" | tail -12; done ;;
  tests-both)   # pytest -m gpu -n ${TEST_WORKERS:-6} with FA4 (installed), then without, one after the other (side by
                # side with the sweeps, as `checks` runs them, tests ran out of GPU memory) -> $OUT/h200_gpu_tests_both[_fa4].txt
    export TORCHINDUCTOR_COMPILE_THREADS=1
    for fa4 in _fa4 ""; do
      { [ -z "$fa4" ] && export NO_FA4=1 PYTHONPATH=$PWD/src${SITE:+:$SITE}
        echo "# pytest -m gpu -n ${TEST_WORKERS:-6} on $(python3 -c 'import attnselect; print(attnselect.Target.current().describe())'), $(date -u +%F)"
        timeout ${TEST_TIMEOUT:-270} python3 -m pytest -m gpu -n ${TEST_WORKERS:-6} -v -p no:cacheprovider -W ignore tests 2>&1 \
          | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | cut -c1-400; } > "$OUT/h200_gpu_tests_both$fa4.txt"
      grep -E "FAILED|ERROR|passed|failed" "$OUT/h200_gpu_tests_both$fa4.txt" | tail -12
    done ;;
  suite)   # pytest -m gpu -n 6 beside the peer sweep under ATTNSELECT_STRICT=1, FA4 as installed (NO_FA4=1: without)
    fa4=$(python3 -c 'import flash_attn.cute' 2>/dev/null && echo _fa4)
    export TORCHINDUCTOR_COMPILE_THREADS=1   # flex's compiles: one thread each, or 10 processes start 16 each
    { echo "# pytest -m gpu -n 6 on $(python3 -c 'import attnselect; print(attnselect.Target.current().describe())'), $(date -u +%F)"
      timeout ${TEST_TIMEOUT:-480} python3 -m pytest -m gpu -n 6 -v -p no:cacheprovider -W ignore tests 2>&1 \
        | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | cut -c1-400; } > "$OUT/h200_gpu_tests$fa4.txt" 2>&1 &
    ATTNSELECT_STRICT=1 timeout $((${SWEEP_DEADLINE:-420} + 60)) python3 benchmarks/peer_sweep.py \
      --deadline ${SWEEP_DEADLINE:-420} --workers 4 --out "$OUT/h200_peer_sweep$fa4" > "/tmp/peer$fa4.log" 2>&1
    wait
    tail -3 "/tmp/peer$fa4.log"; grep -E "^\| all" "$OUT/h200_peer_sweep$fa4.md"
    grep -E "FAILED|ERROR|passed|failed" "$OUT/h200_gpu_tests$fa4.txt" | tail -20 ;;
  sweep)   # the peer sweep alone under ATTNSELECT_STRICT=1, FA4 as installed (NO_FA4=1: without); SWEEP_ARGS adds
           # arguments (--families fa3), SWEEP_PART names the output (h200_peer_sweep_<part>[_fa4])
    fa4=${SWEEP_PART:+_$SWEEP_PART}$(python3 -c 'import flash_attn.cute' 2>/dev/null && echo _fa4)
    ATTNSELECT_STRICT=1 TORCHINDUCTOR_COMPILE_THREADS=1 timeout $((${SWEEP_DEADLINE:-420} + 60)) \
      python3 benchmarks/peer_sweep.py --deadline ${SWEEP_DEADLINE:-420} --workers ${SWEEP_WORKERS:-6} \
      --out "$OUT/h200_peer_sweep$fa4" ${SWEEP_ARGS:-} > "/tmp/peer$fa4.log" 2>&1
    tail -4 "/tmp/peer$fa4.log"; grep -E "^\| all" "$OUT/h200_peer_sweep$fa4.md" ;;
  pytest)   # PYTEST_ARGS, the whole log -> $OUT/h200_pytest${TEST_PART}.txt
    { echo "# pytest $PYTEST_ARGS on $(python3 -c 'import attnselect; print(attnselect.Target.current().describe())'), $(date -u +%F)"
      timeout ${TEST_TIMEOUT:-300} python3 -m pytest -p no:cacheprovider -W ignore $PYTEST_ARGS 2>&1
    } > "$OUT/h200_pytest${TEST_PART:+_$TEST_PART}.txt"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/h200_pytest${TEST_PART:+_$TEST_PART}.txt" | tail -30 ;;
  flex-hooks)   # benchmarks/flex_hooks_probe.py: flex training under the self-check's hook and others (HOOKS_IDS,
                # HOOKS_TIMEOUT; side by side with `correctness` in one call: `... flex-hooks & ... correctness; wait`)
    timeout $((${HOOKS_TIMEOUT:-300} + 60)) python3 benchmarks/flex_hooks_probe.py --ids "${HOOKS_IDS:-17,11,4}" \
      --timeout "${HOOKS_TIMEOUT:-300}" --out "$OUT/h200_flex_hooks_probe" 2>&1 | grep -E '^\|' ;;
  flex-probe)   # FLEX_PROBE_ARGS adds arguments (--only softcap), FLEX_PROBE_PART names the output
    timeout 200 python3 benchmarks/flex_probe.py ${FLEX_PROBE_ARGS:-} \
      --out "$OUT/h200_flex_probe${FLEX_PROBE_PART:+_$FLEX_PROBE_PART}" 2>&1 | grep -E '^\|' ;;
  ladder)   # benchmarks/ladder.py, resuming results/h200_ladder${LADDER_PART:+_$LADDER_PART}.json where present
    name=h200_ladder${LADDER_PART:+_$LADDER_PART}$(python3 -c 'import flash_attn.cute' 2>/dev/null && echo _fa4)
    # the rungs run so far stay in /tmp while the machine is warm: a later call resumes them without a round trip
    [ -f "results/$name.json" ] && [ ! -f "/tmp/$name.json" ] && cp "results/$name.json" /tmp/
    only=(); IFS=';' read -ra rungs <<< "${LADDER_ONLY:-}"; for rung in "${rungs[@]}"; do only+=(--only "$rung"); done
    timeout ${LADDER_TIMEOUT:-560} python3 benchmarks/ladder.py --isolate ${LADDER_GROUP---group} --out "/tmp/$name" --deadline ${LADDER_DEADLINE:-420} \
      ${LADDER_ARGS:-} "${only[@]}" 2>&1 | grep -v -i warn | tail -30
    cp "/tmp/$name.json" "/tmp/$name.md" "$OUT/" ;;
  calibrate-host)   # the calibration's host times measured again (attnselect.bench.calibrate.host_times): this
                    # call's calibration where an earlier step wrote one (steps chain), else the committed one, of
                    # this GPU model (results/<gpu>_calibration.json: h200, h100)
    cal=$(gpu_model)_calibration
    from=results/$cal.json; [ -f "$OUT/$cal.json" ] && from=$OUT/$cal.json
    timeout ${CALIBRATE_TIMEOUT:-300} python3 benchmarks/calibrate.py --host-from "$from" \
      --out "$OUT/$cal" 2>&1 | grep -v -i warn | grep -E "^\| [a-z_0-9]+ \| [0-9-]" | head -16 ;;
  new-packing-host)   # benchmarks/new_packing_host.py: packed host times, a packing seen and new ones, any GPU
    timeout 300 python3 benchmarks/new_packing_host.py --out "$OUT/$(gpu_model)_new_packing_host" \
      2>&1 | grep -E '^\|' ;;
  calibrate-first-calls)   # its first calls measured again, an empty compile cache (as calibrate-host, it chains;
                           # it writes at its end alone: give it a call of its own, CALIBRATE_TIMEOUT under the limit)
    cal=$(gpu_model)_calibration
    from=results/$cal.json; [ -f "$OUT/$cal.json" ] && from=$OUT/$cal.json
    ATTNSELECT_CACHE_DIR=$(mktemp -d) timeout ${CALIBRATE_TIMEOUT:-400} python3 benchmarks/calibrate.py \
      --first-calls-from "$from" --out "$OUT/$cal" 2>&1 | grep -v -i warn \
      | sed -n '/^## First call/,$p' | head -30 ;;
  package-calibration)   # $OUT/<gpu>_calibration.json (calibrate-host's, this GPU model's) as this tree's package data
    python3 benchmarks/calibrate.py --package "$OUT/$(gpu_model)_calibration.json" \
      && cp src/attnselect/data/calibration_*.json "$OUT/" ;;
  torchtitan)
    name=h200_torchtitan_steps$(python3 -c 'import flash_attn.cute' 2>/dev/null && echo _fa4)
    timeout ${TITAN_TIMEOUT:-500} python3 benchmarks/torchtitan_steps.py --out "$OUT/$name" ${TITAN_ARGS:-} 2>&1 \
      | grep -v -i warn | tail -20 ;;
  calibrate)
    timeout ${CALIBRATE_TIMEOUT:-540} python3 benchmarks/calibrate.py \
      --out "$OUT/$(gpu_model)_calibration${CALIBRATE_PART:+_$CALIBRATE_PART}" ${CALIBRATE_ARGS:-} \
      2>&1 | grep -v -i warn | tail -40 ;;
  self-check-cost)
    timeout 300 python3 benchmarks/self_check_cost.py --out "$OUT/h200_self_check_cost" 2>&1 | grep -v -i warn \
      | grep -E '^\|' ;;
  fa4-grid)
    need_fa4 || exit 1
    grid_rows 400 --section fa4 --backends flash_attn4 --deadline "${GRID_DEADLINE:-330}" ;;
  fa4-bench)
    need_fa4 || exit 1
    [ -f results/h200_bench_fa4.json ] && cp results/h200_bench_fa4.json "$OUT/"   # resume the committed problems
    ATTNSELECT_DEBUG=1 ATTNSELECT_DEBUG_LEVEL=2 timeout 570 python3 -m attnselect.cli bench --out "$OUT/h200_bench_fa4" \
      --only "Sq=4096" --only "max sq=4096" --deadline "${MODELS_DEADLINE:-420}" > "$OUT/h200_bench_fa4.log" 2>&1
    grep -v -i warn "$OUT/h200_bench_fa4.log" | grep -v "^\[attnselect" | tail -30 ;;
  bench)
    timeout 560 python3 benchmarks/thd_bench.py --out "$OUT/h200_thd_bench" 2>&1 | grep -v -i warn | tail -60 ;;
  thd-inference)
    timeout "${THD_TIMEOUT:-400}" python3 benchmarks/thd_inference.py --out "$OUT/h200_thd_inference" 2>&1 \
      | grep -E "^\{" | cut -c1-400 ;;
  bench-short)   # the short-document packing alone (after a change of its rules)
    cp results/h200_thd_bench.json "$OUT/h200_thd_bench.json"
    timeout 200 python3 benchmarks/thd_bench.py --only "documents of 128..512" --out "$OUT/h200_thd_bench_short" \
      --into "$OUT/h200_thd_bench" 2>&1 | grep -v -i warn | tail -30 ;;
  crossover)
    timeout 300 python3 benchmarks/thd_bench.py --packings crossover --skip reference,sdpa_math,sdpa_efficient,sdpa_flash \
      --repeats 10 --budget 1 --out "$OUT/h200_thd_crossover" 2>&1 | grep -E "^[0-9]|queued" ;;
  models)
    name=h200_bench${SHARD:+_part${SHARD%/*}-of-${SHARD#*/}}
    [ -f "results/$name.json" ] && cp "results/$name.json" "$OUT/$name.json"
    ATTNSELECT_DEBUG=1 ATTNSELECT_DEBUG_LEVEL=2 timeout 570 python3 -m attnselect.cli bench --out "$OUT/$name" \
      --shard "${SHARD:-0/1}" --deadline "${MODELS_DEADLINE:-480}" > "$OUT/$name.log" 2>&1
    grep -v -i warn "$OUT/$name.log" | grep -v "^\[attnselect" | tail -30 ;;   # measure's timings stay in the log
  settle-check)   # the bench, settling near-ties, on the two 16k training problems measure missed at 34878ee
    ATTNSELECT_DEBUG=1 ATTNSELECT_DEBUG_LEVEL=2 timeout 420 python3 -m attnselect.cli bench --deadline 300 \
      --out "$OUT/h200_bench_settle_check" \
      --only "bshd B=1 Sq=16384 Skv=16384 Hq=16 Hkv=16 d_qk=192 d_v=128 bfloat16 mask=causal training" \
      --only "bshd B=1 Sq=16384 Skv=16384 Hq=64 Hkv=8 d_qk=128 d_v=128 bfloat16 mask=causal training" \
      > "$OUT/h200_bench_settle_check.log" 2>&1
    grep -v "^\[attnselect" "$OUT/h200_bench_settle_check.log" | grep -v -i warn | tail -12 ;;
  noise)
    timeout 400 python3 benchmarks/noise_floor.py --out "$OUT/h200_noise_floor" --sessions "${NOISE_SESSIONS:-2}" 2>&1 \
      | grep -v -i warn ;;
  convergence)
    timeout 400 python3 benchmarks/median_convergence.py --out "$OUT/h200_median_convergence" 2>&1 | grep -v -i warn ;;
  hf)
    timeout 560 python3 benchmarks/hf_deepseek.py --out "$OUT/h200_hf_deepseek" 2>&1 | grep -v -i warn | tail -12 ;;
  megatron)
    timeout 240 python3 -m pytest -v -p no:cacheprovider -W ignore tests/integrations/test_megatron.py 2>&1 | tail -15
    timeout 300 python3 benchmarks/megatron_mla.py --out "$OUT/h200_megatron_mla" 2>&1 | grep -v -i warn | tail -12 ;;
  fa4-stage*)   # one carry of FA4's wheels; the last one joins the split wheel and installs FA4 for the steps after it
    mkdir -p "$FA4_WHEELS" && cp ".$step"/* "$FA4_WHEELS/" || { echo "$step: carry .$step"; exit 1; }
    want=$(cat "$FA4_WHEELS/parts" 2>/dev/null || echo 0); have=$(ls "$FA4_WHEELS"/*.part-* 2>/dev/null | wc -l)
    if [ "$want" = 0 ] || [ "$have" -lt "$want" ]; then
      echo "$step: $have of $want parts here; run the next stage at once, while the machine is warm (a machine given"
      echo "back since fa4-stage1 has lost them: start again from fa4-stage1)"; continue
    fi
    part=$(ls "$FA4_WHEELS"/*.part-aa); cat "${part%.part-aa}".part-* > "${part%.part-aa}" && rm "$FA4_WHEELS"/*.part-*
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$FA4_SITE" \
      "$FA4_WHEELS"/*.whl || { echo "FA4 install failed"; exit 1; }
    # --target skips the wheel's .pth file, which puts dsl_packages (the cutlass module) on the path
    export PYTHONPATH=$FA4_SITE:$FA4_SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
    python3 -c 'import attnselect; print(attnselect.Target.current().describe())' ;;
  fa4-tests)
    need_fa4 || exit 1
    { echo "# pytest -m gpu -k flash_attn4 on $(python3 -c 'import attnselect; print(attnselect.Target.current().describe())'), $(date -u +%F)"
      timeout 280 python3 -m pytest -m gpu -v -p no:cacheprovider -W ignore -k "flash_attn4" ${TEST_PATHS:-tests} 2>&1 \
        | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E " | cut -c1-300
    } | tee "$OUT/h200_gpu_tests_fa4.txt" | tail -40 ;;
  fa4-loop)
    need_fa4 || exit 1   # every row shares one FA4 compile cache (its first-call cost: fa4-compile)
    FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$ATTNSELECT_CACHE_DIR/flash_attn_cute \
    timeout 400 python3 benchmarks/training_loop.py --steps 30 --rounds "${LOOP_ROUNDS:-2}" --out "$OUT/h200_training_loop_fa4" --rows "attnselect default, \
max_seqlen given;attnselect default, FA4 disabled;flash_attn4 native;FA4 flash_attn_varlen_func, called directly;\
cudnn_frontend native;torch varlen_attn, V padded" 2>&1 \
      | grep -v -i warn | tail -40 ;;
  pack-crossover)   # benchmarks/pack_crossover.py: varlen_fa2 against the cuDNN frontend packing by packing
    # (CROSSOVER_ARGS adds arguments, CROSSOVER_PART names the output) -> $OUT/h200_pack_crossover[_part].*
    timeout ${CROSSOVER_TIMEOUT:-500} python3 benchmarks/pack_crossover.py ${CROSSOVER_ARGS:-} \
      --out "$OUT/h200_pack_crossover${CROSSOVER_PART:+_$CROSSOVER_PART}" 2>&1 | grep -v -i warn | cut -c1-200 | tail -8
    grep -A8 "^| policy" "$OUT/h200_pack_crossover${CROSSOVER_PART:+_$CROSSOVER_PART}.md" ;;
  fa4-packed-gap)   # benchmarks/fa4_packed_gap.py: attnselect's packed FA4 calls against FA4 called directly
    need_fa4 || exit 1
    timeout 300 python3 benchmarks/fa4_packed_gap.py ${GAP_ARGS:-} --out "$OUT/h200_fa4_packed_gap${GAP_PART:+_$GAP_PART}" \
      2>&1 | grep -v -i warn | tail -45 ;;
  fa4-replay)   # benchmarks/fa4_forward_replay.py: FA4's dense forward replayed against its flash_attn_func
    need_fa4 || exit 1
    timeout ${REPLAY_TIMEOUT:-400} python3 benchmarks/fa4_forward_replay.py ${REPLAY_ARGS:-} --out "$OUT/h200_fa4_forward_replay" 2>&1 \
      | grep -v -i warn | grep -E "^#|^\||recorded" | cut -c1-200 ;;
  fa4-compile)
    need_fa4 || exit 1
    timeout 400 python3 benchmarks/fa4_compile_cost.py --out "$OUT/h200_fa4_compile" 2>&1 | grep -v -i warn | tail -12 ;;
  cp)
    { echo "# tests/context_parallel/test_ring_gpu.py on $(python3 -c 'import attnselect; print(attnselect.Target.current().describe())'), $(date -u +%F)"
      echo "# rank case [chunk choices] {relative errors against float64}"
      timeout 300 python3 -m pytest -s -v -p no:cacheprovider -W ignore tests/context_parallel/test_ring_gpu.py 2>&1 \
        | grep -E "^[01] |PASSED|FAILED|passed|failed|^E "
    } | tee "$OUT/h200_context_parallel.txt" | tail -30 ;;
  hot-path)   # HOT_PATH_ARGS adds arguments (--only "new packing" --profile-sort cumulative)
    timeout 200 python3 ${BENCH_DIR:-benchmarks}/hot_path.py --profile ${HOT_PATH_ARGS:-} --out "$OUT/h200_hot_path${HOT_PATH_PART:+_$HOT_PATH_PART}" 2>&1 \
      | grep -v -i warn | grep -E '^(\||## )|Error|Traceback' | cut -c1-160 ;;   # a failure shows its error
  new-packing-parts)   # benchmarks/new_packing_parts.py: a new packing's first call, stage by stage (NO_FA4=1: without)
    timeout 300 python3 ${BENCH_DIR:-benchmarks}/new_packing_parts.py ${PARTS_ARGS:-} --out "$OUT/h200_new_packing_parts${PARTS_NAME:+_$PARTS_NAME}" \
      2>&1 | grep -v -i warn | grep -E '^(\||## )|Error|Traceback' | cut -c1-160 ;;   # a failure shows its error
  sdpa-training-gap)   # benchmarks/sdpa_training_gap.py: sdpa_cudnn through attnselect against F.sdpa in training
    timeout 200 python3 benchmarks/sdpa_training_gap.py --out "$OUT/sdpa_training_gap" 2>&1 | grep -v -i warn | tail -60 ;;
  small-calls)   # benchmarks/small_calls_probe.py: small dense calls kernel by kernel (host, latency, stack)
    timeout 300 python3 benchmarks/small_calls_probe.py --out "$OUT/h200_small_calls_probe${SMALL_CALLS_PART:+_$SMALL_CALLS_PART}" \
      ${SMALL_CALLS_ARGS:-} 2>&1 | grep -v -i warn | tail -60 ;;
  first-calls)   # benchmarks/first_calls_probe.py: first calls split into start-up, configuration and size
    timeout 400 python3 benchmarks/first_calls_probe.py --out "$OUT/h200_first_calls_probe" 2>&1 | grep -v -i warn | tail -16 ;;
  new-lengths)   # benchmarks/new_lengths.py: dense calls of ever new lengths, fresh processes (NEW_LENGTHS_ARGS)
    name=h200_new_lengths$(python3 -c 'import flash_attn.cute' 2>/dev/null && echo _fa4)
    timeout ${NEW_LENGTHS_TIMEOUT:-400} python3 benchmarks/new_lengths.py --out "$OUT/$name" ${NEW_LENGTHS_ARGS:-} 2>&1 \
      | grep -v -i warn | tail -40 ;;
  hot-path-parts)
    timeout 200 python3 benchmarks/hot_path_parts.py --out "$OUT/h200_hot_path_parts" 2>&1 | grep -v -i warn \
      | grep -E '^(\||## |Timing)' | cut -c1-160 ;;
  overhead)
    timeout 300 python3 benchmarks/packed_overhead.py --out "$OUT/h200_packed_overhead" 2>&1 | grep -v -i warn | tail -14 ;;
  loop)   # LOOP_ROWS="row;row" runs some of the rows, LOOP_ROUNDS rounds of them, into $OUT/h200_training_loop${LOOP_PART:+_$LOOP_PART}
    timeout ${LOOP_TIMEOUT:-500} python3 benchmarks/training_loop.py --steps 30 --rounds "${LOOP_ROUNDS:-2}" \
      ${LOOP_ROWS:+--rows "$LOOP_ROWS"} --out "$OUT/h200_training_loop${LOOP_PART:+_$LOOP_PART}" 2>&1 \
      | grep -v -i warn | tail -60 ;;
  buckets)
    timeout 400 python3 benchmarks/packing_buckets.py --out "$OUT/h200_packing_buckets" \
      ${BUCKET_SCHEMES:+--schemes "$BUCKET_SCHEMES"} 2>&1 | grep -v -i warn | grep -v "^|" ;;
  *) echo "usage: $0 STEP... (tests suite sweep ladder pytest flex-probe flex-hooks calibrate correctness checks self-check-cost grid grid-odd hot-path hot-path-parts small-calls overhead bench bench-short crossover models settle-check noise convergence hf megatron loop buckets fa4-stage1 fa4-stage2 fa4-stage3 fa4-stage4 fa4-tests fa4-loop fa4-compile fa4-packed-gap fa4-grid fa4-bench)"; exit 2 ;;
esac
echo "## step $step took $((SECONDS - started)) s"
done
