#include "gdn/core/rng.h"

#include <cmath>

#include "gdn/core/error.h"
#include "gdn/core/philox.h"

namespace gdn::rng {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  const detail::Philox4 r =
      detail::philox4x32_10(detail::Philox4{{c[0], c[1], c[2], c[3]}}, k[0], k[1]);
  return {r.v[0], r.v[1], r.v[2], r.v[3]};
}

uint64_t stream_id(std::string_view name) {
  uint64_t h = 1469598103934665603ull;
  for (char ch : name) {
    h ^= static_cast<unsigned char>(ch);
    h *= 1099511628211ull;
  }
  return h;
}

namespace {
std::array<uint32_t, 4> draw(uint64_t seed, uint64_t stream, uint64_t index) {
  const detail::Philox4 r = detail::draw(seed, stream, index);
  return {r.v[0], r.v[1], r.v[2], r.v[3]};
}
}  // namespace

uint32_t bits(uint64_t seed, uint64_t stream, uint64_t index) {
  return draw(seed, stream, index)[0];
}

float uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  return static_cast<float>(draw(seed, stream, index)[0] >> 8) * (1.0f / 16777216.0f);
}

float normal(uint64_t seed, uint64_t stream, uint64_t index) {
  auto r = draw(seed, stream, index);
  // u1 in (0, 1] so that log(u1) is finite.
  double u1 = (static_cast<double>(r[0] >> 8) + 1.0) * (1.0 / 16777216.0);
  double u2 = static_cast<double>(r[1] >> 8) * (1.0 / 16777216.0);
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

namespace {
template <class F>
void fill(const Tensor& t, F value) {
  GDN_CHECK(t.device() == Device::CPU, "rng fill: tensor {} must be on the host", t.describe());
  GDN_CHECK(t.is_contiguous(), "rng fill: tensor {} must be contiguous", t.describe());
  int64_t n = t.numel();
  switch (t.dtype()) {
    case DType::F64:
      for (int64_t i = 0; i < n; ++i) t.ptr<double>()[i] = value(i);
      break;
    case DType::F32:
      for (int64_t i = 0; i < n; ++i) t.ptr<float>()[i] = static_cast<float>(value(i));
      break;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) t.ptr<bf16>()[i] = to_bf16(static_cast<float>(value(i)));
      break;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) t.ptr<f16>()[i] = to_f16(static_cast<float>(value(i)));
      break;
    default:
      GDN_FAIL("rng fill: tensor {} is not a float tensor", t.describe());
  }
}
}  // namespace

void fill_uniform(const Tensor& t, uint64_t seed, uint64_t stream, double lo, double hi) {
  fill(t,
       [&](int64_t i) { return lo + (hi - lo) * uniform(seed, stream, static_cast<uint64_t>(i)); });
}

void fill_normal(const Tensor& t, uint64_t seed, uint64_t stream, double mean, double std) {
  fill(t, [&](int64_t i) { return mean + std * normal(seed, stream, static_cast<uint64_t>(i)); });
}

namespace {
DeviceFillHooks g_fill_hooks;
}  // namespace

void set_device_fill_hooks(const DeviceFillHooks& hooks) { g_fill_hooks = hooks; }

const DeviceFillHooks& device_fill_hooks() {
  GDN_CHECK(g_fill_hooks.normal != nullptr,
            "device initialisation needs the CUDA runtime and a GPU (none is available)");
  return g_fill_hooks;
}

}  // namespace gdn::rng
