// Fused CPU kernels for the bf16 decode path (kvrelay/engine/kernels.py).
//
// Decode runs one token per sequence through 30-odd layers, so its step time
// is dominated by per-op overhead, not arithmetic. These kernels replace the
// chains of small torch ops that overhead comes from: residual add + RMSNorm,
// SiLU-and-multiply, rotary embedding, and attention over the paged KV cache
// (read in place through the block table, no gather copy). All math is fp32;
// results are rounded to bf16 at the points where the unfused torch model
// rounds, so the two agree to bf16 rounding.
#include <torch/extension.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

#include "ops.h"

namespace kvrelay {
namespace {

inline float f(bf16 v) { return static_cast<float>(v); }
inline float rb(float v) { return f(bf16(v)); }  // round to bf16 precision

// 16 bf16 <-> 16 fp32 (bf16 is the top half of an fp32)
inline __m512 load16(const bf16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(bf16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));  // nearest even
}
inline __m512 round16(__m512 v) {  // to bf16 precision and back
  __m256i b = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// exp for fp32 lanes: 2^n * p(r), x = n ln2 + r, |r| <= ln2/2; ~1 ulp.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// Per-thread scratch that grows and is never freed (no allocation per call).
std::vector<float>& scratch(int which) {
  thread_local std::vector<float> bufs[3];
  return bufs[which];
}

}  // namespace

void add_rms_norm(bf16* x, const bf16* delta, const bf16* w, bf16* out, int64_t T, int64_t H, float eps,
                  int threads) {
  par_for(T, 64, threads, [&](int64_t t0, int64_t t1) {
    std::vector<float>& row = scratch(0);
    row.resize(H);
    for (int64_t t = t0; t < t1; ++t) {
      bf16* xr = x + t * H;
      const bf16* dr = delta ? delta + t * H : nullptr;
      bf16* orow = out + t * H;
      // round the sum to bf16 as the unfused model does (x is stored in bf16)
      __m512 ssv = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + 16 <= H; i += 16) {
        __m512 v = load16(xr + i);
        if (dr) v = round16(_mm512_add_ps(v, load16(dr + i)));
        _mm512_storeu_ps(row.data() + i, v);
        ssv = _mm512_fmadd_ps(v, v, ssv);
      }
      float ss = _mm512_reduce_add_ps(ssv);
      for (; i < H; ++i) {
        const float v = dr ? rb(f(xr[i]) + f(dr[i])) : f(xr[i]);
        row[i] = v;
        ss += v * v;
      }
      const float r = 1.f / std::sqrt(ss / H + eps);
      const __m512 rv = _mm512_set1_ps(r);
      i = 0;
      for (; i + 16 <= H; i += 16) {
        const __m512 v = _mm512_loadu_ps(row.data() + i);
        if (dr) store16(xr + i, v);
        store16(orow + i, _mm512_mul_ps(round16(_mm512_mul_ps(v, rv)), load16(w + i)));
      }
      for (; i < H; ++i) {
        if (dr) xr[i] = bf16(row[i]);
        orow[i] = bf16(rb(row[i] * r) * f(w[i]));
      }
    }
  });
}

void head_rms_norm(bf16* x, int64_t s0, int64_t T, int64_t NH, int64_t D, const bf16* w, float eps, int threads) {
  par_for(T * NH, 256, threads, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j) {
      bf16* v = x + (j / NH) * s0 + (j % NH) * D;
      float ss = 0.f;
      for (int64_t i = 0; i < D; ++i) ss += f(v[i]) * f(v[i]);
      const float r = 1.f / std::sqrt(ss / D + eps);
      for (int64_t i = 0; i < D; ++i) v[i] = bf16(rb(f(v[i]) * r) * f(w[i]));
    }
  });
}

void silu_mul(const bf16* gate_up, bf16* out, int64_t T, int64_t I, int threads) {
  const int64_t chunk = 256;  // elements per work item: rows are split too, so one token uses every thread
  const int64_t per_row = (I + chunk - 1) / chunk;
  par_for(T * per_row, 32, threads, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j) {
      const int64_t t = j / per_row, i0 = (j % per_row) * chunk, i1 = std::min(I, i0 + chunk);
      const bf16* g = gate_up + t * 2 * I;
      const bf16* u = g + I;
      bf16* o = out + t * I;
      int64_t i = i0;
      for (; i + 16 <= i1; i += 16) {
        const __m512 gv = load16(g + i);
        const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        store16(o + i, _mm512_mul_ps(round16(s), load16(u + i)));
      }
      for (; i < i1; ++i) {
        const float gv = f(g[i]);
        o[i] = bf16(rb(gv / (1.f + std::exp(-gv))) * f(u[i]));
      }
    }
  });
}

