// Linear cross-entropy: the cuda path's chunk plan (host code, so it runs in CPU CI): it always
// fits in the contract's workspace formula (one caller-sized workspace serves every backend), the
// modes and row counts the GPU tests and the benchmark rely on, the H200 shape within 1.5 GiB,
// and the error for a budget that cannot hold one row.
#include <string>

#include "ops/linear_cross_entropy/op.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

TEST(LinearCrossEntropyCudaPlan, FitsInTheContractWorkspaceFormula) {
  for (int64_t v : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{248320}, int64_t{1} << 26})
    for (int64_t n : {int64_t{1}, int64_t{3}, int64_t{31}, int64_t{37}, int64_t{8192}})
      for (int64_t d : {int64_t{1}, int64_t{24}, int64_t{4096}})
        for (int64_t b : {kLceMinChunkBytes, int64_t{50000}, int64_t{1} << 20, int64_t{268435456},
                          int64_t{1610612736}}) {
          const std::string what = "N " + std::to_string(n) + " V " + std::to_string(v) + " D " +
                                   std::to_string(d) + " B " + std::to_string(b);
          LceChunkPlan p;
          try {
            p = linear_cross_entropy_cuda_plan(n, v, d, b);
          } catch (const Error& e) {
            // Only a budget that cannot hold one row of either layout may be refused.
            EXPECT_NE(std::string(e.what()).find("cannot hold one row of the slab layout"),
                      std::string::npos)
                << what << ": " << e.what();
            EXPECT_GT(lce_cuda_layout_bytes(1, (v + 7) / 8 * 8, d, false),
                      linear_cross_entropy_workspace_bytes(n, v, b))
                << what;
            continue;
          }
          const int64_t ld = (p.cols + 7) / 8 * 8;
          EXPECT_LE(p.workspace_bytes, linear_cross_entropy_workspace_bytes(n, v, b)) << what;
          EXPECT_EQ(p.workspace_bytes, lce_cuda_layout_bytes(p.rows, ld, d, p.cols < v)) << what;
          EXPECT_EQ(p.workspace_bytes % 16, 0) << what;
          EXPECT_GE(p.rows, 1) << what;
          EXPECT_LE(p.rows, n) << what;
          EXPECT_GE(p.cols, 1) << what;
          EXPECT_LE(p.cols, v) << what;
          if (p.cols < v) {
            EXPECT_LE(p.rows, kLceMinRows) << what;
            EXPECT_EQ(p.cols % 8, 0) << what;  // slabs start 16-byte aligned in w
          }
        }
}

TEST(LinearCrossEntropyCudaPlan, PlansOfTheGpuTestsAreTheIntendedOnes) {
  struct Case {
    int64_t n, v, d, b, rows, cols;
  };
  const Case cases[] = {
      {37, 1000, 24, 268435456, 37, 1000},  // full-V, one block
      {37, 1000, 24, 66000, 32, 1000},      // full-V, 32 + 5 rows
      {37, 1000, 24, 50000, 32, 712},       // slabs 712 + 288
      {37, 1000, 24, 20000, 32, 240},       // slabs 4 x 240 + 40
      {37, 1000, 24, 4096, 28, 8},          // the minimum budget: 28 + 9 rows, 125 slabs of 8
      {37, 301, 24, 4096, 28, 8},           // the probe's slab pass: 37 slabs of 8 + one of 5
      {40, 50000, 64, 1 << 20, 32, 16232},  // V = 50000 in slabs 3 x 16232 + 1304
      {40, 50000, 64, 268435456, 40, 50000},
      {3, 1, 33, 4096, 2, 1},           // V = 1: no slab row fits, full-V rows of 2
      {37, 1000, 1024, 4096, 1, 1000},  // wide D: full-V rows of one beat no slab at all
  };
  for (const Case& c : cases) {
    const auto p = linear_cross_entropy_cuda_plan(c.n, c.v, c.d, c.b);
    EXPECT_EQ(p.rows, c.rows) << "N " << c.n << " V " << c.v << " D " << c.d << " B " << c.b;
    EXPECT_EQ(p.cols, c.cols) << "N " << c.n << " V " << c.v << " D " << c.d << " B " << c.b;
  }
}

TEST(LinearCrossEntropyCudaPlan, QwenShapeFitsIn1p5GiB) {
  // N = 8192, D = 4096, V = 248320 at B = 1.5 GiB: three full-V blocks of 3072, 3072, 2048 rows
  // (3242 fit; 3072 keeps three blocks and whole waves of the dx GEMM); the layout itself is
  // 1.42 GiB, the contract's workspace 1.4996 GiB.
  const int64_t b = int64_t{3} << 29;
  const auto p = linear_cross_entropy_cuda_plan(8192, 248320, 4096, b);
  EXPECT_EQ(p.cols, 248320);
  EXPECT_EQ(p.rows, 3072);
  EXPECT_LE(linear_cross_entropy_workspace_bytes(8192, 248320, b), b);
  EXPECT_EQ(p.workspace_bytes, 2 * 3072 * int64_t{248320} + 32 * 3072 + 64);
  // The knob's default budget (256 MiB): blocks of 512 rows (540 fit), 16 of them.
  EXPECT_EQ(linear_cross_entropy_cuda_plan(8192, 248320, 4096, 268435456).rows, 512);
  // The cpu plan at the same budget has 1621 rows: the bf16 tile doubles the rows.
  EXPECT_EQ(linear_cross_entropy_plan(8192, 248320, b).rows, 1621);
}

TEST(LinearCrossEntropyCudaPlan, TooSmallABudgetIsAClearError) {
  try {
    linear_cross_entropy_cuda_plan(8192, 248320, 4096, kLceMinChunkBytes);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "linear_cross_entropy (cuda): a logits budget of 4096 bytes (workspace 4096 "
                  "bytes) cannot hold one row of the slab layout at D = 4096: it needs a "
                  "workspace of at least 16496 bytes"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(linear_cross_entropy_cuda_plan(0, 10, 4, 4096).workspace_bytes, 0);
}

}  // namespace
}  // namespace gdn::ops
