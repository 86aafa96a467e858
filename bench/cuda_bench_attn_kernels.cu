// Per-kernel benchmark of the gated attention's CUDA implementations: where the time of the
// forward and the backward goes, kernel by kernel, for each implementation side by side, at
// Qwen3.5's shape (16 query / 4 kv heads of dim 256, rotary 64, theta 1e7), T = 8192 as one
// document and as four of 2048. Also compares each implementation's outputs with cuda.flash's at
// that size (relative L2), a check of the long tile loops that the unit tests' small shapes
// cannot make.
//
//   cuda_bench_attn_kernels [--iters N] [--impls cuda.flash,cuda.sm90_tma]
//
// Method: CUDA events on the library stream before the first launch and after each launch of one
// forward / backward call (src/ops/gated_attention/cuda_launch.h, forward_marked), each call
// behind a 1 ms device-side wait so that launch gaps stay out; medians over N calls after two
// warm-up calls. TFLOP/s per attention kernel count its own tile products (2 ·
// hd FLOPs per visible (query, key) pair and head each): forward 2, dk/dv 4, dq 3.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include "gdn/backend/cuda_check.h"
#include "gdn/backend/cuda_context.h"
#include "gdn/core/tensor.h"
#include "ops/gated_attention/cuda_launch.h"
#include "ops/gated_attention/op.h"

namespace gdn::bench {
namespace {

using ops::GatedAttentionBwd;
using ops::GatedAttentionFwd;
namespace attn = ops::attn;

__global__ void fill_kernel(__nv_bfloat16* p, int64_t n, uint64_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed * 0x100000001b3ull + static_cast<uint64_t>(i) + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * 0x1p-24f;
    p[i] = __float2bfloat16_rn(lo + (hi - lo) * u);
  }
}

void fill(const Tensor& t, uint64_t seed, float lo, float hi) {
  fill_kernel<<<1024, 256, 0, cuda::Context::get().stream()>>>(
      reinterpret_cast<__nv_bfloat16*>(t.data()), t.numel(), seed, lo, hi);
  GDN_CUDA_LAUNCH_CHECK("fill_kernel");
}

// Keeps the device busy for `ns` so that the host enqueues the next call's launches ahead of it:
// the events then time the kernels, not the host's launch gaps.
__global__ void busy_wait_kernel(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}
void busy_wait() {
  busy_wait_kernel<<<1, 1, 0, cuda::Context::get().stream()>>>(1'000'000);
  GDN_CUDA_LAUNCH_CHECK("busy_wait_kernel");
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Relative L2 distance of a from b (same shape, both on the device, bf16 or f32), reduced on the
// device (double partial sums; the order of the atomic adds makes the last digits vary).
template <class T>
__device__ __forceinline__ double as_double(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return __bfloat162float(x);
  }
}
template <class T>
__global__ void diff_kernel(const T* a, const T* b, int64_t n, double* out) {
  double num = 0, den = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double x = as_double(a[i]), y = as_double(b[i]);
    num += (x - y) * (x - y);
    den += y * y;
  }
  for (int m = 16; m > 0; m >>= 1) {
    num += __shfl_xor_sync(0xffffffffu, num, m);
    den += __shfl_xor_sync(0xffffffffu, den, m);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(out, num);
    atomicAdd(out + 1, den);
  }
}
double rel_l2(const Tensor& a, const Tensor& b) {
  OwnedTensor acc = OwnedTensor::zeros(DType::F64, {2}, Device::CUDA);
  cudaStream_t s = cuda::Context::get().stream();
  if (a.dtype() == DType::F32) {
    diff_kernel<float>
        <<<512, 256, 0, s>>>(a.ptr<float>(), b.ptr<float>(), a.numel(), acc.ptr<double>());
  } else {
    diff_kernel<__nv_bfloat16><<<512, 256, 0, s>>>(reinterpret_cast<const __nv_bfloat16*>(a.data()),
                                                   reinterpret_cast<const __nv_bfloat16*>(b.data()),
                                                   a.numel(), acc.ptr<double>());
  }
  GDN_CUDA_LAUNCH_CHECK("diff_kernel");
  const std::vector<double> v = to_f64_vector(acc);
  return std::sqrt(v[0] / std::max(v[1], 1e-300));
}

