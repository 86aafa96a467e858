// AdamW on CUDA: fp32 masters, gradients and moments, the bf16 compute copy written in the same
// pass; the global gradient norm's sum of squares; the bf16 refresh (op.h has the contract).
//
// Multi-tensor launches through kernel arguments: a call's tensors are packed, up to kMaxTensors
// at a time, into a TensorList passed by value as a __grid_constant__ kernel parameter (pointers,
// sizes, flags and the prefix sums of each tensor's work units; ~7.5 KB, within the 32 KB kernel
// parameter limit of CUDA 12.1+ on Volta and later). Nothing is copied to the device by hand and
// nothing is allocated: a model's ~hundreds of parameter tensors cost ceil(count / kMaxTensors)
// launches per call (4 for 400 tensors), with no host synchronisation (except grad_sumsq, whose
// contract returns a host double). The same chunked-list idea as PyTorch's multi_tensor_apply
// (ATen/native/cuda/MultiTensorApply.cuh), with per-launch prefix sums instead of per-block
// tables so that any number of blocks fits in one launch.
//
// Work unit: kUnit = 4096 consecutive elements of one tensor, one block per unit (a tensor's last
// unit may be partial). A block finds its tensor by binary search over the prefix sums (uniform
// across the block, read from the constant bank). Each thread moves kGroups 16-byte groups of
// every stream, all loads issued before the first use; tensors whose pointers are not 16-byte
// aligned take a single-element loop in the same kernel, and a unit's last n % 4 elements are
// done one by one. Streams are touched once, so loads and stores use the evict-first hints.
//
// The step evaluates exactly the cpu formula (op.h): scalars formed in fp64 on the host and
// rounded to fp32 once; m, v, the denominator and p in fp32; p_bf16 = bf16(p) rounded to nearest
// even (__float2bfloat16_rn, bit-identical to the host's conversion).
// grad_sumsq: its own, larger units (kSumUnit = 32768 elements, one block each, 8 16-byte loads
// in flight per thread); each unit's squares summed in fp64 (per thread, then a butterfly and the
// 8 warps in order) into one fp64 partial per unit; one block then adds the partials in a fixed
// order. The units depend only on the tensors' sizes, so the sum is bitwise reproducible and
// independent of the device; it differs from cpu's (64K-element chunks) only by fp64 rounding.
// Split masters (op.h) read and write 2 + 2 bytes of master and copy instead of 4 (+ 2 written):
// the step reads 16 and writes 12 bytes per element then, 2 fewer.
// Bytes moved (the floor): step 16 read + 12 written (+ 2 for the bf16 copy) per element;
// grad_sumsq 4 per element; refresh_bf16 4 read + 2 written per element.
#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstdint>

#include "backend/cuda/memory_bound.cuh"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/registry.h"
#include "gdn/core/split_f32.h"
#include "ops/adamw/op.h"

