// fp32 matmul on quantized weights (quant.h), for every ISA (isa.h) and every M.
//
// y[M, N] = x[M, K] @ W^T, reading only the quantized bytes: Q4_1 is 5 bits a
// weight (4-bit codes, an fp16 scale and minimum per 32), Q8_0 9, int8 8
// (per-row scales).
//
// The products are integers. Each 32 k of a row of x (a block of the row) are
// held as X = round(x * 2^E), E per block, and X is three signed digits of DB
// bits (X = d2 2^2DB + d1 2^DB + d0, each in [-2^(DB-1), 2^(DB-1))), the
// largest |x| of the block landing just under the largest X three digits hold:
// the same absolute step for the rest, so X is off by at most ~2^-(3DB-2) of
// the block's largest |x|. Against 4-bit codes DB = 8 (~2^-22, fp32 holds
// 2^-24); against 8-bit codes DB = 7 (~2^-19), so that on AVX2 a code (+ 128,
// up to 255) times a digit (|d| up to 64) pairs without saturating vpmaddubsw's
// int16 sums and 8-bit codes take one integer dot per word instead of two
// nibble planes. The sums of code * digit over a block are exact int32, 4 k of
// one column per lane and instruction (quant.h IVec: vpdpbusd, on AVX2
// vpmaddubsw + vpmaddwd), where the fp32 tile this replaces took a mask, a
// conversion and an FMA per vector of single k (on one Zen 4 core: 15 GB/s of
// Q4_1 with its codes in cache, bound by instructions). Per block and column:
//
//   s = fma(float(sum d2), 2^2DB, float(sum d1 2^DB + d0))   (one rounding)
//   y = fma(s, scale 2^-E, y), then for 4-bit codes y = fma(sum X 2^-E, min, y)
//
// 8-bit codes are held + 128 with min = -128 scale (quant.h): their sums drop
// 128 x each digit's sum as integers, exactly, and the minimum is not used.
// The integer sums do not depend on how they were added, and the rest is the
// same per row whatever the tile, so every batch size, thread count and ISA
// gives the same bits.
//
// - One tile for every M: kRows rows against one 32-column block of W
//   (AVX-512: the whole block in 2 zmm; AVX2: half of it in 2 ymm, two passes,
//   but a single row takes the whole block in 4 ymm: in two passes each pass
//   reads every other cache line of the codes, and a decode step, bound by
//   their reads, ran 30% slower), each word of codes loaded once and its code
//   planes shared by the rows.
// - The tiles prefetch their codes kAheadWords ahead: at 5 bits a weight a tile
//   spends so long on each cache line that the hardware prefetcher alone keeps
//   too few lines in flight.
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "ops.h"
#include "quant.h"

