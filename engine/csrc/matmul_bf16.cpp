// bf16 matmul on a pre-packed weight layout, for every ISA (isa.h).
//
// y[M, N] = x[M, K] @ W^T for any M: decode batches (1-48 rows) and prefill.
// W [N, K] is packed once at load (engine/kernels.py PackedWeight) into
// blocks of 32 output columns with K-pairs interleaved:
//
//   packed[b][k/2][c][k%2] = W[32 b + c][k]        shape [ceil(N/32), K/2, 32, 2]
//
// so each block is one contiguous run of memory: a thread that owns a range of
// blocks streams its weights strictly in order (what the hardware prefetcher
// follows at full bandwidth). The register tile (isa.h MatmulTile) is MR
// token rows x one block's 32 columns, accumulated in fp32 straight into the
// outputs' lanes (no horizontal reductions): on AVX512-BF16 one k-pair of a
// block is two zmm registers that vdpbf16ps multiplies by each row's
// broadcast x[m, k:k+2]; on AVX2 the bf16 pairs are widened to fp32 in
// registers and FMA'd with x converted to fp32 beforehand. Every row of the
// output is summed in the same order (k ascending) whatever M is, so a
// token's result does not depend on the batch it is in. Padding columns of
// the last block are zero and never stored.
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

#include "ops.h"

