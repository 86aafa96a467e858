// Split masters of AdamW (op.h; gdn/core/split_f32.h) checked on one device, shared by the cpu
// test (test_adamw.cpp) and the cuda one (test_adamw_cuda.cpp): a step over (bf16 high half, I16
// low half) masters must leave the joined halves bit for bit equal to the fp32 master that the
// F32 path updates from the same values in the same call (at the same alignment), and the high half
// equal to split_hi of it (also at exact ties), over several steps, with decay on and off,
// clipping, sizes around the 4-element groups and the 4096-element units, and (cuda) halves that
// are not 8-byte aligned; and refresh_bf16 with a low half writes both halves of the split.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "gdn/core/rng.h"
#include "gdn/core/split_f32.h"
#include "ops/adamw/op.h"

namespace gdn::ops::testing_adamw {

// Host bits of a tensor on any device.
template <class T>
std::vector<T> host_bits(const Tensor& t) {
  std::vector<T> out(static_cast<size_t>(t.numel()));
  copy_bytes(out.data(), Device::CPU, t.data(), t.device(), out.size() * sizeof(T));
  return out;
}

// A device tensor of `dt` holding the given raw 16- or 32-bit patterns.
template <class T>
OwnedTensor from_bits(const std::vector<T>& bits, DType dt, Device device) {
  OwnedTensor t = OwnedTensor::empty(dt, {static_cast<int64_t>(bits.size())}, device);
  copy_bytes(t.view().data(), device, bits.data(), Device::CPU, bits.size() * sizeof(T));
  return t;
}

// `place` may move a tensor to an unaligned copy (cuda) and returns the view to use.
template <class Place>
void check_split_master_steps(Device device, Place place) {
  const std::vector<int64_t> sizes = {1, 3, 4, 4097, 70001, 8};
  struct Entry {
    OwnedTensor p, g, m, v, pb;       // the F32 path (pb: its fused bf16 copy)
    OwnedTensor h, l, sm, sv;         // the split path's halves and its own moments
    Tensor hi, lo, sm_v, sv_v;        // its halves and moments, as passed (maybe unaligned)
    Tensor p_v, g_v, m_v, v_v, pb_v;  // the F32 path's tensors, as passed (same alignment)
  };
  std::vector<Entry> es(sizes.size());
  std::vector<AdamWParam> params;
  for (size_t k = 0; k < sizes.size(); ++k) {
    const int64_t n = sizes[k];
    std::vector<float> p(static_cast<size_t>(n));
    std::vector<float> g(p.size()), z(p.size(), 0.f);
    std::vector<uint16_t> hi(p.size());
    std::vector<int16_t> lo(p.size());
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] = static_cast<float>(rng::normal(60 + k, 1, i));
      // Every 7th master an exact bf16 tie (ties-away differs from ties-to-even there).
      if (i % 7 == 3) {
        uint32_t b;
        std::memcpy(&b, &p[i], 4);
        b = (b & 0xffff0000u) | 0x8000u;
        std::memcpy(&p[i], &b, 4);
      }
      g[i] = static_cast<float>(0.5 * rng::normal(70 + k, 1, i));
      uint32_t b;
      std::memcpy(&b, &p[i], 4);
      hi[i] = split_hi(b);
      lo[i] = split_lo(b, hi[i]);
    }
    Entry& e = es[k];
    e.p = from_bits(p, DType::F32, device);
    e.g = from_bits(g, DType::F32, device);
    e.m = from_bits(z, DType::F32, device);
    e.v = from_bits(z, DType::F32, device);
    e.pb = from_bits(std::vector<uint16_t>(p.size(), 0), DType::BF16, device);
    e.sm = from_bits(z, DType::F32, device);
    e.sv = from_bits(z, DType::F32, device);
    e.h = from_bits(hi, DType::BF16, device);
    e.l = from_bits(lo, DType::I16, device);
    const bool odd = k % 2 == 1;
    e.hi = place(e.h, odd);
    e.lo = place(e.l, odd);
    e.sm_v = place(e.sm, odd);
    e.sv_v = place(e.sv, odd);
    const bool decay = k != 1;
    // Both twins of a tensor in the same alignment class: cuda's 16-byte and per-element paths
    // may contract the fp32 multiply-adds differently (a last-bit difference between an aligned
    // and an unaligned tensor, F32 or split alike, seen on the H200), so like is compared with
    // like.
    e.p_v = place(e.p, odd);
    e.g_v = place(e.g, odd);
    e.m_v = place(e.m, odd);
    e.v_v = place(e.v, odd);
    e.pb_v = place(e.pb, odd);
    params.push_back({e.p_v, e.g_v, e.m_v, e.v_v, e.pb_v, decay, {}});
    params.push_back({e.lo, e.g_v, e.sm_v, e.sv_v, e.hi, decay, {}});
  }
  // Step 1 has lr = 0, which leaves every master unchanged (p * 1 - 0): the exact ties placed
  // above are still ties, where the split's high half must round away from zero and so differ
  // from the fused copy's ties-to-even in about half of them.
  for (int64_t t = 1; t <= 3; ++t) {
    const AdamWHyper h{t == 1 ? 0.0 : 0.05, 0.9, 0.95, 1e-8, 0.1, t, t == 2 ? 0.3 : 1.0};
    adamw_step(params, h);
    for (size_t k = 0; k < es.size(); ++k) {
      const std::vector<uint32_t> want = host_bits<uint32_t>(es[k].p_v);
      const std::vector<uint16_t> hi = host_bits<uint16_t>(es[k].hi),
                                  fused = host_bits<uint16_t>(es[k].pb_v);
      const std::vector<int16_t> lo = host_bits<int16_t>(es[k].lo);
      int bad = 0, ties = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        if (split_join(hi[i], lo[i]) != want[i] || hi[i] != split_hi(want[i])) ++bad;
        if (hi[i] != fused[i]) ++ties;  // round to nearest even differs only at exact ties
        if (hi[i] != fused[i] && (want[i] & 0xffffu) != 0x8000u) ++bad;
      }
      EXPECT_EQ(bad, 0) << "tensor " << k << " (" << sizes[k] << " elements), step " << t;
      EXPECT_LE(ties, static_cast<int>(want.size() / 7 + 1)) << k;
      if (t == 1 && want.size() > 1000) {
        EXPECT_GT(ties, 0) << k;
      }
      EXPECT_EQ(host_bits<uint32_t>(es[k].m_v), host_bits<uint32_t>(es[k].sm_v)) << k;
      EXPECT_EQ(host_bits<uint32_t>(es[k].v_v), host_bits<uint32_t>(es[k].sv_v)) << k;
    }
  }
}

