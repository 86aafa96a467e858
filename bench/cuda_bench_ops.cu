// GPU op benchmark (ARCHITECTURE.md §10): the device's own ceilings, then every implemented CUDA op
// forward and backward, each as time, bytes moved, achieved GB/s and the ratio to the copy
// bandwidth measured in the same run.
//
//   cuda_bench_ops [JSON_PATH] [--iters N] [--filter SUBSTRING] [--shape SUBSTRING]
//                  [--peers DIR [--peer-steps LIST]]
//                  [--impls A,B,... [--rounds N]]
//
// --impls: every case whose op has CUDA implementations of these names runs once per name and
// round (GDN_OP_<OP> set in the process, decisions cleared), rounds alternating A, B, A, B, ...:
// an A/B in one process, on one copy-rate measurement. Cases of other ops run as usual.
//
// --peers DIR: DIR holds the peers' pure-Python packages unpacked (fla, liger_kernel) and a copy of
// ../shared/bench/peers.py (bench/stack_bench.sh says how to make it). The peers run first, in a
// child python3 (so the two never share the GPU), on the steps of LIST (peers.py --only; default
// "ceil,norms,conv,gdn,attn,flce"); their times are then printed beside ours in a last table, each
// with our matching fwd+bwd time and the speedup, and written to the JSON under "peers".
//
// Method: CUDA events around every iteration, on the library's compute stream; warm-up first
// (which also runs the resolver's probe); a 2 ms device-side wait before the timed iterations so
// that the host enqueues ahead of the device and launch gaps stay out of the numbers; the median of
// N >= 20 iterations (min and max reported too); random data (never zeros); inputs rotated over
// enough buffer sets that every iteration reads from device memory, not L2.
//
// Bytes moved = every input read once + every output written once (an accumulated output counts
// twice: read and written). Kernel-internal temporaries (e.g. rmsnorm's dw partial rows) are not
// counted: they are overhead the ratio should show.
//
// Adding an op: write a make_<op>_cases() that returns OpCases (see make_rmsnorm_cases for a
// memory-bound op, make_gemm_cases for a matrix-bound one) and append it in run().
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "gdn/backend/cuda_check.h"
#include "gdn/backend/cuda_context.h"
#include "gdn/backend/registry.h"
#include "gdn/core/env.h"
#include "gdn/core/tensor.h"
#include "ops/adamw/op.h"
#include "ops/axpy/op.h"
#include "ops/causal_conv1d/op.h"
#include "ops/embedding/op.h"
#include "ops/gated_attention/op.h"
#include "ops/gated_delta_rule/cuda.h"
#include "ops/gated_delta_rule/op.h"
#include "ops/gated_rmsnorm/op.h"
#include "ops/gdn_gates/op.h"
#include "ops/gemm/op.h"
#include "ops/l2norm/op.h"
#include "ops/linear_cross_entropy/op.h"
#include "ops/rmsnorm/op.h"
#include "ops/swiglu/op.h"

namespace gdn::bench {
namespace {

using cuda::Context;

// --- device helpers --------------------------------------------------------------------------
__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform in [lo, hi), a pure function of (seed, index).
template <class T>
__global__ void fill_uniform_kernel(T* p, int64_t n, uint64_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float u = static_cast<float>(splitmix64(seed * 0x100000001b3ull + i) >> 40) * 0x1p-24f;
    const float v = lo + (hi - lo) * u;
    if constexpr (std::is_same_v<T, float>) {
      p[i] = v;
    } else {
      p[i] = __float2bfloat16_rn(v);
    }
  }
}

__global__ void busy_wait_kernel(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(10000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

void fill_uniform(const Tensor& t, uint64_t seed, float lo, float hi) {
  const int64_t n = t.numel();
  cudaStream_t s = cuda::stream();
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 8192));
  if (t.dtype() == DType::F32) {
    fill_uniform_kernel<float><<<blocks, 256, 0, s>>>(t.ptr<float>(), n, seed, lo, hi);
  } else {
    GDN_CHECK(t.dtype() == DType::BF16, "fill_uniform: unsupported dtype");
    fill_uniform_kernel<__nv_bfloat16>
        <<<blocks, 256, 0, s>>>(reinterpret_cast<__nv_bfloat16*>(t.ptr<bf16>()), n, seed, lo, hi);
  }
  GDN_CUDA_LAUNCH_CHECK("fill_uniform_kernel");
}

// --- timing ----------------------------------------------------------------------------------
struct Timing {
  double median_ms = 0, min_ms = 0, max_ms = 0;
  int iters = 0;
};

// Runs fn(i) for warm-up iterations, then times `iters` more, one event pair each.
Timing time_it(const std::function<void(int)>& fn, int warmup, int iters) {
  cudaStream_t s = cuda::stream();
  for (int i = 0; i < warmup; ++i) fn(i);
  GDN_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(iters));
  for (auto& e : ev) GDN_CUDA_CHECK(cudaEventCreate(&e));
  busy_wait_kernel<<<1, 1, 0, s>>>(2'000'000);  // backlog: the host runs ahead of the device
  GDN_CUDA_LAUNCH_CHECK("busy_wait_kernel");
  for (int i = 0; i < iters; ++i) {
    GDN_CUDA_CHECK(cudaEventRecord(ev[2 * i], s));
    fn(warmup + i);
    GDN_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], s));
  }
  GDN_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<double> ms(static_cast<size_t>(iters));
  for (int i = 0; i < iters; ++i) {
    float m = 0;
    GDN_CUDA_CHECK(cudaEventElapsedTime(&m, ev[2 * i], ev[2 * i + 1]));
    ms[i] = m;
  }
  for (auto& e : ev) GDN_CUDA_CHECK(cudaEventDestroy(e));
  std::sort(ms.begin(), ms.end());
  Timing t;
  t.iters = iters;
  t.min_ms = ms.front();
  t.max_ms = ms.back();
  t.median_ms = iters % 2 ? ms[iters / 2] : 0.5 * (ms[iters / 2 - 1] + ms[iters / 2]);
  return t;
}

// --- results ---------------------------------------------------------------------------------
struct Row {
  std::string kind;  // "copy", "gemm", "op"
  std::string name;  // "rmsnorm.fwd"
  std::string shape;
  std::string impl;
  Timing t;
  double bytes = 0;          // bytes moved (ops, copy)
  double flops = 0;          // gemm
  double small_copy_ms = 0;  // ops under kSmallOpBytes: a copy of the same bytes (bench_small_copy)
};

// Memory-bound ops moving fewer bytes than this (about two L2 sizes of an H200) also get the copy
// ceiling at their own size: at 67 MB (l2norm, rmsnorm at D = 2048) a copy reaches only 0.66-0.80
// of the 1 GiB rate (PERF.md run 11).
constexpr double kSmallOpBytes = 128e6;

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o;
}

// --- the ceilings ----------------------------------------------------------------------------
Row bench_copy(int iters) {
  const size_t n = size_t{1} << 30;  // 1 GiB each way
  OwnedTensor src = OwnedTensor::empty(DType::F32, {static_cast<int64_t>(n / 4)}, Device::CUDA);
  OwnedTensor dst = OwnedTensor::empty(DType::F32, {static_cast<int64_t>(n / 4)}, Device::CUDA);
  fill_uniform(src, 1, -1.f, 1.f);
  cudaStream_t s = cuda::stream();
  Row r{"copy", "memcpy_d2d", "[1 GiB]", "cudaMemcpyAsync", {}, 2.0 * static_cast<double>(n), 0};
  r.t = time_it(
      [&](int) {
        GDN_CUDA_CHECK(
            cudaMemcpyAsync(dst.view().data(), src.view().data(), n, cudaMemcpyDeviceToDevice, s));
      },
      3, iters);
  return r;
}

// The copy ceiling of a small op: a device-to-device copy moving the same bytes (bytes / 2 read,
// bytes / 2 written), one cudaMemcpyAsync per iteration, launch included. An op of a few MB is
// bound by launch and memory latency, not bandwidth; the 1 GiB rate is not a ceiling it can
// reach, this is. Each iteration copies a different window of 256 MiB buffers, so it reads device
// memory, not L2.
Timing bench_small_copy(double bytes, int iters) {
  // Made once and kept to the end of the process (never freed: a static destructor would run
  // after the CUDA runtime has shut down).
  static OwnedTensor* src = nullptr;
  static OwnedTensor* dst = nullptr;
  const int64_t span = int64_t{256} << 20;
  if (src == nullptr) {
    src = new OwnedTensor(OwnedTensor::empty(DType::F32, {span / 4}, Device::CUDA));
    dst = new OwnedTensor(OwnedTensor::empty(DType::F32, {span / 4}, Device::CUDA));
    fill_uniform(*src, 5, -1.f, 1.f);
  }
  const int64_t n = (static_cast<int64_t>(bytes / 2) + 255) / 256 * 256;
  const int64_t windows = std::max<int64_t>(1, span / n);
  cudaStream_t s = cuda::stream();
  auto* a = static_cast<char*>(src->view().data());
  auto* b = static_cast<char*>(dst->view().data());
  return time_it(
      [&](int i) {
        const int64_t off = (i % windows) * n;
        GDN_CUDA_CHECK(
            cudaMemcpyAsync(b + off, a + off, static_cast<size_t>(n), cudaMemcpyDeviceToDevice, s));
      },
      3, iters);
}

