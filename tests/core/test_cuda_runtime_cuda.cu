// The CUDA runtime of libgdn (label gpu): device hooks behind OwnedTensor / convert / copy_into,
// arenas on the device, the context, the error checks (their messages name the CUDA error and the
// call or kernel), and that a handled error does not poison the next launch check.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gdn/backend/cuda_check.h"
#include "gdn/backend/cuda_context.h"
#include "gdn/core/arena.h"
#include "gdn/core/tensor.h"

namespace gdn {
namespace {

class CudaRuntime : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(cuda_available())
        << "no CUDA device: the CUDA runtime did not install its device hooks (is a GPU visible? "
           "check nvidia-smi and CUDA_VISIBLE_DEVICES)";
    ASSERT_TRUE(cuda::device_present());
  }
};

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

__global__ void add_one_kernel(float* p, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) p[i] += 1.f;
}

TEST_F(CudaRuntime, ContextDescribesTheDevice) {
  cuda::Context& ctx = cuda::Context::get();
  EXPECT_EQ(&ctx, &cuda::Context::get());
  EXPECT_GT(ctx.sm_count(), 0);
  EXPECT_GE(ctx.props().major, 9) << "built for sm_90a: needs a Hopper GPU, found sm_"
                                  << ctx.props().major << ctx.props().minor;
  EXPECT_NE(ctx.stream(), nullptr);
  EXPECT_NE(ctx.cublaslt(), nullptr);
  EXPECT_NE(ctx.workspace(), nullptr);
  EXPECT_EQ(ctx.workspace_bytes(), size_t{32} << 20);
  void* s1 = ctx.scratch(1000);
  EXPECT_NE(s1, nullptr);
  EXPECT_EQ(ctx.scratch(10), s1);  // never shrinks
  void* s2 = ctx.scratch(size_t{8} << 20);
  EXPECT_NE(s2, nullptr);
  EXPECT_EQ(ctx.scratch(size_t{1} << 20), s2);
}

TEST_F(CudaRuntime, TensorsRoundTripThroughTheDevice) {
  std::vector<double> v(1001);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 0.25 * static_cast<double>(i) - 100.0;
  for (DType dt : {DType::F32, DType::BF16, DType::F64}) {
    OwnedTensor host = from_f64(v, dt, {1001});
    OwnedTensor dev = convert(host, dt, Device::CUDA);
    EXPECT_EQ(dev.view().device(), Device::CUDA);
    OwnedTensor dev2 = OwnedTensor::empty(dt, {1001}, Device::CUDA);
    copy_into(dev2, dev);  // device to device
    EXPECT_EQ(to_f64_vector(dev2), to_f64_vector(host)) << dtype_name(dt);
  }
  std::vector<int64_t> ids = {0, -5, 1 << 30, 7};
  Tensor it(ids.data(), DType::I64, {4});
  OwnedTensor di = convert(it, DType::I32, Device::CUDA);
  OwnedTensor back = convert(di, DType::I64);
  EXPECT_EQ(std::vector<int64_t>(back.ptr<int64_t>(), back.ptr<int64_t>() + 4), ids);
  // zeros() really zeroes device memory that held something else before.
  for (int rep = 0; rep < 3; ++rep) {
    OwnedTensor z = OwnedTensor::zeros(DType::F32, {4096}, Device::CUDA);
    for (double x : to_f64_vector(z)) ASSERT_EQ(x, 0.0);
    OwnedTensor junk = from_f64(std::vector<double>(4096, 3.0), DType::F32, {4096}, Device::CUDA);
  }
}

TEST_F(CudaRuntime, KernelsOnTheComputeStreamSeeHookWrites) {
  // memset (hook, compute stream) -> kernel (compute stream) -> copy back (hook): ordered.
  const int n = 1 << 20;
  OwnedTensor t = OwnedTensor::zeros(DType::F32, {n}, Device::CUDA);
  add_one_kernel<<<(n + 255) / 256, 256, 0, cuda::stream()>>>(t.ptr<float>(), n);
  GDN_CUDA_LAUNCH_CHECK("add_one_kernel");
  add_one_kernel<<<(n + 255) / 256, 256, 0, cuda::stream()>>>(t.ptr<float>(), n);
  GDN_CUDA_LAUNCH_CHECK("add_one_kernel");
  for (double x : to_f64_vector(t)) ASSERT_EQ(x, 2.0);
}

TEST_F(CudaRuntime, ArenaOnTheDevice) {
  Arena arena("activations", Device::CUDA, size_t{1} << 20);
  Tensor a = arena.alloc_tensor(DType::F32, {1000});
  Tensor b = arena.alloc_tensor(DType::BF16, {16, 8});
  EXPECT_EQ(a.device(), Device::CUDA);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 256, 0u);
  copy_into(a, from_f64(std::vector<double>(1000, 1.5), DType::F32, {1000}));
  add_one_kernel<<<4, 256, 0, cuda::stream()>>>(a.ptr<float>(), 1000);
  GDN_CUDA_LAUNCH_CHECK("add_one_kernel");
  for (double x : to_f64_vector(a)) ASSERT_EQ(x, 2.5);
  const std::string msg = error_of([&] { arena.alloc(size_t{2} << 20); });
  EXPECT_NE(msg.find("activations"), std::string::npos) << msg;
}

TEST_F(CudaRuntime, ErrorsNameTheCudaErrorAndDoNotLinger) {
  // An impossible allocation through the hooks: a gdn::Error saying how much and how much is free.
  const std::string oom = error_of([] {
    OwnedTensor::empty(DType::F32, {int64_t{1} << 50}, Device::CUDA);  // 4 PiB
  });
  EXPECT_NE(oom.find("cudaMalloc of"), std::string::npos) << oom;
  EXPECT_NE(oom.find("cudaErrorMemoryAllocation"), std::string::npos) << oom;
  EXPECT_NE(oom.find("free of"), std::string::npos) << oom;
  // GDN_CUDA_CHECK names the call.
  const std::string bad = error_of([] {
    GDN_CUDA_CHECK(
        cudaMemcpyAsync(nullptr, nullptr, 16, static_cast<cudaMemcpyKind>(1234), cuda::stream()));
  });
  EXPECT_NE(bad.find("CUDA error cudaErrorInvalidMemcpyDirection"), std::string::npos) << bad;
  EXPECT_NE(bad.find("cudaMemcpyAsync(nullptr"), std::string::npos) << bad;
  // A bad launch configuration is caught by the launch check, naming the kernel.
  const std::string launch = error_of([] {
    add_one_kernel<<<1, 4096, 0, cuda::stream()>>>(nullptr, 0);  // > 1024 threads per block
    GDN_CUDA_LAUNCH_CHECK("add_one_kernel");
  });
  // The runtime reports this as cudaErrorInvalidConfiguration or (CUDA 13 on the H200, seen
  // 2026-11-29) cudaErrorInvalidValue; either way the message names the kernel and the error.
  EXPECT_NE(launch.find("kernel 'add_one_kernel' failed to launch: CUDA error cudaErrorInvalid"),
            std::string::npos)
      << launch;
  // None of the handled errors is reported again by the next, correct launch.
  OwnedTensor t = OwnedTensor::zeros(DType::F32, {256}, Device::CUDA);
  add_one_kernel<<<1, 256, 0, cuda::stream()>>>(t.ptr<float>(), 256);
  EXPECT_NO_THROW(GDN_CUDA_LAUNCH_CHECK("add_one_kernel"));
  for (double x : to_f64_vector(t)) ASSERT_EQ(x, 1.0);
}

}  // namespace
}  // namespace gdn
