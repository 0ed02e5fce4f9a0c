#!/usr/bin/env bash
# The GPU check in one command: the L2 set-aside microbenchmark, the CUDA extension (prebuilt or built here), the GPU
# tests of the ops and compute-sanitizer over their kernels, the scoring / selection / readout benchmarks with their
# targets, Nsight Compute over the kernels, and the end-to-end benchmark with compiled decoder layers.
#
#   benchmarks/gpu_check.sh [OUT_DIR]     # OUT_DIR default: $OUT if set (a lent device machine), else
#                                         # benchmarks/results/gpu_check
#   GPU_CHECK_DRY=1 benchmarks/gpu_check.sh /tmp/dry    # the dry run, on a machine without a GPU (below)
#
# Sized for a 15-minute device lease (a machine's start takes 1-2 of them, and a rerun after a fix needs 3-4 more):
# every step has a time limit, all of them share one budget (GPU_CHECK_BUDGET_S, default 480 s), and a step that
# would start with less than its minimum left is skipped and says so. Order, most informative first:
#   1. environment; l2_setaside (kernel-plan 8.8: decides whether S-A's logits and S-B's spill can stay in L2; needs
#      only nvcc and an idle GPU, so it runs before anything else touches the GPU);
#   2. build: the extension for MACER_CUDA_ARCHS (default "90;90a": S-B needs 90a). A prebuilt module carried in
#      .gpu-run/ (benchmarks/gpu_prepare.sh, on CPU) is used when its sources' hash, arch list and Python ABI match
#      this tree and it loads; otherwise it is built here (est. 25-40 s on the 16 cores);
#   3. correctness, side by side (none of it is timed; the sanitizers are mostly host work on 16 cores): `pytest -m
#      cuda` over the tests of the ops in two processes (CUDA_TESTS and CUDA_OPS_TESTS below; GPU_CHECK_TESTS
#      overrides), and compute-sanitizer over the new kernels' small cases: memcheck / racecheck / initcheck / synccheck over the scoring cases
#      (tests/kernels/test_cuda_scores_emulation.py -k sanitizer) and over every op on the CUDA backend
#      (benchmarks/sanitize_ops.py), memcheck / racecheck / synccheck over the radix selection's one-CTA, split and
#      cluster shapes (benchmarks/sanitize_select.py), memcheck over the prepared stage (tests/core/test_prepared_stage.py);
#   4. timed, one at a time on the idle GPU: bench_modality_scores, bench_select, bench_readout (each prints its
#      targets beside their limits), Nsight Compute (ncu_scores: kernel-plan 8.7's metrics over both scoring paths and
#      the K stream; ncu_l2_setaside: the microbenchmark's L2 hit rate as counted; ncu_hot_path: Speed Of Light,
#      memory, occupancy, launch and warp state of every hot-path kernel), then bench_e2e on the 7B text shape with
#      eager and compiled decoder layers, full vs MACER at rho = 0.25, the 2.4k clip and the 16.3k clip apart;
#   5. the rest, run when budget is left or when selected: host_profile, pytest_triton and racecheck over the Triton
#      kernels (unchanged since the first run), FlashAttention-2 (flash-attn is not in the device image), eager
#      decode, bench_batch, and the vLLM steps (vLLM is not in the device image: they say so and skip).
# Knobs: PYTHON (default python3), MACER_CUDA_ARCHS, GPU_CHECK_BUDGET_S, GPU_CHECK_STEPS (step names to run, default
# all: a rerun after a fix runs only what it touches), GPU_CHECK_TESTS (test paths for the two pytest steps),
# GPU_CHECK_INSTALL_FLASH_ATTN=1, MACER_GIT_SHA (the commit, where the tree has no .git and .gpu-run has no manifest),
# GPU_CHECK_PREBUILT (the prebuilt module's folder, default .gpu-run).
#
# Output in OUT_DIR: summary.txt (one line per step: status, exit code, seconds), targets.txt (every target of the
# kernel issue beside its limit, met / MISSED / not measured, and the correctness counts: benchmarks/gpu_targets.py),
# log.txt (all output) and gpu_check.tar.gz (the files/ folder: each step's log, the benchmarks' CSV/JSON, pytest's
# junit XML, the L2 CSV). When OUT_DIR is $OUT the files/ folder is removed after packing: four files come back.
# Exit status: 0 when every step that ran passed, 1 otherwise.
#
# Dry run (GPU_CHECK_DRY=1, any machine): every step runs with the programs that need a GPU replaced by stand-ins
# (benchmarks/gpu_dry.py): pytest collects its selection, each benchmark's module is imported and its arguments
# parsed, compute-sanitizer's and ncu's options are checked, the probes' imports resolved, the L2 microbenchmark is
# compiled with the real nvcc and checks its arguments; nothing is timed or skipped for budget. A step fails when its
# command line does not resolve. tests/tools/test_gpu_check.py runs it; benchmarks/gpu_prepare.sh runs it before a device
# call. docs/cuda.md, "The GPU check in one command", has the device call itself.
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT_DIR=${1:-${OUT:-$ROOT/benchmarks/results/gpu_check}}
mkdir -p "$OUT_DIR/files"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
FILES=$OUT_DIR/files
SUMMARY=$OUT_DIR/summary.txt
LOG=$OUT_DIR/log.txt
DRY=$([[ ${GPU_CHECK_DRY:-0} == 1 ]] && echo 1 || echo 0)
HOST_PY=${PYTHON:-python3}  # host-only helpers (hashes, the targets table): run for real in both modes
PY=$HOST_PY                 # everything that touches the GPU: a stand-in in the dry run
BUDGET=${GPU_CHECK_BUDGET_S:-480}
((DRY)) && BUDGET=100000
DEFER_LOG=0
START=$(date +%s)
PREBUILT=${GPU_CHECK_PREBUILT:-$ROOT/.gpu-run}  # benchmarks/gpu_prepare.sh's prebuilt module and manifest
source benchmarks/gpu_lib.sh
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT:$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export MACER_CUDA_ARCHS=${MACER_CUDA_ARCHS:-"90;90a"}  # 90a: the S-B scoring kernel (issue 37)
: >"$SUMMARY"
: >"$LOG"
rm -f "$OUT_DIR/targets.txt"

