// pybind11 module macer_kernels._C. Plain C++: it sees no CUDA header and no libtorch. Tensors arrive as integer
// data pointers with shapes, strides and dtype codes; the stream arrives as an integer (torch's
// `torch.cuda.current_stream().cuda_stream`). Launchers throw std::invalid_argument (-> ValueError) for arguments the
// Python wrappers should have rejected and std::runtime_error (-> RuntimeError) for CUDA errors, each naming the op.
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

// The prepared stage's class and functions (csrc/stage_bindings.cpp).
void macer_bind_stage(py::module_& m);

namespace {

template <typename T>
T* ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

void* stream_ptr(std::uintptr_t stream) { return reinterpret_cast<void*>(stream); }

macer::ModalityScoresParams scores_params(std::uintptr_t query, std::uintptr_t key, std::uintptr_t modality,
                                          std::uintptr_t positions, std::uintptr_t out, std::uintptr_t workspace,
                                          std::uintptr_t counters, int q_dtype, int modality_dtype,
                                          int positions_dtype, const std::array<int64_t, 6>& sizes,
                                          const std::array<int64_t, 4>& q_stride,
                                          const std::array<int64_t, 3>& k_stride,
                                          const std::array<int64_t, 2>& mod_stride,
                                          const std::array<int64_t, 2>& pos_stride, float scale, float eps, int device,
                                          std::uintptr_t stream, int path) {
  macer::ModalityScoresParams p{};
  p.query = ptr<const void>(query);
  p.key = ptr<const void>(key);
  p.modality = ptr<const void>(modality);
  p.query_positions = ptr<const void>(positions);
  p.out = ptr<float>(out);
  p.workspace = ptr<void>(workspace);
  p.counters = ptr<int>(counters);
  p.q_dtype = q_dtype;
  p.modality_dtype = modality_dtype;
  p.positions_dtype = positions_dtype;
  p.batch = sizes[0];
  p.q_heads = sizes[1];
  p.q_len = sizes[2];
  p.head_dim = sizes[3];
  p.kv_heads = sizes[4];
  p.num_keys = sizes[5];
  for (int i = 0; i < 4; ++i) p.q_stride[i] = q_stride[i];
  for (int i = 0; i < 3; ++i) p.k_stride[i] = k_stride[i];
  for (int i = 0; i < 2; ++i) p.mod_stride[i] = mod_stride[i];
  for (int i = 0; i < 2; ++i) p.pos_stride[i] = pos_stride[i];
  p.scale = scale;
  p.eps = eps;
  p.device = device;
  p.stream = stream_ptr(stream);
  p.path = path;
  return p;
}

void modality_scores(std::uintptr_t query, std::uintptr_t key, std::uintptr_t modality, std::uintptr_t positions,
                     std::uintptr_t out, std::uintptr_t workspace, std::uintptr_t counters, int q_dtype,
                     int modality_dtype, int positions_dtype, const std::array<int64_t, 6>& sizes,
                     const std::array<int64_t, 4>& q_stride, const std::array<int64_t, 3>& k_stride,
                     const std::array<int64_t, 2>& mod_stride, const std::array<int64_t, 2>& pos_stride, float scale,
                     float eps, int device, std::uintptr_t stream, int path) {
  macer::modality_scores(scores_params(query, key, modality, positions, out, workspace, counters, q_dtype,
                                       modality_dtype, positions_dtype, sizes, q_stride, k_stride, mod_stride,
                                       pos_stride, scale, eps, device, stream, path));
}

macer::SelectParams select_params(std::uintptr_t scores, int scores_dtype, int64_t n, int64_t scores_stride, int64_t k,
                                  std::uintptr_t out, std::uintptr_t workspace, size_t workspace_bytes, int device,
                                  std::uintptr_t stream) {
  macer::SelectParams p{};
  p.scores = ptr<const void>(scores);
  p.scores_dtype = scores_dtype;
  p.n = n;
  p.scores_stride = scores_stride;
  p.k = k;
  p.out = ptr<int64_t>(out);
  p.workspace = ptr<void>(workspace);
  p.workspace_bytes = workspace_bytes;
  p.device = device;
  p.stream = stream_ptr(stream);
  return p;
}

void topk_indices(std::uintptr_t scores, int scores_dtype, int64_t n, int64_t scores_stride, int64_t k,
                  std::uintptr_t out, std::uintptr_t workspace, size_t workspace_bytes, int device,
                  std::uintptr_t stream) {
  macer::topk_indices(
      select_params(scores, scores_dtype, n, scores_stride, k, out, workspace, workspace_bytes, device, stream));
}

void coverage_select(std::uintptr_t scores, int scores_dtype, int64_t n, int64_t scores_stride,
                     std::uintptr_t chunk_ids, int chunk_dtype, int64_t chunk_stride, int64_t k,
                     double coverage_weight, std::uintptr_t out, std::uintptr_t workspace, size_t workspace_bytes,
                     int device, std::uintptr_t stream) {
  macer::SelectParams p =
      select_params(scores, scores_dtype, n, scores_stride, k, out, workspace, workspace_bytes, device, stream);
  p.chunk_ids = ptr<const void>(chunk_ids);
  p.chunk_dtype = chunk_dtype;
  p.chunk_stride = chunk_stride;
  p.coverage_weight = coverage_weight;
  macer::coverage_select(p);
}

// (label, keep, coverage_weight, coverage) per selected modality.
using CtaModality = std::tuple<int64_t, int64_t, double, bool>;

void select_cta(const std::string& op, std::uintptr_t scores, int scores_dtype,
                const std::array<int64_t, 2>& scores_stride, std::uintptr_t labels, int labels_dtype,
                const std::array<int64_t, 2>& labels_stride, std::uintptr_t chunk_ids, int chunk_dtype,
                const std::array<int64_t, 2>& chunk_stride, std::uintptr_t out, int64_t out_stride, int64_t out_len,
                int64_t batch, int64_t n, const std::vector<CtaModality>& modalities, std::uintptr_t keeps,
                std::uintptr_t nonfinite, int device, std::uintptr_t stream, bool pdl) {
  macer::SelectCtaParams p{};
  p.op = op.c_str();
  p.scores = ptr<const void>(scores);
  p.labels = ptr<const void>(labels);
  p.chunk_ids = ptr<const void>(chunk_ids);
  p.out = ptr<int64_t>(out);
  p.scores_dtype = scores_dtype;
  p.labels_dtype = labels_dtype;
  p.chunk_dtype = chunk_dtype;
  for (int i = 0; i < 2; ++i) {
    p.scores_stride[i] = scores_stride[i];
    p.labels_stride[i] = labels_stride[i];
    p.chunk_stride[i] = chunk_stride[i];
  }
  p.out_stride = out_stride;
  p.out_len = out_len;
  p.batch = batch;
  p.n = n;
  if (modalities.size() > static_cast<size_t>(macer::kMaxStageModalities)) {
    throw std::invalid_argument("macer_kernels." + op + ": the number of selected modalities must be in [1, " +
                                std::to_string(macer::kMaxStageModalities) + "]");
  }
  p.num_modalities = static_cast<int>(modalities.size());
  for (size_t m = 0; m < modalities.size(); ++m) {
    p.modalities[m].label = std::get<0>(modalities[m]);
    p.modalities[m].keep = std::get<1>(modalities[m]);
    p.modalities[m].coverage_weight = std::get<2>(modalities[m]);
    p.modalities[m].coverage = std::get<3>(modalities[m]) ? 1 : 0;
  }
  p.keeps = ptr<const int32_t>(keeps);
  p.nonfinite = ptr<bool>(nonfinite);
  p.device = device;
  p.stream = stream_ptr(stream);
  p.pdl = pdl ? 1 : 0;
  macer::select_cta(p);
}

// (src, dst, outer, batch, row_units, unit_bytes, outer_stride, batch_stride, seq_stride, unit_stride), strides in
// bytes.
using CompactSpec = std::tuple<std::uintptr_t, std::uintptr_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                               int64_t, int64_t>;

// keep_rows: 0 for a 1-D keep [k], B for a 2-D keep [B, k] (see CompactParams).
void compact_many(const std::vector<CompactSpec>& specs, std::uintptr_t keep, int64_t keep_rows, int64_t k,
                  int device, std::uintptr_t stream) {
  macer::CompactParams p{};
  for (const auto& s : specs) {
    macer::CompactTensor t{};
    t.src = ptr<const void>(std::get<0>(s));
    t.dst = ptr<void>(std::get<1>(s));
    t.outer = std::get<2>(s);
    t.batch = std::get<3>(s);
    t.row_units = std::get<4>(s);
    t.unit_bytes = std::get<5>(s);
    t.outer_stride = std::get<6>(s);
    t.batch_stride = std::get<7>(s);
    t.seq_stride = std::get<8>(s);
    t.unit_stride = std::get<9>(s);
    p.tensors.push_back(t);
  }
  p.keep = ptr<const int64_t>(keep);
  p.keep_rows = keep_rows;
  p.k = k;
  p.device = device;
  p.stream = stream_ptr(stream);
  macer::compact_many(p);
}

// (src, dst, shape, strides, element_bytes, dim) per tensor: the descriptor is computed here, not in Python.
using CompactLayout =
    std::tuple<std::uintptr_t, std::uintptr_t, std::vector<int64_t>, std::vector<int64_t>, int64_t, int64_t>;

macer::CompactTensor describe(const CompactLayout& l, bool batched) {
  return macer::compact_descriptor(ptr<const void>(std::get<0>(l)), ptr<void>(std::get<1>(l)), std::get<2>(l),
                                   std::get<3>(l), std::get<4>(l), std::get<5>(l), batched);
}

void compact_layouts(const std::vector<CompactLayout>& layouts, std::uintptr_t keep, int64_t keep_rows, int64_t k,
                     int device, std::uintptr_t stream) {
  macer::CompactParams p{};
  p.tensors.reserve(layouts.size());
  for (const auto& l : layouts) p.tensors.push_back(describe(l, keep_rows > 0));
  p.keep = ptr<const int64_t>(keep);
  p.keep_rows = keep_rows;
  p.k = k;
  p.device = device;
  p.stream = stream_ptr(stream);
  macer::compact_many(p);
}

CompactSpec compact_descriptor(const CompactLayout& l, bool batched) {
  const macer::CompactTensor t = describe(l, batched);
  return {reinterpret_cast<std::uintptr_t>(t.src), reinterpret_cast<std::uintptr_t>(t.dst), t.outer, t.batch,
          t.row_units, t.unit_bytes, t.outer_stride, t.batch_stride, t.seq_stride, t.unit_stride};
}

py::dict device_report() {
  const macer::DeviceReport r = macer::device_report();
  py::dict d;
  d["count"] = r.count;
  d["error"] = r.error;
  d["capability"] = py::make_tuple(r.major, r.minor);
  d["runtime_version"] = r.runtime_version;
  d["driver_version"] = r.driver_version;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "macer_kernels CUDA kernels (torch-free: raw pointers, strides, dtype codes, stream as integers)";
  m.attr("MAX_MODALITIES") = macer::kMaxModalities;
  py::dict codes;
  codes["float32"] = static_cast<int>(macer::kFloat32);
  codes["float16"] = static_cast<int>(macer::kFloat16);
  codes["bfloat16"] = static_cast<int>(macer::kBFloat16);
  codes["float64"] = static_cast<int>(macer::kFloat64);
  codes["int8"] = static_cast<int>(macer::kInt8);
  codes["uint8"] = static_cast<int>(macer::kUInt8);
  codes["int16"] = static_cast<int>(macer::kInt16);
  codes["int32"] = static_cast<int>(macer::kInt32);
  codes["int64"] = static_cast<int>(macer::kInt64);
  m.attr("DTYPE_CODES") = codes;
  m.attr("MAX_COMPACT_TENSORS") = macer::kMaxCompactTensors;

  m.def("modality_scores", &modality_scores, "eq:macer_score on raw pointers (see csrc/launchers.h)",
        py::arg("query"), py::arg("key"), py::arg("modality"), py::arg("positions"), py::arg("out"),
        py::arg("workspace"), py::arg("counters"), py::arg("q_dtype"), py::arg("modality_dtype"),
        py::arg("positions_dtype"), py::arg("sizes"), py::arg("q_stride"), py::arg("k_stride"),
        py::arg("mod_stride"), py::arg("pos_stride"), py::arg("scale"), py::arg("eps"), py::arg("device"),
        py::arg("stream"), py::arg("path") = 0);
  m.def(
      "modality_scores_path",
      [](int q_dtype, const std::array<int64_t, 6>& sizes, const std::array<int64_t, 4>& q_stride,
         const std::array<int64_t, 3>& k_stride, std::uintptr_t key, int device, int path) {
        const macer::ModalityScoresParams p =
            scores_params(0, key, 0, 0, 0, 0, 0, q_dtype, macer::kInt64, macer::kInt64, sizes, q_stride, k_stride,
                          {0, 1}, {0, 1}, 1.0f, 0.0f, device, 0, path);
        return macer::modality_scores_path(p);
      },
      "(\"sa\" or \"sb\", why not S-B) for a call of this shape on `device` (may ask the device; launches nothing)",
      py::arg("q_dtype"), py::arg("sizes"), py::arg("q_stride"), py::arg("k_stride"), py::arg("key"),
      py::arg("device"), py::arg("path") = 0);
  m.def("modality_scores_workspace_bytes", &macer::modality_scores_workspace_bytes, py::arg("batch"),
        py::arg("q_heads"), py::arg("q_len"), py::arg("kv_heads"), py::arg("num_keys"));
  m.def("modality_scores_counter_count", &macer::modality_scores_counter_count, py::arg("batch"),
        py::arg("q_heads"), py::arg("q_len"), py::arg("kv_heads"));
  m.def("modality_scores_max_head_dim", &macer::modality_scores_max_head_dim);
  m.def(
      "modality_scores_split_plan",
      [](int64_t batch, int64_t kv_heads, int64_t row_tiles, int64_t num_keys, int64_t wave) {
        const macer::ScoresSplitPlan plan =
            macer::modality_scores_split_plan(batch, kv_heads, row_tiles, num_keys, wave);
        return std::make_tuple(plan.tiles, plan.splits, plan.split_tiles, plan.split_extra);
      },
      "(tiles, splits, split_tiles, split_extra) of the scoring tile kernel for a wave of CTAs (host arithmetic)",
      py::arg("batch"), py::arg("kv_heads"), py::arg("row_tiles"), py::arg("num_keys"), py::arg("wave"));
  m.def("modality_scores_split_begin", &macer::modality_scores_split_begin,
        "First key tile of a split (the kernel's split_begin)", py::arg("split"), py::arg("split_tiles"),
        py::arg("split_extra"));
  m.def("modality_scores_fragment", &macer::modality_scores_fragment,
        "(key in the tile, row in the row tile) of accumulator element e of a lane of a warp (the kernels' map)",
        py::arg("warp"), py::arg("lane"), py::arg("e"));
  m.def(
      "modality_scores_stream_k",
      [](std::uintptr_t key, std::uintptr_t out, int dtype, const std::array<int64_t, 4>& sizes,
         const std::array<int64_t, 3>& k_stride, int device, std::uintptr_t stream) {
        macer::StreamKParams p{};
        p.key = ptr<const void>(key);
        p.out = ptr<uint32_t>(out);
        p.dtype = dtype;
        p.batch = sizes[0];
        p.kv_heads = sizes[1];
        p.num_keys = sizes[2];
        p.head_dim = sizes[3];
        for (int i = 0; i < 3; ++i) p.k_stride[i] = k_stride[i];
        p.device = device;
        p.stream = stream_ptr(stream);
        return macer::modality_scores_stream_k(p);
      },
      "Read K [B, Hkv, N, D] once with the scoring tile kernel's loads (the benchmark's K-stream baseline)",
      py::arg("key"), py::arg("out"), py::arg("dtype"), py::arg("sizes"), py::arg("k_stride"), py::arg("device"),
      py::arg("stream"));
  m.def("modality_scores_stream_k_words", &macer::modality_scores_stream_k_words, py::arg("batch"),
        py::arg("kv_heads"), py::arg("num_keys"));
  m.def(
      "modality_scores_visible",
      [](const std::vector<int64_t>& keys, const std::vector<int64_t>& labels, int64_t num_keys,
         const std::vector<int64_t>& positions) {
        if (keys.size() != labels.size()) {
          throw std::invalid_argument("macer_kernels.modality_scores: keys and labels must have the same length");
        }
        std::vector<bool> visible;
        visible.reserve(positions.size() * keys.size());
        for (const int64_t pos : positions)
          for (size_t j = 0; j < keys.size(); ++j)
            visible.push_back(macer::modality_scores_key_visible(keys[j], num_keys, pos, labels[j]));
        return visible;
      },
      "The kernel's key_visible for each (row position, key): row-major [len(positions), len(keys)]",
      py::arg("keys"), py::arg("labels"), py::arg("num_keys"), py::arg("positions"));
  {
    py::dict constants;
    for (const auto& [name, value] : macer::modality_scores_constants()) constants[name.c_str()] = value;
    m.attr("MODALITY_SCORES_CONSTANTS") = constants;
  }
  m.def("select_workspace_bytes", &macer::select_workspace_bytes, py::arg("n"), py::arg("device"));
  m.def("topk_indices", &topk_indices, "Top-k indices, ties to the lower index, sorted ascending");
  m.def("coverage_select", &coverage_select, "eq:chunk_coverage_greedy without a k-step loop");
  m.def("select_cta", &select_cta,
        "Top-K / coverage selection of B rows in shared memory, one launch (see launchers.h); pdl: launch with "
        "programmatic stream serialization",
        py::arg("op"), py::arg("scores"), py::arg("scores_dtype"), py::arg("scores_stride"), py::arg("labels"),
        py::arg("labels_dtype"), py::arg("labels_stride"), py::arg("chunk_ids"), py::arg("chunk_dtype"),
        py::arg("chunk_stride"), py::arg("out"), py::arg("out_stride"), py::arg("out_len"), py::arg("batch"),
        py::arg("n"), py::arg("modalities"), py::arg("keeps"), py::arg("nonfinite"), py::arg("device"),
        py::arg("stream"), py::arg("pdl") = false);
  m.def("select_cta_max_n", &macer::select_cta_max_n,
        "Largest n select_cta takes on the device (one CTA, or a cluster on sm_90); wide: float64 scores",
        py::arg("device"), py::arg("coverage"), py::arg("wide") = true);
  m.def("select_cta_device_limits", &macer::select_cta_device_limits,
        "(dynamic shared memory per CTA, largest cluster) of the device, the plan's inputs", py::arg("device"));
  m.def(
      "select_cta_plan",
      [](int64_t n, bool coverage, bool wide, int64_t dynamic_bytes, int max_cluster) {
        const macer::SelectCtaPlan plan = macer::select_cta_plan(n, coverage, wide, dynamic_bytes, max_cluster);
        return std::make_tuple(plan.cluster, plan.cap, plan.layout, plan.table, plan.bytes);
      },
      "(cluster, tokens per CTA, layout, table entries, dynamic bytes) of a row of n tokens (host arithmetic; "
      "cluster 0: it does not fit)",
      py::arg("n"), py::arg("coverage"), py::arg("wide"), py::arg("dynamic_bytes"), py::arg("max_cluster"));
  {
    py::dict constants;
    for (const auto& [name, value] : macer::select_cta_constants()) constants[name.c_str()] = value;
    m.attr("SELECT_CTA_CONSTANTS") = constants;
  }
  m.def("select_cta_max_n_for", &macer::select_cta_max_n_for,
        "select_cta_max_n for a given number of dynamic shared-memory bytes and largest cluster (host arithmetic)",
        py::arg("dynamic_bytes"), py::arg("coverage"), py::arg("wide") = false, py::arg("max_cluster") = 1);
  m.def("select_descending_key32", &macer::select_descending_key32,
        "The kernels' descending order key of a float32 given by its bits", py::arg("float_bits"));
  m.def("select_descending_key64", &macer::select_descending_key64,
        "The kernels' descending order key of a float64 given by its bits", py::arg("double_bits"));
  m.attr("MAX_STAGE_MODALITIES") = macer::kMaxStageModalities;
  m.def("compact_many", &compact_many, "One gather launch per group of up to MAX_COMPACT_TENSORS tensors");
  m.def("compact_layouts", &compact_layouts,
        "compact_many from (src, dst, shape, strides, element_bytes, dim) per tensor: descriptors built here");
  m.def("compact_descriptor", &compact_descriptor, "The CompactSpec tuple compact_layouts builds for one layout",
        py::arg("layout"), py::arg("batched") = false);
  m.def("device_report", &device_report, "CUDA device count, error, capability, runtime and driver versions");
  m.def("compiled_archs", &macer::compiled_archs, "SM versions with SASS in this module");
  m.def("ptx_arch", &macer::ptx_arch, "SM version of the embedded PTX");
  macer_bind_stage(m);
}
