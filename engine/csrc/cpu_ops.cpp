// Fused CPU kernels for the decode path (kvrelay/engine/kernels.py), written
// once against isa.h's Vec (zmm on AVX512-BF16, ymm on AVX2) and once per
// activation type T: bf16 (the bf16 model) and fp32 (the quantized model,
// whose activations stay fp32: matmul_quant.cpp).
//
// Decode runs one token per sequence through 30-odd layers, so its step time
// is dominated by per-op overhead, not arithmetic. These kernels replace the
// chains of small torch ops that overhead comes from: residual add + RMSNorm,
// SiLU-and-multiply, rotary embedding, and attention over the paged KV cache
// (read in place through the block table, no gather copy). All math is fp32;
// results are rounded to T at the points where the unfused torch model
// rounds, so the two agree to bf16 rounding (fp32: no rounding in between).
#include <torch/extension.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "ops.h"

namespace kvrelay {
namespace {

using V = Vec::T;
constexpr int64_t kL = Vec::kLanes;

inline float f(bf16 v) { return static_cast<float>(v); }
inline float f(float v) { return v; }
template <class T>
inline float rb(float v) { return f(T(v)); }  // round to T's precision (fp32: unchanged)
inline V ld(const bf16* p) { return Vec::load_bf16(p); }
inline V ld(const float* p) { return Vec::load(p); }
inline void st(bf16* p, V v) { Vec::store_bf16(p, v); }
inline void st(float* p, V v) { Vec::store(p, v); }
template <class T>
inline V round_to(V v) {  // round the lanes to T's precision
  if constexpr (std::is_same_v<T, bf16>)
    return Vec::round_bf16(v);
  else
    return v;
}

// exp for fp32 lanes: 2^n * p(r), x = n ln2 + r, |r| <= ln2/2; ~1 ulp.
inline V vexp(V x) {
  x = Vec::max(Vec::min(x, Vec::set1(Vec::kExpMax)), Vec::set1(-Vec::kExpMax));
  const V n = Vec::round(Vec::mul(x, Vec::set1(1.44269504088896341f)));
  V r = Vec::fnmadd(n, Vec::set1(0.693359375f), x);
  r = Vec::fnmadd(n, Vec::set1(-2.12194440e-4f), r);
  V p = Vec::set1(1.9875691500e-4f);
  p = Vec::fmadd(p, r, Vec::set1(1.3981999507e-3f));
  p = Vec::fmadd(p, r, Vec::set1(8.3334519073e-3f));
  p = Vec::fmadd(p, r, Vec::set1(4.1665795894e-2f));
  p = Vec::fmadd(p, r, Vec::set1(1.6666665459e-1f));
  p = Vec::fmadd(p, r, Vec::set1(5.0000001201e-1f));
  p = Vec::fmadd(p, Vec::mul(r, r), Vec::add(r, Vec::set1(1.f)));
  return Vec::ldexp(p, n);
}

// Per-thread scratch that grows and is never freed (no allocation per call).
std::vector<float>& scratch(int which) {
  thread_local std::vector<float> bufs[3];
  return bufs[which];
}

}  // namespace

namespace {

template <class E>
void add_rms_norm_t(E* x, const E* delta, const E* w, E* out, int64_t T, int64_t H, float eps, int threads) {
  par_for(T, 64, threads, [&](int64_t t0, int64_t t1) {
    std::vector<float>& row = scratch(0);
    row.resize(H);
    for (int64_t t = t0; t < t1; ++t) {
      E* xr = x + t * H;
      const E* dr = delta ? delta + t * H : nullptr;
      E* orow = out + t * H;
      // round the sum to E as the unfused model does (x is stored as E)
      V ssv = Vec::zero();
      int64_t i = 0;
      for (; i + kL <= H; i += kL) {
        V v = ld(xr + i);
        if (dr) v = round_to<E>(Vec::add(v, ld(dr + i)));
        Vec::store(row.data() + i, v);
        ssv = Vec::fmadd(v, v, ssv);
      }
      float ss = Vec::reduce_add(ssv);
      for (; i < H; ++i) {
        const float v = dr ? rb<E>(f(xr[i]) + f(dr[i])) : f(xr[i]);
        row[i] = v;
        ss += v * v;
      }
      const float r = 1.f / std::sqrt(ss / H + eps);
      const V rv = Vec::set1(r);
      i = 0;
      for (; i + kL <= H; i += kL) {
        const V v = Vec::load(row.data() + i);
        if (dr) st(xr + i, v);
        st(orow + i, Vec::mul(round_to<E>(Vec::mul(v, rv)), ld(w + i)));
      }
      for (; i < H; ++i) {
        if (dr) xr[i] = E(row[i]);
        orow[i] = E(rb<E>(row[i] * r) * f(w[i]));
      }
    }
  });
}

template <class E>
void head_rms_norm_t(E* x, int64_t s0, int64_t T, int64_t NH, int64_t D, const E* w, float eps, int threads) {
  par_for(T * NH, 256, threads, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j) {
      E* v = x + (j / NH) * s0 + (j % NH) * D;
      float ss = 0.f;
      for (int64_t i = 0; i < D; ++i) ss += f(v[i]) * f(v[i]);
      const float r = 1.f / std::sqrt(ss / D + eps);
      for (int64_t i = 0; i < D; ++i) v[i] = E(rb<E>(f(v[i]) * r) * f(w[i]));
    }
  });
}

