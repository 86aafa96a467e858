// Causal conv1d on the CPU: fp32 with OpenMP.
//
// Forward: tokens in parallel; each output row is bias + W rows of x (or of the document's
// initial state) scaled by the weight taps, with the weight transposed once to [W, C] so that
// the inner loops run over contiguous channels.
// Backward: tasks are (chunk of kChunk tokens) x (block of kChannels channels), in parallel.
// A task walks its tokens from last to first, one document segment at a time: u[t] = dy[t] *
// silu'(z[t]) (z recomputed) is then produced after u[t+1 .. t+W-1], which dx[t] needs, so a ring
// of W rows of u replaces a [T, C] buffer; the u of the first W-1 tokens of the next chunk (same
// document) are recomputed as a warm-up. Each task writes its own partial dweight / dbias, and
// the partials are summed per channel in chunk order afterwards (FLA's causal_conv1d backward
// reduces per-tile partials the same way): deterministic and independent of the thread count,
// and the two-level sum keeps the fp32 error near (kChunk + T / kChunk) ulps.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gdn/backend/registry.h"
#include "ops/causal_conv1d/op.h"

namespace gdn::ops {

namespace {
constexpr int64_t kChannels = 256;  // channels per backward task (1 KiB of a row)
constexpr int64_t kChunk = 256;     // tokens per backward task

// exp(x) for fp32 in a form GCC vectorises inside `omp simd` loops without -ffast-math (std::exp
// is a scalar libm call there, and it was 70% of the SiLU conv's time). Cephes' expf method:
// n = round(x / ln 2) by the 1.5 * 2^23 trick, r = x - n ln 2 in two parts, a degree-6 polynomial,
// 2^n from the exponent bits. Measured over every 7th fp32 in [-87.3, 88.4]: at most 0.98 ulp from
// the correctly rounded value. Range: +inf above 88.376 (std::exp overflows at 88.723), 0 below
// -87.337 (std::exp goes denormal there); NaN stays NaN. The selects are integer masks because
// GCC does not if-convert float selects under the default -ftrapping-math.
inline float exp_f32(float x) {
  constexpr float kHi = 88.3762626647949f, kLo = -87.3365478515625f;
  const int32_t over = -static_cast<int32_t>(x > kHi), under = -static_cast<int32_t>(x < kLo);
  const float xc = std::bit_cast<float>((std::bit_cast<int32_t>(x) & ~(over | under)) |
                                        (std::bit_cast<int32_t>(kHi) & over) |
                                        (std::bit_cast<int32_t>(kLo) & under));
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * (r * r) + r + 1.0f;
  const float scale = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  const int32_t bits = std::bit_cast<int32_t>(e * scale);
  return std::bit_cast<float>(((bits & ~over) | (over & 0x7f800000)) & ~under);
}

// weight [C, W] -> [W, C]
std::vector<float> transpose_weight(const float* w, int64_t C, int64_t W) {
  std::vector<float> wt(static_cast<size_t>(C * W));
  for (int64_t c = 0; c < C; ++c)
    for (int64_t j = 0; j < W; ++j) wt[static_cast<size_t>(j * C + c)] = w[c * W + j];
  return wt;
}

// The document of every token; zero-length documents own no token.
std::vector<int32_t> document_of_token(const std::vector<int64_t>& cu, int64_t T) {
  std::vector<int32_t> doc(static_cast<size_t>(T));  // [T]
  for (size_t n = 0; n + 1 < cu.size(); ++n)
    std::fill(doc.begin() + cu[n], doc.begin() + cu[n + 1], static_cast<int32_t>(n));
  return doc;
}

void forward(const CausalConv1dFwd& p) {
  const int64_t T = p.x.size(0), C = p.x.size(1), W = p.weight.size(1), S = W - 1;
  const float* x = p.x.ptr<float>();                                     // [T, C]
  const float* bias = p.bias.defined() ? p.bias.ptr<float>() : nullptr;  // [C]
  const float* init =
      p.initial_state.defined() ? p.initial_state.ptr<float>() : nullptr;       // [N, C, W-1]
  float* y = p.y.ptr<float>();                                                  // [T, C]
  float* fin = p.final_state.defined() ? p.final_state.ptr<float>() : nullptr;  // [N, C, W-1]
  const std::vector<float> wt = transpose_weight(p.weight.ptr<float>(), C, W);  // [W, C]
  const std::vector<int64_t> cu = causal_conv1d_bounds(p.cu_seqlens, T);
  const int64_t N = static_cast<int64_t>(cu.size()) - 1;
  const std::vector<int32_t> doc_of = document_of_token(cu, T);  // [T]

#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n = doc_of[static_cast<size_t>(t)], s = cu[n], q = t - s;
    float* yr = y + t * C;  // [C]
    if (bias)
      std::copy(bias, bias + C, yr);
    else
      std::fill(yr, yr + C, 0.0f);
    for (int64_t j = 0; j < W; ++j) {
      const float* wj = wt.data() + j * C;  // [C]
      const int64_t k = q + j;              // index into the extended input
      if (k >= S) {
        const float* xr = x + (s + k - S) * C;  // [C]
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) yr[c] += wj[c] * xr[c];
      } else if (init) {
        const float* st = init + n * C * S + k;  // [C] with stride S
        for (int64_t c = 0; c < C; ++c) yr[c] += wj[c] * st[c * S];
      }
    }
    if (p.silu) {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) yr[c] = yr[c] / (1.0f + exp_f32(-yr[c]));
    }
  }

  if (!fin || S == 0) return;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int64_t s = cu[n], L = cu[n + 1] - s;
    for (int64_t c = 0; c < C; ++c)
      for (int64_t k = 0; k < S; ++k) {
        const int64_t e = L + k;  // extended index
        float v = 0.0f;
        if (e >= S)
          v = x[(s + e - S) * C + c];
        else if (init)
          v = init[(n * C + c) * S + e];
        fin[(n * C + c) * S + k] = v;
      }
  }
}

