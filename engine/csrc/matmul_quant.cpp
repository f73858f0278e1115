// fp32 matmul on quantized weights (quant.h), for every ISA (isa.h) and every M.
//
// y[M, N] = x[M, K] @ W^T with W's codes widened to fp32 in registers and
// accumulated in fp32 FMAs against fp32 activations; each group's sum is then
// scaled and its minimum added (y += scale * sum(code * x) + min * sum(x)),
// which is the matmul of the dequantized weights up to rounding order. Only
// the quantized bytes are read from memory: Q4_1 is 5 bits a weight (4-bit
// codes, an fp16 scale and minimum per 32), Q8_0 9, int8 8 (per-row scales).
//
// - Up to kDecodeRows rows (decode): one tile per 32-row block of W; each
//   k-word of the block (32 words, one per output column) is loaded once and
//   the code of its slot J is the word masked in place (code * 2^(bits J),
//   exact in fp32), against x[k] * 2^-(bits J), pre-scaled once per call: one
//   AND, one conversion and one FMA per vector of weights, no shifts.
// - More rows: each (rows chunk, block) work item first widens its block's
//   codes into a per-thread fp32 copy ([K][32], in L2), which the chunk's tiles
//   read as a plain fp32 GEMM, with the same per-group epilogue. The products
//   are the decode tiles' (powers of two cancel exactly) and so is the order,
//   so both ways give the same bits and a token's result does not depend on the
//   batch it is in.
// - Each group's sum is two, of even and of odd k, added at its end: twice the
//   independent FMA chains for one row, whose tile was bound by FMA latency on
//   one core (the next FMA into a vector waits 4 cycles for the last).
// - The decode tiles prefetch their codes kAheadWords ahead: at 5 bits a weight a
//   tile spends so long on each cache line that the hardware prefetcher alone
//   keeps too few lines in flight (AVX2, SmolLM2's 120 layer matmuls, 1 token:
//   12 -> 16 GB/s on one core, 23 -> 31 GB/s on two; the same on AVX-512).
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops.h"
#include "quant.h"

