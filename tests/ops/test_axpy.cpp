// axpy: cpu vs ref, accumulation semantics, bad input.
#include "ops/axpy/op.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

TEST(Axpy, CpuMatchesRefAndAccumulates) {
  for (int64_t n : {1, 7, 100000}) {
    auto x = testing::randn({n}, 1);
    auto y = testing::randn({n}, 2);
    auto x32 = convert(x, DType::F32), y32 = convert(y, DType::F32);
    auto y64 = testing::rounded(y, DType::F32);
    auto x64 = testing::rounded(x, DType::F32);
    axpy({x64, y64, 0.5});
    axpy({x32, y32, 0.5});
    testing::expect_close(y32, y64, 1e-7, "y");
    auto yv = to_f64_vector(y64), xv = to_f64_vector(x64),
         y0 = to_f64_vector(testing::rounded(y, DType::F32));
    for (size_t i = 0; i < yv.size(); i += 997) EXPECT_DOUBLE_EQ(yv[i], y0[i] + 0.5 * xv[i]);
  }
}

TEST(Axpy, BadInputNamesTheTensor) {
  auto x = OwnedTensor::zeros(DType::F32, {4});
  auto y = OwnedTensor::zeros(DType::F32, {5});
  try {
    axpy({x, y, 1.0});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("axpy: tensor 'x' has 4 elements but 'y' has 5"),
              std::string::npos);
  }
  auto y64 = OwnedTensor::zeros(DType::F64, {4});
  EXPECT_THROW(axpy({x, y64, 1.0}), Error);
}

}  // namespace
}  // namespace gdn::ops