struct Bufs {
  OwnedTensor qg, k, v, wq, wk, cu, o, q_hat, k_hat, attn, lse, q_rstd, k_rstd, d_o, dqg, dk, dv,
      dwq, dwk;
};

constexpr int64_t kHq = 16, kHkv = 4, kHd = 256, kRot = 64;
constexpr double kTheta = 1e7;

Bufs make_bufs(int64_t T, int64_t docs) {
  const auto bf = [](std::initializer_list<int64_t> s) {
    return OwnedTensor::empty(DType::BF16, s, Device::CUDA);
  };
  const auto f32 = [](std::initializer_list<int64_t> s) {
    return OwnedTensor::zeros(DType::F32, s, Device::CUDA);
  };
  std::vector<int32_t> offs;
  for (int64_t n = 0; n <= docs; ++n) offs.push_back(static_cast<int32_t>(n * T / docs));
  OwnedTensor cu_host = convert(Tensor(offs.data(), DType::I32, {docs + 1}), DType::I32);
  Bufs b{bf({T, kHq, 2 * kHd}),
         bf({T, kHkv, kHd}),
         bf({T, kHkv, kHd}),
         bf({kHd}),
         bf({kHd}),
         convert(cu_host, DType::I32, Device::CUDA),
         bf({T, kHq, kHd}),
         bf({T, kHq, kHd}),
         bf({T, kHkv, kHd}),
         bf({T, kHq, kHd}),
         f32({T, kHq}),
         f32({T, kHq}),
         f32({T, kHkv}),
         bf({T, kHq, kHd}),
         bf({T, kHq, 2 * kHd}),
         bf({T, kHkv, kHd}),
         bf({T, kHkv, kHd}),
         f32({kHd}),
         f32({kHd})};
  fill(b.qg, 300, -2.f, 2.f);
  fill(b.k, 301, -2.f, 2.f);
  fill(b.v, 302, -1.f, 1.f);
  fill(b.wq, 303, -0.1f, 0.1f);
  fill(b.wk, 304, -0.1f, 0.1f);
  fill(b.d_o, 305, -1.f, 1.f);
  return b;
}

GatedAttentionFwd fwd_args(Bufs& b) {
  return {b.qg,    b.k,    b.v,   b.wq,     b.wk,     b.cu, b.o,    b.q_hat,
          b.k_hat, b.attn, b.lse, b.q_rstd, b.k_rstd, kRot, kTheta, 1e-6};
}
GatedAttentionBwd bwd_args(Bufs& b) {
  return {b.qg,     b.k,   b.v,   b.wq, b.wk, b.cu,  b.q_hat, b.k_hat, b.attn, b.lse, b.q_rstd,
          b.k_rstd, b.d_o, b.dqg, b.dk, b.dv, b.dwq, b.dwk,   kRot,    kTheta, 1e-6};
}

