// GPU op benchmark (ARCHITECTURE.md §10): the device's own ceilings, then every implemented CUDA op
// forward and backward, each as time, bytes moved, achieved GB/s and the ratio to the copy
// bandwidth measured in the same run.
//
//   cuda_bench_ops [JSON_PATH] [--iters N] [--filter SUBSTRING]
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
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "gdn/backend/cuda_check.h"
#include "gdn/backend/cuda_context.h"
#include "gdn/backend/registry.h"
#include "gdn/core/tensor.h"
#include "ops/gated_attention/op.h"
#include "ops/gemm/op.h"
#include "ops/rmsnorm/op.h"

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
  double bytes = 0;  // bytes moved (ops, copy)
  double flops = 0;  // gemm
};

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

int run(int argc, char** argv) {
  std::string json_path, filter;
  int iters = 50;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) {
      iters = std::max(20, std::atoi(argv[++i]));
    } else if (a == "--filter" && i + 1 < argc) {
      filter = argv[++i];
    } else if (a == "-h" || a == "--help") {
      std::printf("usage: %s [JSON_PATH] [--iters N (>= 20)] [--filter SUBSTRING]\n", argv[0]);
      return 0;
    } else if (!a.empty() && a[0] != '-') {
      json_path = a;
    } else {
      GDN_FAIL_HINT("--help lists the options", "unknown argument '{}'", a);
    }
  }
  GDN_CHECK_HINT(cuda_available(), "run on a machine with a GPU (check nvidia-smi)",
                 "no CUDA device is available");
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

  std::vector<OpCase> cases;
  for (auto& c : make_rmsnorm_cases()) cases.push_back(std::move(c));
  for (auto& c : make_gemm_cases()) cases.push_back(std::move(c));
  for (auto& c : make_gated_attention_cases()) cases.push_back(std::move(c));

  std::printf("%-26s %-28s %-14s %10s %12s %10s %8s\n", "op", "shape", "impl", "median us",
              "MB | GFLOP", "GB/s|TF/s", "x ceil");
  for (OpCase& c : cases) {
    if (!want(c.name)) continue;
    Row r{"op", c.name, c.shape, "", {}, c.bytes, c.flops};
    r.t = time_it(c.run, 5, iters);  // warm-up resolves (and probes) the op
    r.impl = Registry::global().resolve(c.op, OpQuery{Backend::Cuda, "", {}}).impl->name;
    const double sec = r.t.median_ms * 1e-3;
    if (r.flops > 0) {
      const double tf = r.flops / sec / 1e12;
      std::printf("%-26s %-28s %-14s %10.1f %12.1f %10.1f %8.3f\n", r.name.c_str(), r.shape.c_str(),
                  r.impl.c_str(), r.t.median_ms * 1e3, r.flops / 1e9, tf, tf / gemm_tflops);
    } else {
      const double gbs = r.bytes / sec / 1e9;
      std::printf("%-26s %-28s %-14s %10.1f %12.1f %10.1f %8.3f\n", r.name.c_str(), r.shape.c_str(),
                  r.impl.c_str(), r.t.median_ms * 1e3, r.bytes / 1e6, gbs, gbs / copy_gbs);
    }
    rows.push_back(r);
  }

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
      if (r.flops > 0)
        j += fmt::format(", \"flops\": {:.0f}, \"tflops\": {:.1f}", r.flops, r.flops / sec / 1e12);
      if (r.flops > 0 && r.kind == "op")
        j += fmt::format(", \"ratio_to_gemm\": {:.4f}", r.flops / sec / 1e12 / gemm_tflops);
      j += i + 1 < rows.size() ? "},\n" : "}\n";
    }
    j += "  ]\n}\n";
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