namespace kvrelay {
namespace {

using V = Vec::T;
constexpr int64_t kL = Vec::kLanes;
constexpr int kDecodeNV = kPackedCols / kL;  // the decode tile: a whole block per pass (2 zmm, 4 ymm)
constexpr int kWideNV = 2;                   // the wide tile: 2 vectors per pass (32 columns, 16 on AVX2)
constexpr int64_t kAheadWords = 512;         // 2 KiB: 16 k-words of a block (the sweep's best of 256-1024)
#if defined(__AVX512F__)
constexpr int kDecodeRows = 4;  // of 32 zmm: 16 sums + 2 words + 2 codes + 1 broadcast + scales
constexpr int kWideRows = 6;    // 24 sums + 2 weights + 1 broadcast
#else
constexpr int kDecodeRows = 1;  // of 16 ymm: 8 sums + 4 words + 1 code + 1 broadcast + scales
constexpr int kWideRows = 3;    // 12 sums + 2 weights + 1 broadcast
#endif

template <bool F16>
inline V load_scale(const void* p, int64_t i) {
  if constexpr (F16)
    return QVec::load_f16(static_cast<const uint16_t*>(p) + i);
  else
    return Vec::load(static_cast<const float*>(p) + i);
}

template <int... J, class F>
inline void unroll(std::integer_sequence<int, J...>, const F& f) {
  (f(std::integral_constant<int, J>{}), ...);
}

template <int BITS, bool F16>
struct Fmt {
  static constexpr int kBits = BITS, kPer = 32 / BITS;  // codes per 32-bit word
  static constexpr bool kF16 = F16;
};

// tot[m][c] += acc[m][c] * scale + sx[m] * min, for NV vectors of columns starting at column `at` of the
// scales/mins row of (block, group).
template <class F, int MR, int NV>
inline void epilogue(const QuantMatrix& w, int64_t at, const float* sx, int64_t sx_stride, const V (&acc)[MR][NV],
                     V (&tot)[MR][NV]) {
#pragma GCC unroll 4
  for (int c = 0; c < NV; ++c) {
    const V d = load_scale<F::kF16>(w.scales, at + c * kL), mn = load_scale<F::kF16>(w.mins, at + c * kL);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
      tot[m][c] = Vec::fmadd(Vec::set1(sx[m * sx_stride]), mn, Vec::fmadd(acc[m][c], d, tot[m][c]));
  }
}

// The first n columns of tot's rows [0, MR) into y (row stride N).
template <int MR, int NV>
inline void flush(const V (&tot)[MR][NV], float* y, int64_t N, int64_t n) {
  alignas(64) float res[MR][NV * kL];
#pragma GCC unroll 32
  for (int i = 0; i < MR * NV; ++i) Vec::store(res[i / NV] + kL * (i % NV), tot[i / NV][i % NV]);
  n = std::min<int64_t>(n, NV * kL);
  for (int m = 0; m < MR; ++m) std::memcpy(y + m * N, res[m], n * sizeof(float));
}

template <int MR, int NV>
inline void zero(V (&a)[MR][NV]) {
#pragma GCC unroll 32
  for (int i = 0; i < MR * NV; ++i) a[i / NV][i % NV] = Vec::zero();
}

// a[0] += a[1]: a group's even-k and odd-k sums, kept apart so that a single row has twice
// the independent FMA chains (one row on AVX2 had 4, on AVX-512 2: FMA latency, not the
// memory, bound the tile on one core)
template <int MR, int NV>
inline void fold(V (&a)[2][MR][NV]) {
#pragma GCC unroll 32
  for (int i = 0; i < MR * NV; ++i) a[0][i / NV][i % NV] = Vec::add(a[0][i / NV][i % NV], a[1][i / NV][i % NV]);
}

// Rows [0, MR) against block b of W (`cols` valid columns), the codes masked in place in registers.
// xs: x pre-scaled (prescale_x), row stride K; sx: the rows' group sums, row stride K / group.
template <class F, int MR>
void tile_decode(const float* xs, const float* sx, const QuantMatrix& w, int64_t b, float* y, int64_t N,
                 int64_t cols) {
  constexpr int P = F::kPer, NV = kDecodeNV;
  const int64_t K = w.k, G = w.group, groups = K / G;
  const int32_t* qw = w.q + b * (K / P) * kPackedCols;
  V tot[MR][NV], acc[2][MR][NV];  // acc[k % 2]: slot J of a word is k = J (mod 2), P being even
  zero(tot);
  const float* xk = xs;
  for (int64_t g = 0; g < groups; ++g) {
    zero(acc[0]);
    zero(acc[1]);
    for (int64_t kw = 0; kw < G / P; ++kw, qw += kPackedCols, xk += P) {
      QVec::I words[NV];
      // a k-word is 128 bytes, two cache lines (past the block's end: the next block, or nothing to fault)
      _mm_prefetch(reinterpret_cast<const char*>(qw + kAheadWords), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(qw + kAheadWords + 16), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) words[c] = QVec::load(qw + c * kL);
      unroll(std::make_integer_sequence<int, P>{}, [&](auto j) {
        constexpr int J = decltype(j)::value;
        V(&a)[MR][NV] = acc[J % 2];
        V xv[MR];
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) xv[m] = Vec::set1(xk[m * K + J]);
#pragma GCC unroll 4
        for (int c = 0; c < NV; ++c) {
          const V wv = QVec::template code_in_place<F::kBits, J>(words[c]);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) a[m][c] = Vec::fmadd(wv, xv[m], a[m][c]);
        }
      });
    }
    fold(acc);
    epilogue<F, MR, NV>(w, (b * groups + g) * kPackedCols, sx + g, groups, acc[0], tot);
  }
  flush<MR, NV>(tot, y, N, cols);
}

// Block b of W's codes, as fp32, into this thread's copy [K][32].
template <class F>
const float* widen_block(const QuantMatrix& w, int64_t b) {
  constexpr int P = F::kPer;
  thread_local std::vector<float> buf;
  const int64_t K = w.k;
  buf.resize(K * kPackedCols);
  float* wf = buf.data();
  const int32_t* qw = w.q + b * (K / P) * kPackedCols;
  for (int64_t kw = 0; kw < K / P; ++kw, qw += kPackedCols)
    for (int64_t c = 0; c < kPackedCols / kL; ++c) {
      const QVec::I words = QVec::load(qw + c * kL);
      unroll(std::make_integer_sequence<int, P>{}, [&](auto j) {
        constexpr int J = decltype(j)::value;
        Vec::store(wf + (kw * P + J) * kPackedCols + c * kL, QVec::template code<F::kBits, J>(words));
      });
    }
  return wf;
}