// D = A^T B in cuBLASLt's column-major terms (the "TN" layout of a row-major linear layer
// y = x W^T), bf16 A/B, fp32 accumulation; D bf16 (beta = 0) or fp32 accumulated (beta = 1, the
// dW case).
Row bench_cublaslt_gemm(int64_t M, int64_t N, int64_t K, bool fp32_accumulate_out, int iters) {
  Context& ctx = Context::get();
  OwnedTensor a = OwnedTensor::empty(DType::BF16, {M, K}, Device::CUDA);  // col-major [K, M]
  OwnedTensor b = OwnedTensor::empty(DType::BF16, {N, K}, Device::CUDA);  // col-major [K, N]
  const DType out_dt = fp32_accumulate_out ? DType::F32 : DType::BF16;
  OwnedTensor d = OwnedTensor::empty(out_dt, {N, M}, Device::CUDA);  // col-major [M, N]
  fill_uniform(a, 2, -1.f, 1.f);
  fill_uniform(b, 3, -1.f, 1.f);
  fill_uniform(d, 4, -1.f, 1.f);
  const cudaDataType_t cd = fp32_accumulate_out ? CUDA_R_32F : CUDA_R_16BF;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  GDN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  GDN_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  GDN_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  GDN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, K, M, K));
  GDN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, N, K));
  GDN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lc, cd, M, N, M));
  GDN_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  size_t ws = ctx.workspace_bytes();
  GDN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  GDN_CUBLAS_CHECK(
      cublasLtMatmulAlgoGetHeuristic(ctx.cublaslt(), op, la, lb, lc, lc, pref, 1, &heur, &found));
  GDN_CHECK(found > 0, "cuBLASLt found no algorithm for the {}x{}x{} GEMM", M, N, K);
  const float alpha = 1.f, beta = fp32_accumulate_out ? 1.f : 0.f;
  cudaStream_t s = ctx.stream();
  Row r{"gemm",
        fp32_accumulate_out ? "cublaslt_bf16_f32acc_out" : "cublaslt_bf16",
        fmt::format("[{}, {}, {}]", M, N, K),
        "cublasLtMatmul TN",
        {},
        0,
        2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K)};
  r.t = time_it(
      [&](int) {
        GDN_CUBLAS_CHECK(cublasLtMatmul(ctx.cublaslt(), op, &alpha, a.view().data(), la,
                                        b.view().data(), lb, &beta, d.view().data(), lc,
                                        d.view().data(), lc, &heur.algo, ctx.workspace(), ws, s));
      },
      3, iters);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(op);
  return r;
}

// --- op cases --------------------------------------------------------------------------------
struct OpCase {
  std::string name;   // "rmsnorm.fwd"
  std::string shape;  // "[8192, 4096] plain"
  std::string op;     // registry name, for the implementation column
  double bytes = 0;   // memory-bound ops: reported as GB/s and a ratio to the copy bandwidth
  double flops = 0;   // matrix ops: reported as TFLOP/s and a ratio to the cuBLASLt 8192^3 rate
  std::function<void(int)> run;  // iteration index -> rotates over buffer sets
  std::shared_ptr<void> keep;    // the buffers
  std::string compare_to;        // another case's name: its time is printed as this one's ratio
  double extra_bytes = 0;        // device memory the op needs beyond its inputs and outputs
  double grown_bytes = 0;        // device memory allocated by a call after warm-up (expect 0)
};

// Enough buffer sets that consecutive iterations never find their inputs in L2.
int sets_for(double bytes_per_set) {
  const double l2 = static_cast<double>(Context::get().props().l2CacheSize);
  return static_cast<int>(std::clamp(std::ceil(3.0 * l2 / bytes_per_set), 2.0, 8.0));
}

std::vector<OpCase> make_rmsnorm_cases() {
  struct Set {
    OwnedTensor x, w, y, rstd, dy, dx, dw;
  };
  struct Cfg {
    int64_t R, D;
    bool zc;
  };
  std::vector<OpCase> cases;
  const Cfg cfgs[] = {
      {8192, 4096, false}, {8192, 4096, true}, {8192, 2048, false}, {65536, 128, false}};
  for (const Cfg& c : cfgs) {
    const double act = 2.0 * static_cast<double>(c.R * c.D);  // one bf16 [R, D] tensor
    const double wb = 2.0 * static_cast<double>(c.D), rb = 4.0 * static_cast<double>(c.R),
                 dwb = 4.0 * static_cast<double>(c.D);
    auto sets = std::make_shared<std::vector<Set>>();
    const int nsets = sets_for(4 * act);
    for (int i = 0; i < nsets; ++i) {
      Set s{OwnedTensor::empty(DType::BF16, {c.R, c.D}, Device::CUDA),
            OwnedTensor::empty(DType::BF16, {c.D}, Device::CUDA),
            OwnedTensor::empty(DType::BF16, {c.R, c.D}, Device::CUDA),
            OwnedTensor::empty(DType::F32, {c.R}, Device::CUDA),
            OwnedTensor::empty(DType::BF16, {c.R, c.D}, Device::CUDA),
            OwnedTensor::empty(DType::BF16, {c.R, c.D}, Device::CUDA),
            OwnedTensor::zeros(DType::F32, {c.D}, Device::CUDA)};
      const uint64_t seed = 100 + 10 * static_cast<uint64_t>(i);
      fill_uniform(s.x, seed, -2.f, 2.f);
      fill_uniform(s.w, seed + 1, c.zc ? -0.1f : 0.5f, c.zc ? 0.1f : 1.5f);
      fill_uniform(s.dy, seed + 2, -1.f, 1.f);
      // A real rstd for the backward (and y written once).
      ops::rmsnorm_forward({s.x, s.w, s.y, s.rstd, 1e-6, c.zc});
      sets->push_back(std::move(s));
    }
    const std::string shape = fmt::format("[{}, {}] {}", c.R, c.D, c.zc ? "zero-centred" : "plain");
    OpCase f{"rmsnorm.fwd", shape, "rmsnorm", act + wb + act + rb, 0, nullptr, sets};
    f.run = [sets, c](int i) {
      const Set& s = (*sets)[static_cast<size_t>(i) % sets->size()];
      ops::rmsnorm_forward({s.x, s.w, s.y, s.rstd, 1e-6, c.zc});
    };
    OpCase b{"rmsnorm.bwd", shape, "rmsnorm", act + wb + rb + act + act + 2 * dwb, 0,
             nullptr,       sets};
    b.run = [sets, c](int i) {
      const Set& s = (*sets)[static_cast<size_t>(i) % sets->size()];
      ops::rmsnorm_backward({s.x, s.w, s.rstd, s.dy, s.dx, s.dw, c.zc});
    };
    cases.push_back(std::move(f));
    cases.push_back(std::move(b));
  }
  return cases;
}

// Buffer sets for the memory-bound ops: `make(i)` builds set i; as many sets as sets_for() asks.
template <class Set, class Make>
std::shared_ptr<std::vector<Set>> make_sets(double bytes_per_set, Make make) {
  auto sets = std::make_shared<std::vector<Set>>();
  const int n = sets_for(bytes_per_set);
  for (int i = 0; i < n; ++i) sets->push_back(make(100 + 10 * static_cast<uint64_t>(i)));
  return sets;
}

OwnedTensor dev_empty(DType dt, std::initializer_list<int64_t> shape) {
  return OwnedTensor::empty(dt, shape, Device::CUDA);
}

// Gated RMSNorm of the GDN output: rows = T x Hv value heads of dv = 128 (Qwen3.5-9B: Hv = 32).
std::vector<OpCase> make_gated_rmsnorm_cases() {
  struct Set {
    OwnedTensor x, z, w, y, rstd, dy, dx, dz, dw;
  };
  const int64_t R = 8192 * 32, D = 128;
  const double act = 2.0 * static_cast<double>(R * D), wb = 2.0 * D, rb = 4.0 * R, dwb = 4.0 * D;
  auto sets = make_sets<Set>(7 * act, [&](uint64_t seed) {
    Set s{dev_empty(DType::BF16, {R, D}),
          dev_empty(DType::BF16, {R, D}),
          dev_empty(DType::BF16, {D}),
          dev_empty(DType::BF16, {R, D}),
          dev_empty(DType::F32, {R}),
          dev_empty(DType::BF16, {R, D}),
          dev_empty(DType::BF16, {R, D}),
          dev_empty(DType::BF16, {R, D}),
          OwnedTensor::zeros(DType::F32, {D}, Device::CUDA)};
    fill_uniform(s.x, seed, -2.f, 2.f);
    fill_uniform(s.z, seed + 1, -4.f, 4.f);
    fill_uniform(s.w, seed + 2, 0.5f, 1.5f);
    fill_uniform(s.dy, seed + 3, -1.f, 1.f);
    ops::gated_rmsnorm_forward({s.x, s.z, s.w, s.y, s.rstd, 1e-6});
    return s;
  });
  const std::string shape = fmt::format("[{}*32, {}]", R / 32, D);
  OpCase f{"gated_rmsnorm.fwd", shape, "gated_rmsnorm", 3 * act + wb + rb, 0, nullptr, sets};
  f.run = [sets](int i) {
    const Set& s = (*sets)[static_cast<size_t>(i) % sets->size()];
    ops::gated_rmsnorm_forward({s.x, s.z, s.w, s.y, s.rstd, 1e-6});
  };
  OpCase b{
      "gated_rmsnorm.bwd", shape, "gated_rmsnorm", 5 * act + wb + rb + 2 * dwb, 0, nullptr, sets};
  b.run = [sets](int i) {
    const Set& s = (*sets)[static_cast<size_t>(i) % sets->size()];
    ops::gated_rmsnorm_backward({s.x, s.z, s.w, s.rstd, s.dy, s.dx, s.dz, s.dw});
  };
  std::vector<OpCase> cases;
  cases.push_back(std::move(f));
  cases.push_back(std::move(b));
  return cases;
}

// L2 norm of q (or k): rows = T x Hk key heads of dk = 128 (Qwen3.5-9B: Hk = 16).
std::vector<OpCase> make_l2norm_cases() {
  struct Set {
    OwnedTensor x, y, rstd, dy, dx;
  };
  const int64_t R = 8192 * 16, D = 128;
  const double act = 2.0 * static_cast<double>(R * D), rb = 4.0 * R;
  auto sets = make_sets<Set>(4 * act, [&](uint64_t seed) {
    Set s{dev_empty(DType::BF16, {R, D}), dev_empty(DType::BF16, {R, D}),
          dev_empty(DType::F32, {R}), dev_empty(DType::BF16, {R, D}),
          dev_empty(DType::BF16, {R, D})};
    fill_uniform(s.x, seed, -2.f, 2.f);
    fill_uniform(s.dy, seed + 1, -1.f, 1.f);
    ops::l2norm_forward({s.x, s.y, s.rstd, 1e-6});
    return s;
  });
  const std::string shape = fmt::format("[{}*16, {}]", R / 16, D);
  OpCase f{"l2norm.fwd", shape, "l2norm", 2 * act + rb, 0, nullptr, sets};
  f.run = [sets](int i) {
    const Set& s = (*sets)[static_cast<size_t>(i) % sets->size()];
    ops::l2norm_forward({s.x, s.y, s.rstd, 1e-6});
  };
  OpCase b{"l2norm.bwd", shape, "l2norm", 3 * act + rb, 0, nullptr, sets};
  b.run = [sets](int i) {
    const Set& s = (*sets)[static_cast<size_t>(i) % sets->size()];
    ops::l2norm_backward({s.y, s.rstd, s.dy, s.dx});
  };
  std::vector<OpCase> cases;
  cases.push_back(std::move(f));
  cases.push_back(std::move(b));
  return cases;
}

