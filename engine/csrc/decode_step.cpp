// The whole decoder stack for a batch of decode tokens in one native call.
//
// A decode step on a CPU runs ~15 small ops per layer; through Python and
// torch's dispatcher each costs microseconds that add up to a large part of
// a step for a small model. FusedDecoder holds the weights once and runs every
// layer (QKV projection, q/k norm, rotary, KV write, paged attention, output
// projection, residual + RMSNorm, MLP) into preallocated buffers with the GIL
// released. It computes exactly what engine/model.py computes with the native
// per-op kernels, in the same order and with the same roundings: bf16
// activations on packed bf16 weights (FusedDecoder), or fp32 activations on
// quantized weights (QuantFusedDecoder, quant.h), which a step reads as they
// are stored: for the default model's Q4_1 layers, 5 bits a weight.
#include <torch/extension.h>

#include <atomic>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "quant.h"

namespace kvrelay {

// Whether a fused step of more than one thread runs as one team (ops.h Team), and how many bytes of
// its share of the next matrix a rank fetches while it waits at a barrier; else each op forks and
// joins its threads (engine.decode_team_bench compares them).
std::atomic<bool> g_team{true};
std::atomic<int64_t> g_team_fetch{64 << 10};
constexpr int64_t kMaxTeamFetch = 1 << 20;

void set_decode_team(bool enabled, int64_t fetch_bytes) {
  TORCH_CHECK(fetch_bytes >= 0 && fetch_bytes <= kMaxTeamFetch && fetch_bytes % 64 == 0,
              "set_decode_team: fetch_bytes must be a multiple of 64 from 0 to ", kMaxTeamFetch, ", not ",
              fetch_bytes);
  g_team.store(enabled);
  g_team_fetch.store(fetch_bytes);
}

std::tuple<bool, int64_t> decode_team() { return {g_team.load(), g_team_fetch.load()}; }

// The four matmul weights of a layer, one of two kinds:
struct PackedMat {  // bf16, packed (matmul_bf16.cpp): the bf16 model
  torch::Tensor w;
  int64_t n = 0, k = 0;
  const bf16* p = nullptr;  // w's data, read once here: a step reads it from this struct, not from w's TensorImpl,
                            // which the weights streamed since the last step have pushed out of cache
  void check(int64_t n_, int64_t k_, const char* what) {
    check_packed(w, n_, k_, what);
    n = n_, k = k_, p = w.data_ptr<bf16>();
  }
  void operator()(const bf16* x, bf16* y, int64_t M, int threads) const { matmul_packed(x, p, y, M, k, n, threads); }
  // output blocks [b0, b1) on the calling thread; the bytes those blocks' weights start at, a block's
  void blocks(const bf16* x, bf16* y, int64_t M, int64_t b0, int64_t b1) const {
    matmul_packed_blocks(x, p, y, M, k, n, b0, b1);
  }
  const void* block_bytes(int64_t b) const { return p + b * k * kPackedCols; }
  int64_t bytes_per_block() const { return k * kPackedCols * static_cast<int64_t>(sizeof(bf16)); }
  int64_t nblocks() const { return (n + kPackedCols - 1) / kPackedCols; }
};
struct QuantMat {  // quantized (quant.h), fp32 activations: the quantized model
  torch::Tensor q, scales, mins, scale_d, min_d, grid;
  int64_t bits = 0;
  QuantMatrix mat{};
  int64_t block_words = 0;  // code words of a block of 32 columns
  void check(int64_t n_, int64_t k_, const char* what) {
    mat = quant_matrix(q, scales, mins, scale_d, min_d, n_, k_, bits, what, grid);
    block_words = q.size(1) * kPackedCols;
  }
  void operator()(const float* x, float* y, int64_t M, int threads) const { matmul_quant(x, mat, y, M, threads); }
  void blocks(const float* x, float* y, int64_t M, int64_t b0, int64_t b1) const {
    matmul_quant(x, mat, y, M, 1, b0, b1);
  }
  const void* block_bytes(int64_t b) const { return mat.q + b * block_words; }  // (the codes)
  int64_t bytes_per_block() const { return block_words * static_cast<int64_t>(sizeof(int32_t)); }
  int64_t nblocks() const { return (mat.n + kPackedCols - 1) / kPackedCols; }
};

template <class E, class Mat>
class FusedDecoder {
 public:
  struct Layer {
    torch::Tensor in_norm, post_norm, qkv_b, q_norm, k_norm;  // qkv_b, q_norm, k_norm: undefined where absent
    Mat qkv, o, gate_up, down;
    const E *in_p = nullptr, *post_p = nullptr, *qn_p = nullptr, *kn_p = nullptr;  // the norms' data (as PackedMat::p)
  };

