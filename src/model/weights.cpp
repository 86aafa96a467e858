// Parameter specs, the fp32 parameter store, parameter ids per layer and HF initialisation
// (weights.h; HF safetensors in and out: hf_checkpoint.cpp).
#include "model/weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <type_traits>

#include "gdn/core/error.h"
#include "gdn/core/rng.h"

namespace gdn::model {

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::vector<ParamSpec> param_specs(const Qwen35Config& c) {
  validate(c);
  const int64_t D = c.hidden_size, V = c.vocab_size, I = c.intermediate_size;
  const int64_t Hv = c.linear_num_value_heads, dv = c.linear_value_head_dim;
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
  std::vector<ParamSpec> s;
  auto add = [&](std::string name, std::vector<int64_t> shape, InitKind init) {
    s.push_back(ParamSpec{std::move(name), std::move(shape), init});
  };
  add("model.embed_tokens.weight", {V, D}, InitKind::Embedding);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string L = fmt::format("model.layers.{}.", i);
    add(L + "input_layernorm.weight", {D}, InitKind::Zeros);
    if (c.is_full_attention(i)) {
      add(L + "self_attn.q_proj.weight", {c.q_proj_rows(), D}, InitKind::Normal);
      add(L + "self_attn.k_proj.weight", {Hkv * hd, D}, InitKind::Normal);
      add(L + "self_attn.v_proj.weight", {Hkv * hd, D}, InitKind::Normal);
      add(L + "self_attn.o_proj.weight", {D, Hq * hd}, InitKind::Normal);
      add(L + "self_attn.q_norm.weight", {hd}, InitKind::Zeros);
      add(L + "self_attn.k_norm.weight", {hd}, InitKind::Zeros);
    } else {
      add(L + "linear_attn.in_proj_qkv.weight", {c.conv_dim(), D}, InitKind::Normal);
      add(L + "linear_attn.in_proj_z.weight", {c.value_dim(), D}, InitKind::Normal);
      add(L + "linear_attn.in_proj_b.weight", {Hv, D}, InitKind::Normal);
      add(L + "linear_attn.in_proj_a.weight", {Hv, D}, InitKind::Normal);
      add(L + "linear_attn.conv1d.weight", {c.conv_dim(), 1, c.linear_conv_kernel_dim},
          InitKind::Normal);
      add(L + "linear_attn.dt_bias", {Hv}, InitKind::Ones);
      add(L + "linear_attn.A_log", {Hv}, InitKind::ALog);
      add(L + "linear_attn.norm.weight", {dv}, InitKind::Ones);
      add(L + "linear_attn.out_proj.weight", {D, c.value_dim()}, InitKind::Normal);
    }
    add(L + "post_attention_layernorm.weight", {D}, InitKind::Zeros);
    add(L + "mlp.gate_proj.weight", {I, D}, InitKind::Normal);
    add(L + "mlp.up_proj.weight", {I, D}, InitKind::Normal);
    add(L + "mlp.down_proj.weight", {D, I}, InitKind::Normal);
  }
  add("model.norm.weight", {D}, InitKind::Zeros);
  if (!c.tie_word_embeddings) add("lm_head.weight", {V, D}, InitKind::Normal);
  return s;
}

// --- ParamStore --------------------------------------------------------------------------------

namespace {
constexpr int64_t kAlignFloats = 16;  // 64 bytes
int64_t align_up(int64_t n) { return (n + kAlignFloats - 1) / kAlignFloats * kAlignFloats; }
}  // namespace

ParamStore::ParamStore(std::vector<ParamSpec> specs) : specs_(std::move(specs)) {
  int64_t off = 0;
  for (size_t i = 0; i < specs_.size(); ++i) {
    const ParamSpec& s = specs_[i];
    for (int64_t d : s.shape) {
      GDN_CHECK(d >= 0, "ParamStore: parameter '{}' has a negative dimension", s.name);
    }
    GDN_CHECK(index_.emplace(s.name, i).second, "ParamStore: parameter '{}' given twice", s.name);
    off = align_up(off);
    offsets_.push_back(off);
    off += s.numel();
    numel_ += s.numel();
  }
  flat_numel_ = std::max<int64_t>(align_up(off), kAlignFloats);
  const size_t bytes = static_cast<size_t>(flat_numel_) * sizeof(float);
  arena_ = Arena("parameters", Device::CPU, bytes);
  base_ = static_cast<float*>(arena_.alloc(bytes, 64));
  std::memset(base_, 0, bytes);
}

