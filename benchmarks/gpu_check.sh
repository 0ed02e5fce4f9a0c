#!/usr/bin/env bash
# The GPU check in one command: build the CUDA extension, run the GPU tests, compute-sanitizer (memcheck, racecheck,
# initcheck, synccheck) over every op, the three microbenchmarks, the end-to-end benchmark and Nsight Compute.
#
#   benchmarks/gpu_check.sh [OUT_DIR]     # OUT_DIR default: $OUT if set (a lent device machine), else
#                                         # benchmarks/results/gpu_check
#
# Sized for a 15-minute device lease (a machine's start takes 1-2 of them, and a rerun after fixes needs 4 more):
# every step has a time limit, all of them share one budget (GPU_CHECK_BUDGET_S, default 420 s), and a step that
# would start with too little left is skipped and says so. Order: build; then the correctness steps side by side
# (`pytest -m cuda`, the sanitizer runs, the Triton tests on the GPU: none is timed, and the sanitizers are mostly
# host work); then the timed steps one at a time: the microbenchmarks, the end-to-end benchmark (7B text shape, the
# 2.4k and 16.3k clips, full vs MACER at rho = 0.25), Nsight Compute's Speed Of Light over each hot-path kernel
# (benchmarks/ncu_hot_path.py), FlashAttention-2's GPU test and end-to-end run where flash-attn is importable (else
# skipped with a message), eager decode steps full vs MACER (issue 23 item 5), and the batch throughput benchmark
# (batch 1 / 4 / 8, full vs MACER, issue 11). Where vLLM is importable: its admission benchmark (issue 29) and the
# compiled forward with FULL decode CUDA graphs (issue 36: tests/vllm/test_graphs_gpu.py, bench_vllm --serving).
# Knobs: PYTHON (default python3), MACER_CUDA_ARCHS (default "90;90a"), GPU_CHECK_BUDGET_S, GPU_CHECK_INSTALL_FLASH_ATTN,
# GPU_CHECK_STEPS (step names to run, default all: a rerun after fixes runs only what they touch) and
# GPU_CHECK_TESTS (test paths for the two pytest steps, default all). The prepared stage alone (issue 37):
# GPU_CHECK_STEPS="environment build pytest_cuda sanitize_prepared_memcheck bench_readout host_profile"
# GPU_CHECK_TESTS=tests/test_prepared_stage.py (about 3 minutes, est.).
#
# Output in OUT_DIR: summary.txt (one line per step: status, exit code, seconds), log.txt (all output), and
# gpu_check.tar.gz (the files/ folder: each step's log, the benchmarks' CSV/JSON, pytest's junit XML). When OUT_DIR
# is $OUT the files/ folder is removed after packing, so three files come back from the device machine. A copy of the
# repository without .git cannot name its commit: pass it as MACER_GIT_SHA=<sha> (the result files record it).
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT_DIR=${1:-${OUT:-$ROOT/benchmarks/results/gpu_check}}
mkdir -p "$OUT_DIR/files"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
FILES=$OUT_DIR/files
SUMMARY=$OUT_DIR/summary.txt
LOG=$OUT_DIR/log.txt
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-420}
DEFER_LOG=0
START=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT:$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export MACER_CUDA_ARCHS=${MACER_CUDA_ARCHS:-"90;90a"}  # 90a: the S-B scoring kernel (issue 37)
: >"$SUMMARY"
: >"$LOG"