  FusedDecoder(std::vector<Layer> layers, torch::Tensor final_norm, torch::Tensor cos, torch::Tensor sin,
               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t inter, double eps, double scale)
      : layers_(std::move(layers)), final_norm_(std::move(final_norm)), cos_(std::move(cos)), sin_(std::move(sin)),
        nh_(num_heads), nkv_(num_kv_heads), hd_(head_dim), eps_(static_cast<float>(eps)),
        scale_(static_cast<float>(scale)) {
    TORCH_CHECK(!layers_.empty(), "FusedDecoder: no layers");
    for (const auto& L : layers_)
      for (const torch::Tensor* t : {&L.in_norm, &L.post_norm, &L.qkv_b, &L.q_norm, &L.k_norm})
        TORCH_CHECK(!t->defined() || (t->scalar_type() == kType && t->is_contiguous()),
                    "FusedDecoder: norms and biases must be contiguous ", kType);
    hidden_ = layers_[0].in_norm.size(0);
    inter_ = inter;
    const int64_t H = hidden_, nq = nh_ * hd_, nqkv = nq + 2 * nkv_ * hd_;
    for (auto& L : layers_) {
      L.in_p = L.in_norm.template data_ptr<E>(), L.post_p = L.post_norm.template data_ptr<E>();
      if (L.q_norm.defined()) L.qn_p = L.q_norm.template data_ptr<E>(), L.kn_p = L.k_norm.template data_ptr<E>();
      L.qkv.check(nqkv, H, "FusedDecoder qkv_w");
      L.o.check(H, nq, "FusedDecoder o_w");
      L.gate_up.check(2 * inter_, H, "FusedDecoder gate_up_w");
      L.down.check(H, inter_, "FusedDecoder down_w");
    }
  }

