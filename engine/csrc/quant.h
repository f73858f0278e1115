// Quantized matmul weights kept quantized (engine/quant.py QuantWeight), and
// the per-ISA integer dot products that multiply their codes in registers
// (matmul_quant.cpp).
//
// W [n, k] is held in blocks of 32 output rows, like the bf16 packing
// (isa.h kPackedCols), with the codes of `per` = 32 / bits consecutive k of one
// row in one 32-bit word, lowest bits first:
//
//   q[b][k / per][c]          W's codes at (32 b + c, k) for per consecutive k: 8 bits, byte k % per;
//                             4 bits, byte j = k % 4 of the word, k % 8 = j in its low nibble, j + 4 its high;
//                             5 bits: their low 4 bits so, then q[b][k / 8 + k / 32][c] their fifth
//                             bits per 32 k, k = 8 wi + j of the 32 at bit 8 j + 4 + wi (j < 4) or
//                             8 (j - 4) + wi, so that word wi's bits are bit 4 of its bytes after one
//                             shift and mask
//   scales[b][k / group][c]   fp16 (a GGUF's own), fp32 (int8 made at load), or int8 codes
//                             (the k-quants' 6-bit sub-block scales, as stored)
//   mins[b][k / group][c]     the same type; absent (an empty tensor) where the codes are
//                             signed bytes held + 128 (Q8_0, Q5_0, Q6_K, int8) or signed
//                             nibbles held + 8 (Q4_0, Q3_K)
//   scale_d[b][k / sup][c]    int8 scale codes only: fp32 factors, one per `sup` k (a k-quant's
//   min_d[b][k / sup][c]      super-block of 256: its fp16 d and -dmin), so scale = scale_d * code
//                             and min = min_d * code in fp32, one rounding each, the products
//                             llama.cpp and gguf dequantize with
//
// so W[32 b + c, k] = code * scale + min, the code unsigned (4 or 8 bits), and
// without minimums min = -128 (bytes) or -8 (nibbles) scale, exact. group: 32 or more (or the whole
// row), or 16 for 8- or 4-bit codes with fp32 or coded scales (Q6_K, Q3_K; Q2_K). Coded scales
// read 3 bytes per 32 k of a column where fp32 ones read 8: Q4_K 4.75 bits a
// weight instead of 6.0, Q6_K as bytes 8.6 instead of 10.
// A k-word of a block is 32 words = 128 bytes, read as vector-sized runs of
// columns; a word's codes are bytes as they are (8 bits) or one mask (and a
// shift) away (4 bits), for all lanes at once, with no shuffles.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "isa.h"

