// The instruction-set-specific part of the CPU kernels, for the ISA this
// translation unit is compiled for (engine/kernels.py builds one extension
// module per ISA from the same sources, each with its own -m flags):
//
//   avx512bf16  -mavx512f -mavx512bw -mavx512vl -mavx512bf16   zmm, vdpbf16ps
//               -mavx512vnni                                  (quant.h: vpdpbusd)
//   avx512      -mavx512f -mavx512bw -mavx512vl -mavx512vnni   zmm, bf16 widened in registers, FMA
//                                                             (AVX-512 without BF16: Intel's
//                                                             Cascade Lake and Ice Lake; quant.h
//                                                             as avx512bf16)
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
#include <array>
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#if defined(__AVX512BF16__)
#define KVRELAY_ISA_NAME "avx512bf16"
#else
#define KVRELAY_ISA_NAME "avx512"
#endif

struct Vec {
  using T = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kRegs = 32;
  static constexpr int kAccRegs = 16;  // of 32 zmm: what a kernel may keep as accumulators
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float v) { return _mm512_set1_ps(v); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T load_bf16(const bf16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  // kLanes bf16 pairs (W[c][k], W[c][k+1]) of [p, p + 2 kLanes) widened: k of each lane, then k + 1
  static void widen_pairs(const bf16* p, T& even, T& odd) {
    const __m512i r = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  }
#if defined(__AVX512BF16__)
  static __m256i to_bf16(T v) { return (__m256i)_mm512_cvtneps_pbh(v); }  // nearest even
  static T round_bf16(T v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
  }
#else
  // Round to nearest even, as c10::BFloat16(float) and vcvtneps2bf16 do (NaN aside): add
  // 0x7FFF plus the lowest kept bit, keep the top 16 bits.
  static __m512i bf16_bits(T v) {  // the bf16 in the top half of each 32-bit lane, low half zero
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  }
  static __m256i to_bf16(T v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16)); }
  static T round_bf16(T v) { return _mm512_castsi512_ps(bf16_bits(v)); }
#endif
  static void store_bf16(bf16* p, T v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v)); }
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