struct BwdArgs {
  int64_t C, W, S;
  const float* x;     // [T, C]
  const float* bias;  // [C] or null
  const float* init;  // [N, C, W-1] or null
  const float* dy;    // [T, C]
  const float* dfin;  // [N, C, W-1] or null
  const float* wt;    // [W, C]
  const int64_t* cu;  // [N+1]
  bool silu;
};

// One backward task: tokens [t0, t1) x channels [c0, c0 + cb). Writes dx and dinitial_state of
// what it owns and its partial dweight (dwp [W, cb], row stride C) and dbias (dbp [cb]).
class BwdTask {
 public:
  explicit BwdTask(const BwdArgs& a)
      : a_(a), ring_(W() * kChannels), st_(a.S * kChannels), dst_(a.S * kChannels), z_(kChannels) {}

  void run(const int32_t* doc_of, int64_t t0, int64_t t1, int64_t c0, int64_t cb, float* dx,
           float* dinit, float* dwp, float* dbp) {
    c0_ = c0;
    cb_ = cb;
    const int64_t C = a_.C, S = a_.S;
    for (int64_t j = 0; j < W(); ++j) std::fill(dwp + j * C, dwp + j * C + cb, 0.0f);
    std::fill(dbp, dbp + cb, 0.0f);
    // Document segments [a, b) of the chunk, last first.
    for (int64_t b = t1; b > t0;) {
      const int64_t n = doc_of[b - 1], s = a_.cu[n], e = a_.cu[n + 1], L = e - s;
      const int64_t a = std::max(s, t0);
      stage(n);
      // Warm-up: u of the next W-1 tokens of this document; the next chunk accumulates their
      // dweight, this one only needs them for dx.
      for (int64_t t = std::min(e, b + S) - 1; t >= b; --t) compute_u(s, t, nullptr, nullptr);
      for (int64_t t = b - 1; t >= a; --t) {
        compute_u(s, t, dwp, dbp);
        // dx[t] = dext[q + W-1]: tap j reads u[q + W-1 - j]; past the document end the extended
        // input is the final state, whose gradient is dfinal_state.
        const int64_t q = t - s;
        float* dxr = dx + t * C + c0;  // [cb]
        if (q + S >= L) {
          const float* d = dst_.data() + (q + S - L) * kChannels;  // [cb]
          std::copy(d, d + cb, dxr);
        } else {
          std::fill(dxr, dxr + cb, 0.0f);
        }
        for (int64_t j = 0; j < W(); ++j) {
          const int64_t qq = q + S - j;
          if (qq >= L) continue;
          const float* wj = a_.wt + j * C + c0;                    // [cb]
          const float* u = ring_.data() + (qq % W()) * kChannels;  // [cb]
#pragma omp simd
          for (int64_t cc = 0; cc < cb; ++cc) dxr[cc] += wj[cc] * u[cc];
        }
      }
      // d initial_state[k] = dext[k]: u at positions 0 .. W-2 are in the ring (this chunk or its
      // warm-up computed them last).
      if (dinit && a == s)
        for (int64_t cc = 0; cc < cb; ++cc)
          for (int64_t k = 0; k < S; ++k) {
            float v = k >= L ? dst_[(k - L) * kChannels + cc] : 0.0f;
            for (int64_t j = 0; j <= k; ++j)
              if (k - j < L) v += a_.wt[j * C + c0 + cc] * ring_[(k - j) * kChannels + cc];
            dinit[(n * C + c0 + cc) * S + k] = v;
          }
      b = a;
    }
  }

