// pybind11 bindings of the prepared stage (csrc/stage.cu): the class _C.StagePlan, built once per stage shape by
// macer_kernels.cuda.stage.StageHandle, and its launch(), one host call per stage. Plain C++ like bindings.cpp.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "launchers.h"

namespace py = pybind11;

namespace {

template <typename T>
T* ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

void fail(const std::string& message) { throw std::invalid_argument("macer_kernels.stage: " + message); }

// (label, keep, coverage_weight, coverage) per selected modality, as select_cta takes them.
using Modality = std::tuple<int64_t, int64_t, double, bool>;
// (shape, strides, element_bytes, dim) per gathered table.
using Gather = std::tuple<std::vector<int64_t>, std::vector<int64_t>, int64_t, int64_t>;

macer::StagePlan make_plan(int q_dtype, int labels_dtype, const std::array<int64_t, 6>& sizes,
                           const std::array<int64_t, 2>& labels_stride, std::uintptr_t positions,
                           std::uintptr_t scores, std::uintptr_t workspace, float scale, float eps, int64_t out_len,
                           const std::vector<Modality>& modalities, int chunk_dtype,
                           const std::array<int64_t, 2>& chunk_stride, std::uintptr_t keeps,
                           const std::vector<Gather>& gather, int64_t query_row0, bool chain, int device,
                           int64_t positions_stride, std::uintptr_t counters) {
  macer::StagePlan plan{};
  macer::ModalityScoresParams& s = plan.scores;
  s.query_positions = ptr<const void>(positions);
  s.out = ptr<float>(scores);
  s.workspace = ptr<void>(workspace);
  s.counters = ptr<int>(counters);  // the scoring kernels' zeroed, self-resetting counters (one buffer per stream)
  s.q_dtype = q_dtype;
  s.modality_dtype = labels_dtype;
  s.positions_dtype = macer::kInt64;
  s.batch = sizes[0];
  s.q_heads = sizes[1];
  s.q_len = sizes[2];
  s.head_dim = sizes[3];
  s.kv_heads = sizes[4];
  s.num_keys = sizes[5];
  s.mod_stride[0] = labels_stride[0];
  s.mod_stride[1] = labels_stride[1];
  // 0: every sample reads the same question rows, the positions row0 .. row0 + Lq - 1; Lq: a [B, Lq] table of
  // each sample's own rows (a left-padded batch), whose query rows the caller gathered to rows 0 .. Lq - 1.
  if (positions_stride != 0 && positions_stride != sizes[2])
    fail("positions_stride must be 0 (rows shared by every sample) or Lq=" + std::to_string(sizes[2]) +
         " (a [B, Lq] table), got " + std::to_string(positions_stride));
  if (positions_stride != 0 && query_row0 != 0)
    fail("per-sample question rows (positions_stride = Lq) are read from query row 0, got query_row0 = " +
         std::to_string(query_row0));
  s.pos_stride[0] = positions_stride;
  s.pos_stride[1] = 1;
  s.scale = scale;
  s.eps = eps;
  s.device = device;

  macer::SelectCtaParams& p = plan.select;
  p.op = "stage";
  p.scores_dtype = macer::kFloat32;
  p.labels_dtype = labels_dtype;
  p.chunk_dtype = chunk_dtype;
  p.scores_stride[0] = s.num_keys;  // the plan's scores buffer: contiguous [B, N] float32
  p.scores_stride[1] = 1;
  p.labels_stride[0] = labels_stride[0];
  p.labels_stride[1] = labels_stride[1];
  p.chunk_stride[0] = chunk_stride[0];
  p.chunk_stride[1] = chunk_stride[1];
  p.out_stride = out_len;
  p.out_len = out_len;
  p.batch = s.batch;
  p.n = s.num_keys;
  if (modalities.empty() || modalities.size() > static_cast<size_t>(macer::kMaxStageModalities))
    fail("the number of selected modalities must be in [1, " + std::to_string(macer::kMaxStageModalities) + "]");
  p.num_modalities = static_cast<int>(modalities.size());
  for (size_t m = 0; m < modalities.size(); ++m) {
    p.modalities[m].label = std::get<0>(modalities[m]);
    p.modalities[m].keep = std::get<1>(modalities[m]);
    p.modalities[m].coverage_weight = std::get<2>(modalities[m]);
    p.modalities[m].coverage = std::get<3>(modalities[m]) ? 1 : 0;
  }
  p.keeps = ptr<const int32_t>(keeps);
  p.device = device;

  for (size_t i = 0; i < gather.size(); ++i) {
    macer::StageGather g{std::get<0>(gather[i]), std::get<1>(gather[i]), std::get<2>(gather[i]),
                         std::get<3>(gather[i])};
    const std::string name = "gathered table " + std::to_string(i);
    if (g.dim < 1 || static_cast<size_t>(g.dim) >= g.shape.size() || g.strides.size() != g.shape.size())
      fail(name + ": dim must index its shape after a batch dim, with one stride per dim");
    if (g.shape[g.dim - 1] != s.batch || g.shape[g.dim] != s.num_keys)
      fail(name + ": its batch dim must have size B=" + std::to_string(s.batch) + " and its sequence dim N=" +
           std::to_string(s.num_keys));
    // A dry run of the per-call descriptor (address 0 is aligned for every unit): the layout must flatten.
    macer::compact_descriptor(nullptr, nullptr, g.shape, g.strides, g.element_bytes, g.dim, true);
    plan.gather.push_back(std::move(g));
  }
  plan.query_row0 = query_row0;
  plan.chain = chain;
  return plan;
}

void launch(const macer::StagePlan& plan, std::uintptr_t query, const std::array<int64_t, 4>& q_stride,
            std::uintptr_t key, const std::array<int64_t, 3>& k_stride, std::uintptr_t labels,
            std::uintptr_t chunk_ids, std::uintptr_t keep, std::uintptr_t nonfinite,
            const std::vector<std::uintptr_t>& gather_src, const std::vector<std::uintptr_t>& gather_dst,
            std::uintptr_t stream) {
  macer::StageCall c{};
  c.query = ptr<const void>(query);
  c.key = ptr<const void>(key);
  for (int i = 0; i < 4; ++i) c.q_stride[i] = q_stride[i];
  for (int i = 0; i < 3; ++i) c.k_stride[i] = k_stride[i];
  c.labels = ptr<const void>(labels);
  c.chunk_ids = ptr<const void>(chunk_ids);
  c.keep = ptr<int64_t>(keep);
  c.nonfinite = ptr<bool>(nonfinite);
  c.gather_src.reserve(gather_src.size());
  for (const std::uintptr_t a : gather_src) c.gather_src.push_back(ptr<const void>(a));
  c.gather_dst.reserve(gather_dst.size());
  for (const std::uintptr_t a : gather_dst) c.gather_dst.push_back(ptr<void>(a));
  c.stream = reinterpret_cast<void*>(stream);
  macer::stage_launch(plan, c);
}

}  // namespace

