// Skinny bf16 matmul for decode on CPUs with AVX512-BF16.
//
// y[M, N] = x[M, K] @ w[N, K]^T for small M (decode batches): every weight row
// is read from memory once and dotted with all M activation rows while it sits
// in L1, with fp32 accumulation (vdpbf16ps). Decode is bound by reading the
// weights, so this is what sets single-stream speed.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int kRows = 16;  // weight rows per parallel work item

inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

// Rows [n0, n1) of y, for M <= 4 activation rows. Weight rows are walked in
// memory order (one sequential stream the prefetcher follows), each dotted
// with every activation row; two accumulators per row break the add chain.
template <int kM>
inline void row_dot(const uint16_t* x, const uint16_t* wr, uint16_t* y, int64_t K, int64_t N, int64_t m0,
                    int64_t n) {
  __m512 a0[kM], a1[kM];
  for (int j = 0; j < kM; ++j) a0[j] = a1[j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k);
    __m512bh w1 = (__m512bh)_mm512_loadu_si512(wr + k + 32);
    for (int j = 0; j < kM; ++j) {
      a0[j] = _mm512_dpbf16_ps(a0[j], w0, (__m512bh)_mm512_loadu_si512(x + (m0 + j) * K + k));
      a1[j] = _mm512_dpbf16_ps(a1[j], w1, (__m512bh)_mm512_loadu_si512(x + (m0 + j) * K + k + 32));
    }
  }
  for (; k < K; k += 32) {
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k);
    for (int j = 0; j < kM; ++j)
      a0[j] = _mm512_dpbf16_ps(a0[j], w0, (__m512bh)_mm512_loadu_si512(x + (m0 + j) * K + k));
  }
  for (int j = 0; j < kM; ++j) y[(m0 + j) * N + n] = to_bf16(hsum(_mm512_add_ps(a0[j], a1[j])));
}

void rows(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t M, int64_t K, int64_t N,
          int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * K;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) row_dot<4>(x, wr, y, K, N, m, n);
    for (; m < M; ++m) row_dot<1>(x, wr, y, K, N, m, n);
  }
}

}  // namespace

torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shapes");
  TORCH_CHECK(x.size(1) % 32 == 0, "K must be a multiple of 32");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto y = torch::empty({M, N}, xc.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t blocks = (N + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    rows(xp, wp, yp, M, K, N, b0 * kRows, std::min<int64_t>(b1 * kRows, N));
  });
  return y;
}

torch::Tensor add_rms_norm(torch::Tensor x, const torch::Tensor& delta, const torch::Tensor& w, double eps);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
void rope_(torch::Tensor qk, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions);
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables,
                                     const torch::Tensor& lens, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv_bf16", &gemv_bf16);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("rope_", &rope_);
  m.def("paged_decode_attention", &paged_decode_attention);
}