namespace kvrelay {
namespace {

using V = Vec::T;
using I = IVec::I;
constexpr int64_t kL = Vec::kLanes;
constexpr int64_t kBlockK = 32;                            // k of a row of x under one 2^E
constexpr int kDigits = 3;                                 // signed digits of X
constexpr int kQuads = kBlockK / 4;                        // 4-byte runs of one digit in a block
constexpr int kBlockInts = kDigits * kQuads;               // a block's digits: [digit][k] bytes, as int32
// Bits per digit: base 256 against 4-bit codes; base 128 against 8-bit codes, whose products
// (code + 128 up to 255, |digit| up to 64) then pair without saturating vpmaddubsw on AVX2, and
// against 5-bit codes, whose 8 pair sums a block adds in 16 bits (8 x 2 x 31 x 64 = 31744) then fit.
template <int BITS>
constexpr int kDigitBits = BITS == 4 ? 8 : 7;
template <int DB>
constexpr int32_t kXMax = ((1 << (DB - 1)) - 1) * ((1 << (2 * DB)) + (1 << DB) + 1);  // the largest |X| held
// vectors of columns per tile pass: 2 (32 columns; AVX2: 16, two passes over a block), and on
// AVX2 a single row takes its whole block in one pass (4 ymm), each cache line of codes read once
template <int MR>
constexpr int kNV = kL * 4 == kPackedCols && MR == 1 ? 4 : 2;
constexpr int64_t kAheadWords = 512;                       // 2 KiB: 16 k-words of a block
#if defined(__AVX512F__)
template <int BITS>
constexpr int kRows = 3;  // of 32 zmm: 18 sums, 6 totals, 2 words, 2 code planes, a digit
#else
template <int BITS>
constexpr int kRows = BITS == 8 || BITS == kGridBits ? 1 : 2;  // of 16 ymm: 12 sums (bytes: 6, and their pair sums)
#endif

// A block of a row of x, beside its digits: 2^-E, sum of X * 2^-E, and each digit's sum over
// either half of the block's k (codes scaled per 16 k, Q6_K, Q3_K and Q2_K, take the halves apart).
struct XBlock {
  float p, sxp, sxph[2];  // sxph: the sum of X * 2^-E over each half
  int32_t dsum[2][kDigits];
  int32_t digit_sum(int j) const { return dsum[0][j] + dsum[1][j]; }
};

// The scales (or minimums) of kL columns at index i: fp16 or fp32 values, or int8 codes times
// their fp32 factors at index fi (one rounding, as gguf dequantizes them).
template <int SF>
inline V load_scale(const void* p, const float* factor, int64_t i, int64_t fi) {
  if constexpr (SF == kScaleF16)
    return IVec::load_f16(static_cast<const uint16_t*>(p) + i);
  else if constexpr (SF == kScaleCoded)
    return Vec::mul(Vec::load(factor + fi), IVec::load_i8(static_cast<const int8_t*>(p) + i));
  else
    return Vec::load(static_cast<const float*>(p) + i);
}

// x [M, K] -> digits [M][blocks][kBlockInts] and XBlock [M][blocks]; blocks past K's end are zero.
template <int DB>
void to_digits(const float* x, int64_t M, int64_t K, int32_t* digits, XBlock* xb, int threads) {
  const int64_t blocks = (K + kBlockK - 1) / kBlockK;
  par_for(M * blocks, 64, threads, [&](int64_t a, int64_t e) {
    for (int64_t i = a; i < e; ++i) {
      const int64_t m = i / blocks, k0 = i % blocks * kBlockK, n = std::min(kBlockK, K - k0);
      alignas(64) float v[kBlockK] = {};
      std::memcpy(v, x + m * K + k0, n * sizeof(float));
      int8_t* d = reinterpret_cast<int8_t*>(digits + i * kBlockInts);
      XBlock& b = xb[i];
      b = XBlock{0.f, 0.f, {0.f, 0.f}, {{0, 0, 0}, {0, 0, 0}}};
      std::memset(d, 0, kBlockInts * sizeof(int32_t));  // (kept where the block is all zero, or not finite)
      V vmax = Vec::zero(), probe = Vec::zero();
#pragma GCC unroll 4
      for (int k = 0; k < kBlockK; k += kL) {
        const V t = Vec::load(v + k);
        vmax = Vec::max(vmax, Vec::max(t, Vec::sub(Vec::zero(), t)));
        probe = Vec::fmadd(t, Vec::zero(), probe);  // NaN where some x is not finite
      }
      const float amax = Vec::reduce_max(vmax);
      if (Vec::reduce_add(probe) != 0.f) {  // an inf or NaN: the block's results are NaN, as fp32's would be
        b.p = b.sxp = b.sxph[0] = b.sxph[1] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      if (amax == 0.f) continue;
      int e;
      std::frexp(amax, &e);
      int E = 3 * DB - 1 - e;  // amax 2^E in [2^(3 DB - 2), 2^(3 DB - 1))
      if (std::ldexp(static_cast<double>(amax), E) > kXMax<DB>) --E;
      E = std::min(E, 127);  // (blocks under 2^-104 lose bits: they hardly count)
      const V up = Vec::set1(std::ldexp(1.f, E));
      const I half = IVec::set1(1 << (DB - 1)), mask = IVec::set1((1 << DB) - 1);
      I ds[2][kDigits];  // per half of the block (a vector of kL <= 16 k lies in one half)
      for (auto& h : ds) h[0] = h[1] = h[2] = IVec::zero();
#pragma GCC unroll 4
      for (int k = 0; k < kBlockK; k += kL) {
        const I X = IVec::round(Vec::mul(Vec::load(v + k), up));  // v 2^E is exact: only the rounding
        const I d0 = IVec::sub(IVec::and_(IVec::add(X, half), mask), half);
        const I r = IVec::template sra<DB>(IVec::sub(X, d0));
        const I d1 = IVec::sub(IVec::and_(IVec::add(r, half), mask), half);
        const I d2 = IVec::template sra<DB>(IVec::sub(r, d1));
        IVec::store_bytes(d + k, d0);
        IVec::store_bytes(d + kBlockK + k, d1);
        IVec::store_bytes(d + 2 * kBlockK + k, d2);
        I* dh = ds[k / (kBlockK / 2)];
        dh[0] = IVec::add(dh[0], d0), dh[1] = IVec::add(dh[1], d1), dh[2] = IVec::add(dh[2], d2);
      }
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < kDigits; ++j) b.dsum[h][j] = static_cast<int32_t>(Vec::reduce_add(IVec::to_float(ds[h][j])));
      // the sum of X, exactly
      const int32_t sx = b.digit_sum(2) * (1 << (2 * DB)) + b.digit_sum(1) * (1 << DB) + b.digit_sum(0);
      b.p = std::ldexp(1.f, -E);
      b.sxp = static_cast<float>(sx) * b.p;
      for (int h = 0; h < 2; ++h)
        b.sxph[h] = static_cast<float>(b.dsum[h][2] * (1 << (2 * DB)) + b.dsum[h][1] * (1 << DB) + b.dsum[h][0]) * b.p;
    }
  });
}

#define KVRELAY_INLINE inline __attribute__((always_inline))

// acc[m][d][c] += codes[c] . (digit d of run q of row m), for one plane of codes (4 k per lane)
template <int MR, int NV, bool WIDE = false>
KVRELAY_INLINE void dot_plane(I (&acc)[MR][kDigits][NV], const I (&codes)[NV], const int32_t* xd, int64_t stride,
                              int q) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 3
    for (int d = 0; d < kDigits; ++d) {
      const int32_t s = xd[m * stride + d * kQuads + q];
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c)
        acc[m][d][c] = WIDE ? IVec::dot_wide(acc[m][d][c], codes[c], s) : IVec::dot(acc[m][d][c], codes[c], s);
    }
}