 private:
  int64_t W() const { return a_.W; }

  // Initial state and dfinal_state of document n for this task's channels, [W-1, kChannels].
  void stage(int64_t n) {
    const int64_t S = a_.S;
    for (int64_t k = 0; k < S; ++k)
      for (int64_t cc = 0; cc < cb_; ++cc) {
        const int64_t src = (n * a_.C + c0_ + cc) * S + k;
        st_[k * kChannels + cc] = a_.init ? a_.init[src] : 0.0f;
        dst_[k * kChannels + cc] = a_.dfin ? a_.dfin[src] : 0.0f;
      }
  }

  // u at token t (document start s, position q = t - s) into ring slot q mod W; adds its
  // dweight / dbias terms when dwp is given.
  void compute_u(int64_t s, int64_t t, float* dwp, float* dbp) {
    const int64_t C = a_.C, S = a_.S, q = t - s, c0 = c0_, cb = cb_;
    const float* ext[kConvMaxWidth];  // extended-input rows q .. q+W-1, [cb] each
    for (int64_t j = 0; j < W(); ++j)
      ext[j] = q + j >= S ? a_.x + (s + q + j - S) * C + c0 : st_.data() + (q + j) * kChannels;
    float* z = z_.data();  // [cb]
    if (a_.bias)
      std::copy(a_.bias + c0, a_.bias + c0 + cb, z);
    else
      std::fill(z, z + cb, 0.0f);
    for (int64_t j = 0; j < W(); ++j) {
      const float* wj = a_.wt + j * C + c0;  // [cb]
      const float* e = ext[j];               // [cb]
#pragma omp simd
      for (int64_t cc = 0; cc < cb; ++cc) z[cc] += wj[cc] * e[cc];
    }
    float* u = ring_.data() + (q % W()) * kChannels;  // [cb]
    const float* dyr = a_.dy + t * C + c0;            // [cb]
    if (a_.silu) {
#pragma omp simd
      for (int64_t cc = 0; cc < cb; ++cc) {
        const float zc = z[cc], sg = 1.0f / (1.0f + exp_f32(-zc));
        u[cc] = dyr[cc] * (sg * (1.0f + zc * (1.0f - sg)));
      }
    } else {
      std::copy(dyr, dyr + cb, u);
    }
    if (!dwp) return;
    for (int64_t j = 0; j < W(); ++j) {
      float* d = dwp + j * C;   // [cb]
      const float* e = ext[j];  // [cb]
#pragma omp simd
      for (int64_t cc = 0; cc < cb; ++cc) d[cc] += u[cc] * e[cc];
    }
#pragma omp simd
    for (int64_t cc = 0; cc < cb; ++cc) dbp[cc] += u[cc];
  }