namespace gdn::ops {

namespace {

using cuda::bf16_t;

constexpr int kMaxTensors = 128;
constexpr int kThreads = 256;
constexpr int kGroups = 4;                                  // 16-byte groups per thread per stream
constexpr int64_t kUnit = int64_t{kThreads} * kGroups * 4;  // elements per block: 4096
// grad_sumsq: units of 32768 elements, walked in steps of kSumStep = 8192 (kSumG 16-byte loads per
// thread a step). A read-only stream needs more bytes per block than the step's 4096 elements
// to amortise a block's start and its reduction (measured: docs/PERF.md).
constexpr int kSumG = 8;
constexpr int64_t kSumStep = int64_t{kThreads} * kSumG * 4;  // 8192
constexpr int64_t kSumUnit = 4 * kSumStep;                   // 32768
static_assert(kSumUnit == kAdamWSumUnit, "op.h's workspace functions use kAdamWSumUnit");

// Up to kMaxTensors tensors of one launch; kPtrs pointers per tensor (adamw: p, g, m, v, p_bf16;
// grad_sumsq: g; refresh: master, copy). Tensors with no element are never added, so first_unit
// is strictly increasing.
template <int kPtrs>
struct TensorList {
  int n = 0;
  int64_t first_unit[kMaxTensors + 1];  // prefix sums of ceil(numel / kUnit); [n] = units in all
  int64_t numel[kMaxTensors];
  void* ptr[kPtrs][kMaxTensors];
  uint8_t decay[kMaxTensors];  // adamw only
  uint8_t vec[kMaxTensors];    // 16-byte groups allowed
  uint8_t split[kMaxTensors];  // adamw, refresh: a split master (ptr[0] or ptr[2]: the I16 half)
};

// Kernel parameters may take 32764 bytes (CUDA 12.1+, Volta and later); the largest list plus the
// step's scalars stays well inside.
static_assert(sizeof(TensorList<5>) <= 16 * 1024, "TensorList too large for kernel parameters");

// The tensor of unit u: the largest i with first_unit[i] <= u.
template <int kPtrs>
__device__ __forceinline__ int find_tensor(const TensorList<kPtrs>& l, int64_t u) {
  int lo = 0, hi = l.n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (l.first_unit[mid] <= u) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

struct AdamWScalars {
  float b1, omb1, b2, omb2;  // beta1, 1 - beta1, beta2, 1 - beta2
  float step_size;           // lr / (1 - beta1^t)
  float bc2_sqrt;            // sqrt(1 - beta2^t)
  float eps, scale;          // eps, grad_scale
  float decay_factor;        // 1 - lr * weight_decay (tensors with decay)
};

// One element of the step, in place: the cpu formula (op.h), operation by operation, each rounded
// to nearest (__f*_rn), so nvcc cannot contract a multiply-add. With plain operators it contracted
// them differently in the 16-byte and per-element paths and in the F32 and split instantiations of
// adamw_unit (last-bit differences; after the split path's loads were reordered the probe's split
// twins no longer matched their F32 masters: docs/PERF.md). Memory-bound: the extra
// instructions cost nothing measurable.
__device__ __forceinline__ void adamw_elem(float& p, float g, float& m, float& v,
                                           const AdamWScalars& sc, float df) {
  const float gi = __fmul_rn(sc.scale, g);
  m = __fadd_rn(__fmul_rn(sc.b1, m), __fmul_rn(sc.omb1, gi));
  v = __fadd_rn(__fmul_rn(sc.b2, v), __fmul_rn(__fmul_rn(sc.omb2, gi), gi));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), sc.bc2_sqrt), sc.eps);
  p = __fsub_rn(__fmul_rn(p, df), __fdiv_rn(__fmul_rn(sc.step_size, m), denom));
}

__device__ __forceinline__ uint2 pack4_bf16(float a, float b, float c, float d) {
  return make_uint2(cuda::pack2(a, b), cuda::pack2(c, d));
}

// Split masters (op.h, gdn/core/split_f32.h): two packed halves (hi: bf16 pair, lo: int16 pair)
// to the two fp32 values they hold, and back.
__device__ __forceinline__ float2 join2(uint32_t hi, uint32_t lo) {
  return make_float2(
      __uint_as_float(split_join(static_cast<uint16_t>(hi), static_cast<int16_t>(lo & 0xffffu))),
      __uint_as_float(split_join(static_cast<uint16_t>(hi >> 16), static_cast<int16_t>(lo >> 16))));
}
__device__ __forceinline__ void split2(float a, float b, uint32_t& hi, uint32_t& lo) {
  const uint32_t ba = __float_as_uint(a), bb = __float_as_uint(b);
  const uint16_t ha = split_hi(ba), hb = split_hi(bb);
  hi = static_cast<uint32_t>(ha) | (static_cast<uint32_t>(hb) << 16);
  lo = static_cast<uint32_t>(static_cast<uint16_t>(split_lo(ba, ha))) |
       (static_cast<uint32_t>(static_cast<uint16_t>(split_lo(bb, hb))) << 16);
}