template <int MR, int NV>
KVRELAY_INLINE void zero(I (&acc)[MR][kDigits][NV]) {
#pragma GCC unroll 32
  for (int i = 0; i < MR * kDigits * NV; ++i) acc[i / (kDigits * NV)][i / NV % kDigits][i % NV] = IVec::zero();
}

// Rows [0, MR) of x (as digits, rows `stride` ints apart; xb rows `blocks` apart) against
// columns [h, h + kPass) of block b of W, into y (row stride N; `cols` of them valid).
// H: groups of scales per block of k, 1 (groups of 32 k or more) or 2 (8- or 4-bit codes scaled
// per 16 k: each half of a block is summed and scaled on its own). MINS: the codes are unsigned
// with minimums of their own, else signed, held + 128 (8 bits) or + 8 (4 bits), the minimum
// -128 or -8 scale implied (their sums drop that times each digit's sum, as integers, exactly);
// 5-bit codes always have minimums. BITS 5: 4-bit words of the low bits, and after a block-row's words
// one word per 32 k of its fifth bits (quant.h), spread into bit 4 of each code's byte in registers.
template <int BITS, int SF, int MR, int NV, int H, bool MINS>
KVRELAY_INLINE void tile_pass(const int32_t* digits, const XBlock* xb, int64_t stride, const QuantMatrix& w,
                              int64_t b, int64_t h, float* y, int64_t N, int64_t cols) {
  constexpr int64_t kPass = NV * kL;
  constexpr int P = BITS == 8 ? 4 : 8;                       // codes per word (5 bits: their low 4)
  constexpr int kWords = kBlockK / P;                        // words of a column per block of k
  constexpr int DB = kDigitBits<BITS>;
  const int64_t K = w.k, groups = K / w.group, blocks = (K + kBlockK - 1) / kBlockK;
  static_assert(H == 1 || (H == 2 && BITS != 5), "groups of 16 k are for 8- and 4-bit codes");
  static_assert(MINS || BITS != 5, "5-bit codes have minimums");
  constexpr bool kOffset = !MINS;                    // signed codes held + kOff, the minimum -kOff scale
  constexpr bool kBytes = BITS == 8 || BITS == kGridBits;  // codes (or grid values) read as bytes
  constexpr int32_t kOff = signed_offset(BITS);
  // blocks of k per group of scales (a multiple of 32, or the whole row; or H = 2: quant_matrix checks)
  const int64_t per_group = H == 2 ? 1 : groups == 1 ? blocks : w.group / kBlockK;
  const int64_t sups = SF == kScaleCoded ? K / w.sup : 1, per_sup = SF == kScaleCoded ? w.sup / w.group : 1;
  const int64_t row_words = BITS == 5 ? K / 8 + K / 32 : K / P;  // words of a column per block-row
  const int32_t* qw = w.q + b * row_words * kPackedCols + h;
  const int32_t* qh = qw + (K / 8) * kPackedCols;  // BITS 5: the fifth bits, a word per 32 k
  I grid_table;
  if constexpr (BITS == kGridBits) grid_table = IVec::grid(w.grid);
  V tot[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR * NV; ++i) tot[i / NV][i % NV] = Vec::zero();
  for (int64_t blk = 0, g = 0, in_group = 0; blk < blocks; ++blk)
#pragma GCC unroll 2
   for (int hf = 0; hf < H; ++hf) {
    I acc[MR][kDigits][NV];
    zero(acc);
    const int32_t* xd = digits + blk * kBlockInts;
    // BITS 5: the block's fifth bits, for the low and the high nibbles, shifted one bit a word
    I flo[NV], fhi[NV];
    if constexpr (BITS == 5) {
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) {
        flo[c] = IVec::load(qh + blk * kPackedCols + c * kL);
        fhi[c] = IVec::template shl<4>(flo[c]);
      }
    }
    // (H = 2: K is a multiple of 32, every block whole)
    const int nw = H == 2 ? kWords / 2 * (hf + 1) : static_cast<int>(std::min<int64_t>(kWords, (K - blk * kBlockK) / P));
    for (int wi = H == 2 ? kWords / 2 * hf : 0; wi < nw; ++wi, qw += kPackedCols) {
      // a k-word is 128 bytes, two cache lines (past the block's end: the next block, or nothing to fault)
      _mm_prefetch(reinterpret_cast<const char*>(qw + kAheadWords), _MM_HINT_T0);
      if constexpr (kPass * 4 > 64) _mm_prefetch(reinterpret_cast<const char*>(qw + kAheadWords + 16), _MM_HINT_T0);
      I words[NV];
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) words[c] = IVec::load(qw + c * kL);
      if constexpr (BITS == 8) {
        dot_plane<MR, NV, true>(acc, words, xd, stride, wi);
      } else {  // k 8 wi + [0, 4) low, + [4, 8) high
        I lo[NV], hi[NV];
#pragma GCC unroll 4
        for (int c = 0; c < NV; ++c) lo[c] = IVec::low_nibbles(words[c]), hi[c] = IVec::high_nibbles(words[c]);
        if constexpr (BITS == 5) {  // word wi's fifth bits: k 8 wi + j at bit 8 j + 4 + wi, k 8 wi + 4 + j at 8 j + wi
          const I bit4 = IVec::set1(0x10101010);
#pragma GCC unroll 4
          for (int c = 0; c < NV; ++c) {
            lo[c] = IVec::or_(lo[c], IVec::and_(flo[c], bit4));
            hi[c] = IVec::or_(hi[c], IVec::and_(fhi[c], bit4));
            flo[c] = IVec::template shr_by<1>(flo[c]), fhi[c] = IVec::template shr_by<1>(fhi[c]);
          }
        }
        if constexpr (BITS == kGridBits) {  // indices -> their values + 128
#pragma GCC unroll 4
          for (int c = 0; c < NV; ++c)
            lo[c] = IVec::lookup(grid_table, lo[c]), hi[c] = IVec::lookup(grid_table, hi[c]);
        }
        dot_plane<MR, NV, BITS == kGridBits>(acc, lo, xd, stride, 2 * wi);
        dot_plane<MR, NV, BITS == kGridBits>(acc, hi, xd, stride, 2 * wi + 1);
      }
    }
    if (H == 1) qw += (kWords - nw) * kPackedCols;
    const int64_t gi = H == 2 ? 2 * blk + hf : g;
    const int64_t at = (b * groups + gi) * kPackedCols + h, sat = (b * sups + gi / per_sup) * kPackedCols + h;
    if (H == 1 && ++in_group == per_group) ++g, in_group = 0;
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) {
      const V d = load_scale<SF>(w.scales, w.scale_d, at + c * kL, sat + c * kL);
      const V mn = kOffset ? Vec::zero() : load_scale<SF>(w.mins, w.min_d, at + c * kL, sat + c * kL);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const XBlock& xm = xb[m * blocks + blk];
        I s[kDigits];
#pragma GCC unroll 3
        for (int j = 0; j < kDigits; ++j) {
          if constexpr (kOffset)  // (bytes' sums are 32-bit already)
            s[j] = IVec::sub(kBytes ? acc[m][j][c] : IVec::finish(acc[m][j][c]),
                             IVec::set1(kOff * (H == 2 ? xm.dsum[hf][j] : xm.digit_sum(j))));
          else if constexpr (kBytes)
            s[j] = acc[m][j][c];
          else
            s[j] = IVec::finish(acc[m][j][c]);
        }
        const V sum = Vec::fmadd(IVec::to_float(s[2]), Vec::set1(static_cast<float>(1 << (2 * DB))),
                                 IVec::to_float(IVec::add(IVec::template shl<DB>(s[1]), s[0])));
        tot[m][c] = Vec::fmadd(sum, Vec::mul(d, Vec::set1(xm.p)), tot[m][c]);
        if constexpr (!kOffset) tot[m][c] = Vec::fmadd(Vec::set1(H == 2 ? xm.sxph[hf] : xm.sxp), mn, tot[m][c]);
      }
    }
  }
  alignas(64) float res[MR][kPass];
