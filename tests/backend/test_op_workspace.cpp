// Op workspace (issue 22, gdn/backend/op_workspace.h) on the host: the bounds check a bound
// region applies (a request larger than it is an error naming the op and both sizes), and each
// op's declared <op>_workspace_bytes against the requests its CUDA kernels can make, replayed with
// the kernels' grid formulas for every occupancy a device allows (1 .. max_blocks_per_sm) and
// monotone in the shapes. The GPU side (the requests the kernels actually make) is
// tests/ops/test_op_workspace_cuda.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "gdn/backend/op_workspace.h"
#include "gdn/core/error.h"
#include "ops/adamw/op.h"
#include "ops/causal_conv1d/op.h"
#include "ops/gated_rmsnorm/op.h"
#include "ops/gdn_gates/op.h"
#include "ops/rmsnorm/op.h"

namespace gdn {
namespace {

// H200: 132 multiprocessors, at most 32 resident blocks each; and a small device.
struct Device {
  int sms, max_blocks;
};
const Device kDevices[] = {{132, 32}, {8, 16}, {1, 1}};

TEST(OpWorkspace, CheckAcceptsRequestsWithinTheBoundRegion) {
  EXPECT_NO_THROW(check_op_workspace("rmsnorm", 0, 0));
  EXPECT_NO_THROW(check_op_workspace("rmsnorm", 4096, 4096));
  EXPECT_NO_THROW(check_op_workspace("rmsnorm", 1, 4096));
}

TEST(OpWorkspace, CheckRejectsALargerRequestNamingTheOpAndBothSizes) {
  try {
    check_op_workspace("gated_rmsnorm", 4097, 4096);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("gated_rmsnorm"), std::string::npos) << m;
    EXPECT_NE(m.find("4097"), std::string::npos) << m;
    EXPECT_NE(m.find("4096"), std::string::npos) << m;
  }
  EXPECT_THROW(check_op_workspace(nullptr, 1, 0), Error);  // unnamed: still an error
}

TEST(OpWorkspace, PersistentGridBound) {
  EXPECT_EQ(persistent_grid_bound(0, 132, 32), 0);
  EXPECT_EQ(persistent_grid_bound(-5, 132, 32), 0);
  EXPECT_EQ(persistent_grid_bound(100, 132, 32), 100);
  EXPECT_EQ(persistent_grid_bound(1 << 20, 132, 32), 132 * 32);
  EXPECT_EQ(persistent_grid_bound(1 << 20, 0, 0), 1);  // degenerate properties: one block
}

// rmsnorm / gated_rmsnorm: grid = min(ceil(R / rows_per_block), sm * max(occupancy, 1)).
template <typename Bytes, typename Bound>
void check_rowwise(Bytes partial, Bound bound) {
  for (const Device dev : kDevices) {
    size_t prev_r = 0;
    for (const int64_t R : {1, 2, 7, 64, 1000, 4096, 8192, 65536, 1 << 20}) {
      for (const int64_t D : {1, 64, 1024, 4096, 5120}) {
        const size_t b = bound(R, D, dev.sms, dev.max_blocks);
        for (int occ = 0; occ <= dev.max_blocks; ++occ) {
          for (const int rpb : {1, 2, 4, 8, 32}) {
            const int64_t grid =
                std::min<int64_t>((R + rpb - 1) / rpb, int64_t{dev.sms} * std::max(occ, 1));
            ASSERT_LE(partial(grid, D), b) << R << " " << D << " " << occ << " " << rpb;
          }
        }
        EXPECT_LE(bound(R, D, dev.sms, dev.max_blocks), bound(R, D + 1, dev.sms, dev.max_blocks));
      }
      const size_t cur = bound(R, 4096, dev.sms, dev.max_blocks);
      EXPECT_GE(cur, prev_r);
      prev_r = cur;
    }
  }
}

TEST(OpWorkspace, RmsNormBoundsEveryGrid) {
  check_rowwise(ops::rmsnorm_partial_bytes, ops::rmsnorm_workspace_bytes);
  EXPECT_EQ(ops::rmsnorm_workspace_bytes(0, 4096, 132, 32), 0u);
}

TEST(OpWorkspace, GatedRmsNormBoundsEveryGrid) {
  check_rowwise(ops::gated_rmsnorm_partial_bytes, ops::gated_rmsnorm_workspace_bytes);
}

TEST(OpWorkspace, GdnGatesIsExact) {
  EXPECT_EQ(ops::gdn_gates_workspace_bytes(0, 32), 0u);
  EXPECT_EQ(ops::gdn_gates_workspace_bytes(1, 32), 2u * 1 * 32 * 4);
  EXPECT_EQ(ops::gdn_gates_workspace_bytes(64, 32), 2u * 1 * 32 * 4);
  EXPECT_EQ(ops::gdn_gates_workspace_bytes(65, 32), 2u * 2 * 32 * 4);
  size_t prev = 0;
  for (int64_t T = 0; T < 5000; T += 37) {
    const size_t b = ops::gdn_gates_workspace_bytes(T, 48);
    EXPECT_GE(b, prev);
    prev = b;
  }
}

// causal_conv1d: cuda.cu takes G = clamp(resident / ceil(C / 128), 1, ceil(T / 64));
// cuda.sliding_window G = clamp(resident / ceil(C / 256), 1, min(useful, 65535)) with
// useful <= max(ceil(T / 64) / warps, 1) <= T; resident = sm * max(occupancy, 1).
TEST(OpWorkspace, CausalConv1dBoundsEveryGrid) {
  for (const Device dev : kDevices) {
    for (const int64_t T : {1, 5, 64, 65, 1000, 8192, 65536}) {
      for (const int64_t C : {1, 8, 128, 129, 256, 1000, 6144, 8192, 16384}) {
        for (const int64_t W : {2, 3, 4, 8}) {
          const size_t b = ops::causal_conv1d_workspace_bytes(T, W, C, dev.sms, dev.max_blocks);
          for (int occ = 0; occ <= dev.max_blocks; ++occ) {
            const int64_t resident = int64_t{dev.sms} * std::max(occ, 1);
            const int64_t g1 = std::clamp<int64_t>(resident / ((C + 127) / 128), 1, (T + 63) / 64);
            const int64_t segs = (T + 63) / 64;
            for (const int64_t warps : {1, 4, 8}) {
              const int64_t useful = std::max<int64_t>((segs + warps - 1) / warps, 1);
              const int64_t g2 = std::clamp<int64_t>(resident / ((C + 255) / 256), 1,
                                                     std::min<int64_t>(useful, 65535));
              ASSERT_LE(ops::causal_conv1d_partial_bytes(g2, W, C), b) << T << " " << C << " " << W;
            }
            ASSERT_LE(ops::causal_conv1d_partial_bytes(g1, W, C), b) << T << " " << C << " " << W;
          }
          EXPECT_LE(b, ops::causal_conv1d_workspace_bytes(T + 1, W, C, dev.sms, dev.max_blocks));
          EXPECT_LE(b, ops::causal_conv1d_workspace_bytes(T, W + 1, C, dev.sms, dev.max_blocks));
        }
      }
    }
  }
  EXPECT_EQ(ops::causal_conv1d_workspace_bytes(0, 4, 8192, 132, 32), 0u);
}

TEST(OpWorkspace, AdamWBoundsEveryRequest) {
  const std::vector<int64_t> none;
  EXPECT_EQ(ops::adamw_workspace_bytes(none), std::max(ops::kAdamWClipBytes, sizeof(double)));
  const std::vector<int64_t> numels = {1, 32768, 32769, 4096 * 4096, 0, 248320 * 1024};
  int64_t units = 0;
  for (const int64_t n : numels) units += ops::adamw_sumsq_units(n);
  EXPECT_EQ(units, 1 + 1 + 2 + 512 + 0 + 7760);
  const size_t b = ops::adamw_workspace_bytes(numels);
  EXPECT_GE(b, ops::kAdamWClipBytes);
  EXPECT_GE(b, ops::adamw_sumsq_bytes(units));
  // A subset of the gradients never needs more.
  const std::vector<int64_t> part(numels.begin(), numels.begin() + 3);
  EXPECT_LE(ops::adamw_workspace_bytes(part), b);
}

}  // namespace
}  // namespace gdn
