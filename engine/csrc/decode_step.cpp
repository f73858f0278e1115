// The whole decoder stack for a batch of decode tokens in one native call.
//
// A decode step on a CPU runs ~15 small ops per layer; through Python and
// torch's dispatcher each costs microseconds that add up to a large part of
// a step for a small model. FusedDecoder holds the weights once and runs every
// layer (QKV projection, q/k norm, rotary, KV write, paged attention, output
// projection, residual + RMSNorm, MLP) into preallocated buffers with the GIL
// released. It computes exactly what engine/model.py computes with the native
// per-op kernels, in the same order and with the same bf16 roundings.
#include <torch/extension.h>

#include <cstring>
#include <vector>

#include "ops.h"

namespace kvrelay {

struct LayerWeights {
  torch::Tensor in_norm, post_norm, qkv_w, qkv_b, o_w, gate_up_w, down_w, q_norm, k_norm;
};

class FusedDecoder {
 public:
  // layers: per layer [in_norm, post_norm, qkv_w, qkv_b, o_w, gate_up_w, down_w, q_norm, k_norm],
  // an empty tensor for an absent one (qkv_b, q_norm, k_norm); the four matmul
  // weights packed (matmul_bf16.cpp), the rest plain.
  FusedDecoder(const std::vector<std::vector<torch::Tensor>>& layers, torch::Tensor final_norm, torch::Tensor cos,
               torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
               double scale)
      : final_norm_(std::move(final_norm)), cos_(std::move(cos)), sin_(std::move(sin)), nh_(num_heads),
        nkv_(num_kv_heads), hd_(head_dim), eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)) {
    auto opt = [](const torch::Tensor& t) { return t.numel() ? t : torch::Tensor(); };
    for (const auto& l : layers) {
      TORCH_CHECK(l.size() == 9, "FusedDecoder: 9 tensors per layer");
      for (const auto& t : l)
        TORCH_CHECK(!t.numel() || (t.scalar_type() == at::kBFloat16 && t.is_contiguous()),
                    "FusedDecoder: weights must be contiguous bf16");
      layers_.push_back({l[0], l[1], l[2], opt(l[3]), l[4], l[5], l[6], opt(l[7]), opt(l[8])});
    }
    TORCH_CHECK(!layers_.empty(), "FusedDecoder: no layers");
    hidden_ = layers_[0].in_norm.size(0);
    inter_ = layers_[0].down_w.size(1) * 2;
    const int64_t H = hidden_, nq = nh_ * hd_, nqkv = nq + 2 * nkv_ * hd_;
    for (const auto& L : layers_) {
      check_packed(L.qkv_w, nqkv, H, "FusedDecoder qkv_w");
      check_packed(L.o_w, H, nq, "FusedDecoder o_w");
      check_packed(L.gate_up_w, 2 * inter_, H, "FusedDecoder gate_up_w");
      check_packed(L.down_w, H, inter_, "FusedDecoder down_w");
    }
  }

  // x: [M, H] embeddings of the M decode tokens (bf16); returns the final
  // normed hidden states [M, H]. positions, slot_blocks, slot_offsets: [M];
  // tables [M, maxnb] and lens [M] (context including the new token), int64.
  torch::Tensor forward(const torch::Tensor& x_in, const torch::Tensor& positions, const torch::Tensor& slot_blocks,
                        const torch::Tensor& slot_offsets, const torch::Tensor& tables, const torch::Tensor& lens,
                        const std::vector<torch::Tensor>& kv_caches, int64_t threads_in) {
    const int64_t M = x_in.size(0), H = hidden_, I = inter_;
    TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && x_in.dim() == 2 && x_in.size(1) == H, "x: [M, hidden] bf16");
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache per layer");
    for (const auto* t : {&positions, &slot_blocks, &slot_offsets, &tables, &lens})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->size(0) == M, "int64 metadata, M rows");
    const int threads = static_cast<int>(threads_in);
    const int64_t nq = nh_ * hd_, nkvd = nkv_ * hd_, nqkv = nq + 2 * nkvd;
    auto opts = x_in.options();
    torch::Tensor x = x_in.contiguous().clone();
    torch::Tensor h = torch::empty({M, H}, opts), qkv = torch::empty({M, nqkv}, opts);
    torch::Tensor attn = torch::empty({M, nq}, opts), proj = torch::empty({M, H}, opts);
    torch::Tensor gu = torch::empty({M, 2 * I}, opts), act = torch::empty({M, I}, opts);
    bf16 *xp = x.data_ptr<bf16>(), *hp = h.data_ptr<bf16>(), *qkvp = qkv.data_ptr<bf16>();
    bf16 *attnp = attn.data_ptr<bf16>(), *projp = proj.data_ptr<bf16>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* sb = slot_blocks.data_ptr<int64_t>();
    const int64_t* so = slot_offsets.data_ptr<int64_t>();
    const int64_t* tab = tables.data_ptr<int64_t>();
    const int64_t* len = lens.data_ptr<int64_t>();
    const bf16* cosp = cos_.data_ptr<bf16>();
    const bf16* sinp = sin_.data_ptr<bf16>();

    add_rms_norm(xp, nullptr, layers_[0].in_norm.data_ptr<bf16>(), hp, M, H, eps_, threads);
    for (size_t li = 0; li < layers_.size(); ++li) {
      const LayerWeights& L = layers_[li];
      const torch::Tensor& kv = kv_caches[li];
      TORCH_CHECK(kv.scalar_type() == at::kBFloat16 && kv.is_contiguous() && kv.dim() == 5, "KV cache layout");
      linear(h, L.qkv_w, qkv, nqkv, threads);
      if (L.qkv_b.defined()) qkv.add_(L.qkv_b);  // rounded to bf16, as the unfused model adds it
      if (L.q_norm.defined()) {
        head_rms_norm(qkvp, nqkv, M, nh_, hd_, L.q_norm.data_ptr<bf16>(), eps_, threads);
        head_rms_norm(qkvp + nq, nqkv, M, nkv_, hd_, L.k_norm.data_ptr<bf16>(), eps_, threads);
      }
      rope(qkvp, nqkv, hd_, M, nh_ + nkv_, hd_, cosp, sinp, pos, threads);
      // this token's key and value into its slot: kv[block, 0|1, offset]
      bf16* kvp = kv.data_ptr<bf16>();
      const int64_t BS = kv.size(2), kv_half = BS * nkvd;
      for (int64_t t = 0; t < M; ++t) {
        bf16* slot = kvp + sb[t] * 2 * kv_half + so[t] * nkvd;
        std::memcpy(slot, qkvp + t * nqkv + nq, nkvd * sizeof(bf16));
        std::memcpy(slot + kv_half, qkvp + t * nqkv + nq + nkvd, nkvd * sizeof(bf16));
      }
      decode_attention(qkvp, nqkv, kvp, BS, nkv_, tab, tables.size(1), len, attnp, nq, M, nh_, hd_, scale_,
                       threads);
      linear(attn, L.o_w, proj, H, threads);
      add_rms_norm(xp, projp, L.post_norm.data_ptr<bf16>(), hp, M, H, eps_, threads);
      linear(h, L.gate_up_w, gu, 2 * I, threads);
      silu_mul(gu.data_ptr<bf16>(), act.data_ptr<bf16>(), M, I, threads);
      linear(act, L.down_w, proj, H, threads);
      const torch::Tensor& next = li + 1 < layers_.size() ? layers_[li + 1].in_norm : final_norm_;
      add_rms_norm(xp, projp, next.data_ptr<bf16>(), hp, M, H, eps_, threads);
    }
    return h;
  }

 private:
  // y [M, N] = x [M, K] @ W^T, W packed: the kernel the per-op path runs (NativeOps.linear).
  static void linear(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& y, int64_t N, int threads) {
    matmul_packed(x.data_ptr<bf16>(), w.data_ptr<bf16>(), y.data_ptr<bf16>(), x.size(0), x.size(1), N, threads);
  }

  std::vector<LayerWeights> layers_;
  torch::Tensor final_norm_, cos_, sin_;
  int64_t nh_, nkv_, hd_;
  float eps_, scale_;
  int64_t hidden_ = 0, inter_ = 0;
};

}  // namespace kvrelay