template <class E>
void silu_mul_t(const E* gate_up, E* out, int64_t T, int64_t I, int threads) {
  const int64_t chunk = 256;  // elements per work item: rows are split too, so one token uses every thread
  const int64_t per_row = (I + chunk - 1) / chunk;
  par_for(T * per_row, 32, threads, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j) {
      const int64_t t = j / per_row, i0 = (j % per_row) * chunk, i1 = std::min(I, i0 + chunk);
      const E* g = gate_up + t * 2 * I;
      const E* u = g + I;
      E* o = out + t * I;
      int64_t i = i0;
      for (; i + kL <= i1; i += kL) {
        const V gv = ld(g + i);
        const V s = Vec::div(gv, Vec::add(Vec::set1(1.f), vexp(Vec::sub(Vec::zero(), gv))));
        st(o + i, Vec::mul(round_to<E>(s), ld(u + i)));
      }
      for (; i < i1; ++i) {
        const float gv = f(g[i]);
        o[i] = E(rb<E>(gv / (1.f + std::exp(-gv))) * f(u[i]));
      }
    }
  });
}

template <class E>
void rope_t(E* x, int64_t s0, int64_t s1, int64_t T, int64_t NH, int64_t D, const E* cos, const E* sin,
            const int64_t* positions, int threads) {
  const int64_t half = D / 2;
  par_for(T * NH, 512, threads, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j) {
      const int64_t t = j / NH, h = j % NH;
      E* v = x + t * s0 + h * s1;
      const E* c = cos + positions[t] * D;
      const E* s = sin + positions[t] * D;
      if (half % kL == 0) {
        for (int64_t i = 0; i < half; i += kL) {
          const V lo = ld(v + i), hi = ld(v + half + i);
          const V olo = Vec::add(round_to<E>(Vec::mul(lo, ld(c + i))),
                                 round_to<E>(Vec::mul(hi, ld(s + i))));
          const V ohi = Vec::add(round_to<E>(Vec::mul(hi, ld(c + half + i))),
                                 round_to<E>(Vec::mul(lo, ld(s + half + i))));
          st(v + i, olo);
          st(v + half + i, ohi);
        }
        continue;
      }
      float xs[512];
      TORCH_CHECK(D <= 512, "rope: head_dim > 512");
      for (int64_t i = 0; i < D; ++i) xs[i] = f(v[i]);
      for (int64_t i = 0; i < D; ++i) {
        const float rot = xs[(i + half) % D];
        v[i] = E(rb<E>(xs[i] * f(c[i])) + rb<E>(rot * f(s[i])));
      }
    }
  });
}

}  // namespace