  // x: [M, H] embeddings of the M decode tokens (E), or a previous pipeline
  // stage's residual stream; returns the final normed hidden states [M, H], or
  // with an empty final norm (a pipeline stage before the last) the residual
  // stream after its last layer. positions, slot_blocks, slot_offsets: [M];
  // tables [M, maxnb] and lens [M] (context including the new token), int64.
  torch::Tensor forward(const torch::Tensor& x_in, const torch::Tensor& positions, const torch::Tensor& slot_blocks,
                        const torch::Tensor& slot_offsets, const torch::Tensor& tables, const torch::Tensor& lens,
                        const std::vector<torch::Tensor>& kv_caches, int64_t threads_in) {
    const int64_t M = x_in.size(0), H = hidden_, I = inter_;
    TORCH_CHECK(x_in.scalar_type() == kType && x_in.dim() == 2 && x_in.size(1) == H, "x: [M, hidden] ", kType);
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache per layer");
    for (const auto* t : {&positions, &slot_blocks, &slot_offsets, &tables, &lens})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->size(0) == M, "int64 metadata, M rows");
    for (const auto& kv : kv_caches)
      TORCH_CHECK(kv.scalar_type() == kType && kv.is_contiguous() && kv.dim() == 5, "KV cache layout");
    const int threads = static_cast<int>(std::max<int64_t>(threads_in, 1));
    // a team (ops.h) runs the step when set and there are threads for one; else each op forks and joins
    const int64_t ranks = g_team.load(std::memory_order_relaxed) ? threads : 1;
    const int op_threads = ranks > 1 ? 1 : threads;  // the threads each op takes
    const int64_t nq = nh_ * hd_, nkvd = nkv_ * hd_, nqkv = nq + 2 * nkvd;
    auto opts = x_in.options();
    // what each rank keeps its own copy of (the residual stream, the normed rows, the MLP's activations),
    // and what the ranks share (what matmuls and attention write, a share of the columns each)
    torch::Tensor x = x_in.contiguous().unsqueeze(0).repeat({ranks, 1, 1});
    torch::Tensor h = torch::empty({ranks, M, H}, opts), act = torch::empty({ranks, M, I}, opts);
    torch::Tensor qkv = torch::empty({M, nqkv}, opts), attn = torch::empty({M, nq}, opts);
    torch::Tensor proj = torch::empty({M, H}, opts), gu = torch::empty({M, 2 * I}, opts);
    E *x0 = x.data_ptr<E>(), *h0 = h.data_ptr<E>(), *act0 = act.data_ptr<E>();
    E *qkvp = qkv.data_ptr<E>(), *attnp = attn.data_ptr<E>(), *projp = proj.data_ptr<E>(), *gup = gu.data_ptr<E>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* sb = slot_blocks.data_ptr<int64_t>();
    const int64_t* so = slot_offsets.data_ptr<int64_t>();
    const E* cosp = cos_.data_ptr<E>();
    const E* sinp = sin_.data_ptr<E>();
    DecodeAttention<E> attention(lens.data_ptr<int64_t>(), M, nh_, nkv_, hd_, threads);
    typename DecodeAttention<E>::Args at_args{qkvp, nqkv, nullptr, 0, nkv_, tables.data_ptr<int64_t>(), tables.size(1),
                                              attnp, nq, scale_};
    const bool residual_out = final_norm_.numel() == 0;
    const E* final_p = residual_out ? nullptr : final_norm_.template data_ptr<E>();
    const int64_t fetch = g_team_fetch.load(std::memory_order_relaxed);

    Team::run(static_cast<int>(ranks), [&](Team& team) {
      E* xp = x0 + team.rank * M * H;
      E* hp = h0 + team.rank * M * H;
      E* actp = act0 + team.rank * M * I;
      // y = x @ W^T: this rank's share of the blocks, then every rank's, waiting for which it
      // fetches the start of its share of `next`, the matrix it reads next (null: none)
      auto matmul = [&](const Mat& w, const E* in, E* out, const Mat* next) {
        if (team.size == 1) return w(in, out, M, op_threads);
        const auto [b0, b1] = team.share(w.nblocks());
        w.blocks(in, out, M, b0, b1);
        after(team, next, fetch);
      };
      add_rms_norm(xp, nullptr, layers_[0].in_p, hp, M, H, eps_, op_threads);
      for (size_t li = 0; li < layers_.size(); ++li) {
        const Layer& L = layers_[li];
        E* kvp = kv_caches[li].data_ptr<E>();
        const int64_t BS = kv_caches[li].size(2);  // tokens a cache block holds
        matmul(L.qkv, hp, qkvp, &L.o);
        if (team.rank == 0) {  // the new token's q and k, rotated, and its k and v into the cache: one rank
          if (L.qkv_b.defined()) qkv.add_(L.qkv_b);  // rounded to E, as the unfused model adds it
          if (L.q_norm.defined()) {
            head_rms_norm(qkvp, nqkv, M, nh_, hd_, L.qn_p, eps_, op_threads);
            head_rms_norm(qkvp + nq, nqkv, M, nkv_, hd_, L.kn_p, eps_, op_threads);
          }
          rope(qkvp, nqkv, hd_, M, nh_ + nkv_, hd_, cosp, sinp, pos, op_threads);
          // this token's key and value into its slot: kv[block, 0|1, offset]
          const int64_t kv_half = BS * nkvd;
          for (int64_t t = 0; t < M; ++t) {
            E* slot = kvp + sb[t] * 2 * kv_half + so[t] * nkvd;
            std::memcpy(slot, qkvp + t * nqkv + nq, nkvd * sizeof(E));
            std::memcpy(slot + kv_half, qkvp + t * nqkv + nq + nkvd, nkvd * sizeof(E));
          }
        }
        after(team, &L.o, fetch);
        auto args = at_args;
        args.kv = kvp, args.BS = BS;
        if (team.size == 1) {
          par_for(attention.size(), 1, op_threads, [&](int64_t a, int64_t b) { attention.run(args, a, b); });
          attention.merge(args);
        } else {
          const auto [a, b] = team.share(attention.size());
          attention.run(args, a, b);
          if (attention.has_parts()) {
            team.barrier();
            if (team.rank == 0) attention.merge(args);
          }
          after(team, &L.o, fetch);
        }
        matmul(L.o, attnp, projp, &L.gate_up);
        add_rms_norm(xp, projp, L.post_p, hp, M, H, eps_, op_threads);
        matmul(L.gate_up, hp, gup, &L.down);
        silu_mul(gup, actp, M, I, op_threads);
        matmul(L.down, actp, projp, li + 1 < layers_.size() ? &layers_[li + 1].qkv : nullptr);
        // (no final norm: x += proj all the same; the h normed with layer 0's weight goes unused)
        const E* next = li + 1 < layers_.size() ? layers_[li + 1].in_p : residual_out ? layers_[0].in_p : final_p;
        add_rms_norm(xp, projp, next, hp, M, H, eps_, op_threads);
      }
    });
    return (residual_out ? x : h)[0];
  }