// SwiGLU of the dense MLP: [T, I] = [8192, 12288] (Qwen3.5-9B).
std::vector<OpCase> make_swiglu_cases() {
  struct Set {
    OwnedTensor gate, up, y, dy, dgate, dup;
  };
  const int64_t R = 8192, I = 12288;
  const double act = 2.0 * static_cast<double>(R * I);
  auto sets = make_sets<Set>(6 * act, [&](uint64_t seed) {
    Set s{dev_empty(DType::BF16, {R, I}), dev_empty(DType::BF16, {R, I}),
          dev_empty(DType::BF16, {R, I}), dev_empty(DType::BF16, {R, I}),
          dev_empty(DType::BF16, {R, I}), dev_empty(DType::BF16, {R, I})};
    fill_uniform(s.gate, seed, -6.f, 6.f);
    fill_uniform(s.up, seed + 1, -2.f, 2.f);
    fill_uniform(s.dy, seed + 2, -1.f, 1.f);
    return s;
  });
  const std::string shape = fmt::format("[{}, {}]", R, I);
  OpCase f{"swiglu.fwd", shape, "swiglu", 3 * act, 0, nullptr, sets};
  f.run = [sets](int i) {
    const Set& s = (*sets)[static_cast<size_t>(i) % sets->size()];
    ops::swiglu_forward({s.gate, s.up, s.y});
  };
  OpCase b{"swiglu.bwd", shape, "swiglu", 5 * act, 0, nullptr, sets};
  b.run = [sets](int i) {
    const Set& s = (*sets)[static_cast<size_t>(i) % sets->size()];
    ops::swiglu_backward({s.gate, s.up, s.dy, s.dgate, s.dup});
  };
  std::vector<OpCase> cases;
  cases.push_back(std::move(f));
  cases.push_back(std::move(b));
  return cases;
}

// GDN gates: [T, Hv] = [8192, 32]. ~3.5 MB per call: bound by launch latency, not bandwidth.
std::vector<OpCase> make_gdn_gates_cases() {
  struct Set {
    OwnedTensor a, b, A_log, dt_bias, g, beta, dg, dbeta, da, db, dA, ddt;
  };
  const int64_t T = 8192, H = 32;
  const double act = 2.0 * static_cast<double>(T * H), gate = 4.0 * static_cast<double>(T * H),
               par = 4.0 * H;
  auto sets = make_sets<Set>(4 * act + 4 * gate, [&](uint64_t seed) {
    Set s{dev_empty(DType::BF16, {T, H}),
          dev_empty(DType::BF16, {T, H}),
          dev_empty(DType::F32, {H}),
          dev_empty(DType::F32, {H}),
          dev_empty(DType::F32, {T, H}),
          dev_empty(DType::F32, {T, H}),
          dev_empty(DType::F32, {T, H}),
          dev_empty(DType::F32, {T, H}),
          dev_empty(DType::BF16, {T, H}),
          dev_empty(DType::BF16, {T, H}),
          OwnedTensor::zeros(DType::F32, {H}, Device::CUDA),
          OwnedTensor::zeros(DType::F32, {H}, Device::CUDA)};
    fill_uniform(s.a, seed, -4.f, 4.f);
    fill_uniform(s.b, seed + 1, -4.f, 4.f);
    fill_uniform(s.A_log, seed + 2, 0.f, 2.7f);
    fill_uniform(s.dt_bias, seed + 3, -1.f, 1.f);
    fill_uniform(s.dg, seed + 4, -1.f, 1.f);
    fill_uniform(s.dbeta, seed + 5, -1.f, 1.f);
    return s;
  });
  const std::string shape = fmt::format("[{}, {}]", T, H);
  OpCase f{"gdn_gates.fwd", shape, "gdn_gates", 2 * act + 2 * par + 2 * gate, 0, nullptr, sets};
  f.run = [sets](int i) {
    const Set& s = (*sets)[static_cast<size_t>(i) % sets->size()];
    ops::gdn_gates_forward({s.a, s.b, s.A_log, s.dt_bias, s.g, s.beta});
  };
  OpCase b{"gdn_gates.bwd", shape, "gdn_gates", 4 * act + 2 * gate + 6 * par, 0, nullptr, sets};
  b.run = [sets](int i) {
    const Set& s = (*sets)[static_cast<size_t>(i) % sets->size()];
    ops::gdn_gates_backward({s.a, s.b, s.A_log, s.dt_bias, s.dg, s.dbeta, s.da, s.db, s.dA, s.ddt});
  };
  std::vector<OpCase> cases;
  cases.push_back(std::move(f));
  cases.push_back(std::move(b));
  return cases;
}

// Token embedding of the 248320-token vocabulary at D = 4096, T = 8192: ids uniform over V (all
// rows distinct, the most dW bytes) and skewed (id = V * u^4: a few ids repeated many times, as in
// text). Backward bytes count the touched dW rows only (read and written).
std::vector<OpCase> make_embedding_cases() {
  struct Bufs {
    OwnedTensor w, dw, y;
    std::vector<OwnedTensor> dy;
    OwnedTensor ids_uniform, ids_skewed, plan_uniform, plan_skewed;
    int64_t distinct_uniform = 0, distinct_skewed = 0;
  };
  const int64_t T = 8192, V = 248320, D = 4096;
  auto b = std::make_shared<Bufs>();
  b->w = dev_empty(DType::BF16, {V, D});
  b->dw = OwnedTensor::zeros(DType::F32, {V, D}, Device::CUDA);
  b->y = dev_empty(DType::BF16, {T, D});
  fill_uniform(b->w, 300, -1.f, 1.f);
  const double dyb = 2.0 * static_cast<double>(T * D);
  for (int i = 0, n = sets_for(dyb); i < n; ++i) {
    b->dy.push_back(dev_empty(DType::BF16, {T, D}));
    fill_uniform(b->dy.back(), 301 + static_cast<uint64_t>(i), -1.f, 1.f);
  }
  auto make_ids = [&](bool skewed, int64_t* distinct) {
    OwnedTensor h = OwnedTensor::empty(DType::I32, {T});
    std::set<int32_t> seen;
    uint64_t z = 12345;
    for (int64_t t = 0; t < T; ++t) {
      z = z * 6364136223846793005ull + 1442695040888963407ull;
      const double u = static_cast<double>(z >> 11) * 0x1p-53;
      const int32_t id = static_cast<int32_t>(
          std::min<double>(static_cast<double>(V - 1),
                           std::floor(static_cast<double>(V) * (skewed ? u * u * u * u : u))));
      h.ptr<int32_t>()[t] = id;
      seen.insert(id);
    }
    *distinct = static_cast<int64_t>(seen.size());
    return convert(h, DType::I32, Device::CUDA);
  };
  b->ids_uniform = make_ids(false, &b->distinct_uniform);
  b->ids_skewed = make_ids(true, &b->distinct_skewed);
  const double row = 2.0 * D, idb = 4.0 * T;
  std::vector<OpCase> cases;
  OpCase f{"embedding.fwd",
           fmt::format("T={} V={} D={}", T, V, D),
           "embedding",
           idb + 2 * T * row,
           0,
           nullptr,
           b};
  f.run = [b](int) { ops::embedding_forward({b->ids_uniform, b->w, b->y}); };
  cases.push_back(std::move(f));
  // The training path (ops/embedding/op.h): the forward also writes the plan (the ids ranked on a
  // side stream during the gather: + 8 bytes a token of sorted keys and tokens written), and the
  // backward reads it instead of sorting (8 bytes a token read instead of the 4 of the ids).
  const int64_t plan_n = ops::embedding_plan_numel(T, D);
  b->plan_uniform = OwnedTensor::zeros(DType::I32, {plan_n}, Device::CUDA);
  b->plan_skewed = OwnedTensor::zeros(DType::I32, {plan_n}, Device::CUDA);
  ops::embedding_forward({b->ids_skewed, b->w, b->y, b->plan_skewed});
  ops::embedding_forward({b->ids_uniform, b->w, b->y, b->plan_uniform});
  OpCase fp{"embedding.fwd",
            fmt::format("T={} V={} D={}, plan", T, V, D),
            "embedding",
            idb + 2 * T * row + 8.0 * T,
            0,
            nullptr,
            b};
  fp.run = [b](int) { ops::embedding_forward({b->ids_uniform, b->w, b->y, b->plan_uniform}); };
  cases.push_back(std::move(fp));
  for (bool plan : {false, true}) {
    for (bool skewed : {false, true}) {
      const int64_t distinct = skewed ? b->distinct_skewed : b->distinct_uniform;
      OpCase g{"embedding.bwd",
               fmt::format("T={} V={} D={} {} ({} ids){}", T, V, D, skewed ? "skewed" : "uniform",
                           distinct, plan ? ", plan" : ""),
               "embedding",
               (plan ? 8.0 * T : idb) + T * row + 2.0 * 4.0 * D * static_cast<double>(distinct),
               0,
               nullptr,
               b};
      g.run = [b, skewed, plan](int i) {
        const Tensor& ids = skewed ? b->ids_skewed.view() : b->ids_uniform.view();
        const Tensor p = !plan ? Tensor() : skewed ? b->plan_skewed.view() : b->plan_uniform.view();
        ops::embedding_backward({ids, b->dy[static_cast<size_t>(i) % b->dy.size()], b->dw, p});
      };
      cases.push_back(std::move(g));
    }
  }
  return cases;
}

