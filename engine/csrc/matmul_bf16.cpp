// bf16 matmul on a pre-packed weight layout, for CPUs with AVX512-BF16.
//
// y[M, N] = x[M, K] @ W^T for any M: decode batches (1-48 rows) and prefill.
// W [N, K] is packed once at load (engine/kernels.py PackedWeight) into
// blocks of 32 output columns with K-pairs interleaved:
//
//   packed[b][k/2][c][k%2] = W[32 b + c][k]        shape [ceil(N/32), K/2, 32, 2]
//
// so each block is one contiguous run of memory: a thread that owns a range of
// blocks streams its weights strictly in order (what the hardware prefetcher
// follows at full bandwidth), and one k-pair of a block is two zmm registers,
// 32 columns x 2 k. The register tile is MR token rows x 32 columns: per
// k-pair, the two weight vectors are loaded once and each row's x[m, k:k+2]
// is broadcast as one 32-bit value; vdpbf16ps accumulates in fp32 straight
// into the outputs' lanes, so there are no horizontal reductions. Every row
// of the output is summed in the same order (k ascending) whatever M is, so a
// token's result does not depend on the batch it is in. Padding columns of
// the last block are zero and never stored.
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <utility>

#include "ops.h"

namespace kvrelay {
namespace {

constexpr int64_t kCols = kPackedCols;  // output columns per packed block (two zmm)
constexpr int kMaxRows = 12;            // rows per register tile: 24 accumulators + 2 weights + 1 broadcast

inline __m512bh bcast_pair(const bf16* p) {  // x[m, k], x[m, k+1] in every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return (__m512bh)_mm512_set1_epi32(v);
}

inline void store16(bf16* y, __m512 v, __mmask16 mask) {  // round to nearest even
  const __m256i b = (__m256i)_mm512_cvtneps_pbh(v);
  if (mask == 0xFFFF)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), b);
  else
    _mm256_mask_storeu_epi16(y, mask, b);
}
inline void store16(float* y, __m512 v, __mmask16 mask) {
  if (mask == 0xFFFF)
    _mm512_storeu_ps(y, v);
  else
    _mm512_mask_storeu_ps(y, mask, v);
}