# The tests of the ops the kernel issue changed (scoring, selection, stage, prepared stage, compaction) and the two
# engine-level GPU tests that run them inside a prefill: two pytest processes side by side (pytest_cuda: the kernels'
# file, 184 tests; pytest_cuda_ops: the other 238), so that neither is the correctness group's long pole alone.
# GPU_CHECK_TESTS runs its paths in pytest_cuda alone.
CUDA_TESTS=(tests/kernels/test_cuda_kernels.py)
CUDA_OPS_TESTS=(tests/kernels/test_select.py tests/kernels/test_cuda_scores_emulation.py tests/kernels/test_modality_scores.py
    tests/kernels/test_stage.py tests/kernels/test_batched_stage.py tests/core/test_prepared_stage.py tests/kernels/test_compact.py
    tests/kernels/test_nonfinite_scores.py tests/kernels/test_nonfinite_select.py tests/kernels/test_nosync.py tests/hf/test_macer_patch.py
    tests/hf/test_prefill_packing.py tests/hf/test_batched_prepared.py)
read -r -a TESTS <<<"${GPU_CHECK_TESTS:-}"
if ((${#TESTS[@]})); then
    CUDA_TESTS=("${TESTS[@]}")
    CUDA_OPS_TESTS=()
fi

if ((DRY)); then
    # Stand-ins for the programs that need a GPU, first on PATH; nvcc, git and the shell's tools stay real.
    DRY_BIN=$(mktemp -d)
    trap 'rm -rf "$DRY_BIN"' EXIT
    for tool in python nvidia-smi compute-sanitizer ncu; do
        printf '#!/bin/sh\nexec %q -m benchmarks.gpu_dry %s "$@"\n' "$(command -v "$HOST_PY")" "$tool" >"$DRY_BIN/$tool"
        chmod +x "$DRY_BIN/$tool"
    done
    PY=$DRY_BIN/python
    mkdir "$DRY_BIN/cache"
    export PATH=$DRY_BIN:$PATH GPU_DRY_CACHE=$DRY_BIN/cache
fi

# The commit the results name: MACER_GIT_SHA, else git, else .gpu-run/manifest (written by gpu_prepare.sh with the
# tracked files' hashes: "-modified" when this tree's files differ from the ones it hashed).
manifest() { sed -n "s/^$1=//p" "$PREBUILT/manifest" 2>/dev/null | head -1; }
if [[ -z ${MACER_GIT_SHA:-} ]]; then
    if sha=$(git rev-parse --short HEAD 2>/dev/null); then
        [[ -n $(git status --porcelain --untracked-files=no 2>/dev/null) ]] && sha+=-dirty
        MACER_GIT_SHA=$sha
    elif [[ -n $(manifest git_sha) ]]; then
        MACER_GIT_SHA=$(manifest git_sha)
        tree=$(gpu_tree_hash "$PREBUILT/files" 2>/dev/null)
        [[ $tree == "$(manifest tree_hash)" ]] || MACER_GIT_SHA+=-modified
    else
        MACER_GIT_SHA="unknown (no .git, no .gpu-run/manifest: set MACER_GIT_SHA)"
    fi
fi
export MACER_GIT_SHA

# step NAME LIMIT[/MIN] COMMAND...: run COMMAND with at most LIMIT seconds (less if the budget has less left; skipped
# when under MIN, default 20, is left), its output to files/NAME.log and log.txt; one line in summary.txt.
step() {
    local name=$1 limit=${2%/*} min=20
    [[ $2 == */* ]] && min=${2#*/}
    shift 2
    if [[ -n ${GPU_CHECK_STEPS:-} && " $GPU_CHECK_STEPS " != *" $name "* ]]; then
        printf '%-27s not selected (GPU_CHECK_STEPS)\n' "$name" >>"$SUMMARY"
        return 0
    fi
    local left=$((BUDGET - ($(date +%s) - START)))
    ((limit > left)) && limit=$left
    if ((limit < min)); then
        printf '%-27s skipped (%ds of the %ds budget left, needs %ds)\n' "$name" "$left" "$BUDGET" "$min" |
            tee -a "$SUMMARY"
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
    printf '%-27s %-8s rc=%-3d %4ds\n' "$name" "$status" "$rc" "$(($(date +%s) - t0))" | tee -a "$SUMMARY"
    return 0
}

# sanitize TOOL ARGS...: compute-sanitizer TOOL over `$PY ARGS...` (an op driver, or a pytest selection). memcheck and
# initcheck run with PyTorch's caching allocator off, so every tensor is its own allocation and an out-of-bounds
# access cannot land silently in a neighbour's memory.
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
    "$HOST_PY" -c "import platform, sysconfig; print('python', platform.python_version(), \
sysconfig.get_config_var('EXT_SUFFIX'), platform.platform())"
    nvcc --version | tail -1
    compute-sanitizer --version | head -1
    echo "git sha: $MACER_GIT_SHA"
    echo "cores: $(getconf _NPROCESSORS_ONLN)"
}

# build: the prebuilt module from .gpu-run when it matches this tree (sources' hash, arch list, Python ABI) and passes
# benchmarks/gpu_build_check.py (the backend usable; S-B present where 90a is asked for); else `setup.py build_ext
# --inplace` and the same check.
build() {
    local suffix so why=""
    suffix=$("$HOST_PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
    so=$PREBUILT/_C$suffix
    if [[ ! -f $PREBUILT/manifest ]]; then
        why="no .gpu-run/manifest (benchmarks/gpu_prepare.sh was not run, or .gpu-run was not carried)"
    elif [[ ! -f $so ]]; then
        why="no prebuilt module for this Python ($suffix): .gpu-run has $(cd "$PREBUILT" && ls _C*.so 2>/dev/null)"
    elif [[ $(manifest source_hash) != "$(gpu_source_hash)" ]]; then
        why="its sources' hash $(manifest source_hash) is not this tree's $(gpu_source_hash): csrc/ changed since"
    elif [[ $(manifest archs) != "$MACER_CUDA_ARCHS" ]]; then
        why="built for '$(manifest archs)', not MACER_CUDA_ARCHS='$MACER_CUDA_ARCHS'"
    fi
    if [[ -z $why ]]; then
        echo "build: the prebuilt module ($(manifest built)), sources $(manifest source_hash)"
        if ((DRY)); then
            echo "dry: would copy $so into macer_kernels/"
        else
            cp "$so" macer_kernels/ || return 1
        fi
        "$PY" -m benchmarks.gpu_build_check && return 0
        echo "build: the prebuilt module did not pass the check above: building from source"
        ((DRY)) || rm -f "macer_kernels/_C$suffix"
    else
        echo "build: not using a prebuilt module: $why"
    fi
    "$PY" setup.py -q build_ext --inplace && "$PY" -m benchmarks.gpu_build_check
}

# ---- scoring (issue 37 item 3): the L2 set-aside microbenchmark, compiled here (a few seconds) and run on the idle
# GPU before anything else: it decides whether S-A's logits and S-B's spill can live in L2 (kernel-plan 8.8).
L2_BIN=${TMPDIR:-/tmp}/macer_l2_setaside.$$
L2_CHECK=$( ((DRY)) && echo --check-args)
l2_setaside() {
    nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/l2_setaside.cu -o "$L2_BIN" &&
        "$L2_BIN" --sizes 20,30,45 --stream-mb 100 --reps 5 --csv "$FILES/l2_setaside.csv" $L2_CHECK
}
ncu_l2_setaside() {
    [[ -x $L2_BIN ]] || nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/l2_setaside.cu -o "$L2_BIN" || return 1
    ncu --clock-control none --kernel-name read_back --metrics lts__t_sector_hit_rate.pct,dram__bytes_read.sum \
        "$L2_BIN" --sizes 30 --reps 1 $L2_CHECK
}
SCORES_NCU_METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,smsp__inst_executed.sum

# bench_e2e CLIP: the 7B text shape, full vs MACER at rho = 0.25, eager and compiled decoder layers (issue 37 item 5:
# macer.compress(..., compile=True), regional torch.compile, sequence dynamic; Inductor compiles in the warm-up
# round), 8 decode tokens, one profiled run (MACER's own work), no naive-scores rows. Its table puts the compiled
# prefill targets (>= 2.4x at 2.4k, >= 2.85x at 16.3k) beside the measured speedups. A tree whose bench_e2e has no
# --compile yet runs the eager rows alone and says so.
bench_e2e_clip() {
    local compile=(--compile both)
    if ! grep -q -- '"--compile"' benchmarks/bench_e2e.py; then
        echo "NOTE: benchmarks/bench_e2e.py has no --compile in this tree: eager layers only (no compiled rows)"
        compile=()
    fi
    "$PY" benchmarks/bench_e2e.py --mode gpu --text-shapes 7B --clips "$1" --policies macer --keep-ratios 0.25 \
        "${compile[@]}" --reps 3 --warmup 1 --profile-reps 1 --decode-tokens 8 --naive-lengths --no-plot \
        --out "$FILES" --name "bench_e2e_$1"
}

# have MODULE: whether $PY imports MODULE (in the dry run: whether it resolves here).
have() { "$PY" -c "import $1; print('$1', getattr($1, '__version__', ''))"; }

# FlashAttention-2 (the attention the paper used): its GPU test and the end-to-end benchmark with --attn
# flash_attention_2, where flash-attn 2 is importable. GPU_CHECK_INSTALL_FLASH_ATTN=1 first tries a pip install of
# flash-attn 2.8.x (a prebuilt wheel needs registry access; the device image has none).
flash_attention() {
    if [[ ${GPU_CHECK_INSTALL_FLASH_ATTN:-0} == 1 ]] && ! have flash_attn 2>/dev/null; then
        "$PY" -m pip install -q --retries 0 --timeout 10 --no-build-isolation "flash-attn>=2.8,<2.9" 2>&1 | tail -3
    fi
    if ! have flash_attn; then
        echo "flash-attn is not importable here: the FlashAttention-2 GPU checks are skipped (CI runs transformers'"
        echo "FA2 path with the stand-in kernel of tests/helpers/flash_attn_standin.py)"
        return 0
    fi
    "$PY" -m pytest -m cuda -q -rfEs -p no:cacheprovider tests/hf/test_flash_attention.py \
        --junitxml="$FILES/pytest_flash_attention.xml" &&
        "$PY" benchmarks/bench_e2e.py --mode gpu --attn flash_attention_2 --text-shapes 7B --clips paper --reps 3 \
            --warmup 1 --profile-reps 1 --naive-lengths --out "$FILES" --name bench_e2e_flash_attention_2
}

# vLLM serving with MACER on a GPU (issue 29's admission benchmark), where vLLM is importable (the device image has
# none). Five engine starts: select it alone (GPU_CHECK_STEPS=vllm_admission) with a budget of its own.
vllm_admission() {
    if ! have vllm; then
        echo "vLLM is not importable here: the serving benchmark is skipped (make test-vllm runs the plugin on CPU)"
        return 0
    fi
    VLLM_USE_V2_MODEL_RUNNER=0 "$PY" -m benchmarks.bench_vllm --mode gpu --admission --out "$FILES"
}

# MACER's compiled forward and FULL decode CUDA graphs in vLLM (issue 36), where vLLM is importable: the GPU test and
# the compiled-vs-eager serving rows. Select it alone (GPU_CHECK_STEPS=vllm_graphs) with a budget of its own.
vllm_graphs() {
    if ! have vllm; then
        echo "vLLM is not importable here: the compiled-serving checks are skipped (make test-vllm runs them on CPU)"
        return 0
    fi
    "$PY" -m pytest -m cuda -q -rfEs -p no:cacheprovider tests/serving/test_graphs_gpu.py \
        --junitxml="$FILES/pytest_vllm_graphs.xml" &&
        "$PY" -m benchmarks.bench_vllm --mode gpu --serving --out "$FILES"
}

export -f sanitize environment build gpu_source_hash manifest flash_attention vllm_admission vllm_graphs l2_setaside \
    ncu_l2_setaside bench_e2e_clip have
export PY HOST_PY FILES DRY PREBUILT L2_BIN L2_CHECK
export PATH=$PATH:/usr/local/cuda/bin$(for d in /opt/nvidia/nsight-compute/*/; do [[ -x $d/ncu ]] && printf ":%s" "${d%/}"; done)

# ---- 1-2: environment, L2 set-aside (before anything else uses the GPU), build
step environment 30 environment
step l2_setaside 40 l2_setaside
step build 150 build

# ---- 3: correctness, side by side. Each step's output goes to files/NAME.log, appended to log.txt in this order
# once the group ends.
DEFER_LOG=1
step pytest_cuda 150 "$PY" -m pytest -m cuda -q -rfEs -p no:cacheprovider --junitxml="$FILES/pytest_cuda.xml" \
    "${CUDA_TESTS[@]}" &
if ((${#CUDA_OPS_TESTS[@]})); then
    step pytest_cuda_ops 150 "$PY" -m pytest -m cuda -q -rfEs -p no:cacheprovider \
        --junitxml="$FILES/pytest_cuda_ops.xml" "${CUDA_OPS_TESTS[@]}" &
else
    printf '%-27s not run (GPU_CHECK_TESTS: pytest_cuda runs the selection)\n' pytest_cuda_ops >>"$SUMMARY"
fi
# The scoring kernels on splits of several tiles, two row tiles and PAD keys, both cache layouts, 9 labels and the
# persistent S-B kernel on a small grid (tests named "sanitizer"): named barriers, mbarriers, the cooperative grid.
for tool in memcheck racecheck initcheck synccheck; do
    step "sanitize_scores_$tool" 120 sanitize "$tool" -m pytest -m cuda -q -p no:cacheprovider \
        tests/kernels/test_cuda_scores_emulation.py -k sanitizer &
done
# Every op on small awkward shapes, CUDA backend, each result compared with the torch backend.
for tool in memcheck racecheck initcheck synccheck; do
    step "sanitize_ops_$tool" 120 sanitize "$tool" -m benchmarks.sanitize_ops --backends cuda &
done
# The radix selection: one CTA, a split over a cluster of 2, full clusters, the select's ends, the direct rank count
# and a PDL launch, every result against the torch backend (distributed shared memory included where tracked).
for tool in memcheck racecheck synccheck; do
    step "select_sanitize_$tool" 120 sanitize "$tool" -m benchmarks.sanitize_select &
done
# The prepared stage: its five kernels chained with programmatic dependent launch, eager and replayed from a CUDA
# graph (PyTorch's caching allocator stays on: graph capture needs it).
step sanitize_prepared_memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 30 \
    --leak-check no "$PY" -m pytest -m cuda -q -p no:cacheprovider tests/core/test_prepared_stage.py &
wait
DEFER_LOG=0
for name in pytest_cuda pytest_cuda_ops sanitize_scores_{memcheck,racecheck,initcheck,synccheck} \
    sanitize_ops_{memcheck,racecheck,initcheck,synccheck} select_sanitize_{memcheck,racecheck,synccheck} \
    sanitize_prepared_memcheck; do
    [[ -f $FILES/$name.log ]] && { printf '\n=== %s\n' "$name"; cat "$FILES/$name.log"; } >>"$LOG"
done

# ---- 4: timings, one at a time on an otherwise idle GPU.
step bench_modality_scores 100 "$PY" -m benchmarks.bench_modality_scores --out "$FILES"
step bench_select 100 "$PY" -m benchmarks.bench_select --out "$FILES"
# The readout per op and as a stage (select_stage + compact_many, the prepared stage with and without PDL): the stage
# rows' wall time against the 50 us target and the bytes-moved limit.
step bench_readout 75 "$PY" -m benchmarks.bench_readout --overhead --out "$FILES"
step ncu_scores 90 ncu --clock-control none --profile-from-start off --metrics "$SCORES_NCU_METRICS" \
    "$PY" -m benchmarks.ncu_scores
step ncu_l2_setaside 40 ncu_l2_setaside
# Nsight Compute's Speed Of Light over one call of each hot-path kernel (the profile behind "what limits it").
step ncu_hot_path 90 ncu --clock-control none --profile-from-start off --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats \
    "$PY" -m benchmarks.ncu_hot_path
# Each clip in its own process (its results are written when it ends): skipped rather than cut short.
step bench_e2e_paper 150/90 bench_e2e_clip paper
step bench_e2e_long 150/90 bench_e2e_clip long

# ---- 5: the rest, when budget is left (a first run seldom reaches them) or when selected.
# Host time of one readout (the prepared stage, the fused stage and per-op), per stage and by host operator.
step host_profile 60 "$PY" -m benchmarks.host_profile
# MACER's own work per 7B prefill (plan, setup, each stage's host call alone and its kernels between CUDA events).
step bench_own_work 60 "$PY" -m benchmarks.bench_own_work --device cuda --calls 50 --warmup 5 --out "$FILES"
step pytest_triton 200 "$PY" -m pytest -m "triton and not cuda" -q -rfEs -p no:cacheprovider \
    --deselect tests/kernels/test_triton_kernels.py::test_kernels_compile_for_sm90_and_sm89 \
    --junitxml="$FILES/pytest_triton.xml" "${TESTS[@]}"
step sanitize_triton_racecheck 150/60 sanitize racecheck -m benchmarks.sanitize_ops --backends triton
step flash_attention_2 150 flash_attention
# Eager attention (per-layer masks): full vs MACER per decode token on a 3B decoder.
step bench_e2e_decode_eager 90 "$PY" benchmarks/bench_e2e.py --mode gpu --attn eager --text-shapes 3B --clips paper \
    --policies macer --keep-ratios 0.25 --reps 3 --warmup 1 --profile-reps 2 --decode-tokens 32 --naive-lengths \
    --no-plot --out "$FILES" --name bench_e2e_decode_eager
step bench_batch 120 "$PY" -m benchmarks.bench_batch --mode gpu --batch-sizes 1 4 8 --out "$FILES"
step vllm_admission 420 vllm_admission
step vllm_graphs 420 vllm_graphs

printf '%-27s %ds in all%s\n' total "$(($(date +%s) - START))" "$( ((DRY)) && echo ' (dry run)')" | tee -a "$SUMMARY"
# Every target beside its limit, and the correctness counts, from the files the steps wrote.
"$HOST_PY" -m benchmarks.gpu_targets "$FILES" --summary "$SUMMARY" >"$OUT_DIR/targets.txt" 2>&1 ||
    echo "benchmarks.gpu_targets failed (its output is in targets.txt)" | tee -a "$SUMMARY"
tar czf "$OUT_DIR/gpu_check.tar.gz" -C "$OUT_DIR" files
[[ "${OUT:-}" == "$OUT_DIR" ]] && rm -rf "$FILES"

# The reply of a device call shows the end of the output: the L2 table, the targets, then the summary.
printf '\n--- l2_setaside\n'
sed -n '/^=== l2_setaside /,/^=== /p' "$LOG" | grep -v '^===' | tail -16
printf '\n--- targets (%s)\n' "$OUT_DIR/targets.txt"
cat "$OUT_DIR/targets.txt"
printf '\n--- summary (%s)\n' "$OUT_DIR"
cat "$SUMMARY"
! grep -q -E '^[a-z0-9_]+ +(FAILED|TIMEOUT) ' "$SUMMARY"