#pragma GCC unroll 8
  for (int i = 0; i < MR * NV; ++i) Vec::store(res[i / NV] + kL * (i % NV), tot[i / NV][i % NV]);
  const int64_t n = std::min<int64_t>(cols - h, kPass);
  for (int m = 0; m < MR; ++m) std::memcpy(y + m * N + h, res[m], n * sizeof(float));
}

// Rows [0, MR) against block b of W (`cols` of its columns valid), pass by pass.
template <int BITS, int SF, int H, bool MINS, int MR>
void tile(const int32_t* digits, const XBlock* xb, int64_t stride, const QuantMatrix& w, int64_t b, float* y,
          int64_t N, int64_t cols) {
  constexpr int64_t pass = kNV<MR> * kL;
  for (int64_t h = 0; h < cols; h += pass)
    tile_pass<BITS, SF, MR, kNV<MR>, H, MINS>(digits, xb, stride, w, b, h, y, N, cols);
}

using TileFn = void (*)(const int32_t*, const XBlock*, int64_t, const QuantMatrix&, int64_t, float*, int64_t, int64_t);

template <int BITS, int SF, int H, bool MINS, int... R>
constexpr std::array<TileFn, sizeof...(R) + 1> tile_table(std::integer_sequence<int, R...>) {
  return {nullptr, &tile<BITS, SF, H, MINS, R + 1>...};
}