// Rows [0, MR) of x (row stride K; XP: the rows interleaved by k-pair,
// [K/2][MR][2]) against one packed block wb of `cols` valid columns; y: the
// block's first column of row 0 (row stride N).
// Meanwhile the bytes [pf, pf + pf_len) of the block that comes next are
// fetched into L2, spread evenly over the k loop.
template <int MR, bool XP, class Out>
void tile(const bf16* x, const bf16* wb, Out* y, int64_t K, int64_t N, int64_t cols, const char* pf,
          int64_t pf_len) {
  __m512 lo[MR], hi[MR];
  for (int m = 0; m < MR; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
  const int64_t pf_step = pf ? (pf_len + K / 2 - 1) / (K / 2) : 0;  // bytes per k-pair
  int64_t pf_done = 0, pf_due = 0;
  for (int64_t k = 0; k < K; k += 2, wb += 2 * kCols) {
    if (pf) {
      pf_due += pf_step;
      for (; pf_done < pf_due && pf_done < pf_len; pf_done += 64) _mm_prefetch(pf + pf_done, _MM_HINT_T1);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wb + kCols);
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

template <class Out>
using TileFn = void (*)(const bf16*, const bf16*, Out*, int64_t, int64_t, int64_t, const char*, int64_t);

template <class Out, bool XP, int... R>
constexpr std::array<TileFn<Out>, sizeof...(R) + 1> tile_table(std::integer_sequence<int, R...>) {
  return {nullptr, &tile<R + 1, XP, Out>...};
}

// Rows [0, R) against one block: ceil(R / kMaxRows) tiles of near-equal size
// (16 rows: 8 + 8), the block re-read from L1/L2 for each tile. `next`: the
// block this thread runs next (null: none), prefetched a share per tile, so
// memory is read at an even rate however many tiles the block takes.
template <class Out, bool XP>
inline void rows_x_block(const bf16* x, const bf16* wb, Out* y, int64_t R, int64_t K, int64_t N, int64_t cols,
                         const bf16* next) {
  static constexpr auto table = tile_table<Out, XP>(std::make_integer_sequence<int, kMaxRows>{});
  const int64_t tiles = (R + kMaxRows - 1) / kMaxRows;
  const int64_t bytes = K * kCols * static_cast<int64_t>(sizeof(bf16));
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t r = R / tiles + (t < R % tiles);
    const int64_t p0 = bytes * t / tiles, p1 = bytes * (t + 1) / tiles;
    table[r](x + m * K, wb, y + m * N, K, N, cols, next ? reinterpret_cast<const char*>(next) + p0 : nullptr, p1 - p0);
    m += r;
  }
}

template <class Out>
void matmul_impl(const bf16* x, const bf16* wp, Out* y, int64_t M, int64_t K, int64_t N, int threads) {
  if (M <= 0) return;
  const int64_t blocks = (N + kCols - 1) / kCols;
  // Many rows (prefill): chunks of up to 4 MiB of activations, which stay in L3
  // while a thread runs them against its blocks; each block is read from memory
  // once per chunk and from L2 once per tile. Work items are (chunk, block),
  // chunk-major. (384 KiB chunks: the same speed for SmolLM2's shapes, 2-4% slower
  // at K = 4096-14336, where the weights were re-read from memory more often.)
  const int64_t chunk_cap = std::max<int64_t>(48, (4 << 20) / (2 * K) / kMaxRows * kMaxRows);
  const int64_t chunks = (M + chunk_cap - 1) / chunk_cap;
  const int64_t chunk_rows = (M + chunks - 1) / chunks;
  // Prefill-sized batches: each register tile's rows are first interleaved by k-pair
  // ([K/2][rows][2]), so a tile's broadcasts read one sequential stream instead of
  // one per row (12 streams, which the L1 prefetcher does not all follow once rows
  // are kilobytes long). Same sums in the same order. Side by side at 512 rows:
  // K = 4096: 390 -> 457 GFLOPS, K = 14336: 371 -> 437; SmolLM2's 2048-row
  // prefill +1-3%. Not for decode batches, where the extra pass cost more than it
  // saved on SmolLM2's small matrices.
  const bool xp = M > 4 * kMaxRows;
  std::unique_ptr<bf16[]> packed_x(xp ? new bf16[M * K] : nullptr);
  const bf16* xs = xp ? packed_x.get() : x;
  if (xp) {
    bf16* dst = packed_x.get();
    const int64_t max_tiles = (chunk_rows + kMaxRows - 1) / kMaxRows;  // per chunk
    par_for(chunks * max_tiles, 4, threads, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) {
        const int64_t c = i / max_tiles, t = i % max_tiles;
        const int64_t m0 = c * chunk_rows, R = std::min(M, m0 + chunk_rows) - m0;
        const int64_t tiles = (R + kMaxRows - 1) / kMaxRows;
        if (t >= tiles) continue;
        // the split of rows_x_block: tile t of the chunk's rows
        const int64_t m = m0 + t * (R / tiles) + std::min(t, R % tiles), r = R / tiles + (t < R % tiles);
        const int32_t* src = reinterpret_cast<const int32_t*>(x + m * K);
        int32_t* d = reinterpret_cast<int32_t*>(dst + m * K);
        for (int64_t kp = 0; kp < K / 2; ++kp)
          for (int64_t j = 0; j < r; ++j) d[kp * r + j] = src[j * (K / 2) + kp];
      }
    });
  }
  par_for(chunks * blocks, 2, threads, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const int64_t c = i / blocks, blk = i % blocks;
      const int64_t m0 = c * chunk_rows, m1 = std::min(M, m0 + chunk_rows);
      // Past one tile, a block takes long enough to compute that memory would sit idle
      // while it is re-read from L2; fetch the next one meanwhile (16 rows: 12.8 -> 11.7 ms
      // for a step's matmuls). Up to one tile the hardware prefetcher keeps up, and
      // software prefetches on top slowed 1-8 rows by up to 8% (side-by-side runs).
      const bf16* next = m1 - m0 > kMaxRows && i + 1 < b ? wp + (i + 1) % blocks * K * kCols : nullptr;
      if (xp)
        rows_x_block<Out, true>(xs + m0 * K, wp + blk * K * kCols, y + m0 * N + blk * kCols, m1 - m0, K, N,
                                std::min(kCols, N - blk * kCols), next);
      else
        rows_x_block<Out, false>(x + m0 * K, wp + blk * K * kCols, y + m0 * N + blk * kCols, m1 - m0, K, N,
                                 std::min(kCols, N - blk * kCols), next);
    }
  });
}

}  // namespace