namespace kvrelay {

// How a matrix's scales and minimums are held.
enum ScaleForm : int { kScaleF32 = 0, kScaleF16 = 1, kScaleCoded = 2 };

// QuantMatrix::bits of 4-bit indices into a grid of 16 signed byte values (IQ4_NL, IQ4_XS): packed
// as nibbles, looked up in registers into the values + 128, then read as signed bytes are.
constexpr int kGridBits = 6;

// What signed codes without minimums are held + (the minimum is -that x scale): bytes (and grid
// values) 128, nibbles 8 (engine/quant.py signed_offset).
constexpr int32_t signed_offset(int bits) { return bits == 4 ? 8 : 128; }

struct QuantMatrix {
  const int32_t* q;
  const void* scales;
  const void* mins;      // null: 8-bit signed codes held + 128
  const float* scale_d;  // kScaleCoded: the factors of the scale codes, per sup k (else null)
  const float* min_d;    // kScaleCoded with mins: the factors of the minimum codes
  int64_t n, k, group, sup;
  int bits;              // 8: bytes, 4: nibbles, 5: nibbles and a plane of fifth bits, kGridBits
  ScaleForm form;
  const int8_t* grid;    // kGridBits: the 16 values the nibbles index (else null)
};

// y[M, n] = x[M, k] @ W^T in fp32, W quantized; rows of x and y contiguous; any M.
// Each 32 k of a row of x are held as integers X = x * 2^E (E per row and 32 k,
// X within ~2^-22 of the largest |x| against 4-bit codes, ~2^-19 against 8-bit
// ones; matmul_quant.cpp says why), the sums of code * X are exact integers,
// and per 32 k
// y = fma(s * 2^-E, scale, y) (+ sum of X * 2^-E * min, 4-bit codes), in order,
// whatever M is: a row's result does not depend on its batch or the ISA.
// b0, b1: only output blocks [b0, b1) of 32 columns (b1 < 0: all), y's other columns untouched.
void matmul_quant(const float* x, const QuantMatrix& w, float* y, int64_t M, int threads, int64_t b0 = 0,
                  int64_t b1 = -1);
// The QuantMatrix of tensors q (int32 [ceil(n/32), k/per, 32]), scales and mins
// ([ceil(n/32), k/group, 32], both fp16, fp32 or int8 codes) and, for codes, scale_d
// and min_d (fp32 [ceil(n/32), k/sup, 32]; min_d empty where mins is), checked;
// `what` names the caller. k = 0: any k (taken from q), else q must hold k.
QuantMatrix quant_matrix(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& mins,
                         const at::Tensor& scale_d, const at::Tensor& min_d, int64_t n, int64_t k, int64_t bits,
                         const char* what, const at::Tensor& grid = at::Tensor());

// Integer dot products of unsigned 8-bit codes with signed 8-bit digits of
// the activations (matmul_quant.cpp), for all lanes at once: each 32-bit lane
// holds one output column's four codes, `dot` adds their products with the
// four digits of `s` to the lane's sum.
//
// - AVX-512: vpdpbusd (AVX512-VNNI) sums into 32-bit lanes directly.
// - AVX2: vpmaddubsw sums pairs into 16-bit halves, added up through one
//   32-k block (at most 8 dots of 4-bit codes: 8 x 2 x 15 x 128 = 30720, so
//   they never saturate); finish() widens the halves to the lane's sum.
//   dot_wide() widens each dot at once (vpmaddwd), for 8-bit codes against
//   base-128 digits: 2 x 255 x 64 = 32640 still fits a half.
// Both compute the same integers exactly, so the paths give the same bits.
#if defined(__AVX512F__)
#if !defined(__AVX512VNNI__)
#error "the AVX-512 build of the quantized kernels needs AVX512-VNNI (engine/kernels.py ISAS)"
#endif
struct IVec {
  using I = __m512i;
  static I zero() { return _mm512_setzero_si512(); }
  static I load(const int32_t* p) { return _mm512_loadu_si512(p); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I low_nibbles(I v) { return _mm512_and_si512(v, _mm512_set1_epi32(0x0F0F0F0F)); }
  static I high_nibbles(I v) { return _mm512_and_si512(_mm512_srli_epi32(v, 4), _mm512_set1_epi32(0x0F0F0F0F)); }
  static I dot(I acc, I u, int32_t s) { return _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(s)); }
  static I finish(I acc) { return acc; }
  static I dot_wide(I acc, I u, int32_t s) { return _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(s)); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  template <int S>
  static I shl(I a) { return _mm512_slli_epi32(a, S); }
  static __m512 to_float(I a) { return _mm512_cvtepi32_ps(a); }
  static I round(__m512 v) { return _mm512_cvtps_epi32(v); }  // to nearest even
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  template <int S>
  static I shr_by(I a) { return _mm512_srli_epi32(a, S); }  // logical
  template <int S>
  static I sra(I a) { return _mm512_srai_epi32(a, S); }
  static void store_bytes(int8_t* p, I a) {  // the lanes' low bytes (values in [-128, 127])
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a));
  }
  static __m512 load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static I grid(const int8_t* g) {  // the 16 values + 128, as unsigned bytes in every 128-bit lane
    return _mm512_broadcast_i32x4(_mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)),
                                               _mm_set1_epi8(static_cast<char>(-128))));
  }
  static I lookup(I table, I idx) { return _mm512_shuffle_epi8(table, idx); }  // idx: bytes 0..15
  static __m512 load_i8(const int8_t* p) {  // 16 signed bytes as fp32
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};
#else
struct IVec {
  using I = __m256i;
  static I zero() { return _mm256_setzero_si256(); }
  static I load(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I low_nibbles(I v) { return _mm256_and_si256(v, _mm256_set1_epi32(0x0F0F0F0F)); }
  static I high_nibbles(I v) { return _mm256_and_si256(_mm256_srli_epi32(v, 4), _mm256_set1_epi32(0x0F0F0F0F)); }
  static I dot(I acc, I u, int32_t s) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, _mm256_set1_epi32(s))); }
  static I finish(I acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
  // the same, widened at once (codes up to 255 against |digits| up to 64: no pair saturates)
  static I dot_wide(I acc, I u, int32_t s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_set1_epi32(s)), _mm256_set1_epi16(1)));
  }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  template <int S>
  static I shl(I a) { return _mm256_slli_epi32(a, S); }
  static __m256 to_float(I a) { return _mm256_cvtepi32_ps(a); }
  static I round(__m256 v) { return _mm256_cvtps_epi32(v); }  // to nearest even
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  template <int S>
  static I shr_by(I a) { return _mm256_srli_epi32(a, S); }  // logical
  template <int S>
  static I sra(I a) { return _mm256_srai_epi32(a, S); }
  static void store_bytes(int8_t* p, I a) {  // the lanes' low bytes (values in [-128, 127])
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
  }
  static __m256 load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static I grid(const int8_t* g) {  // the 16 values + 128, as unsigned bytes in both 128-bit lanes
    return _mm256_broadcastsi128_si256(_mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)),
                                                    _mm_set1_epi8(static_cast<char>(-128))));
  }
  static I lookup(I table, I idx) { return _mm256_shuffle_epi8(table, idx); }  // idx: bytes 0..15
  static __m256 load_i8(const int8_t* p) {  // 8 signed bytes as fp32
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
};
#endif

}  // namespace kvrelay
