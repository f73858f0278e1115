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
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

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

// The threads of one OpenMP region that run a whole decode step together (decode_step.cpp
// FusedDecoder), where par_for forks and joins once per op. A one-row step of the default model
// runs ~150 ops, most of them a few microseconds; with a join each, a thread that finishes its
// share first waits while memory idles, and the one-row ops between matrices (norms, rotary) run
// on one thread while the other spins. In a team every thread runs the whole step, each its share
// of a matmul's blocks or of attention's items, and repeats the small row ops itself into its own
// buffers (the same ops on the same inputs: the same bits on every thread), so threads meet only
// where one reads what another wrote. And a thread that reaches a barrier first fetches the start
// of its share of the next weight matrix meanwhile: weights do not depend on the activations.
class Team {
 public:
  const int rank, size;
  // [a, b): this thread's share of n items (consecutive, sizes within one of each other)
  std::pair<int64_t, int64_t> share(int64_t n) const { return {n * rank / size, n * (rank + 1) / size}; }
  // Waits for every thread of the team; meanwhile fetches [pf, pf + bytes) into L2. After a
  // thread has thrown (run rethrows it), barriers stop waiting: the step is lost anyway.
  void barrier(const void* pf = nullptr, int64_t bytes = 0) {
    const int gen = state_.gen.load(std::memory_order_relaxed);
    if (state_.arrived.fetch_add(1, std::memory_order_acq_rel) == size - 1) {
      state_.arrived.store(0, std::memory_order_relaxed);
      state_.gen.store(gen + 1, std::memory_order_release);
      return;
    }
    const char* p = static_cast<const char*>(pf);
    for (int64_t done = 0, turns = 0;
         state_.gen.load(std::memory_order_acquire) == gen && !state_.failed.load(std::memory_order_relaxed); ++turns) {
      if (done < bytes)  // a few lines a turn: the flag is looked at between them
        for (const int64_t end = std::min(bytes, done + 256); done < end; done += 64) _mm_prefetch(p + done, _MM_HINT_T1);
      else if (turns < kSpinTurns)
        _mm_pause();
      else  // long enough that the rank awaited may have lost its core (more threads than cores): give it ours
        std::this_thread::yield();
    }
  }
  // fn(team) on min(threads, the pool's) threads of one OpenMP region (1: on the caller, with no
  // region). The first exception thrown by fn is rethrown on the caller.
  template <class F>
  static void run(int threads, const F& fn) {
    State state;
    if (threads <= 1 || at::in_parallel_region()) {
      Team one(0, 1, state);
      fn(one);
      return;
    }
    std::exception_ptr error;
#pragma omp parallel  // (no num_threads clause, as par_for)
    {
      const int rank = omp_get_thread_num(), size = std::min(threads, omp_get_num_threads());
      at::internal::ThreadIdGuard guard(rank);
      if (rank < size) {
        Team team(rank, size, state);
        try {
          fn(team);
        } catch (...) {
#pragma omp critical(kvrelay_team)
          if (!state.failed.exchange(true)) error = std::current_exception();
        }
      }
    }
    if (error) std::rethrow_exception(error);
  }

 private:
  // turns of a barrier's wait spent spinning before each turn yields the core instead: tens of us,
  // several times a step's longest wait when every rank has a core of its own
  static constexpr int64_t kSpinTurns = 1 << 11;
  struct State {
    alignas(64) std::atomic<int> arrived{0};
    alignas(64) std::atomic<int> gen{0};
    std::atomic<bool> failed{false};
  };
  Team(int rank_, int size_, State& state) : rank(rank_), size(size_), state_(state) {}
  State& state_;
};

// y[M, N] = x[M, K] @ W^T, W packed; rows of x and y contiguous; any M.
void matmul_packed(const bf16* x, const bf16* wp, bf16* y, int64_t M, int64_t K, int64_t N, int threads);
// Only output blocks [b0, b1) of 32 columns (a team's share, y's other columns untouched), on the
// calling thread.
void matmul_packed_blocks(const bf16* x, const bf16* wp, bf16* y, int64_t M, int64_t K, int64_t N, int64_t b0,
                          int64_t b1);
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
// decode_attention's work for one batch, planned once: the items depend only on the batch's
// lengths and shape, so a fused step plans once for all its layers (its team then runs each
// layer's items split between its threads). run: items [first, last); merge, after every item
// has run: the parts of contexts longer than one item's (has_parts), on one thread.
template <class E>
class DecodeAttention {
 public:
  struct Args {  // one layer's: decode_attention's arguments
    const E* q;
    int64_t qs0;
    const E* kv;
    int64_t BS, Hkv;
    const int64_t* tables;
    int64_t maxnb;
    E* out;
    int64_t os0;
    float scale;
  };
  DecodeAttention(const int64_t* lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int threads);
  int64_t size() const { return static_cast<int64_t>(items_.size()); }
  bool has_parts() const { return parts_ > 0; }
  void run(const Args& a, int64_t first, int64_t last);
  void merge(const Args& a);

 private:
  struct Item {
    int64_t s, hk, h0, heads, t0, n, part;  // part: its slot in the partial results, -1 for none
  };
  int64_t G_, D_, parts_ = 0;
  std::vector<Item> items_;
  std::vector<float> part_acc_, part_stats_;
};
}  // namespace kvrelay