// Where a tensor's master weights live, read and written 4 elements (16-byte groups of the fp32
// streams) or 1 at a time: an F32 master with an optional bf16 copy written from it, or a split
// master (lo [n] int16, hi [n] bf16: the copy is the high half).
// load4 returns the raw 16-byte group and value4 turns it into the four fp32 values: the unit
// issues every load of a thread before the first value4 (a join right after its own load stalled
// the warp there, one group in flight, in the split path's SASS; measured: docs/PERF.md).
struct F32Master {
  using Raw = float4;
  float* p;    // [n]
  bf16_t* pb;  // [n] or null
  __device__ __forceinline__ Raw load4(int64_t j) const {
    return __ldcs(reinterpret_cast<const float4*>(p + j));
  }
  __device__ __forceinline__ float4 value4(const Raw& r) const { return r; }
  __device__ __forceinline__ void store4(int64_t j, float4 x) const {
    __stcs(reinterpret_cast<float4*>(p + j), x);
    if (pb != nullptr) __stcs(reinterpret_cast<uint2*>(pb + j), pack4_bf16(x.x, x.y, x.z, x.w));
  }
  __device__ __forceinline__ float load1(int64_t j) const { return p[j]; }
  __device__ __forceinline__ void store1(int64_t j, float x) const {
    p[j] = x;
    if (pb != nullptr) pb[j] = __float2bfloat16_rn(x);
  }
};
struct SplitMaster {
  using Raw = uint4;  // hi pair, hi pair, lo pair, lo pair
  int16_t* lo;        // [n]
  bf16_t* hi;         // [n]
  __device__ __forceinline__ Raw load4(int64_t j) const {
    const uint2 h = __ldcs(reinterpret_cast<const uint2*>(hi + j));
    const uint2 l = __ldcs(reinterpret_cast<const uint2*>(lo + j));
    return make_uint4(h.x, h.y, l.x, l.y);
  }
  __device__ __forceinline__ float4 value4(const Raw& r) const {
    const float2 a = join2(r.x, r.z), b = join2(r.y, r.w);
    return make_float4(a.x, a.y, b.x, b.y);
  }
  __device__ __forceinline__ void store4(int64_t j, float4 x) const {
    uint2 h, l;
    split2(x.x, x.y, h.x, l.x);
    split2(x.z, x.w, h.y, l.y);
    __stcs(reinterpret_cast<uint2*>(hi + j), h);
    __stcs(reinterpret_cast<uint2*>(lo + j), l);
  }
  __device__ __forceinline__ float load1(int64_t j) const {
    return __uint_as_float(split_join(reinterpret_cast<const uint16_t*>(hi)[j], lo[j]));
  }
  __device__ __forceinline__ void store1(int64_t j, float x) const {
    const uint32_t b = __float_as_uint(x);
    const uint16_t h = split_hi(b);
    reinterpret_cast<uint16_t*>(hi)[j] = h;
    lo[j] = split_lo(b, h);
  }
};

// The step over elements [begin, end) of one tensor: 16-byte groups (kGroups per thread, every
// load issued before the first use) when `vec`, else one element at a time; a unit's last
// (end - begin) % 4 elements one by one.
template <class Master>
__device__ __forceinline__ void adamw_unit(const Master& mst, const float* g, float* m, float* v,
                                           int64_t begin, int64_t end, bool vec,
                                           const AdamWScalars& sc, float df) {
  auto scalar = [&](int64_t j) {
    float pj = mst.load1(j), mj = m[j], vj = v[j];
    adamw_elem(pj, g[j], mj, vj, sc, df);
    mst.store1(j, pj);
    m[j] = mj;
    v[j] = vj;
  };
  if (!vec) {
    for (int64_t j = begin + threadIdx.x; j < end; j += kThreads) scalar(j);
    return;
  }
  typename Master::Raw pr[kGroups];
  float4 gv[kGroups], mv[kGroups], vv[kGroups];
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
    const int64_t j = begin + (static_cast<int64_t>(k) * kThreads + threadIdx.x) * 4;
    if (j + 4 <= end) {
      pr[k] = mst.load4(j);
      gv[k] = __ldcs(reinterpret_cast<const float4*>(g + j));
      mv[k] = __ldcs(reinterpret_cast<const float4*>(m + j));
      vv[k] = __ldcs(reinterpret_cast<const float4*>(v + j));
    }
  }
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
    const int64_t j = begin + (static_cast<int64_t>(k) * kThreads + threadIdx.x) * 4;
    if (j + 4 <= end) {
      float4 pv = mst.value4(pr[k]);
      adamw_elem(pv.x, gv[k].x, mv[k].x, vv[k].x, sc, df);
      adamw_elem(pv.y, gv[k].y, mv[k].y, vv[k].y, sc, df);
      adamw_elem(pv.z, gv[k].z, mv[k].z, vv[k].z, sc, df);
      adamw_elem(pv.w, gv[k].w, mv[k].w, vv[k].w, sc, df);
      mst.store4(j, pv);
      __stcs(reinterpret_cast<float4*>(m + j), mv[k]);
      __stcs(reinterpret_cast<float4*>(v + j), vv[k]);
    }
  }
  const int64_t tail = begin + ((end - begin) & ~int64_t{3});
  if (tail + threadIdx.x < end) scalar(tail + threadIdx.x);
}