void macer_bind_stage(py::module_& m) {
  py::class_<macer::StagePlan>(m, "StagePlan",
                               "A prepared MACER stage: scoring, selection and the compaction of row tables, "
                               "launched by one call (see csrc/launchers.h)")
      .def(py::init(&make_plan), py::arg("q_dtype"), py::arg("labels_dtype"), py::arg("sizes"),
           py::arg("labels_stride"), py::arg("positions"), py::arg("scores"), py::arg("workspace"), py::arg("scale"),
           py::arg("eps"), py::arg("out_len"), py::arg("modalities"), py::arg("chunk_dtype"),
           py::arg("chunk_stride"), py::arg("keeps"), py::arg("gather"), py::arg("query_row0"), py::arg("chain"),
           py::arg("device"), py::arg("positions_stride") = 0, py::arg("counters") = 0)
      .def("launch", &launch, "One stage: scoring, selection, compaction, chained on `stream`", py::arg("query"),
           py::arg("q_stride"), py::arg("key"), py::arg("k_stride"), py::arg("labels"), py::arg("chunk_ids"),
           py::arg("keep"), py::arg("nonfinite"), py::arg("gather_src"), py::arg("gather_dst"), py::arg("stream"))
      .def_property_readonly("chain", [](const macer::StagePlan& p) { return p.chain; })
      .def_property_readonly("num_gathered", [](const macer::StagePlan& p) { return p.gather.size(); });
  m.def("stage_chain_supported", &macer::stage_chain_supported,
        "Whether a stage's launches on this device are chained with programmatic dependent launch",
        py::arg("device"));
}
