#!/usr/bin/env bash
# Prepare a GPU run on a machine without a GPU, so that a session lent one spends its device minutes on the run:
#
#   benchmarks/gpu_prepare.sh        # in the checkout the device call sends; then the `run` call it prints
#
# 1. `bash -n` and the dry run of benchmarks/gpu_check.sh (GPU_CHECK_DRY=1): every step's command line resolves
#    (tests collected, benchmarks' arguments parsed, sanitizer and ncu options known). Stops here if one does not.
# 2. The extension prebuilt for the device image's Python (3.12: KINDS.md's pip list, and the first run's build log)
#    and MACER_CUDA_ARCHS (default "90;90a") with this machine's nvcc (13.0, as on the device), in .gpu-run/: the
#    device's build step then copies it instead of compiling (est. 25-40 s saved of the lease; it falls back to
#    building there when anything does not match or the module does not load). Needs a Python 3.12 with its headers
#    (PYTHON312, else python3.12 on PATH or pyenv's); pybind11 goes into .venv-gpu312 at requirements-ci.txt's pin.
#    Checked here: the module links only libc, libm, libgcc_s and libstdc++ (static CUDA runtime, no libtorch), needs
#    no glibc newer than the device image's 2.39, imports under Python 3.12 and reports SASS for sm_90 and PTX for
#    sm_90. Without a Python 3.12 it says so and leaves no module: the device builds it.
# 3. .gpu-run/manifest (commit, "-dirty" with uncommitted changes, the sources' hash the build step compares, the arch
#    list, what built it) and .gpu-run/files (the tracked files' list, whose hash lets the device report "-modified"
#    for a tree that changed after this ran). The results name this commit (the device copy has no .git).
# 4. The device call to make: command, carry list and timeout.
#
# Knobs: PYTHON (the project's environment for the dry run; default .venv/bin/python, else python3), PYTHON312,
# MACER_CUDA_ARCHS, GPU_PREPARE_PREBUILT=0 (no prebuilt module). About 2-3 minutes on the project's 2-core VM (the
# dry run ~1 minute idle, the first build ~80 s; later builds only recompile what changed).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
RUN=$ROOT/.gpu-run
source benchmarks/gpu_lib.sh
PY=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
ARCHS=${MACER_CUDA_ARCHS:-"90;90a"}
DEVICE_GLIBC=2.39  # the device image's glibc (run 1's platform string: ...-with-glibc2.39)

echo "== 1. the script's syntax and its dry run"
bash -n benchmarks/gpu_check.sh
bash -n benchmarks/gpu_prepare.sh
dry=$(mktemp -d)
trap 'rm -rf "$dry"' EXIT
if ! GPU_CHECK_DRY=1 PYTHON=$PY MACER_CUDA_ARCHS=$ARCHS bash benchmarks/gpu_check.sh "$dry/out" >"$dry/log" 2>&1; then
    sed -n '/^--- summary/,$p' "$dry/log"
    echo "gpu_prepare: the dry run failed (the step logs: rerun with GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh DIR)"
    exit 1
fi
grep -E '^total ' "$dry/out/summary.txt"
echo "every step's command line resolves ($(grep -c ' ok ' "$dry/out/summary.txt") steps)"

rm -rf "$RUN"
mkdir -p "$RUN"

echo "== 2. the extension for the device's Python 3.12, MACER_CUDA_ARCHS=$ARCHS"
find_py312() {
    local c
    for c in "${PYTHON312:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 \
        /root/.pyenv/versions/3.12*/bin/python3.12; do
        [[ -n $c ]] && "$c" -c 'import sys, sysconfig, os; assert sys.version_info[:2] == (3, 12); \
assert os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' 2>/dev/null && {
            command -v "$c"
            return 0
        }
    done
    return 1
}
if [[ ${GPU_PREPARE_PREBUILT:-1} != 1 ]]; then
    echo "GPU_PREPARE_PREBUILT=0: no prebuilt module; the device builds the extension"
elif ! py312=$(find_py312); then
    echo "no Python 3.12 with its headers here (set PYTHON312): no prebuilt module; the device builds the extension"