// The clip decision of a step with clip_sumsq (op.h), made on the device by one thread in fp64 as
// host_clip_decision makes it on the host (IEEE sqrt and division: the same bits): ctl[0] = the
// fp32 gradient scale, ctl[1] = 1 when the step is skipped (a non-finite sum or loss).
__global__ void adamw_clip_kernel(const double* sumsq, const void* losses, int n_losses,
                                  int losses_f64, double grad_scale, double max_norm, float* ctl) {
  const double ss = *sumsq;
  bool finite = isfinite(ss);
  for (int i = 0; i < n_losses; ++i)
    finite =
        finite && isfinite(losses_f64 ? static_cast<const double*>(losses)[i]
                                      : static_cast<double>(static_cast<const float*>(losses)[i]));
  double c = 1.0;
  if (max_norm > 0) {
    const double q = max_norm / (sqrt(ss) + 1e-6);
    c = q < 1.0 ? q : 1.0;
  }
  ctl[0] = static_cast<float>(grad_scale * c);
  ctl[1] = finite ? 0.f : 1.f;
}

// ctl: null (sc.scale applies) or adamw_clip_kernel's output (skip flag, then the scale).
__global__ void __launch_bounds__(kThreads)
    adamw_step_kernel(const __grid_constant__ TensorList<5> list, const AdamWScalars scalars,
                      const float* ctl) {
  AdamWScalars sc = scalars;
  if (ctl != nullptr) {
    if (ctl[1] != 0.f) return;
    sc.scale = ctl[0];
  }
  const int64_t u = blockIdx.x;
  const int i = find_tensor(list, u);
  const int64_t begin = (u - list.first_unit[i]) * kUnit;
  const int64_t end = std::min<int64_t>(list.numel[i], begin + kUnit);
  const float* g = static_cast<const float*>(list.ptr[1][i]);  // [n]
  float* m = static_cast<float*>(list.ptr[2][i]);              // [n]
  float* v = static_cast<float*>(list.ptr[3][i]);              // [n]
  bf16_t* pb = static_cast<bf16_t*>(list.ptr[4][i]);           // [n] or null
  const float df = list.decay[i] ? sc.decay_factor : 1.f;
  if (list.split[i]) {  // ptr[0]: the I16 low half [n]
    adamw_unit(SplitMaster{static_cast<int16_t*>(list.ptr[0][i]), pb}, g, m, v, begin, end,
               list.vec[i], sc, df);
  } else {  // ptr[0]: the F32 master [n]
    adamw_unit(F32Master{static_cast<float*>(list.ptr[0][i]), pb}, g, m, v, begin, end, list.vec[i],
               sc, df);
  }
}