namespace kvrelay {
namespace {

constexpr int64_t kCols = kPackedCols;  // output columns per packed block
constexpr int kMaxRows = MatmulTile::kMaxRows;
using XElem = MatmulTile::XElem;  // the activations in a tile's x layout: bf16 or fp32

// Rows [0, MR) of x (row stride K; XP: the rows interleaved by k-pair,
// [K/2][MR][2]) against one packed block wb of `cols` valid columns; y: the
// block's first column of row 0 (row stride N). Meanwhile the bytes
// [pf, pf + pf_len) of the block that comes next are fetched into L2, spread
// evenly over the k loop.
template <class Out>
using TileFn = void (*)(const XElem*, const MatmulTile::Block&, Out*, int64_t, int64_t, int64_t, const char*,
                        int64_t);

template <class Out, bool XP, int... R>
constexpr std::array<TileFn<Out>, sizeof...(R) + 1> tile_table(std::integer_sequence<int, R...>) {
  return {nullptr, &MatmulTile::tile<R + 1, XP, Out>...};
}

// Rows [0, R) against one block: ceil(R / kMaxRows) tiles of near-equal size
// (16 rows: 8 + 8), the block re-read from L1/L2 for each tile. `next`: the
// block this thread runs next (null: none), prefetched a share per tile, so
// memory is read at an even rate however many tiles the block takes.
template <class Out, bool XP, class Tile = MatmulTile>
inline void rows_x_block(const XElem* x, const bf16* wb, Out* y, int64_t R, int64_t K, int64_t N, int64_t cols,
                         const bf16* next) {
  static constexpr auto table = tile_table<Out, XP>(std::make_integer_sequence<int, kMaxRows>{});
  const int64_t tiles = (R + kMaxRows - 1) / kMaxRows;
  const int64_t bytes = K * kCols * static_cast<int64_t>(sizeof(bf16));
  if constexpr (Tile::kBlocksK) {  // AVX2: the tiles run together, a chunk of k at a time
    if (tiles > 1) {
      Tile::tiles_k_blocked(x, wb, y, R, K, N, cols, reinterpret_cast<const char*>(next), next ? bytes : 0, tiles);
      return;
    }
  }
  const MatmulTile::Block block(wb, K, tiles);  // what the tiles read
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t r = R / tiles + (t < R % tiles);
    const int64_t p0 = bytes * t / tiles, p1 = bytes * (t + 1) / tiles;
    table[r](x + m * K, block, y + m * N, K, N, cols, next ? reinterpret_cast<const char*>(next) + p0 : nullptr, p1 - p0);
    m += r;
  }
}

// How decode rows (at most one register tile: one tile a block) stream a matrix, process-wide:
// - the chunks of blocks a thread claims (par_for's per_thread: 1, one run of consecutive blocks a
//   thread, or more, claimed in turn);
// - what each block's tile fetches into L2 in software, spread over its k loop at the rate it
//   reads: the block its thread runs next (for matmuls of prefetch_next_from rows or more; 0:
//   none), and in matmuls of fewer rows nothing or its own stream a fixed distance ahead
//   (prefetch_ahead bytes; past a matrix's end that is the next matrix the step reads, since the
//   weights lie in the order they are read, engine/model.py _to_huge_pages).
// Which is faster depends on the CPU's memory path; engine.decode_stream_bench compares them on
// the machine at hand. One run a thread: on a Zen 4 at 2 threads it beat four chunks by
// 1.06-1.09x (avx2), 1.02-1.07x (avx512) and 1.01-1.08x (avx512bf16) over three runs, as it did
// for the quantized matmul (matmul_quant.cpp); on a Zen 3 (avx2) by 1.03x at one row and
// 1.12-1.16x at 2-4 rows (BENCHMARKS.md "bf16 decode: how a thread streams its weights" and "bf16
// decode on a Zen 3: how a thread streams its weights"). The next-block prefetch costs one row
// 11-27% (Zen 4), 1-8% (Zen 3), but pays once a block takes a tile long enough to compute that
// memory would idle meanwhile, so kPrefetchFromRows (isa.h) sets from how many rows, per tile:
// avx2 from 2 (2-6 rows 1.5-2.0x on a Zen 4, 1.35-1.54x on a Zen 3; its tile takes a block in 2-4
// passes past one row), avx512 from 3 (3-12 rows 1.05-1.14x; 2 rows 0.86-0.92x), avx512bf16 from
// 8 (8-12 rows 0.97-1.15x; 4 rows 0.83-0.93x).
// The own stream 1 KiB ahead, one row, in three runs on a Zen 3: 1.06-1.10x at 1 thread and
// 1.00-1.09x at 2, where 1.5-2 KiB read 1.03-1.10x and 256-512 B 0.98-1.04x (the hardware
// prefetcher alone kept one row's stream at 70-77% of the read wall there; BENCHMARKS.md "bf16
// decode on a Zen 3: one row prefetched 1 KiB ahead, reading it"). On a Zen 4, avx512bf16 read
// 1.02-1.04x in alternated A/B runs, the avx2 build (which a Zen 4 runs only when asked)
// 0.90-0.99x, and 2 KiB or more lost up to 44% ("bf16 decode: a thread's own stream prefetched
// ahead"). So kPrefetchAhead (isa.h) is 1 KiB on the avx2 build, which is what CPUs without
// AVX-512 run, and none on the AVX-512 builds. Same bits either way.
// the defaults, in decode_stream's order: chunks a thread, prefetch_next_from, prefetch_ahead
constexpr std::tuple<int, int, int64_t> kDefaultStream{1, MatmulTile::kPrefetchFromRows, MatmulTile::kPrefetchAhead};
std::atomic<int> g_decode_chunks{std::get<0>(kDefaultStream)};
std::atomic<int> g_decode_prefetch_from{std::get<1>(kDefaultStream)};
std::atomic<int64_t> g_decode_ahead{std::get<2>(kDefaultStream)};
constexpr int64_t kMaxAhead = 1 << 20;

// Output blocks [b0, b1) of the matrix's (all: b1 < 0).
template <class Out>
void matmul_impl(const bf16* x, const bf16* wp, Out* y, int64_t M, int64_t K, int64_t N, int threads,
                 int64_t b0 = 0, int64_t b1 = -1) {
  if (M <= 0) return;
  if (b1 < 0) b1 = (N + kCols - 1) / kCols;
  const int64_t blocks = b1 - b0;  // (each chunk's)
  if (blocks <= 0) return;
  // Many rows (prefill): chunks of up to 4 MiB of activations, which stay in L3
  // while a thread runs them against its blocks; each block is read from memory
  // once per chunk and from L2 once per tile. Work items are (chunk, block),
  // chunk-major. (384 KiB chunks: the same speed for SmolLM2's shapes, 2-4% slower
  // at K = 4096-14336, where the weights were re-read from memory more often.)
  const int64_t chunk_cap = std::max<int64_t>(48, (4 << 20) / (static_cast<int64_t>(sizeof(XElem)) * K) / kMaxRows * kMaxRows);
  const int64_t chunks = (M + chunk_cap - 1) / chunk_cap;
  const int64_t chunk_rows = (M + chunks - 1) / chunks;
  // Each register tile's rows are first interleaved by k-pair ([K/2][rows][2],
  // XElem: converted to fp32 on AVX2), so a tile's broadcasts read one sequential
  // stream instead of one per row (12 streams, which the L1 prefetcher does not all
  // follow once rows are kilobytes long). Same sums in the same order. AVX512-BF16,
  // side by side at 512 rows: K = 4096: 390 -> 457 GFLOPS, K = 14336: 371 -> 437;
  // SmolLM2's 2048-row prefill +1-3%; there not for decode batches, where the extra
  // pass cost more than it saved on SmolLM2's small matrices. AVX2 always takes it:
  // its tile reads x as fp32.
  const bool xp = MatmulTile::packs_x(M);
  std::unique_ptr<XElem[]> packed_x(xp ? new XElem[M * K] : nullptr);
  const XElem* xs = packed_x.get();
  if (xp) {
    XElem* dst = packed_x.get();
    const int64_t max_tiles = (chunk_rows + kMaxRows - 1) / kMaxRows;  // per chunk
    par_for(chunks * max_tiles, 4, threads, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) {
        const int64_t c = i / max_tiles, t = i % max_tiles;
        const int64_t m0 = c * chunk_rows, R = std::min(M, m0 + chunk_rows) - m0;
        const int64_t tiles = (R + kMaxRows - 1) / kMaxRows;
        if (t >= tiles) continue;
        // the split of rows_x_block: tile t of the chunk's rows
        const int64_t m = m0 + t * (R / tiles) + std::min(t, R % tiles), r = R / tiles + (t < R % tiles);
        const bf16* src = x + m * K;
        XElem* d = dst + m * K;
        if (r == 1) {  // (one row: the layout is the row itself; a loop the compiler vectorizes)
          for (int64_t k = 0; k < K; ++k) d[k] = static_cast<XElem>(src[k]);
          continue;
        }
        for (int64_t kp = 0; kp < K / 2; ++kp)
          for (int64_t j = 0; j < r; ++j) {
            d[2 * (kp * r + j)] = static_cast<XElem>(src[j * K + 2 * kp]);
            d[2 * (kp * r + j) + 1] = static_cast<XElem>(src[j * K + 2 * kp + 1]);
          }
      }
    });
  }
  // Past one tile, a block takes long enough to compute that memory would sit idle while it is
  // re-read from L2; fetch the next one meanwhile (16 rows: 12.8 -> 11.7 ms for a step's
  // matmuls). Decode rows (one tile) do too from g_decode_prefetch_from rows on.
  const bool decode = chunk_rows <= kMaxRows;
  const int from = g_decode_prefetch_from.load(std::memory_order_relaxed);
  const bool fetch_next = !decode || (from > 0 && M >= from);
  // below prefetch_next_from rows, the own stream prefetch_ahead bytes ahead (0: not)
  const int64_t ahead = decode && !fetch_next ? g_decode_ahead.load(std::memory_order_relaxed) : 0;
  par_for(chunks * blocks, 2, threads, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const int64_t c = i / blocks, blk = b0 + i % blocks;
      const int64_t m0 = c * chunk_rows, m1 = std::min(M, m0 + chunk_rows);
      const bf16* wb = wp + blk * K * kCols;
      const bf16* next = ahead ? reinterpret_cast<const bf16*>(reinterpret_cast<const char*>(wb) + ahead)
                         : fetch_next && i + 1 < b ? wp + (b0 + (i + 1) % blocks) * K * kCols
                                                   : nullptr;
      if (xp)
        rows_x_block<Out, true>(xs + m0 * K, wb, y + m0 * N + blk * kCols, m1 - m0, K, N,
                                std::min(kCols, N - blk * kCols), next);
      else if constexpr (std::is_same_v<XElem, bf16>)  // tiles that read rows of x in place
        rows_x_block<Out, false>(x + m0 * K, wb, y + m0 * N + blk * kCols, m1 - m0, K, N,
                                 std::min(kCols, N - blk * kCols), next);
    }
  }, decode ? g_decode_chunks.load(std::memory_order_relaxed) : 4);  // (prefill: par_for's default)
}

}  // namespace

