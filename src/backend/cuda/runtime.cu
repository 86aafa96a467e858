// The CUDA runtime of libgdn: device hooks for gdn/core/tensor.h (installed at static-init time
// when a device is present), the per-process Context, and the error reporting behind cuda_check.h.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <string>

#include "gdn/backend/cuda_check.h"
#include "gdn/backend/cuda_context.h"
#include "gdn/backend/op_workspace.h"
#include "gdn/core/arena.h"
#include "gdn/core/log.h"
#include "gdn/core/profile.h"
#include "gdn/core/tensor.h"

namespace gdn::cuda {

void install_device_fill_hooks();  // rng_init.cu

namespace detail {

void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  (void)cudaGetLastError();  // clear the slot (a no-op for sticky errors, which stay anyway)
  ::gdn::detail::throw_error(
      file, line,
      fmt::format("CUDA error {} ({}) in {}", cudaGetErrorName(err), cudaGetErrorString(err), expr),
      err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver
          ? "no usable GPU: check nvidia-smi and CUDA_VISIBLE_DEVICES"
          : "");
}

void throw_cublas_error(cublasStatus_t st, const char* expr, const char* file, int line) {
  (void)cudaGetLastError();
  ::gdn::detail::throw_error(file, line,
                             fmt::format("cuBLAS error {} ({}) in {}", cublasGetStatusName(st),
                                         cublasGetStatusString(st), expr));
}

void throw_launch_error(cudaError_t err, const char* kernel, bool while_running, const char* file,
                        int line) {
  (void)cudaGetLastError();
  ::gdn::detail::throw_error(
      file, line,
      fmt::format("kernel '{}' {}: CUDA error {} ({})", kernel,
                  while_running ? "failed while running" : "failed to launch",
                  cudaGetErrorName(err), cudaGetErrorString(err)),
      while_running ? "an illegal address or similar fault: run the failing command under "
                      "compute-sanitizer to find the access"
                    : "");
}

}  // namespace detail

namespace {

constexpr size_t kCublasLtWorkspace = size_t{32} << 20;

bool g_device_present = false;
std::atomic<uint64_t> g_drains{0};

// --- device hooks (gdn/core/tensor.h) ----------------------------------------------------------
void* hook_alloc(size_t bytes) {
  Context::get();  // create the context (and select its device) before the first allocation
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, std::max<size_t>(bytes, 1));
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    (void)cudaMemGetInfo(&free_b, &total_b);
    (void)cudaGetLastError();
    GDN_FAIL_HINT("lower the micro-batch or sequence length, or free device memory",
                  "cudaMalloc of {} failed: {} ({}); device has {} free of {}",
                  format_bytes(static_cast<double>(bytes)), cudaGetErrorName(err),
                  cudaGetErrorString(err), format_bytes(static_cast<double>(free_b)),
                  format_bytes(static_cast<double>(total_b)));
  }
  return p;
}

// Called from OwnedTensor deleters and Arena destructors: must not throw. At process exit the
// runtime may already be unloading (static destructors run after it); that is not an error.
void hook_free(void* p) {
  const cudaError_t err = cudaFree(p);
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();
  if (err == cudaErrorCudartUnloading) return;
  std::fprintf(stderr, "warning: cudaFree(%p) failed: %s (%s)\n", p, cudaGetErrorName(err),
               cudaGetErrorString(err));
}

void hook_copy(void* dst, const void* src, size_t n) {
  cudaStream_t s = stream();
  GDN_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, s));
  note_drain();
  GDN_CUDA_CHECK(cudaStreamSynchronize(s));
}

// Any direction, stream-ordered, no wait: the host side is page-locked (hook_host_alloc_pinned),
// so the driver neither stages nor blocks.
void hook_copy_async(void* dst, const void* src, size_t n) {
  GDN_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream()));
}
void* hook_host_alloc_pinned(size_t bytes) {
  void* p = nullptr;
  GDN_CUDA_CHECK(cudaMallocHost(&p, bytes));
  return p;
}
void hook_host_free_pinned(void* p) { (void)cudaFreeHost(p); }
uint64_t hook_drains() { return g_drains.load(std::memory_order_relaxed); }