// partial[u] = sum of g^2 over unit u of kSumUnit elements, in fp64 (a fixed order inside the
// unit). The thread loop walks the unit in steps of kSumStep elements, kSumG 16-byte loads a
// thread a step, all issued before the first use.
__global__ void __launch_bounds__(kThreads)
    grad_sumsq_kernel(const __grid_constant__ TensorList<1> list,
                      double* __restrict__ partial) {  // [units of this list]
  __shared__ double warp_sums[kThreads / 32];
  const int64_t u = blockIdx.x;
  const int i = find_tensor(list, u);
  const int64_t begin = (u - list.first_unit[i]) * kSumUnit;
  const int64_t end = std::min<int64_t>(list.numel[i], begin + kSumUnit);
  const float* g = static_cast<const float*>(list.ptr[0][i]);  // [n]
  double acc = 0.0;
  if (list.vec[i]) {
    for (int64_t base = begin; base < end; base += kSumStep) {
      // Unconditional loads (a group past the end reads the unit's first group instead and is
      // dropped below): predicated loads would be issued one at a time, each after the previous
      // group's arithmetic (seen in the SASS), i.e. one 16-byte load in flight per thread.
      float4 gv[kSumG];
#pragma unroll
      for (int k = 0; k < kSumG; ++k) {
        const int64_t j = base + (static_cast<int64_t>(k) * kThreads + threadIdx.x) * 4;
        gv[k] = __ldcs(reinterpret_cast<const float4*>(g + (j + 4 <= end ? j : begin)));
      }
#pragma unroll
      for (int k = 0; k < kSumG; ++k) {
        const int64_t j = base + (static_cast<int64_t>(k) * kThreads + threadIdx.x) * 4;
        if (j + 4 <= end) {
          const double a = gv[k].x, b = gv[k].y, c = gv[k].z, d = gv[k].w;
          acc += a * a + b * b + c * c + d * d;
        }
      }
    }
    const int64_t tail = begin + ((end - begin) & ~int64_t{3});
    if (tail + threadIdx.x < end) {
      const double a = g[tail + threadIdx.x];
      acc += a * a;
    }
  } else {
#pragma unroll 4
    for (int64_t j = begin + threadIdx.x; j < end; j += kThreads) {
      const double a = g[j];
      acc += a * a;
    }
  }
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, mask);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0.0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) s += warp_sums[w];  // warp order
    partial[u] = s;
  }
}

// out[0] = sum of partial[0 .. count): thread t adds t, t + 1024, ... in order, then a fixed
// shared-memory tree. One block.
constexpr int kSumThreads = 1024;
__global__ void __launch_bounds__(kSumThreads)
    sum_partials_kernel(const double* __restrict__ partial,  // [count]
                        int64_t count, double* __restrict__ out) {
  __shared__ double s[kSumThreads];
  double acc = 0.0;
  int64_t j = threadIdx.x;
  for (; j + 3 * kSumThreads < count; j += 4 * kSumThreads) {  // four loads in flight
    const double a = partial[j], b = partial[j + kSumThreads], c = partial[j + 2 * kSumThreads],
                 d = partial[j + 3 * kSumThreads];
    acc += a;
    acc += b;
    acc += c;
    acc += d;
  }
  for (; j < count; j += kSumThreads) acc += partial[j];
  s[threadIdx.x] = acc;
  __syncthreads();
  for (int half = kSumThreads / 2; half > 0; half >>= 1) {
    if (static_cast<int>(threadIdx.x) < half) s[threadIdx.x] += s[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[0] = s[0];
}

__global__ void __launch_bounds__(kThreads)
    refresh_bf16_kernel(const __grid_constant__ TensorList<3> list) {
  const int64_t u = blockIdx.x;
  const int i = find_tensor(list, u);
  const int64_t begin = (u - list.first_unit[i]) * kUnit;
  const int64_t end = std::min<int64_t>(list.numel[i], begin + kUnit);
  const float* src = static_cast<const float*>(list.ptr[0][i]);  // [n]
  bf16_t* dst = static_cast<bf16_t*>(list.ptr[1][i]);            // [n]
  if (list.split[i]) {  // the halves of a split master: one element a thread, start-up only
    int16_t* lo = static_cast<int16_t*>(list.ptr[2][i]);  // [n]
    for (int64_t j = begin + threadIdx.x; j < end; j += kThreads) {
      const uint32_t b = __float_as_uint(src[j]);
      const uint16_t h = split_hi(b);
      reinterpret_cast<uint16_t*>(dst)[j] = h;
      lo[j] = split_lo(b, h);
    }
    return;
  }
  if (!list.vec[i]) {
    for (int64_t j = begin + threadIdx.x; j < end; j += kThreads)
      dst[j] = __float2bfloat16_rn(src[j]);
    return;
  }
  float4 sv[kGroups];
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
    const int64_t j = begin + (static_cast<int64_t>(k) * kThreads + threadIdx.x) * 4;
    if (j + 4 <= end) sv[k] = __ldcs(reinterpret_cast<const float4*>(src + j));
  }
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
    const int64_t j = begin + (static_cast<int64_t>(k) * kThreads + threadIdx.x) * 4;
    if (j + 4 <= end)
      __stcs(reinterpret_cast<uint2*>(dst + j), pack4_bf16(sv[k].x, sv[k].y, sv[k].z, sv[k].w));
  }
  const int64_t tail = begin + ((end - begin) & ~int64_t{3});
  if (tail + threadIdx.x < end)
    dst[tail + threadIdx.x] = __float2bfloat16_rn(src[tail + threadIdx.x]);
}