void check_packed(const at::Tensor& w, int64_t n, int64_t k, const char* what) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.dim() == 4, what,
              ": packed weight must be a contiguous bf16 [blocks, K/2, 32, 2] tensor");
  TORCH_CHECK(n > 0 && k > 0 && k % 2 == 0 && w.size(0) == (n + kCols - 1) / kCols && w.size(1) * 2 == k &&
                  w.size(2) == kCols && w.size(3) == 2,
              what, ": packed weight of shape ", w.sizes(), " is not a packed [", n, ", ", k, "] matrix");
}

void set_decode_stream(int chunks_per_thread, int prefetch_next_from, int64_t prefetch_ahead) {
  TORCH_CHECK(chunks_per_thread >= 1 && chunks_per_thread <= 64,
              "set_bf16_decode_stream: chunks_per_thread must be 1 to 64, not ", chunks_per_thread);
  TORCH_CHECK(prefetch_next_from >= 0 && prefetch_next_from <= kMaxRows,
              "set_bf16_decode_stream: prefetch_next_from must be 0 (never) to ", kMaxRows,
              " (the rows of one tile), not ", prefetch_next_from);
  TORCH_CHECK(prefetch_ahead >= 0 && prefetch_ahead <= kMaxAhead && prefetch_ahead % 64 == 0,
              "set_bf16_decode_stream: prefetch_ahead must be a multiple of 64 bytes from 0 to ", kMaxAhead,
              ", not ", prefetch_ahead);
  g_decode_chunks.store(chunks_per_thread);
  g_decode_prefetch_from.store(prefetch_next_from);
  g_decode_ahead.store(prefetch_ahead);
}

std::tuple<int, int, int64_t> decode_stream() {
  return {g_decode_chunks.load(), g_decode_prefetch_from.load(), g_decode_ahead.load()};
}

std::tuple<int, int, int64_t> default_decode_stream() { return kDefaultStream; }

void matmul_packed(const bf16* x, const bf16* wp, bf16* y, int64_t M, int64_t K, int64_t N, int threads) {
  matmul_impl(x, wp, y, M, K, N, threads);
}

void matmul_packed_f32(const bf16* x, const bf16* wp, float* y, int64_t M, int64_t K, int64_t N, int threads) {
  matmul_impl(x, wp, y, M, K, N, threads);
}

void matmul_packed_blocks(const bf16* x, const bf16* wp, bf16* y, int64_t M, int64_t K, int64_t N, int64_t b0,
                          int64_t b1) {
  matmul_impl(x, wp, y, M, K, N, 1, b0, b1);
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