template <int BITS, int SF, int H = 1, bool MINS = BITS != 8>
void matmul_fmt(const float* x, const QuantMatrix& w, float* y, int64_t M, int threads, int64_t b0, int64_t b1) {
  constexpr int R = kRows<BITS>;
  static constexpr auto table = tile_table<BITS, SF, H, MINS>(std::make_integer_sequence<int, R>{});
  const int64_t N = w.n, K = w.k, blocks = (K + kBlockK - 1) / kBlockK;
  if (b1 < 0) b1 = (N + kPackedCols - 1) / kPackedCols;
  const int64_t wblocks = b1 - b0, stride = blocks * kBlockInts;  // (the output blocks run)
  if (wblocks <= 0) return;
  std::vector<int32_t> digits(M * stride);
  std::vector<XBlock> xb(M * blocks);
  to_digits<kDigitBits<BITS>>(x, M, K, digits.data(), xb.data(), threads);
  // chunks of rows whose digits stay in L2 (~256 KiB) while every block of W passes them
  const int64_t cap = std::max<int64_t>(R, (256 << 10) / (4 * stride + static_cast<int64_t>(sizeof(XBlock)) * blocks) / R * R);
  const int64_t chunks = (M + cap - 1) / cap, chunk_rows = (M + chunks - 1) / chunks;
  // Decode rows (one tile a block): each thread takes one run of consecutive blocks, a single
  // stream of weights, rather than four claimed in turn. At 2 threads on a Zen 4 the default
  // model's Q4_1 layers ran 1.20x (avx512bf16) and 1.11x (avx2) faster so, interleaved in one
  // process (BENCHMARKS.md "Quantized decode at 2 threads"); bf16 matmuls so gained nothing.
  par_for(chunks * wblocks, M <= R ? 2 : 1, threads, [&](int64_t a, int64_t e) {
    for (int64_t i = a; i < e; ++i) {
      const int64_t c = i / wblocks, b = b0 + i % wblocks, m0 = c * chunk_rows, rows = std::min(M, m0 + chunk_rows) - m0;
      const int64_t cols = std::min(kPackedCols, N - b * kPackedCols);
      for (int64_t m = m0; m < m0 + rows; m += R) {
        const int64_t r = std::min<int64_t>(R, m0 + rows - m);
        table[r](digits.data() + m * stride, xb.data() + m * blocks, stride, w, b, y + m * N + b * kPackedCols, N,
                 cols);
      }
    }
  }, M <= R ? 1 : 4);
}

}  // namespace