else
    if [[ ! -x .venv-gpu312/bin/python ]]; then
        "$py312" -m venv .venv-gpu312
        .venv-gpu312/bin/python -m pip install -q "$(grep -E '^pybind11==' requirements-ci.txt)"
    fi
    build=build/cmake-py312-sm${ARCHS//;/_}-device
    t0=$(date +%s)
    cmake -S . -B "$build" -G Ninja -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" \
        -DPython_EXECUTABLE="$ROOT/.venv-gpu312/bin/python" -DMACER_CUDA_ARCHS="$ARCHS" \
        -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$RUN" -DCMAKE_BUILD_TYPE=Release >"$RUN/build.log"
    cmake --build "$build" --parallel "$(getconf _NPROCESSORS_ONLN)" >>"$RUN/build.log"
    so=$(ls "$RUN"/_C.cpython-312-*.so)
    echo "built $(basename "$so") in $(($(date +%s) - t0)) s ($(du -h "$so" | cut -f1))"
    needed=$(readelf -d "$so" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')
    for lib in $needed; do
        [[ $lib =~ ^(libc\.so\.6|libm\.so\.6|libgcc_s\.so\.1|libstdc\+\+\.so\.6|ld-linux-x86-64\.so\.2)$ ]] || {
            echo "gpu_prepare: the module needs $lib, which the device may not have"
            exit 1
        }
    done
    glibc=$(objdump -T "$so" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -V | tail -1)
    if [[ $(printf '%s\n%s\n' "$glibc" "$DEVICE_GLIBC" | sort -V | tail -1) != "$DEVICE_GLIBC" ]]; then
        echo "gpu_prepare: the module needs glibc $glibc, newer than the device image's $DEVICE_GLIBC"
        exit 1
    fi
    PYTHONPATH=$RUN .venv-gpu312/bin/python -c 'import _C
sass, ptx = list(_C.compiled_archs()), _C.ptx_arch()
print("imports under Python 3.12: SASS", sass, "PTX", ptx)
assert 90 in sass, "no sm_90 SASS"'
    echo "links: $needed; newest glibc symbol $glibc (device $DEVICE_GLIBC)"
fi

echo "== 3. the manifest"
source_hash=$(gpu_source_hash)
sha=$(git rev-parse --short HEAD)
[[ -n $(git status --porcelain --untracked-files=no) ]] && sha+=-dirty
git ls-files >"$RUN/files"
tree_hash=$(gpu_tree_hash "$RUN/files")
{
    echo "git_sha=$sha"
    echo "source_hash=$source_hash"
    echo "archs=$ARCHS"
    echo "tree_hash=$tree_hash"
    echo "built=$(date -u +%Y-%m-%dT%H:%MZ), nvcc $(nvcc --version | grep -o 'release [0-9.]*' | cut -d' ' -f2), $(
        cd "$RUN" && ls _C*.so 2>/dev/null || echo 'no module')"
} >"$RUN/manifest"
cat "$RUN/manifest"
[[ $sha == *-dirty ]] && echo "NOTE: uncommitted changes: the results will name $sha; commit first to name a commit"

echo "== 4. the device call (one run; the budget leaves a rerun of a few steps inside a 15-minute lease)"
tree_bytes=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
run_bytes=$(du -cb "$RUN" | tail -1 | cut -f1)
echo "travels: the tree $((tree_bytes / 1024)) KiB + .gpu-run $((run_bytes / 1024)) KiB (limit 64 MiB)"
cat <<'EOF'
run(command="bash benchmarks/gpu_check.sh", carry=[".gpu-run"], timeout_s=570)
   then, from its files: benchmarks/results/<card>-<date>/run1-<sha>/ <- summary.txt, targets.txt and the unpacked
   gpu_check.tar.gz (tar xzf ... --strip-components=1), and
   python -m benchmarks.gpu_targets benchmarks/results/<card>-<date>/run1-<sha> --readme --date <date> > .../README.md
a rerun of the steps a fix touches, on the still-warm machine (within its 30 s), e.g.:
run(command="GPU_CHECK_BUDGET_S=200 GPU_CHECK_STEPS='environment build pytest_cuda' GPU_CHECK_TESTS=tests/kernels/test_stage.py bash benchmarks/gpu_check.sh", carry=[".gpu-run"], timeout_s=260)
EOF