  const BwdArgs& a_;
  int64_t c0_ = 0, cb_ = 0;
  std::vector<float> ring_;  // [W, kChannels] u by document position mod W
  std::vector<float> st_;    // [W-1, kChannels] staged initial state
  std::vector<float> dst_;   // [W-1, kChannels] staged dfinal_state
  std::vector<float> z_;     // [kChannels]
};

void backward(const CausalConv1dBwd& p) {
  const int64_t T = p.x.size(0), C = p.x.size(1), W = p.weight.size(1), S = W - 1;
  const float* dfin =
      p.dfinal_state.defined() ? p.dfinal_state.ptr<float>() : nullptr;  // [N, C, W-1]
  float* dx = p.dx.ptr<float>();                                         // [T, C]
  float* dw = p.dweight.ptr<float>();                                    // [C, W]
  float* db = p.dbias.defined() ? p.dbias.ptr<float>() : nullptr;        // [C]
  float* dinit =
      p.dinitial_state.defined() ? p.dinitial_state.ptr<float>() : nullptr;     // [N, C, W-1]
  const std::vector<float> wt = transpose_weight(p.weight.ptr<float>(), C, W);  // [W, C]
  const std::vector<int64_t> cu = causal_conv1d_bounds(p.cu_seqlens, T);
  const int64_t N = static_cast<int64_t>(cu.size()) - 1;
  const std::vector<int32_t> doc_of = document_of_token(cu, T);  // [T]
  const BwdArgs args{C,
                     W,
                     S,
                     p.x.ptr<float>(),
                     p.bias.defined() ? p.bias.ptr<float>() : nullptr,
                     p.initial_state.defined() ? p.initial_state.ptr<float>() : nullptr,
                     p.dy.ptr<float>(),
                     dfin,
                     wt.data(),
                     cu.data(),
                     p.silu};
  const int64_t nchunk = (T + kChunk - 1) / kChunk, ncb = (C + kChannels - 1) / kChannels;
  std::vector<float> dw_part(static_cast<size_t>(nchunk * W * C));  // [nchunk, W, C]
  std::vector<float> db_part(static_cast<size_t>(nchunk * C));      // [nchunk, C]

#pragma omp parallel
  {
    BwdTask task(args);
#pragma omp for collapse(2) schedule(static)
    for (int64_t chunk = 0; chunk < nchunk; ++chunk)
      for (int64_t cbk = 0; cbk < ncb; ++cbk) {
        const int64_t c0 = cbk * kChannels;
        task.run(doc_of.data(), chunk * kChunk, std::min(T, (chunk + 1) * kChunk), c0,
                 std::min(kChannels, C - c0), dx, dinit, dw_part.data() + chunk * W * C + c0,
                 db_part.data() + chunk * C + c0);
      }
  }

  // Second level of the sums, in chunk order.
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t j = 0; j < W; ++j) {
      float sum = 0.0f;
      for (int64_t k = 0; k < nchunk; ++k) sum += dw_part[static_cast<size_t>((k * W + j) * C + c)];
      dw[c * W + j] += sum;
    }
    if (db) {
      float sum = 0.0f;
      for (int64_t k = 0; k < nchunk; ++k) sum += db_part[static_cast<size_t>(k * C + c)];
      db[c] += sum;
    }
  }
  // Zero-length documents own no token: d initial_state = dfinal_state (or zero).
  if (dinit)
    for (int64_t n = 0; n < N; ++n)
      if (cu[n] == cu[n + 1])
        for (int64_t i = n * C * S; i < (n + 1) * C * S; ++i) dinit[i] = dfin ? dfin[i] : 0.0f;
}

const CausalConv1dTable kTable{forward, backward};
}  // namespace

GDN_REGISTER(causal_conv1d_cpu) {
  Registry::global().add_impl({"causal_conv1d", "cpu.rows", Backend::Cpu, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