// Device to device: stream-ordered, no host wait (a training step never synchronises).
void hook_copy_d2d(void* dst, const void* src, size_t n) {
  GDN_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, stream()));
}

void hook_copy2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                 size_t height) {
  GDN_CUDA_CHECK(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height,
                                   cudaMemcpyDeviceToDevice, stream()));
}

size_t hook_memory_used() {
  size_t free_b = 0, total_b = 0;
  GDN_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return total_b - free_b;
}

void hook_memset_zero(void* p, size_t n) { GDN_CUDA_CHECK(cudaMemsetAsync(p, 0, n, stream())); }

void hook_synchronize() {
  note_drain();
  GDN_CUDA_CHECK(cudaDeviceSynchronize());
}

// Profiler events (--profile-step): timing events recorded on the compute stream.
void* hook_event_create() {
  cudaEvent_t e = nullptr;
  GDN_CUDA_CHECK(cudaEventCreate(&e));
  return e;
}
void hook_event_destroy(void* e) { (void)cudaEventDestroy(static_cast<cudaEvent_t>(e)); }
void hook_event_record(void* e) {
  GDN_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(e), stream()));
}
void hook_event_synchronize(void* e) {
  GDN_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(e)));
}
float hook_elapsed_ms(void* a, void* b) {
  float ms = 0;
  GDN_CUDA_CHECK(
      cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(a), static_cast<cudaEvent_t>(b)));
  return ms;
}

// Runs at static-initialisation time (the library is linked whole-archive). A machine without a
// driver or a device is normal (CPU-only runs of a CUDA build): hooks stay uninstalled and
// cuda_available() is false.
bool install_hooks() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess || n <= 0) {
    (void)cudaGetLastError();
    return false;
  }
  DeviceHooks h;
  h.alloc = hook_alloc;
  h.free = hook_free;
  h.copy = hook_copy;
  h.copy_d2d = hook_copy_d2d;
  h.copy2d = hook_copy2d;
  h.memory_used = hook_memory_used;
  h.memset_zero = hook_memset_zero;
  h.synchronize = hook_synchronize;
  h.copy_async = hook_copy_async;
  h.host_alloc_pinned = hook_host_alloc_pinned;
  h.host_free_pinned = hook_host_free_pinned;
  h.event_create = hook_event_create;
  h.event_destroy = hook_event_destroy;
  h.event_record = hook_event_record;
  h.event_synchronize = hook_event_synchronize;
  h.event_elapsed_ms = hook_elapsed_ms;
  h.drains = hook_drains;
  set_cuda_hooks(h);
  ProfileHooks ph;
  ph.event_create = hook_event_create;
  ph.event_destroy = hook_event_destroy;
  ph.event_record = hook_event_record;
  ph.event_synchronize = hook_event_synchronize;
  ph.elapsed_ms = hook_elapsed_ms;
  set_profile_hooks(ph);
  install_device_fill_hooks();
  g_device_present = true;
  return true;
}

[[maybe_unused]] const bool g_hooks_installed = install_hooks();

}  // namespace

bool device_present() { return g_device_present; }

void note_drain() { g_drains.fetch_add(1, std::memory_order_relaxed); }

Context& Context::get() {
  // Leaked on purpose (see cuda_context.h).
  static Context* ctx = new Context();
  return *ctx;
}

Context::Context() {
  GDN_CHECK_HINT(g_device_present, "run on a machine with a GPU (check nvidia-smi)",
                 "a CUDA kernel or device tensor was requested but no CUDA device is available");
  GDN_CUDA_CHECK(cudaGetDevice(&device_));
  GDN_CUDA_CHECK(cudaGetDeviceProperties(&props_, device_));
  // Blocking (not cudaStreamNonBlocking): ordered with the legacy default stream too.
  GDN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamDefault));
  GDN_CUBLAS_CHECK(cublasLtCreate(&cublaslt_));
  workspace_bytes_ = kCublasLtWorkspace;
  GDN_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
  log::debug("[cuda] device {}: {} (sm_{}{}, {} SMs, L2 {}, {} memory)", device_, props_.name,
             props_.major, props_.minor, props_.multiProcessorCount,
             format_bytes(static_cast<double>(props_.l2CacheSize)),
             format_bytes(static_cast<double>(props_.totalGlobalMem)));
}