void rope(bf16* x, int64_t s0, int64_t s1, int64_t T, int64_t NH, int64_t D, const bf16* cos, const bf16* sin,
          const int64_t* positions, int threads) {
  const int64_t half = D / 2;
  par_for(T * NH, 512, threads, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j) {
      const int64_t t = j / NH, h = j % NH;
      bf16* v = x + t * s0 + h * s1;
      const bf16* c = cos + positions[t] * D;
      const bf16* s = sin + positions[t] * D;
      if (half % 16 == 0) {
        for (int64_t i = 0; i < half; i += 16) {
          const __m512 lo = load16(v + i), hi = load16(v + half + i);
          const __m512 olo = _mm512_add_ps(round16(_mm512_mul_ps(lo, load16(c + i))),
                                           round16(_mm512_mul_ps(hi, load16(s + i))));
          const __m512 ohi = _mm512_add_ps(round16(_mm512_mul_ps(hi, load16(c + half + i))),
                                           round16(_mm512_mul_ps(lo, load16(s + half + i))));
          store16(v + i, olo);
          store16(v + half + i, ohi);
        }
        continue;
      }
      float xs[512];
      TORCH_CHECK(D <= 512, "rope: head_dim > 512");
      for (int64_t i = 0; i < D; ++i) xs[i] = f(v[i]);
      for (int64_t i = 0; i < D; ++i) {
        const float rot = xs[(i + half) % D];
        v[i] = bf16(rb(xs[i] * f(c[i])) + rb(rot * f(s[i])));
      }
    }
  });
}