void check_packed(const at::Tensor& w, int64_t n, int64_t k, const char* what) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.dim() == 4, what,
              ": packed weight must be a contiguous bf16 [blocks, K/2, 32, 2] tensor");
  TORCH_CHECK(n > 0 && k > 0 && k % 2 == 0 && w.size(0) == (n + kCols - 1) / kCols && w.size(1) * 2 == k &&
                  w.size(2) == kCols && w.size(3) == 2,
              what, ": packed weight of shape ", w.sizes(), " is not a packed [", n, ", ", k, "] matrix");
}

void matmul_packed(const bf16* x, const bf16* wp, bf16* y, int64_t M, int64_t K, int64_t N, int threads) {
  matmul_impl(x, wp, y, M, K, N, threads);
}

void matmul_packed_f32(const bf16* x, const bf16* wp, float* y, int64_t M, int64_t K, int64_t N, int threads) {
  matmul_impl(x, wp, y, M, K, N, threads);
}

}  // namespace kvrelay

// y = x @ W^T for W packed (engine/kernels.py PackedWeight: [ceil(n/32), K/2, 32, 2] bf16);
// bf16 or (f32_out) fp32 output. threads <= 0: torch's intra-op thread count.
torch::Tensor linear_packed(const torch::Tensor& x, const torch::Tensor& w, int64_t n, bool f32_out,
                            int64_t threads) {
  kvrelay::check_packed(w, n, x.size(-1), "linear_packed");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "linear_packed: x must be [M, K] bf16");
  auto xc = x.contiguous();
  auto y = torch::empty({xc.size(0), n}, xc.options().dtype(f32_out ? at::kFloat : at::kBFloat16));
  const int t = threads > 0 ? static_cast<int>(threads) : at::get_num_threads();
  const auto* xp = xc.data_ptr<kvrelay::bf16>();
  const auto* wp = w.data_ptr<kvrelay::bf16>();
  if (f32_out)
    kvrelay::matmul_packed_f32(xp, wp, y.data_ptr<float>(), xc.size(0), xc.size(1), n, t);
  else
    kvrelay::matmul_packed(xp, wp, y.data_ptr<kvrelay::bf16>(), xc.size(0), xc.size(1), n, t);
  return y;
}

// Rows `ids` of a packed [n, k] weight W, as bf16 [len(ids), k]: the embedding
// lookup of a tied LM head, which is held only packed. threads <= 0: torch's count.
torch::Tensor packed_rows(const torch::Tensor& w, const torch::Tensor& ids, int64_t n, int64_t k, int64_t threads) {
  kvrelay::check_packed(w, n, k, "packed_rows");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "packed_rows: ids must be a 1-D int64 tensor");
  auto idc = ids.contiguous();
  const int64_t T = idc.size(0), K2 = k / 2, block = K2 * kvrelay::kPackedCols;
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < n, "packed_rows: index ", id[t], " out of range for ", n, " rows");
  auto out = torch::empty({T, k}, w.options());
  const auto* src = reinterpret_cast<const int32_t*>(w.data_ptr<kvrelay::bf16>());  // (k, k+1) pairs
  auto* dst = reinterpret_cast<int32_t*>(out.data_ptr<kvrelay::bf16>());
  const int t_ = threads > 0 ? static_cast<int>(threads) : at::get_num_threads();
  kvrelay::par_for(T, 256, t_, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      const int32_t* row = src + id[t] / kvrelay::kPackedCols * block + id[t] % kvrelay::kPackedCols;
      for (int64_t j = 0; j < K2; ++j) dst[t * K2 + j] = row[j * kvrelay::kPackedCols];
    }
  });
  return out;
}