// Rows [0, MR) of x (row stride K) against block b widened (wf [K][32]): the decode
// tiles' FMAs in their order, even and odd k in two sums.
template <class F, int MR>
void tile_wide(const float* x, const float* sx, const float* wf, const QuantMatrix& w, int64_t b, float* y,
               int64_t N, int64_t cols) {
  constexpr int NV = kWideNV;
  constexpr int64_t kPass = NV * kL;
  const int64_t K = w.k, G = w.group, groups = K / G;
  for (int64_t h = 0; h * kPass < cols; ++h) {
    V tot[MR][NV], acc[2][MR][NV];
    zero(tot);
    const float* wk = wf + h * kPass;
    for (int64_t g = 0, k = 0; g < groups; ++g) {
      zero(acc[0]);
      zero(acc[1]);
      for (const int64_t end = k + G; k < end; k += 2, wk += 2 * kPackedCols) {
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const V x0 = Vec::set1(x[m * K + k]), x1 = Vec::set1(x[m * K + k + 1]);
#pragma GCC unroll 4
          for (int c = 0; c < NV; ++c) {
            acc[0][m][c] = Vec::fmadd(Vec::load(wk + c * kL), x0, acc[0][m][c]);
            acc[1][m][c] = Vec::fmadd(Vec::load(wk + kPackedCols + c * kL), x1, acc[1][m][c]);
          }
        }
      }
      fold(acc);
      epilogue<F, MR, NV>(w, (b * groups + g) * kPackedCols + h * kPass, sx + g, groups, acc[0], tot);
    }
    flush<MR, NV>(tot, y + h * kPass, N, cols - h * kPass);
  }
}

template <class F>
using DecodeFn = void (*)(const float*, const float*, const QuantMatrix&, int64_t, float*, int64_t, int64_t);
template <class F>
using WideFn = void (*)(const float*, const float*, const float*, const QuantMatrix&, int64_t, float*, int64_t,
                        int64_t);

template <class F, int... R>
constexpr std::array<DecodeFn<F>, sizeof...(R) + 1> decode_table(std::integer_sequence<int, R...>) {
  return {nullptr, &tile_decode<F, R + 1>...};
}
template <class F, int... R>
constexpr std::array<WideFn<F>, sizeof...(R) + 1> wide_table(std::integer_sequence<int, R...>) {
  return {nullptr, &tile_wide<F, R + 1>...};
}

template <class F>
void matmul_fmt(const float* x, const QuantMatrix& w, float* y, int64_t M, int threads) {
  constexpr int P = F::kPer;
  const int64_t N = w.n, K = w.k, G = w.group, groups = K / G, blocks = (N + kPackedCols - 1) / kPackedCols;
  // each row's group sums, in one fixed order whatever M is
  std::vector<float> sx(M * groups);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) s += x[m * K + k];
      sx[m * groups + g] = s;
    }
  if (M <= kDecodeRows) {
    // x[k] * 2^-(bits J), J = k % per: what the in-place codes of slot J multiply
    std::vector<float> xs(M * K);
    float scale[P];
    for (int j = 0; j < P; ++j) scale[j] = j == P - 1 ? 1.f : 1.f / static_cast<float>(1u << (F::kBits * j));
    for (int64_t i = 0; i < M * K; ++i) xs[i] = x[i] * scale[i % K % P];
    static constexpr auto table = decode_table<F>(std::make_integer_sequence<int, kDecodeRows>{});
    par_for(blocks, 2, threads, [&](int64_t a, int64_t e) {
      for (int64_t b = a; b < e; ++b)
        table[M](xs.data(), sx.data(), w, b, y + b * kPackedCols, N, std::min(kPackedCols, N - b * kPackedCols));
    });
    return;
  }
  static constexpr auto table = wide_table<F>(std::make_integer_sequence<int, kWideRows>{});
  // chunks of up to ~2 MiB of activations (L3), a block widened once per chunk
  const int64_t cap = std::max<int64_t>(kWideRows, (2 << 20) / (4 * K) / kWideRows * kWideRows);
  const int64_t chunks = (M + cap - 1) / cap, chunk_rows = (M + chunks - 1) / chunks;
  par_for(chunks * blocks, 1, threads, [&](int64_t a, int64_t e) {
    for (int64_t i = a; i < e; ++i) {
      const int64_t c = i / blocks, b = i % blocks;
      const int64_t m0 = c * chunk_rows, R = std::min(M, m0 + chunk_rows) - m0;
      const float* wf = widen_block<F>(w, b);
      const int64_t tiles = (R + kWideRows - 1) / kWideRows, cols = std::min(kPackedCols, N - b * kPackedCols);
      for (int64_t t = 0, m = m0; t < tiles; ++t) {
        const int64_t r = R / tiles + (t < R % tiles);
        table[r](x + m * K, sx.data() + m * groups, wf, w, b, y + m * N + b * kPackedCols, N, cols);
        m += r;
      }
    }
  });
}

}  // namespace

void matmul_quant(const float* x, const QuantMatrix& w, float* y, int64_t M, int threads) {
  if (M <= 0) return;
  if (w.bits == 4 && w.f16)
    matmul_fmt<Fmt<4, true>>(x, w, y, M, threads);  // Q4_1 (and Q4_0: its minimum is -8 scale)
  else if (w.bits == 8 && w.f16)
    matmul_fmt<Fmt<8, true>>(x, w, y, M, threads);  // Q8_0
  else if (w.bits == 8)
    matmul_fmt<Fmt<8, false>>(x, w, y, M, threads);  // int8, one fp32 scale per row
  else
    TORCH_CHECK(false, "matmul_quant: no kernel for ", w.bits, "-bit codes with ", w.f16 ? "fp16" : "fp32",
                " scales");
}