void matmul_quant(const float* x, const QuantMatrix& w, float* y, int64_t M, int threads, int64_t b0, int64_t b1) {
  if (M <= 0) return;
  const bool g16 = w.group == 16 && w.k > 16;  // two groups of scales per block of 32 k
  constexpr int F32 = kScaleF32, F16 = kScaleF16, CODED = kScaleCoded;
  if (w.bits == kGridBits) {  // IQ4_NL (fp16 scales), IQ4_XS (scale codes; multiplied out: fp32)
    if (w.form == F16)
      matmul_fmt<kGridBits, F16, 1, false>(x, w, y, M, threads, b0, b1);
    else if (w.form == CODED)
      matmul_fmt<kGridBits, CODED, 1, false>(x, w, y, M, threads, b0, b1);
    else
      matmul_fmt<kGridBits, F32, 1, false>(x, w, y, M, threads, b0, b1);
  } else if (w.form == CODED) {  // the k-quants as stored: 6-bit scale codes and an fp32 factor per 256 k
    if (w.bits == 4 && !w.mins)
      matmul_fmt<4, CODED, 2, false>(x, w, y, M, threads, b0, b1);  // Q3_K: signed nibbles + 8, scale codes per 16 k
    else if (w.bits == 4 && g16)
      matmul_fmt<4, CODED, 2>(x, w, y, M, threads, b0, b1);  // Q2_K: 2-bit codes as nibbles, codes per 16 k
    else if (w.bits == 4)
      matmul_fmt<4, CODED>(x, w, y, M, threads, b0, b1);  // Q4_K
    else if (w.bits == 5)
      matmul_fmt<5, CODED>(x, w, y, M, threads, b0, b1);  // Q5_K
    else if (w.mins && g16)
      matmul_fmt<8, CODED, 2, true>(x, w, y, M, threads, b0, b1);  // Q4_K beside Q6_K, fused: bytes per 16 k
    else if (w.mins)
      matmul_fmt<8, CODED, 1, true>(x, w, y, M, threads, b0, b1);  // Q5_K held as bytes
    else if (g16)
      matmul_fmt<8, CODED, 2>(x, w, y, M, threads, b0, b1);  // Q6_K: a scale code per 16 k
    else
      matmul_fmt<8, CODED>(x, w, y, M, threads, b0, b1);
  } else if (w.bits == 4 && !w.mins && w.form == F16) {
    matmul_fmt<4, F16, 1, false>(x, w, y, M, threads, b0, b1);  // Q4_0: signed nibbles + 8, an fp16 scale per 32 k
  } else if (w.bits == 4 && !w.mins) {
    matmul_fmt<4, F32, 2, false>(x, w, y, M, threads, b0, b1);  // Q3_K with its scales multiplied out
  } else if (w.bits == 4 && w.form == F16) {
    matmul_fmt<4, F16>(x, w, y, M, threads, b0, b1);  // Q4_1 (and Q4_0: its minimum is -8 scale)
  } else if (w.bits == 4 && g16) {
    matmul_fmt<4, F32, 2>(x, w, y, M, threads, b0, b1);  // Q2_K fused with Q4_0 or Q4_1: fp32, per 16 k
  } else if (w.bits == 4) {
    matmul_fmt<4, F32>(x, w, y, M, threads, b0, b1);  // fp32 scales and minimums per 32 k (4-bit parts fused)
  } else if (w.bits == 5 && w.form == F16) {
    matmul_fmt<5, F16>(x, w, y, M, threads, b0, b1);  // Q5_0 (its minimum -16 scale) and Q5_1
  } else if (w.bits == 5) {
    matmul_fmt<5, F32>(x, w, y, M, threads, b0, b1);  // 5-bit parts fused with Q5_K
  } else if (w.form == F16 && !w.mins) {
    matmul_fmt<8, F16>(x, w, y, M, threads, b0, b1);  // Q8_0 (and Q5_0 or Q4_0 beside it in a fused matmul)
  } else if (w.form == F16) {
    matmul_fmt<8, F16, 1, true>(x, w, y, M, threads, b0, b1);  // unsigned bytes with fp16 minimums
  } else if (!w.mins && g16) {
    matmul_fmt<8, F32, 2>(x, w, y, M, threads, b0, b1);  // an fp32 scale per 16 k (Q6_K parts fused)
  } else if (!w.mins) {
    matmul_fmt<8, F32>(x, w, y, M, threads, b0, b1);  // int8, one fp32 scale per row
  } else if (g16) {
    matmul_fmt<8, F32, 2, true>(x, w, y, M, threads, b0, b1);  // mixed formats, widened to bytes per 16 k
  } else {
    matmul_fmt<8, F32, 1, true>(x, w, y, M, threads, b0, b1);  // mixed formats, widened to bytes per 32 k
  }
}