ParamStore::ParamStore(ParamStore&& o) noexcept { *this = std::move(o); }

ParamStore& ParamStore::operator=(ParamStore&& o) noexcept {
  if (this != &o) {
    specs_ = std::move(o.specs_);
    offsets_ = std::move(o.offsets_);
    index_ = std::move(o.index_);
    arena_ = std::move(o.arena_);
    base_ = std::exchange(o.base_, nullptr);
    flat_numel_ = std::exchange(o.flat_numel_, 0);
    numel_ = std::exchange(o.numel_, 0);
  }
  return *this;
}

Tensor ParamStore::tensor(size_t i) const {
  GDN_CHECK(i < specs_.size(), "ParamStore: index {} out of range ({} parameters)", i,
            specs_.size());
  return Tensor(base_ + offsets_[i], DType::F32, specs_[i].shape);
}

std::optional<size_t> ParamStore::find(std::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) return std::nullopt;
  return it->second;
}

size_t ParamStore::index(std::string_view name) const {
  auto i = find(name);
  GDN_CHECK(i.has_value(), "ParamStore: no parameter named '{}' ({} parameters)", name,
            specs_.size());
  return *i;
}

namespace {
// The layer walk of the parameter names, with `id` mapping a name to its index.
ModelParamIds param_ids_by(const std::function<int64_t(const std::string&)>& id,
                           const Qwen35Config& c) {
  ModelParamIds m;
  m.embed = id("model.embed_tokens.weight");
  m.final_norm = id("model.norm.weight");
  m.lm_head = c.tie_word_embeddings ? -1 : id("lm_head.weight");
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string L = fmt::format("model.layers.{}.", i);
    LayerParamIds l;
    l.type = c.layer_types[static_cast<size_t>(i)];
    l.input_norm = id(L + "input_layernorm.weight");
    l.post_norm = id(L + "post_attention_layernorm.weight");
    l.mlp_gate = id(L + "mlp.gate_proj.weight");
    l.mlp_up = id(L + "mlp.up_proj.weight");
    l.mlp_down = id(L + "mlp.down_proj.weight");
    if (l.type == LayerType::Full) {
      l.q_proj = id(L + "self_attn.q_proj.weight");
      l.k_proj = id(L + "self_attn.k_proj.weight");
      l.v_proj = id(L + "self_attn.v_proj.weight");
      l.o_proj = id(L + "self_attn.o_proj.weight");
      l.q_norm = id(L + "self_attn.q_norm.weight");
      l.k_norm = id(L + "self_attn.k_norm.weight");
    } else {
      l.in_proj_qkv = id(L + "linear_attn.in_proj_qkv.weight");
      l.in_proj_z = id(L + "linear_attn.in_proj_z.weight");
      l.in_proj_b = id(L + "linear_attn.in_proj_b.weight");
      l.in_proj_a = id(L + "linear_attn.in_proj_a.weight");
      l.conv1d = id(L + "linear_attn.conv1d.weight");
      l.dt_bias = id(L + "linear_attn.dt_bias");
      l.a_log = id(L + "linear_attn.A_log");
      l.gated_norm = id(L + "linear_attn.norm.weight");
      l.out_proj = id(L + "linear_attn.out_proj.weight");
    }
    m.layers.push_back(l);
  }
  return m;
}
}  // namespace

ModelParamIds param_ids(const ParamStore& store, const Qwen35Config& c) {
  return param_ids_by([&](const std::string& n) { return static_cast<int64_t>(store.index(n)); },
                      c);
}

ModelParamIds param_ids(std::span<const ParamSpec> specs, const Qwen35Config& c) {
  std::map<std::string, int64_t, std::less<>> index;
  for (size_t i = 0; i < specs.size(); ++i) index[specs[i].name] = static_cast<int64_t>(i);
  return param_ids_by(
      [&](const std::string& n) {
        auto it = index.find(n);
        GDN_CHECK(it != index.end(), "parameter '{}' is missing from the specs", n);
        return it->second;
      },
      c);
}

