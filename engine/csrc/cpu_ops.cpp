// Fused CPU kernels for the bf16 decode path (kvrelay/engine/kernels.py).
//
// Decode runs one token per sequence through 30-odd layers, so its step time
// is dominated by per-op overhead, not arithmetic. These kernels replace the
// chains of small torch ops that overhead comes from: residual add + RMSNorm,
// SiLU-and-multiply, rotary embedding, and attention over the paged KV cache
// (read in place through the block table, no gather copy). All math is fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <immintrin.h>
#include <vector>

namespace {
using bf16 = at::BFloat16;

inline float f(bf16 v) { return static_cast<float>(v); }

// 16 bf16 -> 16 fp32 (bf16 is the top half of an fp32)
inline __m512 load16(const bf16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
}  // namespace

// x += delta (in place, both [T, H]); returns rms_norm(x) * w.
torch::Tensor add_rms_norm(torch::Tensor x, const torch::Tensor& delta, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && delta.is_contiguous(), "bf16 contiguous");
  const int64_t T = x.size(0), H = x.size(1);
  auto out = torch::empty_like(x);
  auto* xp = x.data_ptr<bf16>();
  const auto* dp = delta.data_ptr<bf16>();
  const auto* wp = w.data_ptr<bf16>();
  auto* op = out.data_ptr<bf16>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> row(H);
    for (int64_t t = t0; t < t1; ++t) {
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) {
        // round the sum to bf16 as the unfused model does (x is stored in bf16)
        float v = f(bf16(f(xp[t * H + i]) + f(dp[t * H + i])));
        row[i] = v;
        ss += v * v;
      }
      const float r = 1.f / std::sqrt(ss / H + static_cast<float>(eps));
      for (int64_t i = 0; i < H; ++i) {
        xp[t * H + i] = bf16(row[i]);
        op[t * H + i] = bf16(bf16(row[i] * r) * f(wp[i]));
      }
    }
  });
  return out;
}

// gate_up: [T, 2I] -> silu(gate) * up: [T, I]
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.is_contiguous(), "bf16 contiguous");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  const auto* gp = gate_up.data_ptr<bf16>();
  auto* op = out.data_ptr<bf16>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t i = 0; i < I; ++i) {
        const float g = f(gp[t * 2 * I + i]), u = f(gp[t * 2 * I + I + i]);
        op[t * I + i] = bf16(f(bf16(g / (1.f + std::exp(-g)))) * u);
      }
    }
  });
  return out;
}

// qk: [T, heads, D] rotated in place (rotate-half layout); cos, sin_signed: [P, D];
// sin_signed has its first half negated, so out = x * cos + roll(x, D/2) * sin_signed.
void rope_(torch::Tensor qk, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions) {
  TORCH_CHECK(qk.scalar_type() == at::kBFloat16, "bf16");
  const int64_t T = qk.size(0), NH = qk.size(1), D = qk.size(2), half = D / 2;
  const int64_t s0 = qk.stride(0), s1 = qk.stride(1);
  TORCH_CHECK(qk.stride(2) == 1, "last dim contiguous");
  auto* xp = qk.data_ptr<bf16>();
  const auto* cp = cos.data_ptr<bf16>();
  const auto* sp = sin.data_ptr<bf16>();
  const auto* pp = positions.data_ptr<int64_t>();
  at::parallel_for(0, T * NH, 64, [&](int64_t a, int64_t b) {
    std::vector<float> x(D);
    for (int64_t j = a; j < b; ++j) {
      const int64_t t = j / NH, h = j % NH;
      bf16* v = xp + t * s0 + h * s1;
      const bf16* c = cp + pp[t] * D;
      const bf16* s = sp + pp[t] * D;
      for (int64_t i = 0; i < D; ++i) x[i] = f(v[i]);
      for (int64_t i = 0; i < D; ++i) {
        const float rot = x[(i + half) % D];
        v[i] = bf16(f(bf16(x[i] * f(c[i]))) + f(bf16(rot * f(s[i]))));
      }
    }
  });
}

// One query per sequence against its paged context.
// q: [B, H, D]; kv: [NB, 2, BS, Hkv, D]; tables: [B, maxnb] int64; lens: [B] int64.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables,
                                     const torch::Tensor& lens, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv.scalar_type() == at::kBFloat16, "bf16");
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous() && tables.is_contiguous(), "contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = kv.size(2), Hkv = kv.size(3), G = H / Hkv, maxnb = tables.size(1);
  auto out = torch::empty_like(q);
  const auto* qp = q.data_ptr<bf16>();
  const auto* kvp = kv.data_ptr<bf16>();
  const auto* tp = tables.data_ptr<int64_t>();
  const auto* lp = lens.data_ptr<int64_t>();
  auto* op = out.data_ptr<bf16>();
  const int64_t tok_stride = Hkv * D, kv_stride = BS * Hkv * D, blk_stride = 2 * kv_stride;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t a, int64_t b) {
    std::vector<float> qf(G * D), scores, acc(G * D);
    for (int64_t j = a; j < b; ++j) {
      const int64_t s = j / Hkv, hk = j % Hkv, L = lp[s];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = f(qp[(s * H + hk * G + g) * D + d]) * scale;
      scores.assign(G * L, 0.f);
      const bool vec = (D % 16) == 0;
      for (int64_t t = 0; t < L; ++t) {
        const bf16* k = kvp + tp[s * maxnb + t / BS] * blk_stride + (t % BS) * tok_stride + hk * D;
        for (int64_t g = 0; g < G; ++g) {
          float dot = 0.f;
          if (vec) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(&qf[g * D + d]), load16(k + d), a);
            dot = _mm512_reduce_add_ps(a);
          } else {
            for (int64_t d = 0; d < D; ++d) dot += qf[g * D + d] * f(k[d]);
          }
          scores[g * L + t] = dot;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores.data() + g * L;
        float mx = -INFINITY;
        for (int64_t t = 0; t < L; ++t) mx = std::max(mx, sc[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) { sc[t] = std::exp(sc[t] - mx); sum += sc[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sc[t] *= inv;
      }
      for (int64_t t = 0; t < L; ++t) {
        const bf16* v = kvp + tp[s * maxnb + t / BS] * blk_stride + kv_stride + (t % BS) * tok_stride + hk * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* ac = acc.data() + g * D;
          if (vec) {
            const __m512 pv = _mm512_set1_ps(p);
            for (int64_t d = 0; d < D; d += 16)
              _mm512_storeu_ps(ac + d, _mm512_fmadd_ps(pv, load16(v + d), _mm512_loadu_ps(ac + d)));
          } else {
            for (int64_t d = 0; d < D; ++d) ac[d] += p * f(v[d]);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) op[(s * H + hk * G + g) * D + d] = bf16(acc[g * D + d]);
    }
  });
  return out;
}