// The optimizer over ~1e9 parameters in a model-like list: 100 matrices of 9.4M elements, 150
// small tensors (norm weights of 4096, per-head parameters of 32). One buffer set (18 GB), plus the
// I16 low halves of split masters (2 GB; "adamw.step_split": the bf16 copy is the high half, m and
// v are shared with "adamw.step").
std::vector<OpCase> make_adamw_cases() {
  struct Bufs {
    std::vector<OwnedTensor> p, g, m, v, pb, lo;
    std::vector<ops::AdamWParam> params, split;
    std::vector<Tensor> grads;
    std::vector<ops::Bf16Copy> copies;
    int64_t n = 0;
  };
  auto b = std::make_shared<Bufs>();
  for (int k = 0; k < 250; ++k) {
    const int64_t n = k < 100 ? int64_t{4096} * 2304 : k % 2 ? 4096 : 32;
    b->p.push_back(dev_empty(DType::F32, {n}));
    b->g.push_back(dev_empty(DType::F32, {n}));
    b->m.push_back(OwnedTensor::zeros(DType::F32, {n}, Device::CUDA));
    b->v.push_back(OwnedTensor::zeros(DType::F32, {n}, Device::CUDA));
    b->pb.push_back(dev_empty(DType::BF16, {n}));
    b->lo.push_back(dev_empty(DType::I16, {n}));
    fill_uniform(b->p.back(), 400 + static_cast<uint64_t>(k), -0.05f, 0.05f);
    fill_uniform(b->g.back(), 700 + static_cast<uint64_t>(k), -1e-3f, 1e-3f);
    b->n += n;
  }
  for (size_t k = 0; k < b->p.size(); ++k) {
    b->params.push_back({b->p[k], b->g[k], b->m[k], b->v[k], b->pb[k], k < 100, {}});
    b->split.push_back({b->lo[k], b->g[k], b->m[k], b->v[k], b->pb[k], k < 100, {}});
    b->grads.push_back(b->g[k]);
    b->copies.push_back({b->p[k], b->pb[k]});
  }
  {  // the split halves of p
    std::vector<ops::Bf16Copy> halves;
    for (size_t k = 0; k < b->p.size(); ++k) halves.push_back({b->p[k], b->pb[k], b->lo[k]});
    ops::adamw_refresh_bf16(halves);
  }
  const double n = static_cast<double>(b->n);
  const std::string shape = fmt::format("{:.3g} elements, {} tensors", n, b->p.size());
  std::vector<OpCase> cases;
  OpCase s{"adamw.step", shape, "adamw", 30.0 * n, 0, nullptr, b};
  s.run = [b](int i) {
    ops::AdamWHyper h;
    h.step = 1 + i;
    ops::adamw_step(b->params, h);
  };
  // Split masters: hi, lo, g, m, v read (2 + 2 + 12 bytes), hi, lo, m, v written (2 + 2 + 8).
  OpCase sp{"adamw.step_split", shape, "adamw", 28.0 * n, 0, nullptr, b};
  sp.run = [b](int i) {
    ops::AdamWHyper h;
    h.step = 1 + i;
    ops::adamw_step(b->split, h);
  };
  OpCase q{"adamw.grad_sumsq", shape, "adamw", 4.0 * n, 0, nullptr, b};
  q.run = [b](int) { (void)ops::grad_global_norm(b->grads); };
  OpCase r{"adamw.refresh_bf16", shape, "adamw", 6.0 * n, 0, nullptr, b};
  r.run = [b](int) { ops::adamw_refresh_bf16(b->copies); };
  cases.push_back(std::move(s));
  cases.push_back(std::move(sp));
  cases.push_back(std::move(q));
  cases.push_back(std::move(r));
  return cases;
}

// axpy where two gradient paths meet: [8192, 4096] bf16 (activation gradients) and fp32.
std::vector<OpCase> make_axpy_cases() {
  struct Set {
    OwnedTensor x, y;
  };
  std::vector<OpCase> cases;
  const int64_t R = 8192, D = 4096;
  for (DType dt : {DType::BF16, DType::F32}) {
    const double t = static_cast<double>(dtype_size(dt) * R * D);
    auto sets = make_sets<Set>(2 * t, [&](uint64_t seed) {
      Set s{dev_empty(dt, {R, D}), dev_empty(dt, {R, D})};
      fill_uniform(s.x, seed, -1.f, 1.f);
      fill_uniform(s.y, seed + 1, -1.f, 1.f);
      return s;
    });
    OpCase c{"axpy", fmt::format("[{}, {}] {}", R, D, dtype_name(dt)), "axpy", 3 * t, 0, nullptr,
             sets};
    c.run = [sets](int i) {
      const Set& s = (*sets)[static_cast<size_t>(i) % sets->size()];
      ops::axpy({s.x, s.y, 0.5});
    };
    cases.push_back(std::move(c));
  }
  return cases;
}

// The linear layer (gemm through the registry): y = x W^T, then dx = dy W and dW += dy^T x (fp32).
// Matrix-bound: one buffer set (the operands are re-read from L2 within a product anyway).
std::vector<OpCase> make_gemm_cases() {
  struct Bufs {
    OwnedTensor x, w, y, dy, dx, dw;
  };
  struct Cfg {
    int64_t T, in, out;
  };
  std::vector<OpCase> cases;
  for (const Cfg& c : {Cfg{8192, 4096, 4096}, Cfg{8192, 4096, 12288}, Cfg{8192, 12288, 4096}}) {
    auto b =
        std::make_shared<Bufs>(Bufs{OwnedTensor::empty(DType::BF16, {c.T, c.in}, Device::CUDA),
                                    OwnedTensor::empty(DType::BF16, {c.out, c.in}, Device::CUDA),
                                    OwnedTensor::empty(DType::BF16, {c.T, c.out}, Device::CUDA),
                                    OwnedTensor::empty(DType::BF16, {c.T, c.out}, Device::CUDA),
                                    OwnedTensor::empty(DType::BF16, {c.T, c.in}, Device::CUDA),
                                    OwnedTensor::zeros(DType::F32, {c.out, c.in}, Device::CUDA)});
    fill_uniform(b->x, 200, -1.f, 1.f);
    fill_uniform(b->w, 201, -0.05f, 0.05f);
    fill_uniform(b->dy, 202, -1.f, 1.f);
    const double mnk =
        2.0 * static_cast<double>(c.T) * static_cast<double>(c.in) * static_cast<double>(c.out);
    const std::string shape = fmt::format("T={} {}->{}", c.T, c.in, c.out);
    OpCase f{"linear.fwd", shape, "gemm", 0, mnk, nullptr, b};
    f.run = [b](int) { ops::linear_forward({b->x, b->w, b->y}); };
    OpCase g{"linear.bwd", shape, "gemm", 0, 2 * mnk, nullptr, b};
    g.run = [b](int) { ops::linear_backward({b->x, b->w, b->dy, b->dx, b->dw, false}); };
    cases.push_back(std::move(f));
    cases.push_back(std::move(g));
  }
  return cases;
}

// The gated delta rule at Qwen3.5 shapes (Hk = 16, Hv = 16 (0.8B) or 32 (9B), dk = dv = 128,
// in-kernel l2norm, no initial state): one long document, four documents, and 32k tokens (Hv = 32).
// Matrix-bound: reported in nominal FLOPs of the chunked algorithm as implemented (the backward
// includes its recomputation of the forward chain). "ks=N" cases force the dk split of the
// sequential state passes (gdr_set_state_split; ks=1 is the unsplit kernel), the others take the
// automatic choice. Peers on an H200 (gdn_spec.md §7): FLA 0.47 ms fwd / 1.44 ms bwd, FlashQLA
// 0.28 / 0.79 ms at T = 8192, Hv = 32, one document.
// The op's optional `saved` (op.h): "gated_delta_rule.fwd_saving" is the forward that also writes
// it, "gated_delta_rule.bwd_saved" the backward given it, which skips its recomputation of the
// sequential state pass (and of U); compare them with .fwd and .bwd of the same shape (automatic
// split only). The saved backward's FLOPs leave out what it does not recompute.
double gdr_flops(int64_t T, int64_t Hv, int64_t K, int64_t V, bool backward, bool saved = false) {
  const double C = 64, CK = C * K, CV = C * V, KV = static_cast<double>(K * V);
  // forward: K K^T, W, U | W S, K^T V' | Q K^T, Q H, P V'
  const double fwd = 2 * (3 * CK + 2 * CV + 3 * KV);
  // backward: prep (without U given saved) and the state pass again (not given saved) | dV'_loc |
  // reverse state pass | dqk | wy
  const double again = saved ? 2 * (2 * CK) : 2 * (2 * CK + CV) + 2 * (2 * KV);
  const double bwd = again + 2 * (CK + CV) + 2 * (3 * KV) + 2 * (3 * CK + CV + 2 * KV) +
                     2 * (5 * CK + 2 * CV + KV + 2 * C * C);
  return static_cast<double>(T * Hv) * (backward ? bwd : fwd);
}