QuantMatrix quant_matrix(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& mins,
                         const at::Tensor& scale_d, const at::Tensor& min_d, int64_t n, int64_t k, int64_t bits,
                         const char* what, const at::Tensor& grid) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, what, ": bits must be 4, 5 or 8, got ", bits);
  // words of a column per k: 5-bit codes take a word per 8 k (their low bits) and one per 32 (the fifth)
  const int64_t per = bits == 8 ? 4 : 8, blocks = (n + kPackedCols - 1) / kPackedCols;
  auto words = [&](int64_t kk) { return bits == 5 ? kk / 8 + kk / 32 : kk / per; };
  TORCH_CHECK(q.scalar_type() == at::kInt && q.is_contiguous() && q.dim() == 3 && q.size(0) == blocks &&
                  q.size(2) == kPackedCols && (bits != 5 || q.size(1) % 5 == 0) &&
                  (k == 0 || (q.size(1) == words(k) && (bits != 5 || k % 32 == 0))),
              what, ": codes of shape ", q.sizes(), " are not a quantized [", n, ", ", k, "] matrix of ", bits,
              "-bit codes");
  k = bits == 5 ? q.size(1) / 5 * 32 : q.size(1) * per;
  const bool f16 = scales.scalar_type() == at::kHalf, coded = scales.scalar_type() == at::kChar;
  TORCH_CHECK((f16 || coded || scales.scalar_type() == at::kFloat) && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == blocks && scales.size(1) > 0 && k % scales.size(1) == 0 &&
                  (k / scales.size(1)) % per == 0 && scales.size(2) == kPackedCols,
              what, ": scales of shape ", scales.sizes(), " do not fit codes of shape ", q.sizes());
  const int64_t group = k / scales.size(1);
  TORCH_CHECK(group % 32 == 0 || scales.size(1) == 1 || (group == 16 && bits != 5 && !f16 && k % 32 == 0), what,
              ": a group of ", group, " k is neither a multiple of 32 nor the whole row (nor 16, for 8- or 4-bit "
              "codes with fp32 or coded scales and k a multiple of 32)");
  // 8-bit codes without minimums (an empty tensor): signed, held + 128, the minimum -128 scale
  // 8- and 4-bit codes without minimums (an empty tensor): signed, held + 128 or + 8; signed nibbles
  // are read with fp16 scales per 32 k (Q4_0) or scale codes per 16 k (Q3_K; multiplied out: fp32)
  const bool no_mins = bits != 5 && mins.defined() && mins.numel() == 0;
  const bool gridded = grid.defined() && grid.numel() > 0;  // (its own checks below)
  TORCH_CHECK(!no_mins || bits == 8 || gridded || (f16 && group == 32) || (!f16 && group == 16), what,
              ": 4-bit codes without minimums are read with fp16 scales per 32 k or fp32 or coded scales per 16 k, "
              "not ", scales.scalar_type(), " scales per ", group, " k");
  TORCH_CHECK(no_mins || (mins.defined() && mins.scalar_type() == scales.scalar_type() && mins.is_contiguous() &&
                          mins.sizes() == scales.sizes()),
              what, ": minimums must have the scales' type and shape (or, for 8- or 4-bit codes, be empty)");
  // coded scales: an fp32 factor per `sup` k and column for the scale codes, and one for the minimum codes
  auto factors = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.defined() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 3 &&
                    t.size(0) == blocks && t.size(1) > 0 && k % t.size(1) == 0 && (k / t.size(1)) % group == 0 &&
                    t.size(2) == kPackedCols,
                what, ": ", name, " of shape ", t.sizes(), " are not fp32 factors per whole groups of ", group,
                " k of codes of shape ", q.sizes());
  };
  int64_t sup = 0;
  if (coded) {
    factors(scale_d, "scale factors");
    sup = k / scale_d.size(1);
    if (!no_mins) {
      factors(min_d, "minimum factors");
      TORCH_CHECK(min_d.sizes() == scale_d.sizes(), what, ": minimum factors must have the scale factors' shape");
    }
  } else {
    TORCH_CHECK((!scale_d.defined() || scale_d.numel() == 0) && (!min_d.defined() || min_d.numel() == 0), what,
                ": scale factors are for int8 scale codes, not ", scales.scalar_type(), " scales");
  }
  // a grid: 4-bit indices into 16 signed byte values, without minimums, per 32 k or more
  TORCH_CHECK(!gridded || (grid.scalar_type() == at::kChar && grid.is_contiguous() && grid.numel() == 16 && bits == 4 &&
                           no_mins && group % 32 == 0),
              what, ": a grid must be 16 int8 values, for 4-bit indices without minimums and scales per 32 k or more");
  return {q.data_ptr<int32_t>(),
          scales.data_ptr(),
          no_mins ? nullptr : mins.data_ptr(),
          coded ? scale_d.data_ptr<float>() : nullptr,
          coded && !no_mins ? min_d.data_ptr<float>() : nullptr,
          n,
          k,
          group,
          sup,
          gridded ? kGridBits : static_cast<int>(bits),
          coded ? kScaleCoded : f16 ? kScaleF16 : kScaleF32,
          gridded ? grid.data_ptr<int8_t>() : nullptr};
}

}  // namespace kvrelay