// --- initialisation ----------------------------------------------------------------------------

namespace {
// Every value is a pure function of (seed, name, index), so the loop parallelises without
// changing a single bit (a 9B model is 9e9 Philox draws: minutes on one core).
template <class T, class F>
void fill_typed(T* p, int64_t n, F value) {
#pragma omp parallel for schedule(static) if (n > (int64_t{1} << 16))
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, bf16>) {
      p[i] = to_bf16(static_cast<float>(value(i)));
    } else if constexpr (std::is_same_v<T, f16>) {
      p[i] = to_f16(static_cast<float>(value(i)));
    } else {
      p[i] = static_cast<T>(value(i));
    }
  }
}

template <class F>
void fill_with(const Tensor& t, F value) {
  GDN_CHECK(t.device() == Device::CPU && t.is_contiguous(),
            "init: tensor {} must be contiguous host memory", t.describe());
  const int64_t n = t.numel();
  switch (t.dtype()) {
    case DType::F64:
      fill_typed(t.ptr<double>(), n, value);
      break;
    case DType::F32:
      fill_typed(t.ptr<float>(), n, value);
      break;
    case DType::BF16:
      fill_typed(t.ptr<bf16>(), n, value);
      break;
    case DType::F16:
      fill_typed(t.ptr<f16>(), n, value);
      break;
    default:
      GDN_FAIL("init: tensor {} is not a float tensor", t.describe());
  }
}
}  // namespace

void init_param(const ParamSpec& spec, const Tensor& t, const Qwen35Config& c, uint64_t seed) {
  GDN_CHECK(t.shape_vec() == spec.shape, "init: tensor for '{}' has shape {}, expected {}",
            spec.name, t.shape_str(), fmt::format("[{}]", fmt::join(spec.shape, ", ")));
  const uint64_t stream = rng::stream_id(spec.name);
  const double std = c.initializer_range;
  if (t.device() == Device::CUDA) {
    // On the device (fp32 master weights initialised where they live): the same draws.
    GDN_CHECK(t.dtype() == DType::F32 && t.is_contiguous(),
              "init: device tensor for '{}' must be contiguous F32, got {}", spec.name,
              t.describe());
    const auto& h = rng::device_fill_hooks();
    float* p = t.ptr<float>();
    const int64_t n = t.numel();
    switch (spec.init) {
      case InitKind::Normal:
      case InitKind::Embedding:
        h.normal(p, n, seed, stream, std);
        if (spec.init == InitKind::Embedding && c.pad_token_id) {
          const int64_t D = spec.shape.at(1);
          zero_bytes(p + *c.pad_token_id * D, Device::CUDA, static_cast<size_t>(D) * 4);
        }
        break;
      case InitKind::Zeros:
        h.constant(p, n, 0.0f);
        break;
      case InitKind::Ones:
        h.constant(p, n, 1.0f);
        break;
      case InitKind::ALog:
        h.log_uniform(p, n, seed, stream, 0.01, 16.0);
        break;
    }
    return;
  }
  switch (spec.init) {
    case InitKind::Normal:
    case InitKind::Embedding:
      fill_with(t, [&](int64_t i) {
        return std * static_cast<double>(rng::normal(seed, stream, static_cast<uint64_t>(i)));
      });
      if (spec.init == InitKind::Embedding && c.pad_token_id) {
        const int64_t D = spec.shape.at(1);
        const int64_t es = dtype_size(t.dtype());
        std::memset(static_cast<char*>(t.data()) + *c.pad_token_id * D * es, 0,
                    static_cast<size_t>(D * es));
      }
      break;
    case InitKind::Zeros:
      fill_with(t, [](int64_t) { return 0.0; });
      break;
    case InitKind::Ones:
      fill_with(t, [](int64_t) { return 1.0; });
      break;
    case InitKind::ALog:
      fill_with(t, [&](int64_t i) {
        double u = rng::uniform(seed, stream, static_cast<uint64_t>(i));
        return std::log(0.01 + (16.0 - 0.01) * u);
      });
      break;
  }
}

void init_params(ParamStore& store, const Qwen35Config& c, uint64_t seed) {
  for (size_t i = 0; i < store.size(); ++i) init_param(store.spec(i), store.tensor(i), c, seed);
}

}  // namespace gdn::model