 private:
  // The barrier that ends a team's op (size > 1), fetching meanwhile up to `fetch` bytes of this
  // rank's share of matrix `next`.
  static void after(Team& team, const Mat* next, int64_t fetch) {
    if (team.size == 1) return;
    if (!next || fetch <= 0) return team.barrier();
    const auto [b0, b1] = team.share(next->nblocks());
    team.barrier(next->block_bytes(b0), std::min(fetch, (b1 - b0) * next->bytes_per_block()));
  }

  static constexpr at::ScalarType kType = std::is_same_v<E, float> ? at::kFloat : at::kBFloat16;
  std::vector<Layer> layers_;
  torch::Tensor final_norm_, cos_, sin_;
  int64_t nh_, nkv_, hd_;
  float eps_, scale_;
  int64_t hidden_ = 0, inter_ = 0;
};

using Bf16Decoder = FusedDecoder<bf16, PackedMat>;
using QuantDecoder = FusedDecoder<float, QuantMat>;

namespace {
torch::Tensor opt(const torch::Tensor& t) { return t.numel() ? t : torch::Tensor(); }
}  // namespace

// layers: per layer [in_norm, post_norm, qkv_w, qkv_b, o_w, gate_up_w, down_w, q_norm, k_norm],
// an empty tensor for an absent one (qkv_b, q_norm, k_norm); the four matmul
// weights packed (matmul_bf16.cpp), the rest plain bf16.
Bf16Decoder* make_bf16_decoder(const std::vector<std::vector<torch::Tensor>>& layers, torch::Tensor final_norm,
                               torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, double eps, double scale) {
  std::vector<Bf16Decoder::Layer> ls;
  for (const auto& l : layers) {
    TORCH_CHECK(l.size() == 9, "FusedDecoder: 9 tensors per layer");
    for (size_t i : {2, 4, 5, 6}) TORCH_CHECK(l[i].scalar_type() == at::kBFloat16, "FusedDecoder: bf16 weights");
    ls.push_back({l[0], l[1], opt(l[3]), opt(l[7]), opt(l[8]), {l[2]}, {l[4]}, {l[5]}, {l[6]}});
  }
  TORCH_CHECK(!ls.empty(), "FusedDecoder: no layers");
  const int64_t inter = ls[0].down.w.size(1) * 2;
  return new Bf16Decoder(std::move(ls), std::move(final_norm), std::move(cos), std::move(sin), num_heads,
                         num_kv_heads, head_dim, inter, eps, scale);
}

