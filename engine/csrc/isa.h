// The instruction-set-specific part of the CPU kernels, for the ISA this
// translation unit is compiled for (engine/kernels.py builds one extension
// module per ISA from the same sources, each with its own -m flags):
//
//   avx512bf16  -mavx512f -mavx512bw -mavx512vl -mavx512bf16   zmm, vdpbf16ps
//               -mavx512vnni                                  (quant.h: vpdpbusd)
//   avx2        -mavx2 -mfma -mf16c                            ymm, bf16 widened in registers, FMA
//
// Everything else (cpu_ops.cpp, matmul_bf16.cpp, decode_step.cpp) is written
// once against what this header defines:
//
//   Vec          fp32 SIMD vector ops: kLanes floats, load/store, bf16 load
//                (a 16-bit shift: bf16 is the top half of an fp32) and store
//                (round to nearest even), arithmetic, reductions, ldexp.
//   MatmulTile   the register tile of the packed matmul (see matmul_bf16.cpp):
//                XElem, the activations' element type in the tile's x layout,
//                and tile<MR, XP>(), MR rows against one packed block.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <c10/util/BFloat16.h>

namespace kvrelay {
using bf16 = c10::BFloat16;

// Output columns per block of a packed matmul weight (matmul_bf16.cpp): W [N, K]
// is stored as [ceil(N/32)][K/2][32][2] bf16, K even, padding columns zero.
// One layout for every ISA, so one packing serves whichever kernel runs.
constexpr int64_t kPackedCols = 32;

// Spreads software prefetches of [p, p + len) evenly over `steps` calls of step().
struct Prefetcher {
  const char* p;
  int64_t len, per_step, done = 0, due = 0;
  Prefetcher(const char* p_, int64_t len_, int64_t steps) : p(p_), len(len_), per_step(p_ ? (len_ + steps - 1) / steps : 0) {}
  inline void step() {
    if (!p) return;
    due += per_step;
    for (; done < due && done < len; done += 64) _mm_prefetch(p + done, _MM_HINT_T1);
  }
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVRELAY_ISA_NAME "avx512bf16"

struct Vec {
  using T = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kAccRegs = 16;  // of 32 zmm: what a kernel may keep as accumulators
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float v) { return _mm512_set1_ps(v); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T load_bf16(const bf16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static __m256i to_bf16(T v) { return (__m256i)_mm512_cvtneps_pbh(v); }  // nearest even
  static void store_bf16(bf16* p, T v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v)); }
  static T round_bf16(T v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
  }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T div(T a, T b) { return _mm512_div_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static T min(T a, T b) { return _mm512_min_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
  static T fnmadd(T a, T b, T c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
  static T round(T v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static T ldexp(T p, T n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
  static constexpr float kExpMax = 88.3762626647949f;           // exp() clamps its input to +-this
  static float reduce_add(T v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(T v) { return _mm512_reduce_max_ps(v); }
  // Lane i of the result is the sum of the lanes of v[i] (a transposing
  // reduction tree: 45 shuffles/adds instead of 16 horizontal reductions).
  static T sum_lanes(const T* v) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; ++i)
      t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
      const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
      u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    // each 128-bit lane of u[i] now holds partial sums for v[4i..4i+3]; add the four lanes
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
  }
};

// One k-pair of a packed block is two zmm registers (32 columns x 2 k); each
// row's x[m, k:k+2] is broadcast as one 32-bit value and vdpbf16ps adds both
// products into the fp32 lanes of the outputs, so there are no horizontal
// reductions. x stays bf16: rows of x (XP false, row stride K) or the tile's
// rows interleaved by k-pair ([K/2][MR][2], XP true).
struct MatmulTile {
  using XElem = bf16;
  static constexpr int kMaxRows = 12;  // 24 accumulators + 2 weights + 1 broadcast
  static constexpr bool kBlocksK = false;  // several tiles re-read the block from L1/L2, one after another
  static bool packs_x(int64_t M) { return M > 4 * kMaxRows; }
  struct Block {  // what the tiles of one block read: the packed block itself
    const bf16* w;
    Block(const bf16* w_, int64_t /*K*/, int64_t /*tiles*/) : w(w_) {}
  };

  template <int MR, bool XP, class Out>
  static void tile(const XElem* x, const Block& blk, Out* y, int64_t K, int64_t N, int64_t cols, const char* pf,
                   int64_t pf_len) {
    const bf16* wb = blk.w;
    __m512 lo[MR], hi[MR];
    for (int m = 0; m < MR; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
    Prefetcher fetch(pf, pf_len, K / 2);
    for (int64_t k = 0; k < K; k += 2, wb += 2 * kPackedCols) {
      fetch.step();
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wb + kPackedCols);
      for (int m = 0; m < MR; ++m) {
        const __m512bh xv = bcast_pair(XP ? x + k * MR + 2 * m : x + m * K + k);
        lo[m] = _mm512_dpbf16_ps(lo[m], w0, xv);
        hi[m] = _mm512_dpbf16_ps(hi[m], w1, xv);
      }
    }
    const __mmask16 m0 = cols >= 16 ? 0xFFFF : (1u << cols) - 1;
    const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1;
    for (int m = 0; m < MR; ++m) {
      store16(y + m * N, lo[m], m0);
      if (m1) store16(y + m * N + 16, hi[m], m1);
    }
  }

 private:
  static __m512bh bcast_pair(const bf16* p) {  // x[m, k], x[m, k+1] in every 32-bit lane
    int32_t v;
    std::memcpy(&v, p, sizeof v);
    return (__m512bh)_mm512_set1_epi32(v);
  }
  static void store16(bf16* y, __m512 v, __mmask16 mask) {
    const __m256i b = Vec::to_bf16(v);
    if (mask == 0xFFFF)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), b);
    else
      _mm256_mask_storeu_epi16(y, mask, b);
  }
  static void store16(float* y, __m512 v, __mmask16 mask) {
    if (mask == 0xFFFF)
      _mm512_storeu_ps(y, v);
    else
      _mm512_mask_storeu_ps(y, mask, v);
  }
};

#elif defined(__AVX2__) && defined(__FMA__)
#define KVRELAY_ISA_NAME "avx2"

struct Vec {
  using T = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kAccRegs = 8;  // of 16 ymm
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float v) { return _mm256_set1_ps(v); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T load_bf16(const bf16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  // Round to nearest even, as c10::BFloat16(float) does (NaN aside): add
  // 0x7FFF plus the lowest kept bit, keep the top 16 bits.
  static __m256i bf16_bits(T v) {  // the bf16 in the top half of each 32-bit lane, low half zero
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    return _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  }
  static __m128i to_bf16(T v) {
    const __m256i b = _mm256_srli_epi32(bf16_bits(v), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  }
  static void store_bf16(bf16* p, T v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(v)); }
  static T round_bf16(T v) { return _mm256_castsi256_ps(bf16_bits(v)); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T div(T a, T b) { return _mm256_div_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static T min(T a, T b) { return _mm256_min_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T fnmadd(T a, T b, T c) { return _mm256_fnmadd_ps(a, b, c); }
  static T round(T v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static T ldexp(T p, T n) {  // n in [-126, 127] (exp's clamp keeps it there): 2^n built in the exponent bits
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
  static constexpr float kExpMax = 87.3f;  // round(87.3 / ln 2) = 126: 2^n stays a normal float
  static float reduce_add(T v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
  static float reduce_max(T v) {
    const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
  }
  static T sum_lanes(const T* v) {  // lane i: the sum of v[i]'s lanes
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [v0..v3 | v0..v3], [v4..v7 | ...]
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }
};

// bf16 weights widened to fp32 (a 16-bit shift), fp32 FMAs. A k-pair of 8
// columns is one ymm of 32-bit (W[c][k], W[c][k+1]) pairs: W[c][k] is the
// lane shifted left 16 bits, W[c][k+1] the lane with its low half cleared.
// x is always the tile's rows converted to fp32 and interleaved by k-pair
// ([K/2][MR][2]) beforehand, so x[m, k] is one broadcast load. Each output
// is summed k = 0, 1, 2, ... in one FMA chain, whatever the tile, so the two
// ways a block is read below give the same bits:
//
// - one tile per block (up to kMaxRows rows: decode): the weights are
//   widened in registers as they stream in. One row takes the block's 32
//   columns in one pass (4 FMA chains, which a single row needs to keep
//   memory busy, FMA latency being 4 cycles; in 16 columns it ran at half
//   the speed); 2-5 rows two passes of 16 columns (2 x MR accumulators + 4
//   weights + 2 broadcasts fit 16 ymm), 6 rows four passes of 8.
// - several tiles per block (tiles_k_blocked): the block is widened kKChunk k
//   at a time into a per-thread fp32 buffer that stays in L1, and every tile's
//   rows run over that chunk as a plain fp32 GEMM before the next chunk is
//   widened; the partial sums wait in fp32 between chunks (the same chain).
struct MatmulTile {
  using XElem = float;
  static constexpr int kMaxRows = 6;
  static constexpr bool kBlocksK = true;  // rows_x_block hands several tiles to tiles_k_blocked
  // k of a block widened at a time: 64 x 32 fp32 = 8 KiB, with the tiles' x (16 rows: 4 KiB) in L1
  static constexpr int64_t kKChunk = 64;
  static bool packs_x(int64_t) { return true; }
  struct Block {
    const bf16* w;
    Block(const bf16* w_, int64_t /*K*/, int64_t /*tiles*/) : w(w_) {}
  };

  template <int MR, bool XP, class Out>
  static void tile(const XElem* x, const Block& blk, Out* y, int64_t K, int64_t N, int64_t cols, const char* pf,
                   int64_t pf_len) {
    static_assert(XP, "the avx2 tile reads fp32 x interleaved by k-pair");
    tile_bf16<MR>(x, blk.w, y, K, N, cols, pf, pf_len);
  }

  // Rows [0, R) in `tiles` tiles of near-equal size (rows_x_block's split; tile t's
  // rows interleaved by k-pair at x + m K) against one packed block wb, K-blocked.
  // Against the whole block widened at once ([K][32] fp32, 73 KiB at K = 576, in L2 and
  // re-read from there by every 3 rows), single-thread CPU time, weights cold as in a
  // step: SmolLM2's LM head at 16 rows 15.0-16.7 -> 12.3-12.7 ms, at 128 rows 100-108 ->
  // 80-81 ms; the layer matmuls the same within the noise (~70 GFLOPS at 16 rows, ~100
  // at 128); chunks of 32-288 k all within 3% of each other.
  template <class Out>
  static void tiles_k_blocked(const float* x, const bf16* wb, Out* y, int64_t R, int64_t K, int64_t N,
                              int64_t cols, const char* pf, int64_t pf_len, int64_t tiles) {
    thread_local std::vector<float> wf(kKChunk * kPackedCols), part;
    part.resize(R * kPackedCols);  // [R][32]: the partial sums between chunks
    int64_t groups = 0;
    for (int64_t t = 0; t < tiles; ++t) groups += (R / tiles + (t < R % tiles) + 2) / 3;
    Prefetcher fetch(pf, pf_len, groups * K / 2);
    for (int64_t k0 = 0; k0 < K; k0 += kKChunk) {
      const int64_t kc = std::min(kKChunk, K - k0);
      widen(wb + k0 * kPackedCols, kc, wf.data());
      const bool first = k0 == 0, last = k0 + kc == K;
      for (int64_t t = 0, m = 0; t < tiles; ++t) {
        const int64_t r = R / tiles + (t < R % tiles);
        const float* xt = x + m * K + k0 * r;  // the tile's k-pairs from k0
        for (int64_t g = 0; g < r; g += 3) {
          float* pg = part.data() + (m + g) * kPackedCols;
          Out* yg = y + (m + g) * N;
          switch (std::min<int64_t>(3, r - g)) {
            case 3: chunk_rows<3>(xt + 2 * g, r, wf.data(), kc, pg, first, last, yg, N, cols, fetch); break;
            case 2: chunk_rows<2>(xt + 2 * g, r, wf.data(), kc, pg, first, last, yg, N, cols, fetch); break;
            default: chunk_rows<1>(xt + 2 * g, r, wf.data(), kc, pg, first, last, yg, N, cols, fetch); break;
          }
        }
        m += r;
      }
    }
  }

 private:
  static void widen(const bf16* wb, int64_t kc, float* wf) {  // kc k of a packed block -> [kc][32] fp32
    const __m256i hi_mask = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    for (int64_t kp = 0; kp < kc / 2; ++kp, wb += 2 * kPackedCols)
      for (int c = 0; c < 4; ++c) {  // 8 columns x 2 k
        const __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 16 * c));
        float* d = wf + 2 * kp * kPackedCols + 8 * c;
        _mm256_storeu_ps(d, _mm256_castsi256_ps(_mm256_slli_epi32(r, 16)));
        _mm256_storeu_ps(d + kPackedCols, _mm256_castsi256_ps(_mm256_and_si256(r, hi_mask)));
      }
  }

  // G rows (x: their k-pairs, `rows` rows per k-pair) x 32 columns against kc k of the
  // widened block: 12 accumulators + 4 weights + 1 broadcast at G = 3, one broadcast per
  // 4 FMAs. The sums start at zero (first) or from part, and end in y (last) or in part.
  template <int G, class Out>
  static void chunk_rows(const float* x, int64_t rows, const float* wf, int64_t kc, float* part, bool first,
                         bool last, Out* y, int64_t N, int64_t cols, Prefetcher& fetch) {
    __m256 acc[G][4];
#pragma GCC unroll 16
    for (int i = 0; i < G * 4; ++i)
      acc[i / 4][i % 4] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(part + 8 * i);
    const float* xk = x;
    const float* w = wf;
    for (int64_t k = 0; k < kc; k += 2, xk += 2 * rows) {
      fetch.step();
      for (int j = 0; j < 2; ++j, w += kPackedCols) {
        __m256 wv[4];
        for (int c = 0; c < 4; ++c) wv[c] = _mm256_loadu_ps(w + 8 * c);
        for (int m = 0; m < G; ++m) {
          const __m256 xv = _mm256_broadcast_ss(xk + 2 * m + j);
          for (int c = 0; c < 4; ++c) acc[m][c] = _mm256_fmadd_ps(wv[c], xv, acc[m][c]);
        }
      }
    }
    if (last) {
      flush<G, 4>(acc, y, N, cols);
      return;
    }
#pragma GCC unroll 16
    for (int i = 0; i < G * 4; ++i) _mm256_storeu_ps(part + 8 * i, acc[i / 4][i % 4]);
  }

  template <int MR, class Out>
  static void tile_bf16(const float* x, const bf16* wb, Out* y, int64_t K, int64_t N, int64_t cols, const char* pf,
                        int64_t pf_len) {
    constexpr int NC = MR == 1 ? 4 : MR <= 5 ? 2 : 1;  // ymm of 8 columns per row per pass
    constexpr int64_t kPassCols = 8 * NC;
    const int64_t passes = (cols + kPassCols - 1) / kPassCols;
    Prefetcher fetch(pf, pf_len, passes * K / 2);
    const __m256i hi_mask = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    for (int64_t h = 0; h < passes; ++h) {
      __m256 acc[MR][NC];
      for (int m = 0; m < MR; ++m)
        for (int c = 0; c < NC; ++c) acc[m][c] = _mm256_setzero_ps();
      const bf16* w = wb + 2 * kPassCols * h;  // a k-pair of the block is 64 bf16, 16 per ymm
      const float* xk = x;
      for (int64_t k = 0; k < K; k += 2, w += 2 * kPackedCols, xk += 2 * MR) {
        fetch.step();
        __m256 e[NC], o[NC];
        for (int c = 0; c < NC; ++c) {
          const __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * c));
          e[c] = _mm256_castsi256_ps(_mm256_slli_epi32(r, 16));
          o[c] = _mm256_castsi256_ps(_mm256_and_si256(r, hi_mask));
        }
        for (int m = 0; m < MR; ++m) {
          const __m256 x0 = _mm256_broadcast_ss(xk + 2 * m), x1 = _mm256_broadcast_ss(xk + 2 * m + 1);
          for (int c = 0; c < NC; ++c) acc[m][c] = _mm256_fmadd_ps(o[c], x1, _mm256_fmadd_ps(e[c], x0, acc[m][c]));
        }
      }
      flush<MR, NC>(acc, y + kPassCols * h, N, cols - kPassCols * h);
    }
  }

  // Rows [0, MR) of 8 NC accumulated columns into y (row stride N), the first n of
  // them (n may exceed 8 NC). Through an fp32 buffer in loops GCC unrolls fully:
  // an accumulator array whose elements were indexed by a loop it did not unroll
  // got a stack copy that was written back on every k step (a third slower).
  template <int MR, int NC, class Out>
  static void flush(const __m256 (&acc)[MR][NC], Out* y, int64_t N, int64_t n) {
    alignas(32) float res[MR][8 * NC];
#pragma GCC unroll 32
    for (int i = 0; i < MR * NC; ++i) _mm256_store_ps(res[i / NC] + 8 * (i % NC), acc[i / NC][i % NC]);
    n = std::min<int64_t>(n, 8 * NC);
    for (int m = 0; m < MR; ++m) put(y + m * N, res[m], n);
  }
  static void put(float* y, const float* v, int64_t n) { std::memcpy(y, v, n * sizeof(float)); }
  static void put(bf16* y, const float* v, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) Vec::store_bf16(y + i, _mm256_load_ps(v + i));
    for (; i < n; ++i) y[i] = bf16(v[i]);
  }
};

#else
#error "engine/csrc needs AVX-512 BF16 or AVX2 + FMA (engine/kernels.py passes the -m flags)"
#endif

}  // namespace kvrelay