namespace {

// Keys and values are read through the block table, a few cache lines per
// token at a stride, so the hardware prefetcher loses them at every block
// boundary; fetch the head kAhead tokens ahead.
constexpr int64_t kAhead = 16;
template <int NV, class E>
inline void prefetch_head(const E* p) {
  for (int64_t i = 0; i < NV * kL; i += 64 / sizeof(E)) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

// acc[g][:] = sum over t of scores[g][t] * value(t), for GN query heads at once:
// each value vector is loaded (and widened to fp32) once for all GN heads. Per
// head the sum runs over t in order, as one head at a time would.
template <int NV, int GN, class Key>
inline void weigh_values(const float* scores, int64_t Lp, const Key& key, int64_t kv_stride, int64_t L, float* acc,
                         int64_t D, bool fetch) {
  V o[GN][NV];
  for (int g = 0; g < GN; ++g)
    for (int d = 0; d < NV; ++d) o[g][d] = Vec::zero();
  for (int64_t t = 0; t < L; ++t) {
    const auto* v = key(t) + kv_stride;
    if (fetch && t + kAhead < L) prefetch_head<NV>(key(t + kAhead) + kv_stride);
    V vv[NV];
    for (int d = 0; d < NV; ++d) vv[d] = ld(v + kL * d);
    for (int g = 0; g < GN; ++g) {
      const V pv = Vec::set1(scores[g * Lp + t]);
      for (int d = 0; d < NV; ++d) o[g][d] = Vec::fmadd(pv, vv[d], o[g][d]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int d = 0; d < NV; ++d) Vec::store(acc + g * D + kL * d, o[g][d]);
}

// One (sequence, KV head) pair: G query heads against L of the sequence's keys
// and values from token t_begin on, read in place through its block table.
// NV: fp32 vectors per head (head_dim / kL), a compile-time constant so the
// head stays in registers; 0 takes the scalar path (any head size). stats
// null: acc gets the attention output; else a part of a longer context: acc
// gets the values weighted by exp(score - max), unnormalized, and stats each
// head's (max, sum of those weights), for decode_attention_t to merge.
template <int NV, class E>
void attend_one(const float* qf, const int64_t* table, const E* kv, int64_t BS, int64_t blk_stride,
                int64_t kv_stride, int64_t tok_stride, int64_t t_begin, int64_t L, int64_t G, int64_t D,
                float* scores, float* acc, float* stats, V* part) {
  const int64_t Lp = (L + kL - 1) / kL * kL;  // score row stride: whole vectors
  // every token's key, walked block by block once: through the table per token, a 64-bit
  // division each time (three per token and head), it was most of a short context's time
  thread_local std::vector<const E*> keys;
  keys.resize(L);
  for (int64_t b = t_begin / BS, o = t_begin % BS, t = 0; t < L; ++b, o = 0) {
    const E* base = kv + table[b] * blk_stride;
    for (; o < BS && t < L; ++o, ++t) keys[t] = base + o * tok_stride;
  }
  const E* const* kp = keys.data();
  auto key = [kp](int64_t t) { return kp[t]; };
  if constexpr (NV > 0) {
    // scores, kL keys at a time: one partial vector per (head, key), then one transposing reduction
    for (int64_t t0 = 0; t0 < L; t0 += kL) {
      const int64_t n = std::min<int64_t>(kL, L - t0);
      for (int64_t i = 0; i < kL; ++i) {
        if (i >= n) {
          for (int64_t g = 0; g < G; ++g) part[g * kL + i] = Vec::zero();
          continue;
        }
        const E* k = key(t0 + i);
        if (t0 + i + kAhead < L) prefetch_head<NV>(key(t0 + i + kAhead));
        V kvec[NV];
        for (int d = 0; d < NV; ++d) kvec[d] = ld(k + kL * d);
        for (int64_t g = 0; g < G; ++g) {
          V p = Vec::mul(Vec::load(qf + g * D), kvec[0]);
          for (int d = 1; d < NV; ++d) p = Vec::fmadd(Vec::load(qf + g * D + kL * d), kvec[d], p);
          part[g * kL + i] = p;
        }
      }
      for (int64_t g = 0; g < G; ++g) Vec::store(scores + g * Lp + t0, Vec::sum_lanes(part + g * kL));
    }
  } else {
    for (int64_t t = 0; t < L; ++t) {
      const E* k = key(t);
      for (int64_t g = 0; g < G; ++g) {
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qf[g * D + d] * f(k[d]);
        scores[g * Lp + t] = dot;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // softmax
    float* sc = scores + g * Lp;
    V mxv = Vec::set1(-INFINITY);
    int64_t t = 0;
    for (; t + kL <= L; t += kL) mxv = Vec::max(mxv, Vec::load(sc + t));
    float mx = Vec::reduce_max(mxv);
    for (; t < L; ++t) mx = std::max(mx, sc[t]);
    const V mxb = Vec::set1(mx);
    V sumv = Vec::zero();
    t = 0;
    for (; t + kL <= L; t += kL) {
      const V e = vexp(Vec::sub(Vec::load(sc + t), mxb));
      Vec::store(sc + t, e);
      sumv = Vec::add(sumv, e);
    }
    float sum = Vec::reduce_add(sumv);
    for (; t < L; ++t) {
      sc[t] = std::exp(sc[t] - mx);
      sum += sc[t];
    }
    if (stats != nullptr) {  // a part: its weights stay unnormalized
      stats[2 * g] = mx;
      stats[2 * g + 1] = sum;
      continue;
    }
    const float inv = 1.f / sum;
    for (t = 0; t < L; ++t) sc[t] *= inv;
  }
  if constexpr (NV > 0) {
    // the weighted sums of values in registers, up to 4 heads (kAccRegs vectors) per pass over the values
    constexpr int kAcc = Vec::kAccRegs;
    for (int64_t g = 0; g < G;) {
      const int64_t n = std::min<int64_t>(G - g, std::max(1, kAcc / NV));
      const float* sc = scores + g * Lp;
      float* ac = acc + g * D;
      const bool fetch = g == 0;
      switch (n) {
        case 1: weigh_values<NV, 1>(sc, Lp, key, kv_stride, L, ac, D, fetch); break;
        case 2: if constexpr (2 * NV <= kAcc) weigh_values<NV, 2>(sc, Lp, key, kv_stride, L, ac, D, fetch); break;
        case 3: if constexpr (3 * NV <= kAcc) weigh_values<NV, 3>(sc, Lp, key, kv_stride, L, ac, D, fetch); break;
        default: if constexpr (4 * NV <= kAcc) weigh_values<NV, 4>(sc, Lp, key, kv_stride, L, ac, D, fetch); break;
      }
      g += std::min<int64_t>(n, 4);
    }
  } else {
    std::fill(acc, acc + G * D, 0.f);
    for (int64_t t = 0; t < L; ++t) {
      const auto* v = key(t) + kv_stride;
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * Lp + t];
        float* ac = acc + g * D;
        for (int64_t d = 0; d < D; ++d) ac[d] += p * f(v[d]);
      }
    }
  }
}

template <class E>
using AttendFn = decltype(&attend_one<0, E>);

// The kernel for head size D: D / kL vectors kept in registers, up to 16 of them.
template <class E>
AttendFn<E> attend_for(int64_t D) {
  if (D % kL) return &attend_one<0, E>;
  switch (D / kL) {
    case 1: return &attend_one<1, E>;
    case 2: return &attend_one<2, E>;
    case 4: return &attend_one<4, E>;
    case 8: return &attend_one<8, E>;
    case 16: return &attend_one<16, E>;
    default: return &attend_one<0, E>;
  }
}

// A context longer than this is attended in parts of this many tokens, one work item each,
// merged in order afterwards (as flash-decoding does): a single long stream then spreads
// over the threads with each KV head's keys and values read once, where splitting its
// query heads read them once per head. The parts depend on the length only, so a
// sequence's bits do not depend on its batch.
constexpr int64_t kPartTokens = 512;

}  // namespace

template <class E>
DecodeAttention<E>::DecodeAttention(const int64_t* lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int threads)
    : G_(H / Hkv), D_(D) {
  // Work items are (sequence, KV head) pairs, each query head group reading its
  // keys and values once; with fewer pairs than two per thread (a single stream:
  // SmolLM2's 3 KV heads on 2 threads ran 2:1) each query head is its own item
  // instead. Per head the sums are the same either way, so are the bits. A long
  // context is cut into parts (kPartTokens), one item each.
  const int64_t G = G_, Gi = B * Hkv < 2 * threads ? 1 : G;  // query heads per item of a short context
  for (int64_t s = 0; s < B; ++s)
    for (int64_t hk = 0; hk < Hkv; ++hk) {
      const int64_t L = lens[s];
      if (L <= kPartTokens) {
        for (int64_t j = 0; j < G / Gi; ++j) items_.push_back({s, hk, hk * G + j * Gi, Gi, 0, L, -1});
      } else {
        for (int64_t t0 = 0; t0 < L; t0 += kPartTokens)
          items_.push_back({s, hk, hk * G, G, t0, std::min(kPartTokens, L - t0), parts_++});
      }
    }
  part_acc_.resize(parts_ * G * D);
  part_stats_.resize(parts_ * G * 2);
}

template <class E>
void DecodeAttention<E>::run(const Args& a, int64_t first, int64_t last) {
  const int64_t G = G_, D = D_, tok_stride = a.Hkv * D, kv_stride = a.BS * a.Hkv * D, blk_stride = 2 * kv_stride;
  const AttendFn<E> fn = attend_for<E>(D);
  std::vector<float>& qf = scratch(0);
  std::vector<float>& scores = scratch(1);
  std::vector<float>& acc = scratch(2);
  qf.resize(G * D);
  acc.resize(G * D);
  std::vector<V> part(G * kL);
  for (int64_t j = first; j < last; ++j) {
    const Item& it = items_[j];
    const E* qs = a.q + it.s * a.qs0 + it.h0 * D;
    for (int64_t i = 0; i < it.heads * D; ++i) qf[i] = f(qs[i]) * a.scale;
    scores.resize(it.heads * ((it.n + kL - 1) / kL * kL));
    float* ac = it.part < 0 ? acc.data() : part_acc_.data() + it.part * G * D;
    float* st = it.part < 0 ? nullptr : part_stats_.data() + it.part * G * 2;
    fn(qf.data(), a.tables + it.s * a.maxnb, a.kv + it.hk * D, a.BS, blk_stride, kv_stride, tok_stride, it.t0, it.n,
       it.heads, D, scores.data(), ac, st, part.data());
    if (it.part < 0) {
      E* os = a.out + it.s * a.os0 + it.h0 * D;
      for (int64_t i = 0; i < it.heads * D; ++i) os[i] = E(ac[i]);
    }
  }
}

template <class E>
void DecodeAttention<E>::merge(const Args& a) {
  const int64_t G = G_, D = D_;
  // each long context's parts, in order: out = sum_c e^(m_c - m) acc_c / sum_c e^(m_c - m) s_c
  std::vector<float> merged(D);
  for (size_t j = 0; j < items_.size();) {
    const Item& first = items_[j];
    if (first.part < 0) {
      ++j;
      continue;
    }
    size_t end = j;
    while (end < items_.size() && items_[end].s == first.s && items_[end].hk == first.hk) ++end;
    for (int64_t g = 0; g < G; ++g) {
      float m = -INFINITY;
      for (size_t c = j; c < end; ++c) m = std::max(m, part_stats_[(items_[c].part * G + g) * 2]);
      float sum = 0.f;
      float* o = merged.data();
      std::fill(o, o + D, 0.f);
      for (size_t c = j; c < end; ++c) {
        const float w = std::exp(part_stats_[(items_[c].part * G + g) * 2] - m);
        sum += w * part_stats_[(items_[c].part * G + g) * 2 + 1];
        const float* pa = part_acc_.data() + (items_[c].part * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * pa[d];
      }
      const float inv = 1.f / sum;
      E* os = a.out + first.s * a.os0 + (first.h0 + g) * D;
      for (int64_t d = 0; d < D; ++d) os[d] = E(o[d] * inv);
    }
    j = end;
  }
}

template class DecodeAttention<bf16>;
template class DecodeAttention<float>;

namespace {

template <class E>
void decode_attention_t(const E* q, int64_t qs0, const E* kv, int64_t BS, int64_t Hkv, const int64_t* tables,
                        int64_t maxnb, const int64_t* lens, E* out, int64_t os0, int64_t B, int64_t H, int64_t D,
                        float scale, int threads) {
  DecodeAttention<E> plan(lens, B, H, Hkv, D, threads);
  const typename DecodeAttention<E>::Args args{q, qs0, kv, BS, Hkv, tables, maxnb, out, os0, scale};
  par_for(plan.size(), 1, threads, [&](int64_t a, int64_t b) { plan.run(args, a, b); });
  plan.merge(args);
}

}  // namespace

// The bf16 and fp32 builds of each kernel (ops.h).
#define KVRELAY_ELEMENTWISE(E)                                                                                     \
  void add_rms_norm(E* x, const E* delta, const E* w, E* out, int64_t T, int64_t H, float eps, int threads) {     \
    add_rms_norm_t(x, delta, w, out, T, H, eps, threads);                                                          \
  }                                                                                                                \
  void head_rms_norm(E* x, int64_t s0, int64_t T, int64_t NH, int64_t D, const E* w, float eps, int threads) {    \
    head_rms_norm_t(x, s0, T, NH, D, w, eps, threads);                                                             \
  }                                                                                                                \
  void silu_mul(const E* gate_up, E* out, int64_t T, int64_t I, int threads) {                                    \
    silu_mul_t(gate_up, out, T, I, threads);                                                                       \
  }                                                                                                                \
  void rope(E* x, int64_t s0, int64_t s1, int64_t T, int64_t NH, int64_t D, const E* cos, const E* sin,           \
            const int64_t* positions, int threads) {                                                               \
    rope_t(x, s0, s1, T, NH, D, cos, sin, positions, threads);                                                     \
  }                                                                                                                \
  void decode_attention(const E* q, int64_t qs0, const E* kv, int64_t BS, int64_t Hkv, const int64_t* tables,     \
                        int64_t maxnb, const int64_t* lens, E* out, int64_t os0, int64_t B, int64_t H, int64_t D, \
                        float scale, int threads) {                                                                \
    decode_attention_t(q, qs0, kv, BS, Hkv, tables, maxnb, lens, out, os0, B, H, D, scale, threads);               \
  }
KVRELAY_ELEMENTWISE(bf16)
KVRELAY_ELEMENTWISE(float)
#undef KVRELAY_ELEMENTWISE

}  // namespace kvrelay

// ---- torch-facing wrappers (engine/kernels.py NativeOps, QuantOps) -------------
// Each takes bf16 or fp32 tensors (all of one call the same type).

namespace {
using kvrelay::bf16;

int resolve(int64_t threads) { return threads > 0 ? static_cast<int>(threads) : at::get_num_threads(); }

void check_act(const torch::Tensor& t, at::ScalarType type, const char* what) {
  TORCH_CHECK((type == at::kBFloat16 || type == at::kFloat) && t.scalar_type() == type && t.is_contiguous(), what,
              ": expected a contiguous ", type == at::kFloat ? "fp32" : "bf16", " tensor, got ", t.scalar_type());
}

// fn(E{}) with E the element type of `t` (bf16 or float)
template <class F>
auto by_type(const torch::Tensor& t, const F& fn) {
  if (t.scalar_type() == at::kFloat) return fn(float{});
  return fn(bf16{});
}
}  // namespace

// x += delta (in place, both [T, H]; no delta: x unchanged); returns rms_norm(x) * w.
torch::Tensor add_rms_norm(torch::Tensor x, const c10::optional<torch::Tensor>& delta, const torch::Tensor& w,
                           double eps, int64_t threads) {
  const auto type = x.scalar_type();
  check_act(x, type, "add_rms_norm x");
  if (delta) check_act(*delta, type, "add_rms_norm delta");
  check_act(w, type, "add_rms_norm w");
  auto out = torch::empty_like(x);
  by_type(x, [&](auto e) {
    using E = decltype(e);
    kvrelay::add_rms_norm(x.data_ptr<E>(), delta ? delta->data_ptr<E>() : nullptr, w.data_ptr<E>(),
                          out.data_ptr<E>(), x.size(0), x.size(1), static_cast<float>(eps), resolve(threads));
    return 0;
  });
  return out;
}

// gate_up: [T, 2I] -> silu(gate) * up: [T, I]
torch::Tensor silu_mul(const torch::Tensor& gate_up, int64_t threads) {
  check_act(gate_up, gate_up.scalar_type(), "silu_mul");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  by_type(gate_up, [&](auto e) {
    using E = decltype(e);
    kvrelay::silu_mul(gate_up.data_ptr<E>(), out.data_ptr<E>(), T, I, resolve(threads));
    return 0;
  });
  return out;
}

// qk: [T, heads, D] rotated in place; cos, sin_signed: [P, D]; sin_signed has
// its first half negated, so out = x * cos + roll(x, D/2) * sin_signed.
void rope_(torch::Tensor qk, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions,
           int64_t threads) {
  const auto type = qk.scalar_type();
  TORCH_CHECK((type == at::kBFloat16 || type == at::kFloat) && qk.stride(2) == 1,
              "rope_: bf16 or fp32 with a contiguous last dim");
  check_act(cos, type, "rope_ cos");
  check_act(sin, type, "rope_ sin");
  by_type(qk, [&](auto e) {
    using E = decltype(e);
    kvrelay::rope(qk.data_ptr<E>(), qk.stride(0), qk.stride(1), qk.size(0), qk.size(1), qk.size(2),
                  cos.data_ptr<E>(), sin.data_ptr<E>(), positions.data_ptr<int64_t>(), resolve(threads));
    return 0;
  });
}

// q: [B, H, D]; kv: [NB, 2, BS, Hkv, D]; tables: [B, maxnb] int64; lens: [B] int64.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables,
                                     const torch::Tensor& lens, double scale, int64_t threads) {
  const auto type = q.scalar_type();
  check_act(q, type, "paged_decode_attention q");
  check_act(kv, type, "paged_decode_attention kv");
  TORCH_CHECK(tables.is_contiguous() && lens.is_contiguous(), "paged_decode_attention: contiguous tables, lens");
  auto out = torch::empty_like(q);
  by_type(q, [&](auto e) {
    using E = decltype(e);
    kvrelay::decode_attention(q.data_ptr<E>(), q.stride(0), kv.data_ptr<E>(), kv.size(2), kv.size(3),
                              tables.data_ptr<int64_t>(), tables.size(1), lens.data_ptr<int64_t>(),
                              out.data_ptr<E>(), out.stride(0), q.size(0), q.size(1), q.size(2),
                              static_cast<float>(scale), resolve(threads));
    return 0;
  });
  return out;
}