void* Context::scratch(size_t bytes, const char* op) {
  std::lock_guard lock(scratch_mu_);
  peak_request_ = std::max(peak_request_, bytes);
  if (bound_) {
    check_op_workspace(op, bytes, bound_bytes_);
    return bound_ptr_;
  }
  if (bytes <= scratch_bytes_) return scratch_;
  // Earlier work on the stream may still read the old buffer.
  note_drain();
  GDN_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (scratch_ != nullptr) GDN_CUDA_CHECK(cudaFree(scratch_));
  scratch_ = nullptr;
  scratch_bytes_ = 0;
  // Round up (1 MiB) so that slowly growing requests do not reallocate every time.
  const size_t want = (bytes + (size_t{1} << 20) - 1) & ~((size_t{1} << 20) - 1);
  GDN_CUDA_CHECK(cudaMalloc(&scratch_, want));
  scratch_bytes_ = want;
  return scratch_;
}

void Context::release_scratch() {
  std::lock_guard lock(scratch_mu_);
  if (scratch_ == nullptr) return;
  note_drain();
  GDN_CUDA_CHECK(cudaStreamSynchronize(stream_));  // work on the stream may still read it
  GDN_CUDA_CHECK(cudaFree(scratch_));
  scratch_ = nullptr;
  scratch_bytes_ = 0;
}

void Context::bind_workspace(void* ptr, size_t bytes) {
  GDN_CHECK(ptr != nullptr || bytes == 0, "bind_workspace: a null region of {} bytes", bytes);
  std::lock_guard lock(scratch_mu_);
  bound_ = true;
  bound_ptr_ = ptr;
  bound_bytes_ = bytes;
}

void Context::unbind_workspace() {
  std::lock_guard lock(scratch_mu_);
  bound_ = false;
  bound_ptr_ = nullptr;
  bound_bytes_ = 0;
}

}  // namespace gdn::cuda

namespace gdn {

// gdn/backend/op_workspace.h's host-code side of the binding (the same as cuda::ScopedWorkspace).
OpWorkspaceDevice op_workspace_device() {
  const cudaDeviceProp& p = cuda::Context::get().props();
  return {p.multiProcessorCount, p.maxBlocksPerMultiProcessor};
}

OpWorkspaceBinding::OpWorkspaceBinding(void* ptr, size_t bytes) {
  cuda::Context& ctx = cuda::Context::get();
  prev_bound_ = ctx.workspace_bound();
  prev_ = ctx.bound_workspace();
  prev_bytes_ = ctx.bound_workspace_bytes();
  ctx.bind_workspace(ptr, bytes);
}

OpWorkspaceBinding::~OpWorkspaceBinding() {
  cuda::Context& ctx = cuda::Context::get();
  if (prev_bound_) {
    ctx.bind_workspace(prev_, prev_bytes_);
  } else {
    ctx.unbind_workspace();
  }
}

OpWorkspaceSuspend::OpWorkspaceSuspend() {
  cuda::Context& ctx = cuda::Context::get();
  prev_bound_ = ctx.workspace_bound();
  prev_ = ctx.bound_workspace();
  prev_bytes_ = ctx.bound_workspace_bytes();
  if (prev_bound_) ctx.unbind_workspace();
}

OpWorkspaceSuspend::~OpWorkspaceSuspend() {
  if (!prev_bound_) return;
  cuda::Context& ctx = cuda::Context::get();
  try {
    ctx.release_scratch();
  } catch (const Error& e) {  // a destructor does not throw; the next launch reports the device
    log::warn("op workspace: releasing the grow-only scratch failed: {}", e.message());
  }
  ctx.bind_workspace(prev_, prev_bytes_);
}

}  // namespace gdn