// refresh_bf16 with lo: copy = split_hi, lo = split_lo of every master (specials included).
inline void check_split_refresh(Device device) {
  std::vector<uint32_t> bits = {0x3f808000u, 0xbf808000u, 0x3f818000u, 0x7f800000u, 0xff800000u,
                                0x7f7fffffu, 0x00000000u, 0x80000000u, 0x00008000u, 0x3f80ffffu};
  for (uint32_t i = 0; i < 5000; ++i) bits.push_back(i * 2654435761u);
  OwnedTensor master = from_bits(bits, DType::F32, device);
  OwnedTensor hi = from_bits(std::vector<uint16_t>(bits.size(), 0), DType::BF16, device);
  OwnedTensor lo = from_bits(std::vector<int16_t>(bits.size(), 0), DType::I16, device);
  const Bf16Copy cs[] = {{master, hi, lo}};
  adamw_refresh_bf16(cs);
  const std::vector<uint16_t> h = host_bits<uint16_t>(hi);
  const std::vector<int16_t> l = host_bits<int16_t>(lo);
  int bad = 0;
  for (size_t i = 0; i < bits.size(); ++i)
    if (h[i] != split_hi(bits[i]) || split_join(h[i], l[i]) != bits[i]) ++bad;
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(h[0], 0x3f81);  // 1 + 2^-8: a tie, away from zero (ties to even would give 0x3f80)
  EXPECT_EQ(h[1], 0xbf81);
  EXPECT_EQ(h[3], 0x7f80);  // inf stays inf
  EXPECT_EQ(h[5], 0x7f80);  // the largest float rounds to inf; the low half keeps it exact
}

}  // namespace gdn::ops::testing_adamw
