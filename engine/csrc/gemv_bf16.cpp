// Skinny bf16 matmul for decode on CPUs with AVX512-BF16.
//
// y[M, N] = x[M, K] @ w[N, K]^T for small M (decode batches): every weight row
// is read from memory once and dotted with all M activation rows while it sits
// in L1, with fp32 accumulation (vdpbf16ps). Decode is bound by reading the
// weights, so this is what sets single-stream speed. Each thread walks its
// weight rows in memory order, one row at a time: one sequential stream per
// core is what the hardware prefetcher follows at full bandwidth (four
// interleaved row streams ran at half of it on the machine measured).
#include <torch/extension.h>
#include <immintrin.h>

#include <cstring>

#include "ops.h"

namespace kvrelay {
namespace {

constexpr int kRows = 16;  // weight rows per parallel work item

inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

inline void store(bf16* y, float v) { y[0] = bf16(v); }  // round to nearest even
inline void store(float* y, float v) { y[0] = v; }

// Row n of w dotted with activation rows [m0, m0 + kM); two accumulators per
// activation row break the add chain.
template <int kM, class Out>
inline void row_dot(const bf16* x, const bf16* wr, Out* y, int64_t K, int64_t N, int64_t m0, int64_t n) {
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
  for (int j = 0; j < kM; ++j) store(y + (m0 + j) * N + n, hsum(_mm512_add_ps(a0[j], a1[j])));
}

template <class Out>
void rows(const bf16* x, const bf16* w, Out* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const bf16* wr = w + n * K;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) row_dot<4>(x, wr, y, K, N, m, n);
    for (; m + 2 <= M; m += 2) row_dot<2>(x, wr, y, K, N, m, n);
    for (; m < M; ++m) row_dot<1>(x, wr, y, K, N, m, n);
  }
}

// Sum of each of a, b, c, d's 16 lanes, as 4 floats.
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  // each 128-bit lane holds [a, b, c, d] partial sums; add the four lanes
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// A tile of 8 weight rows x kM activation rows, for batches past the skinny
// range: each weight vector loaded feeds kM dot products and each activation
// vector 8, so the loop is bound by vdpbf16ps rather than loads; 8 x kM
// accumulators are reduced four rows at a time at the end.
template <int kM, class Out>
inline void tile8(const bf16* x, const bf16* w, Out* y, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  __m512 acc[8][kM];
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < kM; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh xv[kM];
    for (int j = 0; j < kM; ++j) xv[j] = (__m512bh)_mm512_loadu_si512(x + (m0 + j) * K + k);
    for (int i = 0; i < 8; ++i) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (n0 + i) * K + k);
      for (int j = 0; j < kM; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[j]);
    }
  }
  for (int j = 0; j < kM; ++j) {
    for (int i = 0; i < 8; i += 4) {
      alignas(16) float r[4];
      _mm_store_ps(r, reduce4(acc[i][j], acc[i + 1][j], acc[i + 2][j], acc[i + 3][j]));
      for (int q = 0; q < 4; ++q) store(y + (m0 + j) * N + n0 + i + q, r[q]);
    }
  }
}

template <class Out>
void gemm_impl(const bf16* x, const bf16* w, Out* y, int64_t M, int64_t K, int64_t N, int threads) {
  const int64_t blocks = N / 8;
  par_for(blocks, 4, threads, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int64_t m = 0;
      for (; m + 2 <= M; m += 2) tile8<2>(x, w, y, K, N, m, b * 8);
      if (m < M) tile8<1>(x, w, y, K, N, m, b * 8);
    }
  });
  if (N % 8) rows(x, w, y, M, K, N, blocks * 8, N);  // the last few weight rows
}

template <class Out>
void gemv_impl(const bf16* x, const bf16* w, Out* y, int64_t M, int64_t K, int64_t N, int threads) {
  const int64_t blocks = (N + kRows - 1) / kRows;
  par_for(blocks, 16, threads, [&](int64_t b0, int64_t b1) {
    rows(x, w, y, M, K, N, b0 * kRows, std::min<int64_t>(b1 * kRows, N));
  });
}

}  // namespace

void gemv(const bf16* x, const bf16* w, bf16* y, int64_t M, int64_t K, int64_t N, int threads) {
  gemv_impl(x, w, y, M, K, N, threads);
}

void gemv_f32(const bf16* x, const bf16* w, float* y, int64_t M, int64_t K, int64_t N, int threads) {
  gemv_impl(x, w, y, M, K, N, threads);
}

void gemm(const bf16* x, const bf16* w, bf16* y, int64_t M, int64_t K, int64_t N, int threads) {
  gemm_impl(x, w, y, M, K, N, threads);
}

void gemm_f32(const bf16* x, const bf16* w, float* y, int64_t M, int64_t K, int64_t N, int threads) {
  gemm_impl(x, w, y, M, K, N, threads);
}

}  // namespace kvrelay

namespace {
void check_gemv_args(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemv: bf16 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv: x [M, K] and w [N, K]");
  TORCH_CHECK(x.size(1) % 32 == 0, "gemv: K must be a multiple of 32");
}
}  // namespace

// y = x @ w^T through the skinny kernel or (tiles) the register tiles; bf16
// or (f32_out) fp32 output. threads <= 0: torch's intra-op thread count.
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w, bool tiles, bool f32_out,
                          int64_t threads) {
  check_gemv_args(x, w);
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  auto y = torch::empty({xc.size(0), wc.size(0)}, xc.options().dtype(f32_out ? at::kFloat : at::kBFloat16));
  const int t = threads > 0 ? static_cast<int>(threads) : at::get_num_threads();
  const auto* xp = xc.data_ptr<kvrelay::bf16>();
  const auto* wp = wc.data_ptr<kvrelay::bf16>();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  if (f32_out)
    (tiles ? kvrelay::gemm_f32 : kvrelay::gemv_f32)(xp, wp, y.data_ptr<float>(), M, K, N, t);
  else
    (tiles ? kvrelay::gemm : kvrelay::gemv)(xp, wp, y.data_ptr<kvrelay::bf16>(), M, K, N, t);
  return y;
}