torch::Tensor linear_packed(const torch::Tensor& x, const torch::Tensor& w, int64_t n, bool f32_out,
                            int64_t threads);
torch::Tensor packed_rows(const torch::Tensor& w, const torch::Tensor& ids, int64_t n, int64_t k, int64_t threads);
torch::Tensor add_rms_norm(torch::Tensor x, const c10::optional<torch::Tensor>& delta, const torch::Tensor& w,
                           double eps, int64_t threads);
torch::Tensor silu_mul(const torch::Tensor& gate_up, int64_t threads);
void rope_(torch::Tensor qk, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions,
           int64_t threads);
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables,
                                     const torch::Tensor& lens, double scale, int64_t threads);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using release = py::call_guard<py::gil_scoped_release>;
  auto t = py::arg("threads") = -1;  // -1: torch's intra-op thread count
  m.attr("isa") = KVRELAY_ISA_NAME;  // the instruction set this module is compiled for (isa.h)
  m.def("linear_packed", &linear_packed, py::arg("x"), py::arg("w"), py::arg("n"), py::arg("f32_out") = false, t,
        release());
  m.def("packed_rows", &packed_rows, py::arg("w"), py::arg("ids"), py::arg("n"), py::arg("k"), t, release());
  m.def("add_rms_norm", &add_rms_norm, py::arg("x"), py::arg("delta"), py::arg("w"), py::arg("eps"), t, release());
  m.def("silu_mul", &silu_mul, py::arg("gate_up"), t, release());
  m.def("rope_", &rope_, py::arg("qk"), py::arg("cos"), py::arg("sin"), py::arg("positions"), t, release());
  m.def("paged_decode_attention", &paged_decode_attention, py::arg("q"), py::arg("kv"), py::arg("tables"),
        py::arg("lens"), py::arg("scale"), t, release());
  py::class_<kvrelay::FusedDecoder>(m, "FusedDecoder", py::module_local())
      .def(py::init<const std::vector<std::vector<torch::Tensor>>&, torch::Tensor, torch::Tensor, torch::Tensor,
                    int64_t, int64_t, int64_t, double, double>())
      .def("forward", &kvrelay::FusedDecoder::forward, release());
}
