// Step S-B of modality_scores (csrc/modality_scores_sm90a.cu, compiled for sm_90a only): the interface the S-A
// launcher (csrc/modality_scores.cu) asks. Without 90a in MACER_CUDA_ARCHS the stubs at the end of
// csrc/modality_scores.cu answer "not built".
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "launchers.h"

namespace macer {
namespace sm90a {

bool scores_compiled();
// Why p cannot take S-B on its device ("" when it can): the device is not sm_90, the shape is outside the kernel's
// (B = 1, <= 32 rows per KV head, D = 128, bf16/fp16, K rows 16-byte aligned, at most kMaxHeads KV heads), or the
// cooperative grid does not fit.
std::string scores_ineligible(const ModalityScoresParams& p);
// Workspace S-B needs (0 without 90a or for a shape it never takes): the launcher's bound is the larger of both
// paths. Its counters are the first scores::kSbCounterWords words of the counter buffer.
size_t scores_workspace_bytes(int64_t batch, int64_t q_heads, int64_t q_len, int64_t kv_heads, int64_t num_keys);
void scores_launch(const ModalityScoresParams& p);

}  // namespace sm90a
}  // namespace macer