#if defined(__AVX512BF16__)
// One k-pair of a packed block is two zmm registers (32 columns x 2 k); each
// row's x[m, k:k+2] is broadcast as one 32-bit value and vdpbf16ps adds both
// products into the fp32 lanes of the outputs, so there are no horizontal
// reductions. x stays bf16: rows of x (XP false, row stride K) or the tile's
// rows interleaved by k-pair ([K/2][MR][2], XP true).
struct MatmulTile {
  using XElem = bf16;
  static constexpr int kMaxRows = 12;  // 24 accumulators + 2 weights + 1 broadcast
  // decode rows from which a tile fetches its thread's next block (matmul_bf16.cpp g_decode_prefetch_from)
  static constexpr int kPrefetchFromRows = 8;
  // bytes ahead a tile of fewer decode rows fetches its own stream (matmul_bf16.cpp g_decode_ahead): none
  static constexpr int64_t kPrefetchAhead = 0;
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
#endif  // __AVX512BF16__

#elif defined(__AVX2__) && defined(__FMA__)
#define KVRELAY_ISA_NAME "avx2"

struct Vec {
  using T = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kRegs = 16;
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
  static void widen_pairs(const bf16* p, T& even, T& odd) {  // as the AVX-512 one
    const __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(r, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  }
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

#else
#error "engine/csrc needs AVX-512 or AVX2 + FMA (engine/kernels.py passes the -m flags)"
#endif

// bf16 weights widened to fp32 (a 16-bit shift), fp32 FMAs: the tile of every
// build without vdpbf16ps (avx2, avx512). A k-pair of kLanes columns is one
// vector of 32-bit (W[c][k], W[c][k+1]) pairs: W[c][k] is the lane shifted
// left 16 bits, W[c][k+1] the lane with its low half cleared (Vec::widen_pairs).
// x is always the tile's rows converted to fp32 and interleaved by k-pair
// ([K/2][MR][2]) beforehand, so x[m, k] is one broadcast load. Each output
// is summed k = 0, 1, 2, ... in one FMA chain, whatever the tile and the vector
// width, so the two ways a block is read below, and the avx2 and avx512 builds,
// give the same bits:
//
// - one tile per block (up to kMaxRows rows: decode): the weights are
//   widened in registers as they stream in. One row takes the block's 32
//   columns in one pass (on AVX2 4 FMA chains, which a single row needs to
//   keep memory busy, FMA latency being 4 cycles; in 16 columns it ran at half
//   the speed); more rows take as many columns a pass as their accumulators,
//   the widened weights and two broadcasts leave registers for (AVX2: 2-5 rows
//   16 columns, 6 rows 8; AVX-512: up to 12 rows all 32).
// - several tiles per block (tiles_k_blocked): the block is widened kKChunk k
//   at a time into a per-thread fp32 buffer that stays in L1, and every tile's
//   rows run over that chunk as a plain fp32 GEMM before the next chunk is
//   widened; the partial sums wait in fp32 between chunks (the same chain).
struct WidenTile {
  using V = Vec::T;
  using XElem = float;
  static constexpr int kL = Vec::kLanes;
  static constexpr int kFull = kPackedCols / kL;  // vectors of a block's 32 columns
  static constexpr int kMaxRows = Vec::kRegs == 32 ? 12 : 6;
  // decode rows from which a tile fetches its thread's next block (matmul_bf16.cpp g_decode_prefetch_from)
  static constexpr int kPrefetchFromRows = Vec::kRegs == 32 ? 3 : 2;
  // bytes ahead a tile of fewer decode rows fetches its own stream (matmul_bf16.cpp g_decode_ahead):
  // avx2 1 KiB (a Zen 3's one row 1.00-1.10x), avx512 none
  static constexpr int64_t kPrefetchAhead = Vec::kRegs == 32 ? 0 : 1024;
  // rows of a chunk_rows group, and the vectors of columns a pass of it takes: G x kPassVectors
  // accumulators beside kPassVectors weights and a broadcast. AVX2: 6 rows x 16 columns in two
  // passes over the widened chunk (12 + 2 + 1 of its 16 registers), where 3 rows x all 32 columns
  // (12 + 4 + 1: one short, so the compiler read weights as memory operands, once per row) ran
  // prefill's matmuls at 63-70 GFLOPS on a Zen 3 core against torch's fp32 SGEMM's 86-93
  // (BENCHMARKS.md "AVX2 matmul of many rows: 6 x 16 register tiles"). AVX-512: 8 rows x 32.
  static constexpr int kGroupRows = Vec::kRegs == 32 ? 8 : 6;
  static constexpr int kPassVectors = 2;
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
    static_assert(XP, "the widening tile reads fp32 x interleaved by k-pair");
    tile_bf16<MR>(x, blk.w, y, K, N, cols, pf, pf_len);
  }

  // Rows [0, R) in `tiles` tiles of near-equal size (rows_x_block's split; tile t's
  // rows interleaved by k-pair at x + m K) against one packed block wb, K-blocked.
  // Against the whole block widened at once ([K][32] fp32, 73 KiB at K = 576, in L2 and
  // re-read from there by every 3 rows), single-thread CPU time on AVX2, weights cold as in a
  // step: SmolLM2's LM head at 16 rows 15.0-16.7 -> 12.3-12.7 ms, at 128 rows 100-108 ->
  // 80-81 ms; the layer matmuls the same within the noise (~70 GFLOPS at 16 rows, ~100
  // at 128); chunks of 32-288 k all within 3% of each other.
  template <class Out>
  static void tiles_k_blocked(const float* x, const bf16* wb, Out* y, int64_t R, int64_t K, int64_t N,
                              int64_t cols, const char* pf, int64_t pf_len, int64_t tiles) {
    thread_local std::vector<float> wf(kKChunk * kPackedCols), part;
    part.resize(R * kPackedCols);  // [R][32]: the partial sums between chunks
    int64_t groups = 0;
    for (int64_t t = 0; t < tiles; ++t) groups += (R / tiles + (t < R % tiles) + kGroupRows - 1) / kGroupRows;
    Prefetcher fetch(pf, pf_len, groups * K / 2);
    static constexpr auto chunk = chunk_table<Out>(std::make_integer_sequence<int, kGroupRows>{});
    for (int64_t k0 = 0; k0 < K; k0 += kKChunk) {
      const int64_t kc = std::min(kKChunk, K - k0);
      widen(wb + k0 * kPackedCols, kc, wf.data());
      const bool first = k0 == 0, last = k0 + kc == K;
      for (int64_t t = 0, m = 0; t < tiles; ++t) {
        const int64_t r = R / tiles + (t < R % tiles);
        const float* xt = x + m * K + k0 * r;  // the tile's k-pairs from k0
        for (int64_t g = 0; g < r; g += kGroupRows) {
          const int64_t G = std::min<int64_t>(kGroupRows, r - g);
          chunk[G](xt + 2 * g, r, wf.data(), kc, part.data() + (m + g) * kPackedCols, first, last, y + (m + g) * N,
                   N, cols, fetch);
        }
        m += r;
      }
    }
  }

 private:
  template <class Out>
  using ChunkFn = void (*)(const float*, int64_t, const float*, int64_t, float*, bool, bool, Out*, int64_t, int64_t,
                           Prefetcher&);
  template <class Out, int... G>
  static constexpr std::array<ChunkFn<Out>, kGroupRows + 1> chunk_table(std::integer_sequence<int, G...>) {
    return {nullptr, &chunk_rows<G + 1, Out>...};
  }

  static void widen(const bf16* wb, int64_t kc, float* wf) {  // kc k of a packed block -> [kc][32] fp32
    for (int64_t kp = 0; kp < kc / 2; ++kp, wb += 2 * kPackedCols)
      for (int c = 0; c < kFull; ++c) {  // kL columns x 2 k
        V e, o;
        Vec::widen_pairs(wb + 2 * kL * c, e, o);
        float* d = wf + 2 * kp * kPackedCols + kL * c;
        Vec::store(d, e);
        Vec::store(d + kPackedCols, o);
      }
  }

  // G rows (x: their k-pairs, `rows` rows per k-pair) x 32 columns against kc k of the
  // widened block, kPassVectors vectors of columns a pass: G x kPassVectors accumulators +
  // kPassVectors weights + 1 broadcast (AVX2, G = 6: 12 + 2 + 1, one broadcast per 2 FMAs). The
  // sums start at zero (first) or from part ([G][32]), and end in y (last) or in part; each is the
  // same chain, k ascending, whatever the pass or group.
  template <int G, class Out>
  static void chunk_rows(const float* x, int64_t rows, const float* wf, int64_t kc, float* part, bool first,
                         bool last, Out* y, int64_t N, int64_t cols, Prefetcher& fetch) {
    constexpr int NV = kPassVectors;
    for (int64_t c0 = 0; c0 < std::min<int64_t>(cols, kPackedCols); c0 += kL * NV) {  // (padding columns: none)
      V acc[G][NV];
#pragma GCC unroll 32
      for (int i = 0; i < G * NV; ++i)
        acc[i / NV][i % NV] = first ? Vec::zero() : Vec::load(part + i / NV * kPackedCols + c0 + kL * (i % NV));
      const float* xk = x;
      const float* w = wf + c0;
      for (int64_t k = 0; k < kc; k += 2, xk += 2 * rows) {
        if (c0 == 0) fetch.step();
        for (int j = 0; j < 2; ++j, w += kPackedCols) {
          V wv[NV];
          for (int c = 0; c < NV; ++c) wv[c] = Vec::load(w + kL * c);
          for (int m = 0; m < G; ++m) {
            const V xv = Vec::set1(xk[2 * m + j]);
            for (int c = 0; c < NV; ++c) acc[m][c] = Vec::fmadd(wv[c], xv, acc[m][c]);
          }
        }
      }
      if (last) {
        flush<G, NV>(acc, y + c0, N, cols - c0);
        continue;
      }
#pragma GCC unroll 32
      for (int i = 0; i < G * NV; ++i) Vec::store(part + i / NV * kPackedCols + c0 + kL * (i % NV), acc[i / NV][i % NV]);
    }
  }

  // vectors of kL columns per row per pass: the whole block for one row, else as many as
  // MR rows' accumulators leave registers for beside the widened weights and 2 broadcasts
  template <int MR>
  static constexpr int pass_vectors() {
    if (MR == 1) return kFull;
    int nc = kFull;
    while (nc > 1 && MR * nc + 2 * nc + 2 > Vec::kRegs) nc /= 2;
    return nc;
  }

  template <int MR, class Out>
  static void tile_bf16(const float* x, const bf16* wb, Out* y, int64_t K, int64_t N, int64_t cols, const char* pf,
                        int64_t pf_len) {
    constexpr int NC = pass_vectors<MR>();
    constexpr int64_t kPassCols = kL * NC;
    const int64_t passes = (cols + kPassCols - 1) / kPassCols;
    Prefetcher fetch(pf, pf_len, passes * K / 2);
    for (int64_t h = 0; h < passes; ++h) {
      V acc[MR][NC];
      for (int m = 0; m < MR; ++m)
        for (int c = 0; c < NC; ++c) acc[m][c] = Vec::zero();
      const bf16* w = wb + 2 * kPassCols * h;  // a k-pair of the block is 64 bf16, 2 kL per vector
      const float* xk = x;
      for (int64_t k = 0; k < K; k += 2, w += 2 * kPackedCols, xk += 2 * MR) {
        fetch.step();
        V e[NC], o[NC];
        for (int c = 0; c < NC; ++c) Vec::widen_pairs(w + 2 * kL * c, e[c], o[c]);
        for (int m = 0; m < MR; ++m) {
          const V x0 = Vec::set1(xk[2 * m]), x1 = Vec::set1(xk[2 * m + 1]);
          for (int c = 0; c < NC; ++c) acc[m][c] = Vec::fmadd(o[c], x1, Vec::fmadd(e[c], x0, acc[m][c]));
        }
      }
      flush<MR, NC>(acc, y + kPassCols * h, N, cols - kPassCols * h);
    }
  }

  // Rows [0, MR) of kL NC accumulated columns into y (row stride N), the first n of
  // them (n may exceed kL NC). Through an fp32 buffer in loops GCC unrolls fully:
  // an accumulator array whose elements were indexed by a loop it did not unroll
  // got a stack copy that was written back on every k step (a third slower).
  template <int MR, int NC, class Out>
  static void flush(const V (&acc)[MR][NC], Out* y, int64_t N, int64_t n) {
    alignas(64) float res[MR][kL * NC];
#pragma GCC unroll 32
    for (int i = 0; i < MR * NC; ++i) Vec::store(res[i / NC] + kL * (i % NC), acc[i / NC][i % NC]);
    n = std::min<int64_t>(n, kL * NC);
    for (int m = 0; m < MR; ++m) put(y + m * N, res[m], n);
  }
  static void put(float* y, const float* v, int64_t n) { std::memcpy(y, v, n * sizeof(float)); }
  static void put(bf16* y, const float* v, int64_t n) {
    int64_t i = 0;
    for (; i + kL <= n; i += kL) Vec::store_bf16(y + i, Vec::load(v + i));
    for (; i < n; ++i) y[i] = bf16(v[i]);
  }
};

#if !defined(__AVX512BF16__)
using MatmulTile = WidenTile;
#endif

}  // namespace kvrelay