// Lane i of the result is the sum of the 16 lanes of v[i] (a transposing
// reduction tree: 45 shuffles/adds instead of 16 horizontal reductions).
inline __m512 reduce16(const __m512* v) {
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

// Keys and values are read through the block table, a few cache lines per
// token at a stride, so the hardware prefetcher loses them at every block
// boundary; fetch the head kAhead tokens ahead.
constexpr int64_t kAhead = 16;
inline void prefetch_head(const bf16* p, int nv) {
  for (int i = 0; i < nv; i += 2) _mm_prefetch(reinterpret_cast<const char*>(p + 16 * i), _MM_HINT_T0);
}

// acc[g][:] = sum over t of scores[g][t] * value(t), for GN query heads at once:
// each value vector is loaded (and widened to fp32) once for all GN heads. Per
// head the sum runs over t in order, as one head at a time would.
template <int NV, int GN, class Key>
inline void weigh_values(const float* scores, int64_t Lp, const Key& key, int64_t kv_stride, int64_t L, float* acc,
                         int64_t D, bool fetch) {
  __m512 o[GN][NV];
  for (int g = 0; g < GN; ++g)
    for (int d = 0; d < NV; ++d) o[g][d] = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; ++t) {
    const bf16* v = key(t) + kv_stride;
    if (fetch && t + kAhead < L) prefetch_head(key(t + kAhead) + kv_stride, NV);
    __m512 vv[NV];
    for (int d = 0; d < NV; ++d) vv[d] = load16(v + 16 * d);
    for (int g = 0; g < GN; ++g) {
      const __m512 pv = _mm512_set1_ps(scores[g * Lp + t]);
      for (int d = 0; d < NV; ++d) o[g][d] = _mm512_fmadd_ps(pv, vv[d], o[g][d]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int d = 0; d < NV; ++d) _mm512_storeu_ps(acc + g * D + 16 * d, o[g][d]);
}

// One (sequence, KV head) pair: G query heads against the sequence's L keys
// and values, read in place through its block table. NV: fp32 vectors per
// head (head_dim / 16), a compile-time constant so the head stays in
// registers; 0 takes the scalar path (any head size).
template <int NV>
void attend_one(const float* qf, const int64_t* table, const bf16* kv, int64_t BS, int64_t blk_stride,
                int64_t kv_stride, int64_t tok_stride, int64_t L, int64_t G, int64_t D, float* scores, float* acc,
                __m512* part) {
  const int64_t Lp = (L + 15) / 16 * 16;  // score row stride: whole vectors
  auto key = [&](int64_t t) { return kv + table[t / BS] * blk_stride + (t % BS) * tok_stride; };
  if constexpr (NV > 0) {
    // scores, 16 keys at a time: one partial vector per (head, key), then one transposing reduction
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
      const int64_t n = std::min<int64_t>(16, L - t0);
      for (int64_t i = 0; i < 16; ++i) {
        if (i >= n) {
          for (int64_t g = 0; g < G; ++g) part[g * 16 + i] = _mm512_setzero_ps();
          continue;
        }
        const bf16* k = key(t0 + i);
        if (t0 + i + kAhead < L) prefetch_head(key(t0 + i + kAhead), NV);
        __m512 kvec[NV];
        for (int d = 0; d < NV; ++d) kvec[d] = load16(k + 16 * d);
        for (int64_t g = 0; g < G; ++g) {
          __m512 p = _mm512_mul_ps(_mm512_loadu_ps(qf + g * D), kvec[0]);
          for (int d = 1; d < NV; ++d) p = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * D + 16 * d), kvec[d], p);
          part[g * 16 + i] = p;
        }
      }
      for (int64_t g = 0; g < G; ++g) _mm512_storeu_ps(scores + g * Lp + t0, reduce16(part + g * 16));
    }
  } else {
    for (int64_t t = 0; t < L; ++t) {
      const bf16* k = key(t);
      for (int64_t g = 0; g < G; ++g) {
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qf[g * D + d] * f(k[d]);
        scores[g * Lp + t] = dot;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // softmax
    float* sc = scores + g * Lp;
    __m512 mxv16 = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= L; t += 16) mxv16 = _mm512_max_ps(mxv16, _mm512_loadu_ps(sc + t));
    float mx = _mm512_reduce_max_ps(mxv16);
    for (; t < L; ++t) mx = std::max(mx, sc[t]);
    const __m512 mxv = _mm512_set1_ps(mx);
    __m512 sumv = _mm512_setzero_ps();
    t = 0;
    for (; t + 16 <= L; t += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + t), mxv));
      _mm512_storeu_ps(sc + t, e);
      sumv = _mm512_add_ps(sumv, e);
    }
    float sum = _mm512_reduce_add_ps(sumv);
    for (; t < L; ++t) {
      sc[t] = std::exp(sc[t] - mx);
      sum += sc[t];
    }
    const float inv = 1.f / sum;
    for (t = 0; t < L; ++t) sc[t] *= inv;
  }
  if constexpr (NV > 0) {
    // the weighted sums of values in registers, up to 4 heads (16 vectors) per pass over the values
    for (int64_t g = 0; g < G;) {
      const int64_t n = std::min<int64_t>(G - g, 16 / NV);
      const float* sc = scores + g * Lp;
      float* ac = acc + g * D;
      const bool fetch = g == 0;
      switch (n) {
        case 1: weigh_values<NV, 1>(sc, Lp, key, kv_stride, L, ac, D, fetch); break;
        case 2: if constexpr (2 * NV <= 16) weigh_values<NV, 2>(sc, Lp, key, kv_stride, L, ac, D, fetch); break;
        case 3: if constexpr (3 * NV <= 16) weigh_values<NV, 3>(sc, Lp, key, kv_stride, L, ac, D, fetch); break;
        default: if constexpr (4 * NV <= 16) weigh_values<NV, 4>(sc, Lp, key, kv_stride, L, ac, D, fetch); break;
      }
      g += std::min<int64_t>(n, 4);
    }
  } else {
    std::fill(acc, acc + G * D, 0.f);
    for (int64_t t = 0; t < L; ++t) {
      const bf16* v = key(t) + kv_stride;
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * Lp + t];
        float* ac = acc + g * D;
        for (int64_t d = 0; d < D; ++d) ac[d] += p * f(v[d]);
      }
    }
  }
}

