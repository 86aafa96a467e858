// Ampere-style asynchronous global -> shared copies (cp.async, sm_80+), the wrappers every kernel
// that stages tiles or rows through shared memory uses. Each thread's copies are grouped by
// cp_async_commit(); cp_async_wait<N>() returns once at most N of the thread's groups are still in
// flight, and the bytes of the completed groups are then visible to that thread (other threads
// need a barrier). Hand-written: the CUDA headers offer these only through cuda::pipeline /
// cooperative_groups::memcpy_async, whose extra state the kernels here do not need.
#pragma once

namespace gdn::cuda {

// 16 bytes from global `gmem` to shared `smem` (both 16-byte aligned), L2 only (.cg).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}

// The same, reading only the first `src_bytes` (0..16) bytes of `gmem` and zero-filling the rest
// (src_bytes = 0: no read at all, 16 zero bytes).
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes)
               : "memory");
}

// A hint to bring the 128-byte line holding `gmem` into L2 (prefetch.global.L2): no register, no
// completion to wait for; a later load of the line then waits for an L2 hit at most.
__device__ __forceinline__ void prefetch_l2(const void* gmem) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(gmem));
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace gdn::cuda