int run(int argc, char** argv) {
  int iters = 20;
  std::vector<std::string> impls{"cuda.flash", "cuda.sm90_tma"};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) {
      iters = std::max(3, std::atoi(argv[++i]));
    } else if (a == "--impls" && i + 1 < argc) {
      impls.clear();
      std::string list = argv[++i];
      for (size_t p = 0; p <= list.size();) {
        const size_t q = std::min(list.find(',', p), list.size());
        if (q > p) impls.push_back(list.substr(p, q - p));
        p = q + 1;
      }
    } else {
      std::printf("usage: %s [--iters N] [--impls a,b,...]\n", argv[0]);
      return a == "--help" ? 0 : 2;
    }
  }
  cuda::Context& ctx = cuda::Context::get();
  std::vector<cudaEvent_t> ev(attn::kBwdMarks);
  for (auto& e : ev) GDN_CUDA_CHECK(cudaEventCreate(&e));
  const char* fwd_names[] = {"index", "prologue", "attn_fwd"};
  const char* bwd_names[] = {"index", "preproc", "dkdv", "dq", "epilogue", "dw_reduce"};

  for (int64_t docs : {1, 4}) {
    const int64_t T = 8192;
    Bufs b = make_bufs(T, docs);
    const double len = static_cast<double>(T / docs);
    const double pair_flops = 2.0 * docs * len * (len + 1) / 2 * kHd * kHq;  // one product
    std::printf("\n== T=%lld, %lld document(s), %lld/%lld heads x %lld, %d iterations\n",
                static_cast<long long>(T), static_cast<long long>(docs),
                static_cast<long long>(kHq), static_cast<long long>(kHkv),
                static_cast<long long>(kHd), iters);
    OwnedTensor ref_o, ref_dqg, ref_dk, ref_dv, ref_lse;
    for (const std::string& impl : impls) {
      std::vector<std::vector<double>> tf(attn::kFwdMarks), tb(attn::kBwdMarks);
      for (int it = 0; it < iters + 2; ++it) {
        busy_wait();
        attn::forward_marked(fwd_args(b), impl, ev.data());
        GDN_CUDA_CHECK(cudaEventSynchronize(ev[attn::kFwdMarks - 1]));
        for (int k = 1; k < attn::kFwdMarks; ++k) {
          float ms = 0;
          GDN_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[k - 1], ev[k]));
          if (it >= 2) tf[k].push_back(ms);
        }
        float ms = 0;
        GDN_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[0], ev[attn::kFwdMarks - 1]));
        if (it >= 2) tf[0].push_back(ms);
        busy_wait();
        attn::backward_marked(bwd_args(b), impl, ev.data());
        GDN_CUDA_CHECK(cudaEventSynchronize(ev[attn::kBwdMarks - 1]));
        for (int k = 1; k < attn::kBwdMarks; ++k) {
          GDN_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[k - 1], ev[k]));
          if (it >= 2) tb[k].push_back(ms);
        }
        GDN_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[0], ev[attn::kBwdMarks - 1]));
        if (it >= 2) tb[0].push_back(ms);
      }
      const double fwd = median(tf[0]), bwd = median(tb[0]);
      std::printf("%-11s fwd %7.3f ms:", impl.c_str(), fwd);
      for (int k = 1; k < attn::kFwdMarks; ++k)
        std::printf(" %s %.3f", fwd_names[k - 1], median(tf[k]));
      std::printf("  [attn_fwd %.0f TFLOP/s]\n", 2 * pair_flops / median(tf[3]) * 1e-9);
      std::printf("%-11s bwd %7.3f ms:", impl.c_str(), bwd);
      for (int k = 1; k < attn::kBwdMarks; ++k)
        std::printf(" %s %.3f", bwd_names[k - 1], median(tb[k]));
      std::printf("  [dkdv %.0f, dq %.0f TFLOP/s]\n", 4 * pair_flops / median(tb[3]) * 1e-9,
                  3 * pair_flops / median(tb[4]) * 1e-9);
      std::printf("%-11s fwd+bwd %.3f ms\n", impl.c_str(), fwd + bwd);
      // Outputs of the last call against the first implementation's.
      if (!ref_o.defined()) {
        ref_o = convert(b.o, DType::BF16, Device::CUDA);
        ref_lse = convert(b.lse, DType::F32, Device::CUDA);
        ref_dqg = convert(b.dqg, DType::BF16, Device::CUDA);
        ref_dk = convert(b.dk, DType::BF16, Device::CUDA);
        ref_dv = convert(b.dv, DType::BF16, Device::CUDA);
      } else {
        std::printf("%-11s vs %s (rel L2): o %.2e lse %.2e dqg %.2e dk %.2e dv %.2e\n",
                    impl.c_str(), impls[0].c_str(), rel_l2(b.o, ref_o), rel_l2(b.lse, ref_lse),
                    rel_l2(b.dqg, ref_dqg), rel_l2(b.dk, ref_dk), rel_l2(b.dv, ref_dv));
      }
      std::fflush(stdout);
    }
  }
  for (auto& e : ev) GDN_CUDA_CHECK(cudaEventDestroy(e));
  (void)ctx;
  return 0;
}

}  // namespace
}  // namespace gdn::bench

int main(int argc, char** argv) {
  try {
    return gdn::bench::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cuda_bench_attn_kernels: %s\n", e.what());
    return 1;
  }
}
