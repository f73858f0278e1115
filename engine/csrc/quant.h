// Quantized matmul weights kept quantized (engine/quant.py QuantWeight), and
// the per-ISA integer steps that widen them to fp32 in registers
// (matmul_quant.cpp).
//
// W [n, k] is held in blocks of 32 output rows, like the bf16 packing
// (isa.h kPackedCols), with the codes of `per` = 32 / bits consecutive k of one
// row in one 32-bit word, lowest bits first:
//
//   q[b][k / per][c]          bits [bits * (k % per), bits * (k % per + 1)) hold W's code at (32 b + c, k)
//   scales[b][k / group][c]   fp16 (a GGUF's own) or fp32 (int8 made at load)
//   mins[b][k / group][c]     the same type
//
// so W[32 b + c, k] = code * scale + min, the code unsigned (4 or 8 bits; the
// signed bytes of Q8_0 and int8 are held + 128, with min = -128 scale, exact).
// A k-word of a block is 32 words = 128 bytes, read as Vec-sized runs of
// columns; the code of k is one mask (or shift) away, for all lanes at once,
// with no shuffles.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "isa.h"

namespace kvrelay {

struct QuantMatrix {
  const int32_t* q;
  const void* scales;
  const void* mins;
  int64_t n, k, group;
  int bits;          // 8: bytes, 4: nibbles
  bool f16;          // scales and mins are fp16 (else fp32)
};

// y[M, n] = x[M, k] @ W^T in fp32, W quantized; rows of x and y contiguous; any M.
// Per group of k: s = sum of code * x (fp32 FMAs, k ascending, even and odd k
// in two sums added at the group's end), then
// y = fma(s, scale, y), y = fma(sum of x, min, y), groups in order, whatever M
// is, so a row's result does not depend on its batch.
void matmul_quant(const float* x, const QuantMatrix& w, float* y, int64_t M, int threads);
// The QuantMatrix of tensors q (int32 [ceil(n/32), k/per, 32]), scales and mins
// ([ceil(n/32), k/group, 32], both fp16 or both fp32), checked;
// `what` names the caller. k = 0: any k (taken from q), else q must hold k.
QuantMatrix quant_matrix(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& mins, int64_t n, int64_t k,
                         int64_t bits, const char* what);

#if defined(__AVX512F__)
struct QVec {
  using I = __m512i;
  static I load(const int32_t* p) { return _mm512_loadu_si512(p); }
  // The code of slot J of each lane's word, as fp32.
  template <int BITS, int J>
  static __m512 code(I v) {
    if constexpr (J == 32 / BITS - 1)
      return _mm512_cvtepi32_ps(_mm512_srli_epi32(v, BITS * J));
    else
      return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, BITS * J), _mm512_set1_epi32((1 << BITS) - 1)));
  }
  // The same times 2^(BITS J) (one mask, no shift), but for the top slot, which is code(): exact.
  template <int BITS, int J>
  static __m512 code_in_place(I v) {
    if constexpr (J == 32 / BITS - 1)
      return code<BITS, J>(v);
    else
      return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(((1 << BITS) - 1) << (BITS * J))));
  }
  static __m512 load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};
#else
struct QVec {
  using I = __m256i;
  static I load(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  template <int BITS, int J>
  static __m256 code(I v) {
    if constexpr (J == 32 / BITS - 1)
      return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, BITS * J));
    else
      return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, BITS * J), _mm256_set1_epi32((1 << BITS) - 1)));
  }
  template <int BITS, int J>
  static __m256 code_in_place(I v) {
    if constexpr (J == 32 / BITS - 1)
      return code<BITS, J>(v);
    else
      return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(((1 << BITS) - 1) << (BITS * J))));
  }
  static __m256 load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};
#endif

}  // namespace kvrelay