// layers: per layer [in_norm, post_norm, qkv_b, q_norm, k_norm] (fp32; empty where absent), then
// (codes, scales, mins, scale_d, min_d, grid) of qkv_w, o_w, gate_up_w and down_w (engine/quant.py
// QuantWeight.tensors);
// bits: per layer the four matrices' code widths.
QuantDecoder* make_quant_decoder(const std::vector<std::vector<torch::Tensor>>& layers,
                                 const std::vector<std::vector<int64_t>>& bits, torch::Tensor final_norm,
                                 torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t intermediate, double eps, double scale) {
  TORCH_CHECK(layers.size() == bits.size(), "QuantFusedDecoder: code widths for every layer");
  std::vector<QuantDecoder::Layer> ls;
  for (size_t li = 0; li < layers.size(); ++li) {
    const auto& l = layers[li];
    TORCH_CHECK(l.size() == 29 && bits[li].size() == 4, "QuantFusedDecoder: 29 tensors and 4 widths per layer");
    auto mat = [&](int i) {
      const size_t a = 5 + 6 * i;
      return QuantMat{l[a], l[a + 1], l[a + 2], l[a + 3], l[a + 4], l[a + 5], bits[li][i]};
    };
    ls.push_back({l[0], l[1], opt(l[2]), opt(l[3]), opt(l[4]), mat(0), mat(1), mat(2), mat(3)});
  }
  return new QuantDecoder(std::move(ls), std::move(final_norm), std::move(cos), std::move(sin), num_heads,
                          num_kv_heads, head_dim, intermediate, eps, scale);
}

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
torch::Tensor linear_quant(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                           const torch::Tensor& mins, int64_t n, int64_t bits, int64_t threads,
                           const c10::optional<torch::Tensor>& scale_d, const c10::optional<torch::Tensor>& min_d,
                           const c10::optional<torch::Tensor>& grid);

torch::Tensor quant_rows(const torch::Tensor& q, const torch::Tensor& scales, const torch::Tensor& mins,
                         const torch::Tensor& ids, int64_t n, int64_t bits, const c10::optional<torch::Tensor>& scale_d,
                         const c10::optional<torch::Tensor>& min_d, const c10::optional<torch::Tensor>& grid);

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
  // scale_d, min_d: the factors of int8 scale and minimum codes; grid: the values 4-bit indices stand
  // for (engine/quant.py QuantWeight)
  m.def("linear_quant", &linear_quant, py::arg("x"), py::arg("q"), py::arg("scales"), py::arg("mins"), py::arg("n"),
        py::arg("bits"), t, py::arg("scale_d") = py::none(), py::arg("min_d") = py::none(),
        py::arg("grid") = py::none(), release());
  m.def("quant_rows", &quant_rows, py::arg("q"), py::arg("scales"), py::arg("mins"), py::arg("ids"), py::arg("n"),
        py::arg("bits"), py::arg("scale_d") = py::none(), py::arg("min_d") = py::none(), py::arg("grid") = py::none(),
        release());
  // how bf16 matmuls of decode rows stream their weights (matmul_bf16.cpp; engine.decode_stream_bench)
  m.def("set_bf16_decode_stream", &kvrelay::set_decode_stream, py::arg("chunks_per_thread"),
        py::arg("prefetch_next_from"), py::arg("prefetch_ahead") = 0);
  m.def("bf16_decode_stream", &kvrelay::decode_stream);
  m.def("default_bf16_decode_stream", &kvrelay::default_decode_stream);
  // whether a fused decode step of several threads runs as one team (decode_step.cpp), for every weight format
  m.def("set_decode_team", &kvrelay::set_decode_team, py::arg("enabled"), py::arg("fetch_bytes") = 64 << 10);
  m.def("decode_team", &kvrelay::decode_team);
  py::class_<kvrelay::Bf16Decoder>(m, "FusedDecoder", py::module_local())
      .def(py::init(&kvrelay::make_bf16_decoder))
      .def("forward", &kvrelay::Bf16Decoder::forward, release());
  py::class_<kvrelay::QuantDecoder>(m, "QuantFusedDecoder", py::module_local())
      .def(py::init(&kvrelay::make_quant_decoder))
      .def("forward", &kvrelay::QuantDecoder::forward, release());
}