// --- host side ---------------------------------------------------------------------------------

int64_t units_of(int64_t numel, int64_t unit = kUnit) { return (numel + unit - 1) / unit; }

bool aligned(const void* p, uintptr_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; }

// Fills TensorLists of kPtrs pointers and calls launch(list, units, first_global_unit) whenever
// one is full and once at the end (if not empty).
template <int kPtrs, class Launch>
class ListBatcher {
 public:
  explicit ListBatcher(Launch launch, int64_t unit = kUnit) : launch_(launch), unit_(unit) {}
  void add(int64_t numel, const std::array<void*, kPtrs>& ptrs, bool decay, bool vec,
           bool split = false) {
    if (numel == 0) return;
    const int i = list_.n;
    list_.first_unit[i] = units_;
    list_.numel[i] = numel;
    for (int k = 0; k < kPtrs; ++k) list_.ptr[k][i] = ptrs[static_cast<size_t>(k)];
    list_.decay[i] = decay ? 1 : 0;
    list_.vec[i] = vec ? 1 : 0;
    list_.split[i] = split ? 1 : 0;
    units_ += units_of(numel, unit_);
    list_.n = i + 1;
    if (list_.n == kMaxTensors) flush();
  }
  void flush() {
    if (list_.n == 0) return;
    list_.first_unit[list_.n] = units_;
    GDN_CHECK(units_ <= INT_MAX, "adamw (cuda): {} work units in one launch is too many", units_);
    launch_(list_, units_, done_);
    done_ += units_;
    units_ = 0;
    list_.n = 0;
  }

 private:
  Launch launch_;
  int64_t unit_;
  TensorList<kPtrs> list_;
  int64_t units_ = 0;  // in the current list
  int64_t done_ = 0;   // in the lists already launched
};

void step(const AdamWStep& s) {
  const AdamWHyper& h = s.hyper;
  // Scalars in fp64 on the host, rounded once to fp32 (as the cpu implementation and torch's
  // foreach AdamW).
  const double t = static_cast<double>(h.step);
  const double bc1 = 1.0 - std::pow(h.beta1, t), bc2 = 1.0 - std::pow(h.beta2, t);
  AdamWScalars sc;
  sc.b1 = static_cast<float>(h.beta1);
  sc.omb1 = static_cast<float>(1.0 - h.beta1);
  sc.b2 = static_cast<float>(h.beta2);
  sc.omb2 = static_cast<float>(1.0 - h.beta2);
  sc.step_size = static_cast<float>(h.lr / bc1);
  sc.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  sc.eps = static_cast<float>(h.eps);
  sc.scale = static_cast<float>(h.grad_scale);
  sc.decay_factor = static_cast<float>(1.0 - h.lr * h.weight_decay);
  cuda::Context& ctx = cuda::Context::get();
  cudaStream_t stream = ctx.stream();
  float* ctl = nullptr;
  const AdamWClip& c = s.clip;
  if (c.sumsq.defined()) {
    ctl = static_cast<float*>(ctx.scratch(kAdamWClipBytes, "adamw"));
    const bool lf = c.losses.defined();
    adamw_clip_kernel<<<1, 1, 0, stream>>>(c.sumsq.ptr<double>(), lf ? c.losses.data() : nullptr,
                                           lf ? static_cast<int>(c.losses.numel()) : 0,
                                           lf && c.losses.dtype() == DType::F64 ? 1 : 0,
                                           h.grad_scale, c.max_norm, ctl);
    GDN_CUDA_LAUNCH_CHECK("adamw_clip_kernel");
  }
  auto launch = [&](const TensorList<5>& l, int64_t units, int64_t) {
    adamw_step_kernel<<<static_cast<unsigned>(units), kThreads, 0, stream>>>(l, sc, ctl);
    GDN_CUDA_LAUNCH_CHECK("adamw_step_kernel");
  };
  ListBatcher<5, decltype(launch)> batch(launch);
  for (const AdamWParam& e : s.params) {
    void* pb = e.p_bf16.defined() ? e.p_bf16.data() : nullptr;
    const bool split = e.p.dtype() == DType::I16;
    const bool vec = aligned(e.p.data(), split ? 8 : 16) && cuda::aligned16(e.g.data()) &&
                     cuda::aligned16(e.m.data()) && cuda::aligned16(e.v.data()) &&
                     (pb == nullptr || aligned(pb, 8));
    batch.add(e.p.numel(), {e.p.data(), e.g.data(), e.m.data(), e.v.data(), pb}, e.decay, vec,
              split);
  }
  batch.flush();
}

