// Element types and the host-side bf16 / f16 conversions.
// bf16 conversion rounds to nearest, ties to even (what PyTorch and CUDA's __float2bfloat16 do);
// NaN stays NaN (quiet), +-inf stays inf.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace gdn {

enum class DType : uint8_t { F64, F32, BF16, F16, I32, I64, I16 };

constexpr int64_t dtype_size(DType t) {
  switch (t) {
    case DType::F64:
      return 8;
    case DType::F32:
      return 4;
    case DType::BF16:
      return 2;
    case DType::F16:
      return 2;
    case DType::I32:
      return 4;
    case DType::I64:
      return 8;
    case DType::I16:
      return 2;
  }
  return 0;
}

constexpr bool dtype_is_float(DType t) {
  return t == DType::F64 || t == DType::F32 || t == DType::BF16 || t == DType::F16;
}

// Names as in safetensors headers ("F32", "BF16", ...).
std::string_view dtype_name(DType t);
// Parses a safetensors dtype name; throws gdn::Error naming the unknown string.
DType dtype_from_name(std::string_view name);
bool dtype_try_from_name(std::string_view name, DType* out);

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Host bf16 storage type (bit pattern only; arithmetic happens in float).
struct bf16 {
  uint16_t bits = 0;
};
struct f16 {
  uint16_t bits = 0;
};

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN: keep sign, force quiet bit
  }
  // Round to nearest even: add 0x7fff plus the lowest kept bit, then truncate.
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_bits_to_float(uint16_t b) {
  return f32_from_bits(static_cast<uint32_t>(b) << 16);
}
inline bf16 to_bf16(float f) { return bf16{float_to_bf16_bits(f)}; }
inline float to_float(bf16 b) { return bf16_bits_to_float(b.bits); }
// Rounds a float through bf16 and back (what storing an activation in bf16 does to it).
inline float round_bf16(float f) { return bf16_bits_to_float(float_to_bf16_bits(f)); }

// IEEE binary16, round to nearest even, with subnormals.
uint16_t float_to_f16_bits(float f);
float f16_bits_to_float(uint16_t h);
inline f16 to_f16(float f) { return f16{float_to_f16_bits(f)}; }
inline float to_float(f16 h) { return f16_bits_to_float(h.bits); }

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<double>() {
  return DType::F64;
}
template <>
constexpr DType dtype_of<float>() {
  return DType::F32;
}
template <>
constexpr DType dtype_of<bf16>() {
  return DType::BF16;
}
template <>
constexpr DType dtype_of<f16>() {
  return DType::F16;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::I32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::I64;
}
template <>
constexpr DType dtype_of<int16_t>() {
  return DType::I16;
}

}  // namespace gdn
