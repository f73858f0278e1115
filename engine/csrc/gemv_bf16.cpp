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

constexpr int kRows = 4;  // weight rows per inner iteration

inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

// Rows [n0, n1) of y. Activations are taken kM at a time so each weight
// vector loaded is used kM times from registers (4 x 4 accumulators).
template <int kM>
inline void tile(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t K, int64_t N, int64_t m0,
                 int64_t n, int64_t nr) {
  __m512 acc[kRows][kM];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kM; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh xv[kM];
    for (int j = 0; j < kM; ++j) xv[j] = (__m512bh)_mm512_loadu_si512(x + (m0 + j) * K + k);
    for (int r = 0; r < kRows; ++r) {
      if (r >= nr) break;
      __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (n + r) * K + k);
      for (int j = 0; j < kM; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv, xv[j]);
    }
  }
  for (int r = 0; r < nr; ++r)
    for (int j = 0; j < kM; ++j) y[(m0 + j) * N + n + r] = to_bf16(hsum(acc[r][j]));
}

void rows(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t M, int64_t K, int64_t N,
          int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += kRows) {
    const int64_t nr = std::min<int64_t>(kRows, N - n);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) tile<4>(x, w, y, K, N, m, n, nr);
    for (; m < M; ++m) tile<1>(x, w, y, K, N, m, n, nr);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("gemv_bf16", &gemv_bf16); }
