// Raw bf16 CPU kernels shared by the per-op wrappers (cpu_ops.cpp,
// matmul_bf16.cpp) and the fused decode step (decode_step.cpp), for the ISA
// this module is compiled for (isa.h). Every kernel takes `threads`: 1 runs it
// on the calling thread (no fork/join, no spinning workers), more runs it on
// torch's intra-op pool.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <cstdint>

#include "isa.h"

namespace kvrelay {

template <class F>
inline void par_for(int64_t n, int64_t grain, int threads, const F& fn) {
  if (n <= 0) return;
  if (threads <= 1 || n <= grain) {
    fn(int64_t{0}, n);
    return;
  }
  at::parallel_for(0, n, grain, fn);
}

// y[M, N] = x[M, K] @ W^T, W packed; rows of x and y contiguous; any M.
void matmul_packed(const bf16* x, const bf16* wp, bf16* y, int64_t M, int64_t K, int64_t N, int threads);
// Same, fp32 output (the LM head: logits stay fp32).
void matmul_packed_f32(const bf16* x, const bf16* wp, float* y, int64_t M, int64_t K, int64_t N, int threads);
// Checks that w is a packed [n, k] weight (contiguous bf16 [ceil(n/32), k/2, 32, 2]); `what` names the caller.
void check_packed(const at::Tensor& w, int64_t n, int64_t k, const char* what);
// The elementwise kernels, each for E = bf16 (the bf16 model) and E = float (the
// quantized model's fp32 activations); cpu_ops.cpp.
#define KVRELAY_ELEMENTWISE_DECL(E)                                                                                 \
  /* x += delta (skipped when delta is null), out = rms_norm(x) * w; [T, H]. */                                      \
  void add_rms_norm(E* x, const E* delta, const E* w, E* out, int64_t T, int64_t H, float eps, int threads);       \
  /* RMSNorm of each head vector in place: x rows of `D` at x + t*s0 + h*D. */                                       \
  void head_rms_norm(E* x, int64_t s0, int64_t T, int64_t NH, int64_t D, const E* w, float eps, int threads);      \
  /* gate_up [T, 2I] -> silu(gate) * up [T, I]. */                                                                   \
  void silu_mul(const E* gate_up, E* out, int64_t T, int64_t I, int threads);                                       \
  /* Rotate heads in place (rotate-half layout); head h of token t at x + t*s0 + h*s1. */                            \
  void rope(E* x, int64_t s0, int64_t s1, int64_t T, int64_t NH, int64_t D, const E* cos, const E* sin,             \
            const int64_t* positions, int threads);                                                                 \
  /* One query per sequence against its paged context. q [B, H, D] (row stride qs0), */                              \
  /* kv [NB, 2, BS, Hkv, D], tables [B, maxnb], lens [B]; out [B, H, D] (row stride os0). */                         \
  void decode_attention(const E* q, int64_t qs0, const E* kv, int64_t BS, int64_t Hkv, const int64_t* tables,       \
                        int64_t maxnb, const int64_t* lens, E* out, int64_t os0, int64_t B, int64_t H, int64_t D,   \
                        float scale, int threads);
KVRELAY_ELEMENTWISE_DECL(bf16)
KVRELAY_ELEMENTWISE_DECL(float)
#undef KVRELAY_ELEMENTWISE_DECL
}  // namespace kvrelay