std::vector<OpCase> make_gated_delta_rule_cases() {
  struct Bufs {
    OwnedTensor q, k, v, g, beta, cu, o, dout, dq, dk, dv, dg, dbeta;
    OwnedTensor saved;   // the op's `saved` (automatic-split configurations only)
    bool saved_written;  // by a forward (the saved backward runs one at its first call)
  };
  struct Cfg {
    int64_t T, N, Hv;
    int ks;  // 0: automatic dk split of the state passes
  };
  const int64_t Hk = 16, D = 128;
  const Cfg cfgs[] = {{8192, 1, 16, 0}, {8192, 1, 16, 1}, {8192, 1, 16, 8}, {8192, 4, 16, 0},
                      {8192, 4, 16, 2}, {8192, 4, 16, 4}, {8192, 1, 32, 0}, {8192, 1, 32, 1},
                      {8192, 1, 32, 8}, {8192, 4, 32, 0}, {32768, 1, 32, 0}};
  std::vector<OpCase> cases;
  for (const Cfg& c : cfgs) {
    const int64_t Hv = c.Hv;
    auto act = [&](int64_t H) {
      return OwnedTensor::empty(DType::BF16, {c.T, H, D}, Device::CUDA);
    };
    auto st = [&] { return OwnedTensor::empty(DType::F32, {c.T, Hv}, Device::CUDA); };
    auto b = std::make_shared<Bufs>(Bufs{act(Hk), act(Hk), act(Hv), st(), st(), OwnedTensor(),
                                         act(Hv), act(Hv), act(Hk), act(Hk), act(Hv), st(), st(),
                                         OwnedTensor(), false});
    fill_uniform(b->q, 300, -1.f, 1.f);
    fill_uniform(b->k, 301, -1.f, 1.f);
    fill_uniform(b->v, 302, -1.f, 1.f);
    fill_uniform(b->g, 303, -2.f, -0.01f);
    fill_uniform(b->beta, 304, 0.05f, 0.95f);
    fill_uniform(b->dout, 305, -1.f, 1.f);
    std::vector<int64_t> cu(static_cast<size_t>(c.N) + 1);
    for (int64_t i = 0; i <= c.N; ++i) cu[static_cast<size_t>(i)] = c.T * i / c.N;
    b->cu = convert(Tensor(cu.data(), DType::I64, {c.N + 1}), DType::I32, Device::CUDA);
    const std::string shape = fmt::format("T={} N={} Hk={} Hv={} d={}{}", c.T, c.N, Hk, Hv, D,
                                          c.ks == 0 ? "" : fmt::format(" ks={}", c.ks));
    const int ks = c.ks;
    OpCase f{"gated_delta_rule.fwd",
             shape,
             "gated_delta_rule",
             0,
             gdr_flops(c.T, Hv, D, D, false),
             nullptr,
             b};
    f.run = [b, ks](int) {
      ops::gdr_set_state_split(ks);
      ops::gated_delta_rule_forward(
          {b->q, b->k, b->v, b->g, b->beta, b->cu, Tensor(), b->o, Tensor(), 0.0, true});
      ops::gdr_set_state_split(0);
    };
    OpCase g{"gated_delta_rule.bwd",
             shape,
             "gated_delta_rule",
             0,
             gdr_flops(c.T, Hv, D, D, true),
             nullptr,
             b};
    g.run = [b, ks](int) {
      ops::gdr_set_state_split(ks);
      ops::gated_delta_rule_backward({b->q, b->k, b->v, b->g, b->beta, b->cu, Tensor(), b->dout,
                                      Tensor(), b->dq, b->dk, b->dv, b->dg, b->dbeta, Tensor(), 0.0,
                                      true});
      ops::gdr_set_state_split(0);
    };
    cases.push_back(std::move(f));
    cases.push_back(std::move(g));
    if (ks != 0) continue;
    b->saved =
        OwnedTensor::empty(DType::BF16, {ops::gdr_saved_numel(c.T, c.N, Hv, D, D)}, Device::CUDA);
    OpCase fs{"gated_delta_rule.fwd_saving",
              shape,
              "gated_delta_rule",
              0,
              gdr_flops(c.T, Hv, D, D, false),
              nullptr,
              b};
    fs.run = [b](int) {
      ops::GatedDeltaRuleFwd a{b->q,     b->k, b->v,     b->g, b->beta, b->cu,
                               Tensor(), b->o, Tensor(), 0.0,  true};
      a.saved = b->saved;
      ops::gated_delta_rule_forward(a);
      b->saved_written = true;
    };
    OpCase gs{"gated_delta_rule.bwd_saved",
              shape,
              "gated_delta_rule",
              0,
              gdr_flops(c.T, Hv, D, D, true, true),
              nullptr,
              b};
    gs.run = [b](int) {
      if (!b->saved_written) {  // the first (warm-up) call
        ops::GatedDeltaRuleFwd f{b->q,     b->k, b->v,     b->g, b->beta, b->cu,
                                 Tensor(), b->o, Tensor(), 0.0,  true};
        f.saved = b->saved;
        ops::gated_delta_rule_forward(f);
        b->saved_written = true;
      }
      ops::GatedDeltaRuleBwd a{b->q,     b->k,     b->v,     b->g,  b->beta, b->cu,
                               Tensor(), b->dout,  Tensor(), b->dq, b->dk,   b->dv,
                               b->dg,    b->dbeta, Tensor(), 0.0,   true};
      a.saved = b->saved;
      ops::gated_delta_rule_backward(a);
    };
    cases.push_back(std::move(fs));
    cases.push_back(std::move(gs));
  }
  return cases;
}

// Gated attention (norms + RoPE + causal GQA attention + gate) at Qwen3.5's shape: 16 query / 4
// kv heads of dim 256, rotary factor 0.25, theta 1e7; one 8192-token document and four of 2048.
// Matrix-bound: FLOPs are the attention products alone, counted as FlashAttention does (causal:
// 4 · hd per visible (query, key) pair per head forward, 2.5x that backward), so that the time
// compares directly with torch SDPA (PEERS.md: 0.92 ms forward, 4.62 ms forward + backward at
// T = 8192, one document; 1.53 ms forward + backward for 4 x 2048). The backward's own
// recomputation (7 tile products where FlashAttention-2 has 5) is not counted.
std::vector<OpCase> make_gated_attention_cases() {
  struct Bufs {
    OwnedTensor qg, k, v, wq, wk, cu, o, q_hat, k_hat, attn, lse, q_rstd, k_rstd, d_o, dqg, dk, dv,
        dwq, dwk;
  };
  struct Cfg {
    int64_t T, docs;
  };
  constexpr int64_t Hq = 16, Hkv = 4, hd = 256, rot = 64;
  constexpr double theta = 1e7;
  std::vector<OpCase> cases;
  for (const Cfg& c : {Cfg{8192, 1}, Cfg{8192, 4}}) {
    const auto bf = [](std::initializer_list<int64_t> s) {
      return OwnedTensor::empty(DType::BF16, s, Device::CUDA);
    };
    const auto f32 = [](std::initializer_list<int64_t> s) {
      return OwnedTensor::zeros(DType::F32, s, Device::CUDA);
    };
    std::vector<int64_t> offs;
    for (int64_t n = 0; n <= c.docs; ++n) offs.push_back(n * c.T / c.docs);
    OwnedTensor cu_host = convert(Tensor(offs.data(), DType::I64, {c.docs + 1}), DType::I32);
    auto b = std::make_shared<Bufs>(
        Bufs{bf({c.T, Hq, 2 * hd}), bf({c.T, Hkv, hd}), bf({c.T, Hkv, hd}), bf({hd}), bf({hd}),
             convert(cu_host, DType::I32, Device::CUDA), bf({c.T, Hq, hd}), bf({c.T, Hq, hd}),
             bf({c.T, Hkv, hd}), bf({c.T, Hq, hd}), f32({c.T, Hq}), f32({c.T, Hq}), f32({c.T, Hkv}),
             bf({c.T, Hq, hd}), bf({c.T, Hq, 2 * hd}), bf({c.T, Hkv, hd}), bf({c.T, Hkv, hd}),
             f32({hd}), f32({hd})});
    fill_uniform(b->qg, 300, -2.f, 2.f);
    fill_uniform(b->k, 301, -2.f, 2.f);
    fill_uniform(b->v, 302, -1.f, 1.f);
    fill_uniform(b->wq, 303, -0.1f, 0.1f);
    fill_uniform(b->wk, 304, -0.1f, 0.1f);
    fill_uniform(b->d_o, 305, -1.f, 1.f);
    const auto fwd = [b] {
      ops::gated_attention_forward({b->qg, b->k, b->v, b->wq, b->wk, b->cu, b->o, b->q_hat,
                                    b->k_hat, b->attn, b->lse, b->q_rstd, b->k_rstd, rot, theta,
                                    1e-6});
    };
    const auto bwd = [b] {
      ops::gated_attention_backward({b->qg,    b->k,     b->v,    b->wq,  b->wk,     b->cu,
                                     b->q_hat, b->k_hat, b->attn, b->lse, b->q_rstd, b->k_rstd,
                                     b->d_o,   b->dqg,   b->dk,   b->dv,  b->dwq,    b->dwk,
                                     rot,      theta,    1e-6});
    };
    fwd();             // the saved tensors the backward reads
    double pairs = 0;  // visible (query, key) pairs per head
    for (int64_t n = 0; n < c.docs; ++n) {
      const double len = static_cast<double>(offs[n + 1] - offs[n]);
      pairs += len * (len + 1) / 2;
    }
    const double flops = 4.0 * pairs * hd * Hq;
    const std::string shape = fmt::format("T={} N={} {}/{}x{}", c.T, c.docs, Hq, Hkv, hd);
    OpCase f{"gated_attention.fwd", shape, "gated_attention", 0, flops, nullptr, b};
    f.run = [fwd](int) { fwd(); };
    OpCase g{"gated_attention.bwd", shape, "gated_attention", 0, 2.5 * flops, nullptr, b};
    g.run = [bwd](int) { bwd(); };
    OpCase fb{"gated_attention.fwd+bwd", shape, "gated_attention", 0, 3.5 * flops, nullptr, b};
    fb.run = [fwd, bwd](int) {
      fwd();
      bwd();
    };
    cases.push_back(std::move(f));
    cases.push_back(std::move(g));
    cases.push_back(std::move(fb));
  }
  return cases;
}