void decode_attention(const bf16* q, int64_t qs0, const bf16* kv, int64_t BS, int64_t Hkv, const int64_t* tables,
                      int64_t maxnb, const int64_t* lens, bf16* out, int64_t os0, int64_t B, int64_t H, int64_t D,
                      float scale, int threads) {
  const int64_t G = H / Hkv;
  const int64_t tok_stride = Hkv * D, kv_stride = BS * Hkv * D, blk_stride = 2 * kv_stride;
  auto* fn = D == 64 ? &attend_one<4> : D == 128 ? &attend_one<8> : D == 32 ? &attend_one<2>
           : D == 256 ? &attend_one<16> : D == 16 ? &attend_one<1> : &attend_one<0>;
  par_for(B * Hkv, 1, threads, [&](int64_t a, int64_t b) {
    std::vector<float>& qf = scratch(0);
    std::vector<float>& scores = scratch(1);
    std::vector<float>& acc = scratch(2);
    qf.resize(G * D);
    acc.resize(G * D);
    std::vector<__m512> part(G * 16);
    for (int64_t j = a; j < b; ++j) {
      const int64_t s = j / Hkv, hk = j % Hkv, L = lens[s];
      const bf16* qs = q + s * qs0 + hk * G * D;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = f(qs[i]) * scale;
      scores.resize(G * ((L + 15) / 16 * 16));
      fn(qf.data(), tables + s * maxnb, kv + hk * D, BS, blk_stride, kv_stride, tok_stride, L, G, D, scores.data(),
         acc.data(), part.data());
      bf16* os = out + s * os0 + hk * G * D;
      for (int64_t i = 0; i < G * D; ++i) os[i] = bf16(acc[i]);
    }
  });
}

}  // namespace kvrelay

// ---- torch-facing wrappers (engine/kernels.py NativeOps) ----------------------

namespace {
using kvrelay::bf16;

int resolve(int64_t threads) { return threads > 0 ? static_cast<int>(threads) : at::get_num_threads(); }

void check_bf16(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous(), what, ": expected a contiguous bf16 tensor");
}
}  // namespace

// x += delta (in place, both [T, H]; no delta: x unchanged); returns rms_norm(x) * w.
torch::Tensor add_rms_norm(torch::Tensor x, const c10::optional<torch::Tensor>& delta, const torch::Tensor& w,
                           double eps, int64_t threads) {
  check_bf16(x, "add_rms_norm x");
  if (delta) check_bf16(*delta, "add_rms_norm delta");
  auto out = torch::empty_like(x);
  kvrelay::add_rms_norm(x.data_ptr<bf16>(), delta ? delta->data_ptr<bf16>() : nullptr, w.data_ptr<bf16>(),
                        out.data_ptr<bf16>(),
                        x.size(0), x.size(1), static_cast<float>(eps), resolve(threads));
  return out;
}

// gate_up: [T, 2I] -> silu(gate) * up: [T, I]
torch::Tensor silu_mul(const torch::Tensor& gate_up, int64_t threads) {
  check_bf16(gate_up, "silu_mul");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  kvrelay::silu_mul(gate_up.data_ptr<bf16>(), out.data_ptr<bf16>(), T, I, resolve(threads));
  return out;
}

// qk: [T, heads, D] rotated in place; cos, sin_signed: [P, D]; sin_signed has
// its first half negated, so out = x * cos + roll(x, D/2) * sin_signed.
void rope_(torch::Tensor qk, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions,
           int64_t threads) {
  TORCH_CHECK(qk.scalar_type() == at::kBFloat16 && qk.stride(2) == 1, "rope_: bf16 with a contiguous last dim");
  kvrelay::rope(qk.data_ptr<bf16>(), qk.stride(0), qk.stride(1), qk.size(0), qk.size(1), qk.size(2),
                cos.data_ptr<bf16>(), sin.data_ptr<bf16>(), positions.data_ptr<int64_t>(), resolve(threads));
}

// q: [B, H, D]; kv: [NB, 2, BS, Hkv, D]; tables: [B, maxnb] int64; lens: [B] int64.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables,
                                     const torch::Tensor& lens, double scale, int64_t threads) {
  check_bf16(q, "paged_decode_attention q");
  check_bf16(kv, "paged_decode_attention kv");
  TORCH_CHECK(tables.is_contiguous() && lens.is_contiguous(), "paged_decode_attention: contiguous tables, lens");
  auto out = torch::empty_like(q);
  kvrelay::decode_attention(q.data_ptr<bf16>(), q.stride(0), kv.data_ptr<bf16>(), kv.size(2), kv.size(3),
                            tables.data_ptr<int64_t>(), tables.size(1), lens.data_ptr<int64_t>(),
                            out.data_ptr<bf16>(), out.stride(0), q.size(0), q.size(1), q.size(2),
                            static_cast<float>(scale), resolve(threads));
  return out;
}