# step NAME LIMIT_S COMMAND...: run COMMAND with at most LIMIT_S seconds (less if the budget has less left), its
# output to files/NAME.log and log.txt; one line in summary.txt.
step() {
    local name=$1 limit=$2
    shift 2
    if [[ -n ${GPU_CHECK_STEPS:-} && " $GPU_CHECK_STEPS " != *" $name "* ]]; then
        printf '%-26s not selected (GPU_CHECK_STEPS)\n' "$name" >>"$SUMMARY"
        return 0
    fi
    local left=$((BUDGET - ($(date +%s) - START)))
    ((limit > left)) && limit=$left
    if ((limit < 20)); then
        printf '%-26s skipped (%ds of the %ds budget left)\n' "$name" "$left" "$BUDGET" | tee -a "$SUMMARY"
        return 0
    fi
    if ((DEFER_LOG)); then
        printf '\n=== %s (limit %ds, at %ds)\n' "$name" "$limit" "$(($(date +%s) - START))"
    else
        printf '\n=== %s (limit %ds, at %ds)\n' "$name" "$limit" "$(($(date +%s) - START))" | tee -a "$LOG"
    fi
    local t0=$(date +%s) rc
    # bash -c: COMMAND may be one of the functions below (exported), which timeout alone cannot run.
    timeout --signal=INT --kill-after=15 "$limit" bash -c '"$@"' step "$@" >"$FILES/$name.log" 2>&1
    rc=$?
    ((DEFER_LOG)) || cat "$FILES/$name.log" >>"$LOG"
    local status=ok
    ((rc == 124 || rc == 137)) && status=TIMEOUT
    ((rc != 0 && rc != 124 && rc != 137)) && status=FAILED
    printf '%-26s %-8s rc=%-3d %4ds\n' "$name" "$status" "$rc" "$(($(date +%s) - t0))" | tee -a "$SUMMARY"
    return 0
}

# sanitize TOOL ARGS...: compute-sanitizer TOOL over `$PY ARGS...` (the op driver, or a pytest selection). The op
# driver compiles its Triton kernels in the warm-up step first (cached in ~/.triton), so the tools spend their time
# on the kernels, not on compilation. memcheck and initcheck run with PyTorch's caching allocator off, so every tensor
# is its own allocation and an out-of-bounds access cannot land silently in a neighbour's memory.
sanitize() {
    local tool=$1 env=()
    [[ $tool == memcheck || $tool == initcheck ]] && env=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1)
    local extra=()
    [[ $tool == memcheck ]] && extra=(--leak-check no)
    "${env[@]}" compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 30 "${extra[@]}" \
        "$PY" "${@:2}"
}

environment() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', \
triton.__version__, torch.cuda.get_device_name(), 'threads', torch.get_num_threads())"
    nvcc --version | tail -1
    compute-sanitizer --version | head -1
    echo "git sha: ${MACER_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo 'unknown (no .git; set MACER_GIT_SHA)')}"
    nproc
}

build() {
    "$PY" setup.py -q build_ext --inplace &&
        "$PY" -c "import macer_kernels as mk; s = mk.backend_status(); print(s); \
raise SystemExit(0 if s['cuda'] is None else 'the cuda backend is not usable: ' + s['cuda'])"
}

# FlashAttention-2 (the attention the paper used): its GPU test and the end-to-end benchmark with --attn
# flash_attention_2, where flash-attn 2 is importable. GPU_CHECK_INSTALL_FLASH_ATTN=1 first tries a pip install of
# flash-attn 2.8.x (a prebuilt wheel needs registry access; the device image has none, and a source build takes far
# longer than this check's budget).
flash_attention() {
    if [[ ${GPU_CHECK_INSTALL_FLASH_ATTN:-0} == 1 ]] && ! "$PY" -c "import flash_attn" 2>/dev/null; then
        "$PY" -m pip install -q --retries 0 --timeout 10 --no-build-isolation "flash-attn>=2.8,<2.9" 2>&1 | tail -3
    fi
    if ! "$PY" -c "import flash_attn; print('flash-attn', flash_attn.__version__)"; then
        echo "flash-attn is not importable here: the FlashAttention-2 GPU checks are skipped (CI runs transformers'"
        echo "FA2 path with the stand-in kernel of tests/flash_attn_standin.py)"
        return 0
    fi
    "$PY" -m pytest -m cuda -q -rfEs -p no:cacheprovider tests/test_flash_attention.py \
        --junitxml="$FILES/pytest_flash_attention.xml" &&
        "$PY" benchmarks/bench_e2e.py --mode gpu --attn flash_attention_2 --text-shapes 7B --clips paper --reps 3 \
            --warmup 1 --profile-reps 1 --naive-lengths --out "$FILES" --name bench_e2e_flash_attention_2
}

