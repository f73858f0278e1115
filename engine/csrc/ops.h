// Raw bf16 CPU kernels shared by the per-op wrappers (cpu_ops.cpp,
// matmul_bf16.cpp) and the fused decode step (decode_step.cpp), for the ISA
// this module is compiled for (isa.h). Every kernel takes `threads`: 1 runs it
// on the calling thread (no fork/join, no spinning workers), more runs it on
// torch's intra-op pool.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <tuple>
#include <utility>

#include "isa.h"

namespace kvrelay {

// fn(a, b) over [0, n) on up to `threads` threads, in chunks of at least `grain`
// claimed one after another from a shared counter, not split evenly in advance:
// a decode step runs hundreds of these, each a few microseconds, and with equal
// shares every one waited for the slower thread (a core shared with another job,
// a cold cache), which perf showed as a fifth of both threads' time spinning.
// Which thread runs a chunk never changes what it computes, so the bits are the
// same. The first exception thrown by fn is rethrown on the caller. `per_thread`:
// chunks a thread, about (the decode matmuls take one, a single weight stream a
// thread: matmul_bf16.cpp, matmul_quant.cpp).
template <class F>
inline void par_for(int64_t n, int64_t grain, int threads, const F& fn, int per_thread = 4) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  if (threads <= 1 || n <= grain || at::in_parallel_region()) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t nt = std::min<int64_t>(std::min(threads, at::get_num_threads()), (n + grain - 1) / grain);
  // four chunks a thread by default: few enough claims, small enough for the faster thread to take more
  const int64_t chunk = std::max(grain, n / (std::max(per_thread, 1) * nt));
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
#pragma omp parallel  // (no num_threads clause: torch avoids it for GOMP's pool, pytorch#32008)
  {
    const int tid = omp_get_thread_num();
    at::internal::ThreadIdGuard guard(tid);
    for (int64_t a; tid < nt && !failed.load(std::memory_order_relaxed) && (a = next.fetch_add(chunk)) < n;) {
      try {
        fn(a, std::min(n, a + chunk));
      } catch (...) {
#pragma omp critical(kvrelay_par_for)
        if (!failed.exchange(true)) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

// y[M, N] = x[M, K] @ W^T, W packed; rows of x and y contiguous; any M.
void matmul_packed(const bf16* x, const bf16* wp, bf16* y, int64_t M, int64_t K, int64_t N, int threads);
// Same, fp32 output (the LM head: logits stay fp32).
void matmul_packed_f32(const bf16* x, const bf16* wp, float* y, int64_t M, int64_t K, int64_t N, int threads);
// How bf16 matmuls of decode rows stream their weights, process-wide (matmul_bf16.cpp): chunks of
// blocks a thread (1-64), and what each block's tile prefetches: the thread's next block, in
// matmuls of prefetch_next_from rows or more (0: none; 1: all), and in those of fewer rows its own
// stream prefetch_ahead bytes ahead (a multiple of 64 up to 1 MiB; 0: nothing). default_decode_stream:
// this ISA's defaults, in decode_stream's order.
void set_decode_stream(int chunks_per_thread, int prefetch_next_from, int64_t prefetch_ahead);
std::tuple<int, int, int64_t> decode_stream();
std::tuple<int, int, int64_t> default_decode_stream();
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