// The GDN short convolution: depthwise causal conv1d, W = 4, SiLU, no bias (Qwen3.5), at the
// [8192 tokens, 8192 channels] micro-batch, as one document and packed as 16 documents of 512.
// Bytes: forward x + weight + y; backward x + weight + dy + dx + dweight (fp32, read and written).
std::vector<OpCase> make_causal_conv1d_cases() {
  struct Set {
    OwnedTensor x, y, dy, dx;
  };
  struct Bufs {
    std::vector<Set> sets;
    OwnedTensor w, cu, dw;
  };
  struct Cfg {
    int64_t T, C, W, docs;
  };
  std::vector<OpCase> cases;
  for (const Cfg& c : {Cfg{8192, 8192, 4, 1}, Cfg{8192, 8192, 4, 4}, Cfg{8192, 8192, 4, 16}}) {
    auto b = std::make_shared<Bufs>();
    const double act = 2.0 * static_cast<double>(c.T * c.C);  // one bf16 [T, C] tensor
    const double wb = 2.0 * static_cast<double>(c.C * c.W),
                 dwb = 4.0 * static_cast<double>(c.C * c.W);
    const int nsets = sets_for(4 * act);
    for (int i = 0; i < nsets; ++i) {
      Set s{OwnedTensor::empty(DType::BF16, {c.T, c.C}, Device::CUDA),
            OwnedTensor::empty(DType::BF16, {c.T, c.C}, Device::CUDA),
            OwnedTensor::empty(DType::BF16, {c.T, c.C}, Device::CUDA),
            OwnedTensor::empty(DType::BF16, {c.T, c.C}, Device::CUDA)};
      const uint64_t seed = 300 + 10 * static_cast<uint64_t>(i);
      fill_uniform(s.x, seed, -2.f, 2.f);
      fill_uniform(s.dy, seed + 1, -1.f, 1.f);
      b->sets.push_back(std::move(s));
    }
    b->w = OwnedTensor::empty(DType::BF16, {c.C, c.W}, Device::CUDA);
    fill_uniform(b->w, 310, -0.5f, 0.5f);
    b->dw = OwnedTensor::zeros(DType::F32, {c.C, c.W}, Device::CUDA);
    if (c.docs > 1) {
      OwnedTensor cu = OwnedTensor::empty(DType::I32, {c.docs + 1});
      for (int64_t n = 0; n <= c.docs; ++n)
        cu.ptr<int32_t>()[n] = static_cast<int32_t>(n * c.T / c.docs);
      b->cu = convert(cu, DType::I32, Device::CUDA);
    }
    const std::string shape = fmt::format("[{}, {}] W={} silu {}doc", c.T, c.C, c.W, c.docs);
    OpCase f{"causal_conv1d.fwd", shape, "causal_conv1d", act + wb + act, 0, nullptr, b};
    f.run = [b](int i) {
      const Set& s = b->sets[static_cast<size_t>(i) % b->sets.size()];
      ops::causal_conv1d_forward({s.x, b->w, Tensor(), b->cu, Tensor(), s.y, Tensor(), true});
    };
    OpCase g{"causal_conv1d.bwd", shape, "causal_conv1d", 3 * act + wb + 2 * dwb, 0, nullptr, b};
    g.run = [b](int i) {
      const Set& s = b->sets[static_cast<size_t>(i) % b->sets.size()];
      ops::causal_conv1d_backward({s.x, b->w, Tensor(), b->cu, Tensor(), s.dy, Tensor(), s.dx,
                                   b->dw, Tensor(), Tensor(), true});
    };
    cases.push_back(std::move(f));
    cases.push_back(std::move(g));
  }
  return cases;
}

// The fused LM head + cross-entropy + z-loss (linear_cross_entropy_forward_backward: loss, lse,
// z_loss, dx, dW += in fp32) at the Qwen3.5 head shape, next to the three plain cuBLASLt GEMMs of
// that shape timed in the same run through the same plumbing (logits = x W^T bf16 out,
// dx = G W bf16 out, dW += G^T x fp32 out with beta = 1): the target is fused <= 1.25 x GEMMs.
// Budgets: 1.5 GiB (3 blocks of 3072/3072/2048 rows; the caller's workspace is the extra memory)
// and the knob's default 256 MiB (16 blocks of 512 rows) for comparison; forward only at 1.5 GiB.
std::vector<OpCase> make_lce_cases() {
  constexpr int64_t N = 8192, D = 4096, V = 248320;
  struct Bufs {
    OwnedTensor x, w, targets, logits, dx, dw, loss, lse, z, ws_big, ws_small;
  };
  const int64_t big = int64_t{3} << 29, small = int64_t{1} << 28;  // 1.5 GiB, 256 MiB
  auto b = std::make_shared<Bufs>();
  b->x = OwnedTensor::empty(DType::BF16, {N, D}, Device::CUDA);
  b->w = OwnedTensor::empty(DType::BF16, {V, D}, Device::CUDA);
  b->dx = OwnedTensor::empty(DType::BF16, {N, D}, Device::CUDA);
  b->dw = OwnedTensor::zeros(DType::F32, {V, D}, Device::CUDA);
  b->loss = OwnedTensor::zeros(DType::F32, {1}, Device::CUDA);
  b->lse = OwnedTensor::zeros(DType::F32, {N}, Device::CUDA);
  b->z = OwnedTensor::zeros(DType::F32, {1}, Device::CUDA);
  fill_uniform(b->x, 300, -1.f, 1.f);
  fill_uniform(b->w, 301, -0.05f, 0.05f);  // logit std ~1
  {
    OwnedTensor t = OwnedTensor::empty(DType::I64, {N});
    for (int64_t i = 0; i < N; ++i)
      t.ptr<int64_t>()[i] = i % 97 == 0 ? ops::kLceIgnoreIndex : (i * 7919 + 11) % V;
    b->targets = convert(t, DType::I64, Device::CUDA);
  }
  const double flops =
      6.0 * static_cast<double>(N) * static_cast<double>(D) * static_cast<double>(V);
  const std::string shape = fmt::format("N={} D={} V={}", N, D, V);
  std::vector<OpCase> cases;

  // The three plain GEMMs (the logits buffer doubles as G for the two backward products).
  b->logits = OwnedTensor::empty(DType::BF16, {N, V}, Device::CUDA);
  fill_uniform(b->logits, 302, -1e-4f, 1e-4f);
  OpCase g{"lce.3gemm", shape, "gemm", 0, flops, nullptr, b};
  g.run = [b](int) {
    ops::gemm({b->x, b->w, b->logits, false, true, 1.0, 0.0});    // [N, V] = x W^T
    ops::gemm({b->logits, b->w, b->dx, false, false, 1.0, 0.0});  // [N, D] = G W
    ops::gemm({b->logits, b->x, b->dw, true, false, 1.0, 1.0});   // [V, D] += G^T x (fp32)
  };
  cases.push_back(std::move(g));

  auto args = [b](const Tensor& ws, int64_t budget, bool backward) {
    ops::LinearCrossEntropyArgs a;
    a.x = b->x, a.w = b->w, a.targets = b->targets, a.loss = b->loss, a.lse = b->lse;
    a.z_loss = b->z, a.workspace = ws, a.chunk_bytes = budget;
    a.reduction = ops::LceReduction::Mean, a.z_loss_scale = 1e-4;
    if (backward) a.dx = b->dx, a.dw = b->dw;
    return a;
  };
  // Device memory allocated by a call after a warm-up call (which resolves and probes the op and
  // makes the cuBLASLt plans): measured, expected 0 (no allocation inside a call).
  auto first_call_growth = [](const std::function<void()>& f) {
    size_t free0 = 0, free1 = 0, total = 0;
    f();
    GDN_CUDA_CHECK(cudaDeviceSynchronize());
    GDN_CUDA_CHECK(cudaMemGetInfo(&free0, &total));
    f();
    GDN_CUDA_CHECK(cudaDeviceSynchronize());
    GDN_CUDA_CHECK(cudaMemGetInfo(&free1, &total));
    return static_cast<double>(free0) - static_cast<double>(free1);
  };
  for (int64_t budget : {big, small}) {
    const int64_t ws_bytes = ops::linear_cross_entropy_workspace_bytes(N, V, budget);
    OwnedTensor& ws = budget == big ? b->ws_big : b->ws_small;
    ws = OwnedTensor::empty(DType::F32, {(ws_bytes + 3) / 4}, Device::CUDA);
    const auto plan = ops::linear_cross_entropy_cuda_plan(N, V, D, budget);
    const std::string sh = fmt::format("{} B={}MiB R={}", shape, budget >> 20, plan.rows);
    const Tensor wsv = ws.view();
    OpCase f{"lce.fwd_bwd", sh, "linear_cross_entropy", 0, flops, nullptr, b};
    f.run = [args, wsv, budget](int) {
      ops::linear_cross_entropy_forward_backward(args(wsv, budget, true));
    };
    f.compare_to = "lce.3gemm";
    f.extra_bytes = static_cast<double>(ws_bytes);
    f.grown_bytes = first_call_growth([&] { f.run(0); });
    cases.push_back(std::move(f));
  }
  {
    const Tensor wsv = b->ws_big.view();
    OpCase f{"lce.fwd",
             fmt::format("{} B=1536MiB", shape),
             "linear_cross_entropy",
             0,
             flops / 3,
             nullptr,
             b};
    f.run = [args, wsv, big](int) { ops::linear_cross_entropy_forward(args(wsv, big, false)); };
    f.extra_bytes = static_cast<double>(wsv.nbytes());
    f.grown_bytes = first_call_growth([&] { f.run(0); });
    cases.push_back(std::move(f));
  }
  return cases;
}

// --- peers -----------------------------------------------------------------------------------
// Runs DIR/peers.py --timing-only --only STEPS --out OUT in a child process; returns its JSON
// (an empty object if it failed: the reason is printed, ours are still measured). --timing-only:
// fla refuses its gated-delta-rule backward on Hopper with Triton < 3.7.1 (its results are wrong
// there, fla issue 640); peers.py lifts that guard for timing, so those peer times are timings
// only.
nlohmann::json run_peers(const std::string& dir, const std::string& steps, const std::string& out) {
  for (char c : dir + steps + out)
    GDN_CHECK(std::isalnum(static_cast<unsigned char>(c)) || std::strchr("/._-,", c) != nullptr,
              "--peers / --peer-steps / JSON path: character '{}' is not allowed here (letters, "
              "digits, / . _ - , only)",
              c);
  {
    std::ifstream probe(dir + "/peers.py");
    GDN_CHECK_HINT(probe.good(), "see the --peers note at the top of bench/cuda_bench_ops.cu",
                   "--peers {}: no {}/peers.py", dir, dir);
  }
  const std::string cmd = fmt::format(
      "PYTHONPATH={0} PYTHONUNBUFFERED=1 python3 {0}/peers.py --timing-only --only {1} --out {2}",
      dir, steps, out);
  std::printf("peers: %s\n", cmd.c_str());
  std::fflush(stdout);
  const int rc = std::system(cmd.c_str());
  std::ifstream f(out);
  if (rc != 0 || !f.good()) {
    std::printf("peers: the peer run failed (exit status %d); no peer times in this run\n", rc);
    return nlohmann::json::object();
  }
  try {
    return nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    std::printf("peers: %s is not JSON (%s)\n", out.c_str(), e.what());
    return nlohmann::json::object();
  }
}