# vLLM serving with MACER on a GPU (issue 29's admission benchmark: the most concurrent long clips in a 4 GiB KV cache
# and their throughput, vLLM's own model against MACER), where vLLM is importable (the device image has none). Five
# engine starts: select it alone (GPU_CHECK_STEPS=vllm_admission) with a budget of its own.
vllm_admission() {
    if ! "$PY" -c "import vllm; print('vllm', vllm.__version__)"; then
        echo "vLLM is not importable here: the serving benchmark is skipped (make test-vllm runs the plugin on CPU)"
        return 0
    fi
    VLLM_USE_V2_MODEL_RUNNER=0 "$PY" -m benchmarks.bench_vllm --mode gpu --admission --out "$FILES"
}

# MACER's compiled forward and FULL decode CUDA graphs in vLLM (issue 36), where vLLM is importable: the GPU test
# (per attention backend, the engine's load-time graph check, then FULL decodes against piecewise ones) and the
# compiled-vs-eager serving rows (vLLM's own model and MACER, 1 and 8 in flight). Four engine starts with graph capture
# for the benchmark, two for the test: select it alone (GPU_CHECK_STEPS=vllm_graphs) with a budget of its own.
vllm_graphs() {
    if ! "$PY" -c "import vllm; print('vllm', vllm.__version__)"; then
        echo "vLLM is not importable here: the compiled-serving checks are skipped (make test-vllm runs them on CPU)"
        return 0
    fi
    "$PY" -m pytest -m cuda -q -rfEs -p no:cacheprovider tests/vllm/test_graphs_gpu.py \
        --junitxml="$FILES/pytest_vllm_graphs.xml" &&
        "$PY" -m benchmarks.bench_vllm --mode gpu --serving --out "$FILES"
}

# ---- scoring (issue 37 item 3): the L2 set-aside microbenchmark, compiled here (a few seconds) and run on the idle
# GPU before anything else (even the extension's build): it decides whether S-A's logits and S-B's spill can live in L2 (kernel-plan 8.8). Then
# Nsight Compute's metrics of kernel-plan 8.7 over both scoring paths and the K stream (benchmarks/ncu_scores.py),
# and over the microbenchmark's read-back (the L2 hit rate as the hardware counts it).
l2_setaside() {
    nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/l2_setaside.cu -o /tmp/macer_l2_setaside &&
        /tmp/macer_l2_setaside --sizes 20,30,45 --stream-mb 100 --reps 5 --csv "$FILES/l2_setaside.csv"
}
ncu_l2_setaside() {
    [[ -x /tmp/macer_l2_setaside ]] || nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/l2_setaside.cu -o /tmp/macer_l2_setaside
    ncu --clock-control none --kernel-name read_back --metrics lts__t_sector_hit_rate.pct,dram__bytes_read.sum \
        /tmp/macer_l2_setaside --sizes 30 --reps 1
}
SCORES_NCU_METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,smsp__inst_executed.sum