// The sum of squares into *dst (device memory), on the compute stream.
void sumsq_to(std::span<const Tensor> grads, double* dst) {
  int64_t total = 0;
  for (const Tensor& g : grads) total += adamw_sumsq_units(g.numel());
  cuda::Context& ctx = cuda::Context::get();
  cudaStream_t stream = ctx.stream();
  if (total == 0) {
    GDN_CUDA_CHECK(cudaMemsetAsync(dst, 0, sizeof(double), stream));
    return;
  }
  double* partial = static_cast<double*>(  // [total]: the unit sums (and grad_sumsq's result)
      ctx.scratch(adamw_sumsq_bytes(total), "adamw"));
  auto launch = [&](const TensorList<1>& l, int64_t units, int64_t first) {
    grad_sumsq_kernel<<<static_cast<unsigned>(units), kThreads, 0, stream>>>(l, partial + first);
    GDN_CUDA_LAUNCH_CHECK("grad_sumsq_kernel");
  };
  ListBatcher<1, decltype(launch)> batch(launch, kSumUnit);
  for (const Tensor& g : grads) batch.add(g.numel(), {g.data()}, false, cuda::aligned16(g.data()));
  batch.flush();
  sum_partials_kernel<<<1, kSumThreads, 0, stream>>>(partial, total, dst);
  GDN_CUDA_LAUNCH_CHECK("sum_partials_kernel");
}

void grad_sumsq_into(std::span<const Tensor> grads, const Tensor& out) {
  sumsq_to(grads, out.ptr<double>());
}

double grad_sumsq(std::span<const Tensor> grads) {
  cuda::Context& ctx = cuda::Context::get();
  // The result after the unit sums (scratch is reused by sumsq_to: one extra double at the end).
  int64_t total = 0;
  for (const Tensor& g : grads) total += adamw_sumsq_units(g.numel());
  double* res = static_cast<double*>(ctx.scratch(adamw_sumsq_bytes(total), "adamw")) + total;
  sumsq_to(grads, res);
  // The contract returns a host double: the one synchronisation of the optimizer's calls.
  double result = 0.0;
  GDN_CUDA_CHECK(
      cudaMemcpyAsync(&result, res, sizeof(double), cudaMemcpyDeviceToHost, ctx.stream()));
  cuda::note_drain();
  GDN_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
  return result;
}

void refresh_bf16(std::span<const Bf16Copy> copies) {
  cudaStream_t stream = cuda::stream();
  auto launch = [&](const TensorList<3>& l, int64_t units, int64_t) {
    refresh_bf16_kernel<<<static_cast<unsigned>(units), kThreads, 0, stream>>>(l);
    GDN_CUDA_LAUNCH_CHECK("refresh_bf16_kernel");
  };
  ListBatcher<3, decltype(launch)> batch(launch);
  for (const Bf16Copy& c : copies)
    batch.add(c.master.numel(),
              {c.master.data(), c.copy.data(), c.lo.defined() ? c.lo.data() : nullptr}, false,
              cuda::aligned16(c.master.data()) && aligned(c.copy.data(), 8), c.lo.defined());
  batch.flush();
}

const AdamWTable kTable{step, grad_sumsq, grad_sumsq_into, refresh_bf16};

}  // namespace

GDN_REGISTER(adamw_cuda) {
  Registry::global().add_impl({"adamw", "cuda.multi_tensor", Backend::Cuda, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