// A peer measurement and the sum of our rows that does the same work.
struct PeerMatch {
  const char* peer;   // key in peers.py's JSON
  const char* field;  // its time field (ms)
  const char* ours;   // our case names, '|'-separated
  const char* shape;  // substring of our case's shape
  const char* note;
};

constexpr PeerMatch kPeerMatches[] = {
    {"liger.zc_rmsnorm.fwdbwd.T8192", "ms", "rmsnorm.fwd|rmsnorm.bwd", "[8192, 4096] zero-centred",
     "Liger zero-centred RMSNorm fwd+bwd"},
    {"eager.zc_rmsnorm.fwdbwd.T8192", "ms", "rmsnorm.fwd|rmsnorm.bwd", "[8192, 4096] zero-centred",
     "PyTorch eager"},
    {"liger.swiglu.fwdbwd.T8192", "ms", "swiglu.fwd|swiglu.bwd", "[8192, 12288]", "Liger SwiGLU"},
    {"eager.swiglu.fwdbwd.T8192", "ms", "swiglu.fwd|swiglu.bwd", "[8192, 12288]", "PyTorch eager"},
    {"fla.gated_rmsnorm.fwdbwd.T8192", "ms", "gated_rmsnorm.fwd|gated_rmsnorm.bwd",
     "[8192*32, 128]", "fla rms_norm_gated"},
    {"fla.l2norm.fwdbwd.T8192", "ms", "l2norm.fwd|l2norm.bwd", "[8192*16, 128]", "fla l2norm"},
    {"fla.conv1d.T8192.n1", "fwd_ms", "causal_conv1d.fwd", "W=4 silu 1doc",
     "fla causal_conv1d fwd"},
    {"fla.conv1d.T8192.n1", "fwdbwd_ms", "causal_conv1d.fwd|causal_conv1d.bwd", "W=4 silu 1doc",
     "fla causal_conv1d fwd+bwd"},
    {"fla.conv1d.T8192.n4", "fwdbwd_ms", "causal_conv1d.fwd|causal_conv1d.bwd", "W=4 silu 4doc",
     "fla, 4 documents"},
    {"fla.gdn.T8192.n1", "fwd_ms", "gated_delta_rule.fwd", "T=8192 N=1 Hk=16 Hv=32 d=128",
     "fla chunk_gated_delta_rule fwd"},
    {"fla.gdn.T8192.n1", "fwdbwd_ms", "gated_delta_rule.fwd|gated_delta_rule.bwd",
     "T=8192 N=1 Hk=16 Hv=32 d=128", "fla fwd+bwd (timing only)"},
    {"fla.gdn.T8192.n4", "fwdbwd_ms", "gated_delta_rule.fwd|gated_delta_rule.bwd",
     "T=8192 N=4 Hk=16 Hv=32 d=128", "fla fwd+bwd, 4 documents"},
    {"fla.gdn.T32768.n1", "fwdbwd_ms", "gated_delta_rule.fwd|gated_delta_rule.bwd",
     "T=32768 N=1 Hk=16 Hv=32 d=128", "fla fwd+bwd, 32k tokens"},
    {"fla.gdn.T8192.n1", "fwdbwd_ms", "gated_delta_rule.fwd_saving|gated_delta_rule.bwd_saved",
     "T=8192 N=1 Hk=16 Hv=32 d=128", "fla fwd+bwd vs ours with 'saved' (recompute none)"},
    {"fla.gdn.T8192.n4", "fwdbwd_ms", "gated_delta_rule.fwd_saving|gated_delta_rule.bwd_saved",
     "T=8192 N=4 Hk=16 Hv=32 d=128", "fla, 4 documents, ours with 'saved'"},
    {"fla.gdn.T32768.n1", "fwdbwd_ms", "gated_delta_rule.fwd_saving|gated_delta_rule.bwd_saved",
     "T=32768 N=1 Hk=16 Hv=32 d=128", "fla, 32k tokens, ours with 'saved'"},
    {"torch.sdpa.T8192.n1", "fwd_ms", "gated_attention.fwd", "T=8192 N=1 16/4x256",
     "SDPA core only; ours adds norms, RoPE, gate"},
    {"torch.sdpa.T8192.n1", "fwdbwd_ms", "gated_attention.fwd+bwd", "T=8192 N=1 16/4x256",
     "SDPA core only; ours adds norms, RoPE, gate"},
    {"torch.sdpa.T8192.n4", "fwdbwd_ms", "gated_attention.fwd+bwd", "T=8192 N=4 16/4x256",
     "SDPA, 4 documents"},
    {"cublas.lmhead_3gemm.N8192.V248320", "ms", "lce.3gemm", "N=8192 D=4096 V=248320",
     "torch's three GEMMs vs ours (cuBLASLt)"},
    {"eager.flce.N8192.V248320", "ms", "lce.fwd_bwd", "B=1536MiB", "PyTorch eager LM head + CE"},
    {"liger.flce.N8192.V248320", "ms", "lce.fwd_bwd", "B=1536MiB", "Liger fused linear CE"},
};

// Prints the peer table; returns its rows as JSON.
nlohmann::json print_peers(const nlohmann::json& peers, const std::vector<Row>& rows) {
  nlohmann::json out = nlohmann::json::array();
  if (peers.empty()) return out;
  std::printf("\npeers, measured in this run (time ms; speedup = peer time / ours)\n");
  std::printf("%-36s %-10s %10s %10s %8s  %s\n", "peer", "field", "peer ms", "ours ms", "speedup",
              "note");
  for (const PeerMatch& m : kPeerMatches) {
    if (!peers.contains(m.peer) || !peers[m.peer].contains(m.field)) continue;
    const double peer_ms = peers[m.peer][m.field].get<double>();
    double ours = 0;
    bool found_all = true;
    std::string names = m.ours;
    for (size_t pos = 0; pos <= names.size();) {
      const size_t end = names.find('|', pos);
      const std::string name = names.substr(pos, end == std::string::npos ? end : end - pos);
      bool found = false;
      for (const Row& r : rows)
        if (r.kind == "op" && r.name == name && r.shape.find(m.shape) != std::string::npos) {
          ours += r.t.median_ms;
          found = true;
          break;
        }
      found_all = found_all && found;
      if (end == std::string::npos) break;
      pos = end + 1;
    }
    if (!found_all) continue;  // our case was filtered out of this run
    std::printf("%-36s %-10s %10.3f %10.3f %7.2fx  %s\n", m.peer, m.field, peer_ms, ours,
                peer_ms / ours, m.note);
    out.push_back({{"peer", m.peer},
                   {"field", m.field},
                   {"peer_ms", peer_ms},
                   {"ours", m.ours},
                   {"shape", m.shape},
                   {"ours_ms", ours},
                   {"speedup", peer_ms / ours},
                   {"note", m.note}});
  }
  for (auto it = peers.begin(); it != peers.end(); ++it)
    if (it.key().find("error") != std::string::npos)
      std::printf("peer step failed: %s %s\n", it.key().c_str(), it.value().dump().c_str());
  if (peers.contains("ceiling.copy"))
    std::printf("peers' own copy ceiling (torch copy_): %.1f GB/s\n",
                peers["ceiling.copy"].value("TBps", 0.0) * 1e3);
  return out;
}

