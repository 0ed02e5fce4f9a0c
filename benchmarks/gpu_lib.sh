# Shell helpers shared by benchmarks/gpu_prepare.sh (which writes .gpu-run/manifest) and benchmarks/gpu_check.sh (which
# compares this tree with it on the device), so that both sides hash alike. Sourced; run from the repository root.

# The extension's sources: what a prebuilt module was compiled from.
gpu_source_hash() {
    find csrc CMakeLists.txt setup.py -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
}

# gpu_tree_hash FILE_LIST: the files named one a line in FILE_LIST (the tracked files when the manifest was written).
gpu_tree_hash() {
    xargs -d '\n' sha256sum <"$1" | sha256sum | cut -c1-16
}
