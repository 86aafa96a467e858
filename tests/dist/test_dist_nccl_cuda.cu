// The NCCL communicator at world size 1 on one GPU (label gpu): every collective moves the right
// bytes on the compute stream and on a caller's stream, for each dtype it maps to NCCL. The
// multi-GPU runs are issue 23's measurement part; on CPU the same interface is tested under mpirun.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

#include "dist/comm.h"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/cuda_context.h"

namespace gdn::dist {
namespace {

template <class T>
std::vector<T> round_trip(Comm& comm, const std::vector<T>& in, DType dtype, int which,
                          cudaStream_t stream) {
  const size_t bytes = in.size() * sizeof(T);
  void* d_in = nullptr;
  void* d_out = nullptr;
  GDN_CUDA_CHECK(cudaMalloc(&d_in, bytes + 1));
  GDN_CUDA_CHECK(cudaMalloc(&d_out, bytes + 1));
  GDN_CUDA_CHECK(cudaMemcpy(d_in, in.data(), bytes, cudaMemcpyHostToDevice));
  GDN_CUDA_CHECK(cudaMemset(d_out, 0, bytes));
  GDN_CUDA_CHECK(cudaDeviceSynchronize());
  const auto n = static_cast<int64_t>(in.size());
  switch (which) {
    case 0:
      comm.all_reduce(d_in, d_out, n, dtype, ReduceOp::Sum, stream);
      break;
    case 1:
      comm.all_reduce(d_in, d_out, n, dtype, ReduceOp::Avg, stream);
      break;
    case 2:
      comm.reduce_scatter(d_in, d_out, n, dtype, ReduceOp::Sum, stream);
      break;
    case 3:
      comm.all_gather(d_in, d_out, n, dtype, stream);
      break;
    default:
      GDN_CUDA_CHECK(cudaMemcpy(d_out, d_in, bytes, cudaMemcpyDeviceToDevice));
      comm.broadcast(d_out, n, dtype, 0, stream);
      break;
  }
  GDN_CUDA_CHECK(cudaStreamSynchronize(stream ? stream : cuda::stream()));
  std::vector<T> out(in.size());
  GDN_CUDA_CHECK(cudaMemcpy(out.data(), d_out, bytes, cudaMemcpyDeviceToHost));
  GDN_CUDA_CHECK(cudaFree(d_in));
  GDN_CUDA_CHECK(cudaFree(d_out));
  return out;
}

TEST(NcclComm, WorldOneCollectivesMoveTheRightBytes) {
  auto comm = make_comm(LaunchInfo{}, CommKind::Nccl, {.timeout_s = 60});
  ASSERT_EQ(comm->kind(), CommKind::Nccl);
  EXPECT_TRUE(comm->on_device());
  EXPECT_EQ(comm->size(), 1);
  cudaStream_t side = nullptr;
  GDN_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  std::vector<float> f(4099);
  std::vector<double> d(513);
  std::vector<uint16_t> b(1001);  // bf16 bit patterns of exactly representable values
  for (size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>(i % 97) * 0.25f - 7.f;
  for (size_t i = 0; i < d.size(); ++i) d[i] = static_cast<double>(i) * 1e-3 - 0.1;
  for (size_t i = 0; i < b.size(); ++i) b[i] = float_to_bf16_bits(static_cast<float>(i % 50) - 25);
  for (cudaStream_t s : {static_cast<cudaStream_t>(nullptr), side}) {
    for (int which = 0; which < 5; ++which) {
      EXPECT_EQ(round_trip(*comm, f, DType::F32, which, s), f) << which;
      EXPECT_EQ(round_trip(*comm, d, DType::F64, which, s), d) << which;
      EXPECT_EQ(round_trip(*comm, b, DType::BF16, which, s), b) << which;
    }
  }
  comm->barrier();
  GDN_CUDA_CHECK(cudaStreamDestroy(side));
}

}  // namespace
}  // namespace gdn::dist