QuantMatrix quant_matrix(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& mins, int64_t n, int64_t k,
                         int64_t bits, const char* what) {
  TORCH_CHECK(bits == 4 || bits == 8, what, ": bits must be 4 or 8, got ", bits);
  const int64_t per = 32 / bits, blocks = (n + kPackedCols - 1) / kPackedCols;
  TORCH_CHECK(q.scalar_type() == at::kInt && q.is_contiguous() && q.dim() == 3 && q.size(0) == blocks &&
                  q.size(2) == kPackedCols && (k == 0 || q.size(1) * per == k),
              what, ": codes of shape ", q.sizes(), " are not a quantized [", n, ", ", k, "] matrix of ", bits,
              "-bit codes");
  k = q.size(1) * per;
  const bool f16 = scales.scalar_type() == at::kHalf;
  TORCH_CHECK((f16 || scales.scalar_type() == at::kFloat) && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == blocks && scales.size(1) > 0 && k % scales.size(1) == 0 &&
                  (k / scales.size(1)) % per == 0 && scales.size(2) == kPackedCols,
              what, ": scales of shape ", scales.sizes(), " do not fit codes of shape ", q.sizes());
  TORCH_CHECK(mins.defined() && mins.scalar_type() == scales.scalar_type() && mins.is_contiguous() &&
                  mins.sizes() == scales.sizes(),
              what, ": minimums must have the scales' type and shape");
  return {q.data_ptr<int32_t>(), scales.data_ptr(), mins.data_ptr(), n, k, k / scales.size(1),
          static_cast<int>(bits), f16};
}

}  // namespace kvrelay

// y [M, n] = x [M, K] @ W^T, fp32, W quantized (engine/quant.py QuantWeight).
// threads <= 0: torch's intra-op thread count.
torch::Tensor linear_quant(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                           const torch::Tensor& mins, int64_t n, int64_t bits, int64_t threads) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "linear_quant: x must be [M, K] fp32");
  const auto w = kvrelay::quant_matrix(q, scales, mins, n, x.size(1), bits, "linear_quant");
  auto xc = x.contiguous();
  auto y = torch::empty({xc.size(0), n}, xc.options());
  kvrelay::matmul_quant(xc.data_ptr<float>(), w, y.data_ptr<float>(), xc.size(0),
                        threads > 0 ? static_cast<int>(threads) : at::get_num_threads());
  return y;
}

// Rows `ids` of a quantized [n, k] weight, dequantized to fp32 [len(ids), k]: the embedding
// lookup of a tied, quantized LM head (engine/quant.py QuantWeight.rows is the reference:
// fma(code, scale, min), one rounding, as torch's addcmul there; for the fp16-scaled GGUF
// formats the product is exact anyway).
torch::Tensor quant_rows(const torch::Tensor& q, const torch::Tensor& scales, const torch::Tensor& mins,
                         const torch::Tensor& ids, int64_t n, int64_t bits) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "quant_rows: ids must be a 1-D int64 tensor");
  const auto w = kvrelay::quant_matrix(q, scales, mins, n, 0, bits, "quant_rows");
  const auto idc = ids.contiguous();
  const int64_t T = idc.size(0), K = w.k, per = 32 / w.bits, G = w.group, groups = K / G;
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < n, "quant_rows: row ", id[t], " is not in [0, ", n, ")");
  auto y = torch::empty({T, K}, q.options().dtype(at::kFloat));
  float* out = y.data_ptr<float>();
  const uint32_t mask = (1u << w.bits) - 1;
  auto scale = [&](const void* p, int64_t i) {
    return w.f16 ? static_cast<float>(static_cast<const c10::Half*>(p)[i]) : static_cast<const float*>(p)[i];
  };
  for (int64_t t = 0; t < T; ++t) {
    const int64_t b = id[t] / kvrelay::kPackedCols, c = id[t] % kvrelay::kPackedCols;
    const int32_t* qw = w.q + b * (K / per) * kvrelay::kPackedCols + c;
    float* row = out + t * K;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = (b * groups + g) * kvrelay::kPackedCols + c;
      const float d = scale(w.scales, at), mn = scale(w.mins, at);
      for (int64_t k = g * G; k < (g + 1) * G; k += per) {
        const uint32_t word = static_cast<uint32_t>(qw[k / per * kvrelay::kPackedCols]);
        for (int64_t j = 0; j < per; ++j) row[k + j] = std::fma(static_cast<float>((word >> (w.bits * j)) & mask), d, mn);
      }
    }
  }
  return y;
}