export -f sanitize environment build flash_attention vllm_admission vllm_graphs l2_setaside ncu_l2_setaside
export PY FILES
export PATH=$PATH:/usr/local/cuda/bin$(for d in /opt/nvidia/nsight-compute/*/; do [[ -x $d/ncu ]] && printf ":%s" "${d%/}"; done)

step environment 30 environment
step l2_setaside 40 l2_setaside  # first: needs no build, only nvcc and an idle GPU (issue 37)
step build 240 build

# Correctness, in parallel: nothing here is timed, and the sanitizers are mostly host work (16 cores on the device
# machine), so the group takes about as long as its slowest member instead of the sum (the serial order of the last
# sizing would not reach the timings inside a 15-minute device lease). Each step's output goes to files/NAME.log and
# is appended to log.txt in this order once the group ends.
DEFER_LOG=1
# GPU_CHECK_TESTS (test paths, default all) narrows both pytest steps, e.g. to the files of a fix on a rerun.
read -r -a TESTS <<<"${GPU_CHECK_TESTS:-}"
step pytest_cuda 200 "$PY" -m pytest -m cuda -q -rfEs -p no:cacheprovider --junitxml="$FILES/pytest_cuda.xml" \
    "${TESTS[@]}" &
(
    step sanitize_warmup 90 "$PY" -m benchmarks.sanitize_ops
    for tool in memcheck racecheck initcheck synccheck; do
        step "sanitize_$tool" 150 sanitize "$tool" -m benchmarks.sanitize_ops &
    done
    # The scoring kernels on splits of several tiles, two row tiles and PAD keys (the op driver's shapes give one
    # tile per split), both cache layouts, and the persistent S-B kernel on a small grid (tests named "sanitizer"):
    # the same tools over those small cases, synccheck included (named barriers, mbarriers, the cooperative grid).
    for tool in memcheck racecheck initcheck synccheck; do
        step "sanitize_scores_$tool" 120 sanitize "$tool" -m pytest -m cuda -q -p no:cacheprovider \
            tests/test_cuda_scores_emulation.py -k sanitizer &
    done
    # The prepared stage (issue 37): its five kernels chained with programmatic dependent launch, eager and replayed
    # from a CUDA graph, under memcheck (PyTorch's caching allocator stays on: graph capture needs it).
    step sanitize_prepared_memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 30 \
        --leak-check no "$PY" -m pytest -m cuda -q -p no:cacheprovider tests/test_prepared_stage.py &
    wait
) &
# Issue 37 selection: the radix selection kernel's small (one CTA), split (a cluster of 2) and cluster shapes, the
# select's ends, the direct rank count and a PDL launch, under racecheck and synccheck (benchmarks/sanitize_select.py,
# every result compared with the torch backend; distributed shared memory included where the tools track it).
(
    for tool in racecheck synccheck; do
        step "select_sanitize_$tool" 120 sanitize "$tool" -m benchmarks.sanitize_select &
    done
    wait
) &
# The offline sm_89/sm_90 compile test is left to CI's CPU run: it needs no GPU, and beside the sanitizers it took
# longer than the step's limit (H200, 2026-11-27).
step pytest_triton 200 "$PY" -m pytest -m "triton and not cuda" -q -rfEs -p no:cacheprovider \
    --deselect tests/test_triton_kernels.py::test_kernels_compile_for_sm90_and_sm89 \
    --junitxml="$FILES/pytest_triton.xml" "${TESTS[@]}" &
wait
DEFER_LOG=0
for name in pytest_cuda sanitize_warmup sanitize_memcheck sanitize_racecheck sanitize_initcheck sanitize_synccheck \
    sanitize_scores_memcheck sanitize_scores_racecheck sanitize_scores_initcheck sanitize_scores_synccheck \
    sanitize_prepared_memcheck \
    pytest_triton; do
    [[ -f $FILES/$name.log ]] && { printf '\n=== %s\n' "$name"; cat "$FILES/$name.log"; } >>"$LOG"
done
for name in select_sanitize_racecheck select_sanitize_synccheck; do
    [[ -f $FILES/$name.log ]] && { printf '\n=== %s\n' "$name"; cat "$FILES/$name.log"; } >>"$LOG"
done

# Timings, one at a time on an otherwise idle GPU.
step bench_modality_scores 100 "$PY" -m benchmarks.bench_modality_scores --out "$FILES"
step ncu_scores 90 ncu --clock-control none --profile-from-start off --metrics "$SCORES_NCU_METRICS" \
    "$PY" -m benchmarks.ncu_scores
step ncu_l2_setaside 40 ncu_l2_setaside
step bench_select 100 "$PY" -m benchmarks.bench_select --out "$FILES"
# The readout per op and as a stage (select_stage + compact_many, the prepared stage with and without PDL), the stage
# rows' wall time against the 50 us target and the bytes-moved limit (issue 37).
step bench_readout 75 "$PY" -m benchmarks.bench_readout --overhead --out "$FILES"
# The 7B text shape on the paper's 2.4k clip and the 16.3k clip, full vs MACER at rho = 0.25 (the targets' point):
# prefill and decoder time, MACER's own work (profiled run), host synchronisations, decode per token, KV cache.
step bench_e2e 150 "$PY" benchmarks/bench_e2e.py --mode gpu --text-shapes 7B --clips paper long --policies macer \
    --keep-ratios 0.25 --reps 3 --warmup 1 --profile-reps 1 --naive-lengths --no-plot --out "$FILES" \
    --name bench_e2e_gpu_check
# Issue 37 item 5: the decoder layers through torch.compile (macer.compress(..., compile=True): regional, sequence
# dynamic, MACER's stages between the compiled regions) beside eager layers, 7B shape, the 2.4k and 16.3k clips, full
# vs MACER at rho = 0.25. Inductor compiles in the warm-up round (first_prefill_ms); the table at the step's end puts
# the targets (>= 2.4x at 2.4k, >= 2.85x at 16.3k, compiled MACER / compiled full) beside the measured speedups.
step bench_e2e_compiled 240 "$PY" benchmarks/bench_e2e.py --mode gpu --text-shapes 7B --clips paper long \
    --policies macer --keep-ratios 0.25 --compile both --reps 3 --warmup 1 --profile-reps 0 --decode-tokens 8 \
    --naive-lengths --no-plot --out "$FILES" --name bench_e2e_compiled
# Nsight Compute's Speed Of Light over one call of each hot-path kernel (the profile behind "what limits it").
step ncu_hot_path 90 ncu --clock-control none --profile-from-start off --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats \
    "$PY" -m benchmarks.ncu_hot_path
# Host time of one readout (the prepared stage, the fused stage and per-op), per stage and by host operator.
step host_profile 60 "$PY" -m benchmarks.host_profile
step flash_attention_2 150 flash_attention
# Decode steps with eager attention (per-layer masks): full vs MACER per token on a 3B decoder, and the host time of
# MACER's decode-step code (decode_host_us_per_step, from the profiled runs).
step bench_e2e_decode_eager 90 "$PY" benchmarks/bench_e2e.py --mode gpu --attn eager --text-shapes 3B --clips paper \
    --policies macer --keep-ratios 0.25 --reps 3 --warmup 1 --profile-reps 2 --decode-tokens 32 --naive-lengths \
    --no-plot --out "$FILES" --name bench_e2e_decode_eager

step bench_batch 120 "$PY" -m benchmarks.bench_batch --mode gpu --batch-sizes 1 4 8 --out "$FILES"
step vllm_admission 420 vllm_admission
step vllm_graphs 420 vllm_graphs

printf '%-26s %ds in all\n' total "$(($(date +%s) - START))" | tee -a "$SUMMARY"
tar czf "$OUT_DIR/gpu_check.tar.gz" -C "$OUT_DIR" files
[[ "${OUT:-}" == "$OUT_DIR" ]] && rm -rf "$FILES"

# The reply of a device call shows the end of the output: the tables, then the summary.
for name in l2_setaside bench_modality_scores bench_select bench_readout; do
    printf '\n--- %s\n' "$name"
    grep -v '^wrote' "$LOG" | sed -n "/^=== $name /,/^=== /p" | grep -v '^===' | tail -25
done
printf '\n--- sanitizer\n'
grep -h -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize (pass|MISMATCH)' "$LOG" | sort | uniq -c
# bench_e2e_compiled (issue 37 item 5): its speedup table, targets beside the measured.
[[ -f $LOG ]] && grep -q '^=== bench_e2e_compiled ' "$LOG" && {
    printf '\n--- bench_e2e_compiled\n'
    sed -n '/^=== bench_e2e_compiled /,/^=== /p' "$LOG" | sed -n '/^speedup = /,$p' | grep -v '^===' | head -12
}
printf '\n--- summary (%s)\n' "$OUT_DIR"
cat "$SUMMARY"