int run(int argc, char** argv) {
  std::string json_path, filter, shape_filter, peers_dir,
      peer_steps = "ceil,norms,conv,gdn,attn,flce";
  int iters = 50, rounds = 1;
  std::vector<std::string> impls;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) {
      iters = std::max(20, std::atoi(argv[++i]));
    } else if (a == "--filter" && i + 1 < argc) {
      filter = argv[++i];
    } else if (a == "--shape" && i + 1 < argc) {
      shape_filter = argv[++i];
    } else if (a == "--peers" && i + 1 < argc) {
      peers_dir = argv[++i];
    } else if (a == "--peer-steps" && i + 1 < argc) {
      peer_steps = argv[++i];
    } else if (a == "--impls" && i + 1 < argc) {
      const std::string list = argv[++i];
      for (size_t p = 0; p <= list.size();) {
        const size_t q = std::min(list.find(',', p), list.size());
        if (q > p) impls.push_back(list.substr(p, q - p));
        p = q + 1;
      }
    } else if (a == "--rounds" && i + 1 < argc) {
      rounds = std::max(1, std::atoi(argv[++i]));
    } else if (a == "-h" || a == "--help") {
      std::printf(
          "usage: %s [JSON_PATH] [--iters N (>= 20)] [--filter SUBSTRING] [--shape SUBSTRING] "
          "[--peers DIR [--peer-steps LIST]] [--impls A,B,... [--rounds N]]\n",
          argv[0]);
      return 0;
    } else if (!a.empty() && a[0] != '-') {
      json_path = a;
    } else {
      GDN_FAIL_HINT("--help lists the options", "unknown argument '{}'", a);
    }
  }
  GDN_CHECK_HINT(cuda_available(), "run on a machine with a GPU (check nvidia-smi)",
                 "no CUDA device is available");
  // The peers first, before this process holds GPU memory.
  const nlohmann::json peers =
      peers_dir.empty()
          ? nlohmann::json::object()
          : run_peers(peers_dir, peer_steps,
                      json_path.empty() ? std::string("peers.json") : json_path + ".peers.json");
  Context& ctx = Context::get();
  const cudaDeviceProp& p = ctx.props();
  std::printf("device: %s, sm_%d%d, %d SMs, L2 %.0f MB, %.1f GB\n", p.name, p.major, p.minor,
              p.multiProcessorCount, p.l2CacheSize / 1e6, p.totalGlobalMem / 1e9);

  std::vector<Row> rows;
  auto want = [&](const std::string& name) {
    return filter.empty() || name.find(filter) != std::string::npos;
  };
  Row copy = bench_copy(std::max(20, iters / 2));
  const double copy_gbs = copy.bytes / (copy.t.median_ms * 1e-3) / 1e9;
  std::printf("%-26s %-28s %10.3f ms  %8.1f GB/s  (ceiling for memory-bound ops)\n",
              copy.name.c_str(), copy.shape.c_str(), copy.t.median_ms, copy_gbs);
  rows.push_back(copy);

  double gemm_tflops = 0;  // the bf16-output 8192^3 rate: the ceiling for matrix-bound ops
  for (bool acc : {false, true}) {
    Row g = bench_cublaslt_gemm(8192, 8192, 8192, acc, 20);
    const double tf = g.flops / (g.t.median_ms * 1e-3) / 1e12;
    if (!acc) gemm_tflops = tf;
    std::printf("%-26s %-28s %10.3f ms  %8.1f TFLOP/s\n", g.name.c_str(), g.shape.c_str(),
                g.t.median_ms, tf);
    rows.push_back(g);
  }

  // A filter "HEAD.TAIL" (with a dot) can only match names "PREFIX.xxx" whose PREFIX ends with
  // HEAD (every dotted case name has one dot, after its op prefix): the other ops' buffers are
  // then not even made, so that an A/B over one op starts in seconds.
  auto may_match = [&](const std::string& prefix) {
    const size_t dot = filter.find('.');
    if (filter.empty() || dot == std::string::npos) return true;
    const std::string head = filter.substr(0, dot);
    return prefix.size() >= head.size() &&
           prefix.compare(prefix.size() - head.size(), head.size(), head) == 0;
  };
  std::vector<OpCase> cases;
  auto add = [&](const std::string& prefix, auto make) {
    if (!may_match(prefix)) return;
    for (auto& c : make()) cases.push_back(std::move(c));
  };
  add("rmsnorm", make_rmsnorm_cases);
  add("linear", make_gemm_cases);
  add("causal_conv1d", make_causal_conv1d_cases);
  add("gated_delta_rule", make_gated_delta_rule_cases);
  add("gated_attention", make_gated_attention_cases);
  if (filter.empty() || filter.find("lce") != std::string::npos)  // 12 GB of buffers
    add("lce", make_lce_cases);
  add("gated_rmsnorm", make_gated_rmsnorm_cases);
  add("l2norm", make_l2norm_cases);
  add("swiglu", make_swiglu_cases);
  add("gdn_gates", make_gdn_gates_cases);
  add("embedding", make_embedding_cases);
  add("adamw", make_adamw_cases);
  add("axpy", make_axpy_cases);

  struct Extra {
    size_t row;
    std::string compare_to;
    double extra_bytes, grown_bytes;
  };
  std::vector<Extra> extras;
  std::printf("%-26s %-28s %-22s %10s %12s %10s %8s\n", "op", "shape", "impl", "median us",
              "MB | GFLOP", "GB/s|TF/s", "x ceil");
  // Forces `impl` for `op` (empty: the resolver's own choice) and forgets earlier decisions.
  auto force = [](const std::string& op, const std::string& impl) {
    std::string knob = "GDN_OP_" + op;
    for (char& ch : knob) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    if (impl.empty()) {
      unsetenv(knob.c_str());
    } else {
      setenv(knob.c_str(), impl.c_str(), 1);
    }
    env::reset_cache_for_testing();
    Registry::global().clear_resolutions();
  };
  for (OpCase& c : cases) {
    if (!want(c.name) || c.shape.find(shape_filter) == std::string::npos) continue;
    std::vector<std::string> runs;  // forced implementations, in round order ("" = no forcing)
    for (int round = 0; round < rounds; ++round)
      for (const std::string& name : impls)
        for (const ImplDesc* d : Registry::global().impls(c.op, Backend::Cuda))
          if (d->name == name) runs.push_back(name);
    if (runs.empty()) runs.push_back("");
    for (const std::string& forced : runs) {
      if (!forced.empty()) force(c.op, forced);
      Row r{"op", c.name, c.shape, "", {}, c.bytes, c.flops};
      // Decisions are per shape class: forget them so that the ones this case makes name what it
      // ran (its classes, not the op's default class).
      Registry::global().clear_resolutions();
      r.t = time_it(c.run, 5, iters);  // warm-up resolves (and probes) the op
      for (const Registry::Decision& d : Registry::global().decisions())
        if (d.op == c.op && d.query.backend == Backend::Cuda &&
            ("+" + r.impl + "+").find("+" + d.result.impl->name + "+") == std::string::npos)
          r.impl += (r.impl.empty() ? "" : "+") + d.result.impl->name;
      if (r.impl.empty()) r.impl = "?";
      const double sec = r.t.median_ms * 1e-3;
      if (r.flops > 0) {
        const double tf = r.flops / sec / 1e12;
        std::printf("%-26s %-28s %-22s %10.1f %12.1f %10.1f %8.3f\n", r.name.c_str(),
                    r.shape.c_str(), r.impl.c_str(), r.t.median_ms * 1e3, r.flops / 1e9, tf,
                    tf / gemm_tflops);
      } else {
        const double gbs = r.bytes / sec / 1e9;
        std::printf("%-26s %-28s %-22s %10.1f %12.1f %10.1f %8.3f\n", r.name.c_str(),
                    r.shape.c_str(), r.impl.c_str(), r.t.median_ms * 1e3, r.bytes / 1e6, gbs,
                    gbs / copy_gbs);
        if (r.bytes < kSmallOpBytes) {
          r.small_copy_ms = bench_small_copy(r.bytes, iters).median_ms;
          std::printf("%-26s   a copy of the same %.1f MB takes %.1f us: %.3f x that copy's time\n",
                      "", r.bytes / 1e6, r.small_copy_ms * 1e3, r.small_copy_ms / r.t.median_ms);
        }
      }
      rows.push_back(r);
      if (!c.compare_to.empty() || c.extra_bytes > 0) {
        std::string line;
        for (const Row& o : rows)
          if (o.kind == "op" && o.name == c.compare_to)
            line += fmt::format("{:.3f} x {} ({:.2f} ms)", r.t.median_ms / o.t.median_ms, o.name,
                                o.t.median_ms);
        if (c.extra_bytes > 0)
          line += fmt::format(
              "{}extra memory {:.3f} GiB (workspace), {:.0f} bytes allocated by a "
              "call",
              line.empty() ? "" : "; ", c.extra_bytes / double(1 << 30), c.grown_bytes);
        std::printf("%-26s   %s\n", "", line.c_str());
        extras.push_back({rows.size() - 1, c.compare_to, c.extra_bytes, c.grown_bytes});
      }
      if (!forced.empty()) force(c.op, "");
    }
  }

  const nlohmann::json peer_rows = print_peers(peers, rows);

  if (!json_path.empty()) {
    std::string j = "{\n";
    j += fmt::format(
        "  \"device\": {{\"name\": \"{}\", \"sm\": \"{}{}\", \"sms\": {}, \"l2_bytes\": {}, "
        "\"memory_bytes\": {}}},\n",
        json_escape(p.name), p.major, p.minor, p.multiProcessorCount, p.l2CacheSize,
        p.totalGlobalMem);
    j += fmt::format("  \"copy_gbs\": {:.1f},\n  \"gemm_tflops\": {:.1f},\n  \"results\": [\n",
                     copy_gbs, gemm_tflops);
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      const double sec = r.t.median_ms * 1e-3;
      j += fmt::format(
          "    {{\"kind\": \"{}\", \"name\": \"{}\", \"shape\": \"{}\", \"impl\": \"{}\", "
          "\"median_ms\": {:.6f}, \"min_ms\": {:.6f}, \"max_ms\": {:.6f}, \"iters\": {}",
          r.kind, json_escape(r.name), json_escape(r.shape), json_escape(r.impl), r.t.median_ms,
          r.t.min_ms, r.t.max_ms, r.t.iters);
      if (r.bytes > 0)
        j += fmt::format(", \"bytes\": {:.0f}, \"gbs\": {:.1f}, \"ratio_to_copy\": {:.4f}", r.bytes,
                         r.bytes / sec / 1e9, r.bytes / sec / 1e9 / copy_gbs);
      if (r.small_copy_ms > 0)
        j += fmt::format(", \"same_bytes_copy_ms\": {:.6f}, \"ratio_to_same_bytes_copy\": {:.4f}",
                         r.small_copy_ms, r.small_copy_ms / r.t.median_ms);
      if (r.flops > 0)
        j += fmt::format(", \"flops\": {:.0f}, \"tflops\": {:.1f}", r.flops, r.flops / sec / 1e12);
      if (r.flops > 0 && r.kind == "op")
        j += fmt::format(", \"ratio_to_gemm\": {:.4f}", r.flops / sec / 1e12 / gemm_tflops);
      for (const Extra& e : extras) {
        if (e.row != i) continue;
        for (const Row& o : rows)
          if (o.kind == "op" && o.name == e.compare_to)
            j += fmt::format(", \"compare_to\": \"{}\", \"time_ratio\": {:.4f}",
                             json_escape(o.name), r.t.median_ms / o.t.median_ms);
        j += fmt::format(", \"extra_bytes\": {:.0f}, \"call_alloc_bytes\": {:.0f}", e.extra_bytes,
                         e.grown_bytes);
      }
      j += i + 1 < rows.size() ? "},\n" : "}\n";
    }
    j += "  ],\n  \"peers\": " + peer_rows.dump() + "\n}\n";
    std::ofstream f(json_path);
    GDN_CHECK(f.good(), "cannot write {}", json_path);
    f << j;
    GDN_CHECK(f.good(), "writing {} failed", json_path);
    std::printf("wrote %s\n", json_path.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace gdn::bench

int main(int argc, char** argv) {
  try {
    return gdn::bench::run(argc, argv);
  } catch (const gdn::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.message().c_str());
    if (!e.hint().empty()) std::fprintf(stderr, "hint: %s\n", e.hint().c_str());
    return 1;
  }
}