// y [M, n] = x [M, K] @ W^T, fp32, W quantized (engine/quant.py QuantWeight).
// threads <= 0: torch's intra-op thread count.
torch::Tensor linear_quant(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                           const torch::Tensor& mins, int64_t n, int64_t bits, int64_t threads,
                           const c10::optional<torch::Tensor>& scale_d, const c10::optional<torch::Tensor>& min_d,
                           const c10::optional<torch::Tensor>& grid) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "linear_quant: x must be [M, K] fp32");
  const auto w = kvrelay::quant_matrix(q, scales, mins, scale_d.value_or(torch::Tensor()),
                                       min_d.value_or(torch::Tensor()), n, x.size(1), bits, "linear_quant",
                                       grid.value_or(torch::Tensor()));
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
                         const torch::Tensor& ids, int64_t n, int64_t bits, const c10::optional<torch::Tensor>& scale_d,
                         const c10::optional<torch::Tensor>& min_d, const c10::optional<torch::Tensor>& grid) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "quant_rows: ids must be a 1-D int64 tensor");
  const auto w = kvrelay::quant_matrix(q, scales, mins, scale_d.value_or(torch::Tensor()),
                                       min_d.value_or(torch::Tensor()), n, 0, bits, "quant_rows",
                                       grid.value_or(torch::Tensor()));
  const auto idc = ids.contiguous();
  const int64_t T = idc.size(0), K = w.k, per = w.bits == 8 ? 4 : 8, G = w.group, groups = K / G;
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < n, "quant_rows: row ", id[t], " is not in [0, ", n, ")");
  auto y = torch::empty({T, K}, q.options().dtype(at::kFloat));
  float* out = y.data_ptr<float>();
  const int64_t row_words = w.bits == 5 ? K / 8 + K / 32 : K / per;  // a column's words in its block-row
  const uint32_t mask = w.bits == 8 ? 255u : 15u;
  const int64_t sups = w.form == kvrelay::kScaleCoded ? K / w.sup : 1;
  // the scale (or minimum) of group g at index i: coded ones times their factor (f: scale_d or min_d)
  auto scale = [&](const void* p, const float* f, int64_t i, int64_t b, int64_t g, int64_t c) {
    if (w.form == kvrelay::kScaleCoded)
      return f[(b * sups + g * G / w.sup) * kvrelay::kPackedCols + c] * static_cast<float>(static_cast<const int8_t*>(p)[i]);
    return w.form == kvrelay::kScaleF16 ? static_cast<float>(static_cast<const c10::Half*>(p)[i])
                                        : static_cast<const float*>(p)[i];
  };
  for (int64_t t = 0; t < T; ++t) {
    const int64_t b = id[t] / kvrelay::kPackedCols, c = id[t] % kvrelay::kPackedCols;
    const int32_t* qw = w.q + b * row_words * kvrelay::kPackedCols + c;
    const int32_t* qh = qw + K / 8 * kvrelay::kPackedCols;  // 5 bits: the fifth bits, a word per 32 k
    float* row = out + t * K;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = (b * groups + g) * kvrelay::kPackedCols + c;
      const float d = scale(w.scales, w.scale_d, at, b, g, c);
      const float off = static_cast<float>(kvrelay::signed_offset(w.bits));
      const float mn = w.mins ? scale(w.mins, w.min_d, at, b, g, c) : -off * d;  // (exact)
      for (int64_t k = g * G; k < (g + 1) * G; k += per) {
        const uint32_t word = static_cast<uint32_t>(qw[k / per * kvrelay::kPackedCols]);
        for (int64_t j = 0; j < per; ++j) {
          const int shift = w.bits == 8 ? 8 * j : 8 * (j & 3) + 4 * (j >> 2);  // (quant.h: a word's layout)
          uint32_t code = (word >> shift) & mask;
          if (w.bits == 5) {  // k = 8 wi + j of its block of 32: bit 8 j + 4 + wi (j < 4), 8 (j - 4) + wi
            const int64_t wi = k % 32 / 8;
            const int64_t at5 = j < 4 ? 8 * j + 4 + wi : 8 * (j - 4) + wi;
            code |= ((static_cast<uint32_t>(qh[k / 32 * kvrelay::kPackedCols]) >> at5) & 1u) << 4;
          }
          row[k + j] = w.grid ? static_cast<float>(w.grid[code]) * d : std::fma(static_cast<float>(code), d, mn);
        }
      }
    }
  }
  return y;
}
