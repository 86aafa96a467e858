// Hopper (sm_90) bulk copies global -> shared completing on an mbarrier, and the mbarrier
// operations they need. One thread issues a whole contiguous block (a row of a tensor) with
// cp_async_bulk_g2s(); the copy engine moves it and, when the bytes have landed, decrements the
// transaction count of the named mbarrier. A phase of such an mbarrier completes when its expected
// arrivals have arrived (mbar_arrive_expect_tx() is one arrival that also raises the transaction
// count by the bytes announced) and every announced byte has landed; threads wait for a phase with
// mbar_wait_parity(), after which the copied bytes are visible to them.
//
// Phases and parity: an mbarrier starts in phase 0; each completion moves it to the next phase.
// mbar_wait_parity(bar, p) returns once the phase of parity p most recently begun (p = 0: phase 0,
// 2, ...) has completed, i.e. a waiter must know which use of the barrier it waits for and must
// never fall two phases behind (the caller's protocol has to guarantee that a barrier cannot
// complete phase u + 1 while some thread still has to wait for phase u).
//
// Hand-written PTX, as cp_async.cuh: libcu++ exposes these through cuda::barrier +
// cuda::memcpy_async / cuda::device::barrier_arrive_tx, whose barrier is a non-trivial object
// (init() in shared memory, token-based waiting that ties a wait to an arrival of the same thread)
// while the kernels here want many waiters that never arrive, waiting on an explicit phase parity,
// the protocol CUTLASS's sm90 pipelines use; the five instructions are simpler to read raw.
// Shared-memory addresses are 32-bit .shared::cta addresses (__cvta_generic_to_shared); a CTA
// launched without clusters is its own cluster of one, so they are valid .shared::cluster
// addresses of the copy as well.
#pragma once

#include <cstdint>

namespace gdn::cuda {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Initialises the mbarrier at `bar` (8 bytes, 8-byte aligned) for `count` arrivals per phase. Once
// every barrier is initialised, call mbar_init_fence() and then a block barrier before any other
// thread or the copy engine uses them.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}

// Makes the initialisations of this thread visible to the async proxy (the copy engine).
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival on `bar` that also announces `bytes` more bytes to land in the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

// Returns once the phase of `bar` with parity `parity` (0 or 1) has completed (see the header).
// try_wait suspends the thread for a hardware-chosen time before returning false, so the loop does
// not hammer the barrier.
__device__ __forceinline__ void mbar_wait_parity(uint64_t* bar, uint32_t parity) {
  const uint32_t a = smem_addr(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
  } while (done == 0);
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global `gmem` to shared
// `smem`; completion decrements the transaction count of `bar` by `bytes`. The caller announces
// the bytes on `bar` (mbar_arrive_expect_tx) in the same phase.
__device__ __forceinline__ void cp_async_bulk_g2s(void* smem, const void* gmem, uint32_t bytes,
                                                  uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(smem_addr(smem)),
      "l"(gmem), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

}  // namespace gdn::cuda
