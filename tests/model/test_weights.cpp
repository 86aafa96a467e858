// Qwen3.5 weights: HF names and shapes, the single-allocation parameter store, HF-rule init from
// the counter RNG, and safetensors save/load (F32/BF16, both prefixes, sharded, untouched raw
// tensors, errors listing missing/unexpected/mis-shaped names).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "gdn/core/error.h"
#include "gdn/core/rng.h"
#include "gdn/core/safetensors.h"
#include "model/weights.h"
#include "support/error_of.h"

namespace gdn::model {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ::testing::HasSubstr;

fs::path temp_dir(const std::string& tag) {
  auto d =
      fs::temp_directory_path() / ("gdn_test_weights_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

Qwen35Config untied_tiny() {
  Qwen35Config c = tiny_config();
  c.tie_word_embeddings = false;
  return c;
}

std::vector<float> values(const Tensor& t) {
  const float* p = t.ptr<float>();
  return std::vector<float>(p, p + t.numel());
}

using gdn::testing::error_of;

// Writes the store's tensors under `prefix` (F32) with edits: names in `drop` left out, `extra`
// tensors added. For building deliberately wrong checkpoints.
void write_custom(const fs::path& file, const ParamStore& s, WeightPrefix prefix,
                  const std::vector<std::string>& drop, std::vector<NamedTensor> extra) {
  std::vector<NamedTensor> t;
  for (size_t i = 0; i < s.size(); ++i) {
    std::string n = hf_name(s.spec(i).name, prefix);
    if (std::find(drop.begin(), drop.end(), n) != drop.end()) continue;
    NamedTensor nt;
    nt.name = n;
    nt.tensor = s.tensor(i);
    t.push_back(nt);
  }
  for (auto& e : extra) t.push_back(std::move(e));
  write_safetensors(file.string(), t, {{"format", "pt"}});
}

TEST(Weights, SpecNamesAndShapesFollowTheHfStateDict) {
  // The 9B worked example of gdn_spec.md §1.8.
  Qwen35Config c = tiny_config();
  c.vocab_size = 248320;
  c.hidden_size = 4096;
  c.intermediate_size = 12288;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 16;
  c.num_key_value_heads = 4;
  c.head_dim = 256;
  c.linear_num_key_heads = 16;
  c.linear_num_value_heads = 32;
  c.linear_key_head_dim = 128;
  c.linear_value_head_dim = 128;
  c.tie_word_embeddings = false;
  c.pad_token_id.reset();
  auto specs = param_specs(c);
  std::map<std::string, std::vector<int64_t>> shape;
  for (const auto& s : specs) shape[s.name] = s.shape;
  using V = std::vector<int64_t>;
  EXPECT_EQ(shape.at("model.embed_tokens.weight"), (V{248320, 4096}));
  EXPECT_EQ(shape.at("lm_head.weight"), (V{248320, 4096}));
  EXPECT_EQ(shape.at("model.norm.weight"), (V{4096}));
  EXPECT_EQ(shape.at("model.layers.0.input_layernorm.weight"), (V{4096}));
  EXPECT_EQ(shape.at("model.layers.0.post_attention_layernorm.weight"), (V{4096}));
  EXPECT_EQ(shape.at("model.layers.0.linear_attn.in_proj_qkv.weight"), (V{8192, 4096}));
  EXPECT_EQ(shape.at("model.layers.0.linear_attn.in_proj_z.weight"), (V{4096, 4096}));
  EXPECT_EQ(shape.at("model.layers.0.linear_attn.in_proj_a.weight"), (V{32, 4096}));
  EXPECT_EQ(shape.at("model.layers.0.linear_attn.in_proj_b.weight"), (V{32, 4096}));
  EXPECT_EQ(shape.at("model.layers.0.linear_attn.conv1d.weight"), (V{8192, 1, 4}));
  EXPECT_EQ(shape.at("model.layers.0.linear_attn.dt_bias"), (V{32}));
  EXPECT_EQ(shape.at("model.layers.0.linear_attn.A_log"), (V{32}));
  EXPECT_EQ(shape.at("model.layers.0.linear_attn.norm.weight"), (V{128}));
  EXPECT_EQ(shape.at("model.layers.0.linear_attn.out_proj.weight"), (V{4096, 4096}));
  EXPECT_EQ(shape.at("model.layers.3.self_attn.q_proj.weight"), (V{8192, 4096}));
  EXPECT_EQ(shape.at("model.layers.3.self_attn.k_proj.weight"), (V{1024, 4096}));
  EXPECT_EQ(shape.at("model.layers.3.self_attn.v_proj.weight"), (V{1024, 4096}));
  EXPECT_EQ(shape.at("model.layers.3.self_attn.o_proj.weight"), (V{4096, 4096}));
  EXPECT_EQ(shape.at("model.layers.3.self_attn.q_norm.weight"), (V{256}));
  EXPECT_EQ(shape.at("model.layers.3.self_attn.k_norm.weight"), (V{256}));
  EXPECT_EQ(shape.at("model.layers.3.mlp.gate_proj.weight"), (V{12288, 4096}));
  EXPECT_EQ(shape.at("model.layers.3.mlp.up_proj.weight"), (V{12288, 4096}));
  EXPECT_EQ(shape.at("model.layers.3.mlp.down_proj.weight"), (V{4096, 12288}));
  EXPECT_FALSE(shape.contains("model.layers.3.linear_attn.A_log"));
  EXPECT_FALSE(shape.contains("model.layers.0.self_attn.q_proj.weight"));
  // embed + 3 GDN layers x (2 norms + 9 + 3 mlp) + 1 attention layer x (2 + 6 + 3) + norm + head.
  EXPECT_EQ(specs.size(), 1u + 3 * 14 + 11 + 1 + 1);
  EXPECT_EQ(specs.front().name, "model.embed_tokens.weight");
  EXPECT_EQ(specs.back().name, "lm_head.weight");
  c.tie_word_embeddings = true;
  EXPECT_FALSE(std::any_of(param_specs(c).begin(), param_specs(c).end(),
                           [](const ParamSpec& s) { return s.name == "lm_head.weight"; }));

  EXPECT_EQ(hf_name("model.layers.2.linear_attn.A_log", WeightPrefix::Multimodal),
            "model.language_model.layers.2.linear_attn.A_log");
  EXPECT_EQ(hf_name("lm_head.weight", WeightPrefix::Multimodal), "lm_head.weight");
  EXPECT_EQ(hf_name("model.norm.weight", WeightPrefix::Text), "model.norm.weight");
  EXPECT_TRUE(is_untouched_family("model.visual.blocks.0.attn.qkv.weight"));
  EXPECT_TRUE(is_untouched_family("mtp.fc.weight"));
  EXPECT_FALSE(is_untouched_family("model.layers.0.mlp.up_proj.weight"));
}

TEST(Weights, ParamStoreIsOneContiguousAlignedBuffer) {
  Qwen35Config c = untied_tiny();
  ParamStore s(param_specs(c));
  ASSERT_EQ(s.size(), param_specs(c).size());
  int64_t sum = 0;
  int64_t prev_end = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    Tensor t = s.tensor(i);
    EXPECT_EQ(t.dtype(), DType::F32);
    EXPECT_EQ(t.shape_vec(), s.spec(i).shape);
    EXPECT_EQ(s.offset(i) % 16, 0) << s.spec(i).name;
    EXPECT_GE(s.offset(i), prev_end);
    EXPECT_LT(s.offset(i) - prev_end, 16);  // only alignment padding between tensors
    EXPECT_EQ(static_cast<float*>(t.data()), s.flat().data() + s.offset(i));
    prev_end = s.offset(i) + t.numel();
    sum += t.numel();
  }
  EXPECT_EQ(s.numel(), sum);
  EXPECT_GE(static_cast<int64_t>(s.flat().size()), prev_end);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(s.flat().data()) % 64, 0u);
  EXPECT_TRUE(std::all_of(s.flat().begin(), s.flat().end(), [](float v) { return v == 0.0f; }));
  init_params(s, c, 7);
  // The padding stays zero after init.
  std::vector<bool> used(s.flat().size(), false);
  for (size_t i = 0; i < s.size(); ++i) {
    for (int64_t k = 0; k < s.tensor(i).numel(); ++k)
      used[static_cast<size_t>(s.offset(i) + k)] = true;
  }
  for (size_t k = 0; k < used.size(); ++k) {
    if (!used[k]) {
      EXPECT_EQ(s.flat()[k], 0.0f) << k;
    }
  }
  EXPECT_EQ(s.index("model.norm.weight"), s.size() - 2);
  EXPECT_FALSE(s.find("model.nope").has_value());
  EXPECT_THAT(error_of([&] { s.tensor("model.nope"); }),
              HasSubstr("no parameter named 'model.nope'"));
  // Moving keeps the data.
  float first = s.flat()[0];
  ParamStore m = std::move(s);
  EXPECT_EQ(m.flat()[0], first);
  ModelParamIds ids = param_ids(m, c);
  EXPECT_EQ(ids.embed, 0);
  EXPECT_EQ(ids.lm_head, static_cast<int64_t>(m.size()) - 1);
  ASSERT_EQ(ids.layers.size(), 4u);
  EXPECT_EQ(m.spec(static_cast<size_t>(ids.layers[1].a_log)).name,
            "model.layers.1.linear_attn.A_log");
  EXPECT_EQ(m.spec(static_cast<size_t>(ids.layers[3].k_norm)).name,
            "model.layers.3.self_attn.k_norm.weight");
  EXPECT_EQ(ids.layers[3].a_log, -1);
  EXPECT_EQ(ids.layers[0].q_proj, -1);
}

TEST(Weights, InitFollowsHfRulesAndIsReproducibleAndOrderIndependent) {
  Qwen35Config c = untied_tiny();
  ParamStore a(param_specs(c)), b(param_specs(c)), other(param_specs(c));
  init_params(a, c, 1234);
  init_params(b, c, 1234);
  init_params(other, c, 1235);
  EXPECT_EQ(std::memcmp(a.flat().data(), b.flat().data(), a.flat().size() * 4), 0);
  EXPECT_NE(values(a.tensor("model.layers.0.mlp.up_proj.weight")),
            values(other.tensor("model.layers.0.mlp.up_proj.weight")));

  // Reversed parameter order, and a standalone tensor: the same values per name.
  auto rev = param_specs(c);
  std::reverse(rev.begin(), rev.end());
  ParamStore r(rev);
  init_params(r, c, 1234);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(values(a.tensor(i)), values(r.tensor(a.spec(i).name))) << a.spec(i).name;
  }
  const ParamSpec& qs = a.spec(a.index("model.layers.3.self_attn.q_proj.weight"));
  OwnedTensor lone = OwnedTensor::empty(DType::F32, std::span<const int64_t>(qs.shape));
  init_param(qs, lone, c, 1234);
  EXPECT_EQ(values(lone), values(a.tensor(qs.name)));

  // Large tensors are filled in parallel: the thread count changes nothing.
  {
    ParamSpec big{"model.layers.0.mlp.up_proj.weight", {400, 512}, InitKind::Normal};
    OwnedTensor one = OwnedTensor::empty(DType::F32, {400, 512});
    OwnedTensor two = OwnedTensor::empty(DType::F32, {400, 512});
    const int keep = omp_get_max_threads();
    omp_set_num_threads(1);
    init_param(big, one, c, 1234);
    omp_set_num_threads(2);
    init_param(big, two, c, 1234);
    omp_set_num_threads(keep);
    EXPECT_EQ(values(one), values(two));
  }
  for (size_t i = 0; i < a.size(); ++i) {
    const ParamSpec& s = a.spec(i);
    auto v = values(a.tensor(i));
    switch (s.init) {
      case InitKind::Zeros:
        EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](float x) { return x == 0.0f; })) << s.name;
        break;
      case InitKind::Ones:
        EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](float x) { return x == 1.0f; })) << s.name;
        break;
      case InitKind::ALog:
        for (float x : v) {
          EXPECT_GE(x, std::log(0.01f) - 1e-6f) << s.name;
          EXPECT_LT(x, std::log(16.0f) + 1e-6f) << s.name;
        }
        break;
      default: {
        double m = 0, q = 0;
        for (float x : v) {
          m += x;
          q += static_cast<double>(x) * x;
        }
        m /= static_cast<double>(v.size());
        double sd = std::sqrt(q / static_cast<double>(v.size()) - m * m);
        if (v.size() >= 4096) {
          EXPECT_NEAR(sd, 0.02, 0.02 * 0.05) << s.name;
          EXPECT_NEAR(m, 0.0, 0.002) << s.name;
        }
      }
    }
  }
  // Which norm is which flavour (gdn_spec.md §1.4).
  EXPECT_EQ(a.spec(a.index("model.layers.0.input_layernorm.weight")).init, InitKind::Zeros);
  EXPECT_EQ(a.spec(a.index("model.layers.3.self_attn.q_norm.weight")).init, InitKind::Zeros);
  EXPECT_EQ(a.spec(a.index("model.norm.weight")).init, InitKind::Zeros);
  EXPECT_EQ(a.spec(a.index("model.layers.0.linear_attn.norm.weight")).init, InitKind::Ones);
  EXPECT_EQ(a.spec(a.index("model.layers.0.linear_attn.dt_bias")).init, InitKind::Ones);
  EXPECT_EQ(a.spec(a.index("model.layers.0.linear_attn.conv1d.weight")).init, InitKind::Normal);
  // A_log values spread over the range (not a constant).
  auto al = values(a.tensor("model.layers.0.linear_attn.A_log"));
  EXPECT_GT(*std::max_element(al.begin(), al.end()) - *std::min_element(al.begin(), al.end()),
            0.1f);
  // The pad row of the embedding is zero; the others are not.
  Tensor e = a.tensor("model.embed_tokens.weight");
  const float* ep = e.ptr<float>();
  const int64_t D = c.hidden_size;
  EXPECT_TRUE(std::all_of(ep, ep + D, [](float x) { return x == 0.0f; }));  // pad_token_id = 0
  EXPECT_TRUE(std::any_of(ep + D, ep + 2 * D, [](float x) { return x != 0.0f; }));
}

TEST(Weights, SaveLoadRoundTripF32AndBf16BothPrefixes) {
  auto dir = temp_dir("roundtrip");
  for (bool tied : {false, true}) {
    Qwen35Config c = tiny_config();
    c.tie_word_embeddings = tied;
    ParamStore src(param_specs(c));
    init_params(src, c, 99);
    for (WeightPrefix prefix : {WeightPrefix::Text, WeightPrefix::Multimodal}) {
      for (DType dt : {DType::F32, DType::BF16}) {
        SCOPED_TRACE(::testing::Message() << "tied " << tied << " prefix " << int(prefix)
                                          << " dtype " << dtype_name(dt));
        fs::path d = dir / fmt::format("{}_{}_{}", tied, int(prefix), dtype_name(dt));
        SaveOptions opt;
        opt.dtype = dt;
        opt.prefix = prefix;
        save_hf_weights(d.string(), c, src, opt);
        ASSERT_TRUE(fs::exists(d / "model.safetensors"));
        EXPECT_FALSE(fs::exists(d / "model.safetensors.index.json"));
        SafeTensorsFile f((d / "model.safetensors").string());
        EXPECT_EQ(f.metadata().at("format"), "pt");
        EXPECT_EQ(f.tensors().size(), src.size());
        const std::string embed = hf_name("model.embed_tokens.weight", prefix);
        EXPECT_TRUE(f.contains(embed));
        EXPECT_EQ(f.info(embed).dtype, dt);
        EXPECT_EQ(f.info(hf_name("model.layers.0.linear_attn.A_log", prefix)).dtype, DType::F32);
        EXPECT_EQ(f.info(hf_name("model.layers.0.linear_attn.conv1d.weight", prefix)).shape,
                  (std::vector<int64_t>{c.conv_dim(), 1, 4}));
        EXPECT_EQ(f.contains("lm_head.weight"), !tied);

        ParamStore dst(param_specs(c));
        HfExtras ex = load_hf_weights(d.string(), c, dst);
        EXPECT_EQ(ex.prefix, prefix);
        EXPECT_TRUE(ex.untouched.empty());
        EXPECT_EQ(ex.disk_dtypes.at(embed), dtype_name(dt));
        for (size_t i = 0; i < src.size(); ++i) {
          auto want = values(src.tensor(i));
          if (dt == DType::BF16 && !src.spec(i).name.ends_with("A_log")) {
            for (float& x : want) x = round_bf16(x);
          }
          EXPECT_EQ(values(dst.tensor(i)), want) << src.spec(i).name;
        }
      }
    }
  }
  // A single .safetensors file path works too.
  Qwen35Config c = tiny_config();
  ParamStore src(param_specs(c)), dst(param_specs(c));
  init_params(src, c, 5);
  save_hf_weights((dir / "single").string(), c, src, SaveOptions{.dtype = DType::F32});
  load_hf_weights((dir / "single" / "model.safetensors").string(), c, dst);
  EXPECT_EQ(std::memcmp(src.flat().data(), dst.flat().data(), src.flat().size() * 4), 0);
  fs::remove_all(dir);
}

TEST(Weights, ShardedSaveLoadAndUntouchedTensorsAreByteIdentical) {
  auto dir = temp_dir("sharded");
  Qwen35Config c = untied_tiny();
  c.nested = true;
  ParamStore src(param_specs(c));
  init_params(src, c, 3);
  std::vector<RawTensor> raw(2);
  raw[0].name = "model.visual.blocks.0.attn.qkv.weight";
  raw[0].dtype = "F8_E4M3";
  raw[0].shape = {3, 5};
  raw[1].name = "mtp.fc.weight";
  raw[1].dtype = "BF16";
  raw[1].shape = {4, 6};
  for (auto& r : raw) {
    int64_t n = r.shape[0] * r.shape[1] * (r.dtype == "BF16" ? 2 : 1);
    for (int64_t i = 0; i < n; ++i)
      r.bytes.push_back(static_cast<uint8_t>(rng::bits(1, 2, static_cast<uint64_t>(i))));
  }
  SaveOptions opt;
  opt.dtype = DType::BF16;
  opt.prefix = prefix_for(c);
  opt.max_shard_bytes = 40000;  // the tiny model is ~0.2 MB in BF16: several shards
  save_hf_weights(dir.string(), c, src, opt, raw);
  ASSERT_TRUE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors"));
  std::ifstream in(dir / "model.safetensors.index.json");
  std::stringstream ss;
  ss << in.rdbuf();
  json index = json::parse(ss.str());
  std::set<std::string> shard_files;
  uint64_t total = 0;
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
    shard_files.insert(it.value().get<std::string>());
  }
  EXPECT_GT(shard_files.size(), 2u);
  EXPECT_EQ(index["weight_map"].size(), src.size() + raw.size());
  for (const auto& f : shard_files) {
    EXPECT_THAT(f, ::testing::MatchesRegex("model-000[0-9][0-9]-of-000[0-9][0-9]\\.safetensors"));
    SafeTensorsFile sf((dir / f).string());
    for (const auto& t : sf.tensors()) total += t.end - t.begin;
    EXPECT_LE(fs::file_size(dir / f), opt.max_shard_bytes + 4096);
  }
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);

  ParamStore dst(param_specs(c));
  HfExtras ex = load_hf_weights(dir.string(), c, dst);
  EXPECT_EQ(ex.prefix, WeightPrefix::Multimodal);
  ASSERT_EQ(ex.untouched.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    // Loaded in name order: model.visual... < mtp...
    const RawTensor& want = raw[i];
    const RawTensor& got = ex.untouched[i];
    EXPECT_EQ(got.name, want.name);
    EXPECT_EQ(got.dtype, want.dtype);
    EXPECT_EQ(got.shape, want.shape);
    EXPECT_EQ(got.bytes, want.bytes);
  }
  for (size_t i = 0; i < src.size(); ++i) {
    auto want = values(src.tensor(i));
    if (!src.spec(i).name.ends_with("A_log")) {
      for (float& x : want) x = round_bf16(x);
    }
    EXPECT_EQ(values(dst.tensor(i)), want) << src.spec(i).name;
  }

  // Re-save the loaded checkpoint as one file into the same directory: the shards and the
  // index of the replaced checkpoint are removed, the raw tensors survive byte for byte.
  opt.max_shard_bytes = 1ull << 40;
  save_hf_weights(dir.string(), c, dst, opt, ex.untouched);
  EXPECT_TRUE(fs::exists(dir / "model.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  for (const auto& f : shard_files) EXPECT_FALSE(fs::exists(dir / f)) << f;
  SafeTensorsFile one((dir / "model.safetensors").string());
  const SafeTensorInfo& vi = one.info("model.visual.blocks.0.attn.qkv.weight");
  EXPECT_EQ(vi.dtype_name, "F8_E4M3");
  EXPECT_EQ(std::memcmp(one.raw(vi), raw[0].bytes.data(), raw[0].bytes.size()), 0);
  ParamStore again(param_specs(c));
  HfExtras ex2 = load_hf_weights(dir.string(), c, again);
  EXPECT_EQ(ex2.untouched[1].bytes, raw[1].bytes);
  EXPECT_EQ(std::memcmp(again.flat().data(), dst.flat().data(), dst.flat().size() * 4), 0);
  fs::remove_all(dir);
}

TEST(Weights, MismatchesAreListedByName) {
  auto dir = temp_dir("mismatch");
  Qwen35Config c = untied_tiny();
  ParamStore s(param_specs(c));
  init_params(s, c, 1);
  OwnedTensor small = OwnedTensor::zeros(DType::F32, {5});
  std::vector<NamedTensor> extra(2);
  extra[0].name = "model.layers.0.linear_attn.surprise";
  extra[0].tensor = small;
  extra[1].name = "model.layers.1.linear_attn.A_log";  // dropped below and re-added mis-shaped
  extra[1].tensor = small;
  write_custom(
      dir / "model.safetensors", s, WeightPrefix::Text,
      {"model.layers.2.mlp.up_proj.weight", "lm_head.weight", "model.layers.1.linear_attn.A_log"},
      std::move(extra));
  ParamStore dst(param_specs(c));
  std::string m = error_of([&] { load_hf_weights(dir.string(), c, dst); });
  EXPECT_THAT(m, HasSubstr("does not match the config"));
  EXPECT_THAT(m,
              HasSubstr("2 missing:\n    model.layers.2.mlp.up_proj.weight\n    lm_head.weight"));
  EXPECT_THAT(m, HasSubstr("1 unexpected:\n    model.layers.0.linear_attn.surprise"));
  EXPECT_THAT(
      m,
      HasSubstr("1 mis-shaped:\n    model.layers.1.linear_attn.A_log has shape [5], expected [4]"));

  // Loading a checkpoint with the other prefix style mixed in: those names are unexpected.
  write_custom(dir / "model.safetensors", s, WeightPrefix::Multimodal, {}, {});
  ParamStore ok(param_specs(c));
  load_hf_weights(dir.string(), c, ok);
  {
    std::vector<NamedTensor> stray(1);
    stray[0].name = "model.embed_tokens.weight";
    stray[0].tensor = s.tensor(0);
    write_custom(dir / "model.safetensors", s, WeightPrefix::Multimodal, {}, std::move(stray));
    EXPECT_THAT(error_of([&] { load_hf_weights(dir.string(), c, ok); }),
                HasSubstr("1 unexpected:\n    model.embed_tokens.weight"));
  }

  // Many missing names are truncated with a count.
  Qwen35Config big = untied_tiny();
  big.num_hidden_layers = 8;
  big.layer_types.resize(8, LayerType::Linear);
  ParamStore bs(param_specs(big));
  write_custom(dir / "model.safetensors", s, WeightPrefix::Text, {}, {});
  m = error_of([&] { load_hf_weights(dir.string(), big, bs); });
  EXPECT_THAT(m, HasSubstr("missing:"));
  EXPECT_THAT(m, HasSubstr("... and "));

  // A store not built from this config is refused.
  EXPECT_THAT(error_of([&] { load_hf_weights(dir.string(), c, bs); }),
              HasSubstr("was not built from param_specs() of this config"));
  // A directory without weights.
  fs::remove(dir / "model.safetensors");
  EXPECT_THAT(error_of([&] { load_hf_weights(dir.string(), c, dst); }),
              HasSubstr("has neither model.safetensors nor model.safetensors.index.json"));
  fs::remove_all(dir);
}

TEST(Weights, TiedHeadMustMatchTheEmbedding) {
  auto dir = temp_dir("tied");
  Qwen35Config c = tiny_config();  // tied
  ParamStore s(param_specs(c));
  init_params(s, c, 1);
  // An lm_head identical to the embedding is accepted (torch-style files carry both).
  std::vector<NamedTensor> head(1);
  head[0].name = "lm_head.weight";
  head[0].tensor = s.tensor("model.embed_tokens.weight");
  write_custom(dir / "model.safetensors", s, WeightPrefix::Text, {}, head);
  ParamStore dst(param_specs(c));
  load_hf_weights(dir.string(), c, dst);
  // A different one is an error with a hint.
  OwnedTensor other = OwnedTensor::zeros(DType::F32, {c.vocab_size, c.hidden_size});
  head[0].tensor = other;
  write_custom(dir / "model.safetensors", s, WeightPrefix::Text, {}, head);
  EXPECT_THAT(
      error_of([&] { load_hf_weights(dir.string(), c, dst); }),
      HasSubstr("ties the embeddings but the checkpoint has an lm_head.weight that differs"));
  fs::remove_all(dir);
}

TEST(Weights, InconsistentShardIndexIsAnError) {
  auto dir = temp_dir("badindex");
  Qwen35Config c = tiny_config();
  ParamStore s(param_specs(c));
  init_params(s, c, 1);
  SaveOptions opt;
  opt.max_shard_bytes = 60000;
  save_hf_weights(dir.string(), c, s, opt);
  std::ifstream in(dir / "model.safetensors.index.json");
  std::stringstream ss;
  ss << in.rdbuf();
  json index = json::parse(ss.str());
  in.close();
  // layers.0.input_layernorm shares the first shard with the embedding (33 KB of 60 KB).
  const std::string moved = "model.layers.0.input_layernorm.weight";
  std::string first = index["weight_map"]["model.embed_tokens.weight"];
  std::string last = index["weight_map"]["model.norm.weight"];
  ASSERT_EQ(index["weight_map"][moved], first);
  ASSERT_NE(first, last);
  index["weight_map"][moved] = last;  // wrong shard
  write_file_atomic((dir / "model.safetensors.index.json").string(), index.dump());
  ParamStore dst(param_specs(c));
  EXPECT_THAT(error_of([&] { load_hf_weights(dir.string(), c, dst); }),
              HasSubstr("tensor '" + moved + "' is in shard '" + first +
                        "' but the index maps it to '" + last + "'"));
  index["weight_map"][moved] = "../escape.safetensors";
  write_file_atomic((dir / "model.safetensors.index.json").string(), index.dump());
  EXPECT_THAT(error_of([&] { load_hf_weights(dir.string(), c, dst); }),
              HasSubstr("not a file in the same directory"));
  index["weight_map"].erase(moved);
  write_file_atomic((dir / "model.safetensors.index.json").string(), index.dump());
  EXPECT_THAT(error_of([&] { load_hf_weights(dir.string(), c, dst); }),
              HasSubstr("holds tensor '" + moved + "' which the index does not list"));
  index["weight_map"][moved] = "model-00099-of-00099.safetensors";
  write_file_atomic((dir / "model.safetensors.index.json").string(), index.dump());
  EXPECT_THAT(error_of([&] { load_hf_weights(dir.string(), c, dst); }), HasSubstr("cannot open"));
  fs::remove_all(dir);
}

TEST(Weights, CheckpointWithConfigRoundTrip) {
  auto dir = temp_dir("checkpoint");
  Qwen35Config c = tiny_config();
  ParamStore s(param_specs(c));
  init_params(s, c, 11);
  save_hf_checkpoint(dir.string(), c, s, SaveOptions{.dtype = DType::F32});
  HfCheckpoint ck = load_hf_checkpoint(dir.string());
  EXPECT_EQ(ck.config.layer_types, c.layer_types);
  EXPECT_EQ(ck.config.hidden_size, c.hidden_size);
  ASSERT_EQ(ck.params.size(), s.size());
  EXPECT_EQ(std::memcmp(ck.params.flat().data(), s.flat().data(), s.flat().size() * 4), 0);
  EXPECT_THAT(error_of([&] {
                SaveOptions bad;
                bad.dtype = DType::I32;
                save_hf_weights(dir.string(), c, s, bad);
              }),
              HasSubstr("not a checkpoint dtype"));
  std::vector<RawTensor> wrong(1);
  wrong[0].name = "model.layers.0.something";
  wrong[0].dtype = "U8";
  EXPECT_THAT(error_of([&] { save_hf_weights(dir.string(), c, s, SaveOptions{}, wrong); }),
              HasSubstr("is not of an untouched family"));
  fs::remove_all(dir);
}

// Checkpoints written by HF transformers 5.24 save_pretrained (tests/data/golden, made by
// scripts/make_golden.py): our names, shapes, prefixes and untouched families must match HF's own
// files exactly, and a load -> save round trip must reproduce every tensor byte for byte and the
// config.json verbatim.
TEST(Weights, HfSavedGoldenCheckpointsLoadAndRoundTripExactly) {
  struct Case {
    const char* name;
    WeightPrefix prefix;
    size_t untouched;
  };
  auto out = temp_dir("golden");
  for (const Case& k :
       {Case{"r1_tied", WeightPrefix::Text, 0}, Case{"r2_untied", WeightPrefix::Text, 0},
        Case{"nested_vl", WeightPrefix::Multimodal, 21}}) {
    SCOPED_TRACE(k.name);
    const fs::path dir = fs::path(GDN_TEST_DATA_DIR) / "golden" / k.name;
    HfCheckpoint ck = load_hf_checkpoint(dir.string());
    EXPECT_EQ(ck.extras.prefix, k.prefix);
    EXPECT_EQ(prefix_for(ck.config), k.prefix);
    EXPECT_EQ(ck.extras.untouched.size(), k.untouched);
    for (const auto& r : ck.extras.untouched)
      EXPECT_TRUE(r.name.starts_with("model.visual.")) << r.name;
    SafeTensorsFile hf((dir / "model.safetensors").string());
    EXPECT_EQ(hf.tensors().size(), ck.params.size() + k.untouched);
    EXPECT_EQ(hf.contains("lm_head.weight"), !ck.config.tie_word_embeddings);
    for (size_t i = 0; i < ck.params.size(); ++i) {
      const std::string n = hf_name(ck.params.spec(i).name, k.prefix);
      ASSERT_TRUE(hf.contains(n)) << n;
      const SafeTensorInfo& info = hf.info(n);
      EXPECT_EQ(info.shape, ck.params.spec(i).shape) << n;
      ASSERT_EQ(info.dtype, DType::F32);
      EXPECT_EQ(std::memcmp(hf.raw(info), ck.params.tensor(i).data(), info.end - info.begin), 0)
          << n;
    }

    const fs::path o = out / k.name;
    SaveOptions opt;
    opt.dtype = DType::F32;
    opt.prefix = prefix_for(ck.config);
    save_hf_checkpoint(o.string(), ck.config, ck.params, opt, ck.extras.untouched);
    SafeTensorsFile ours((o / "model.safetensors").string());
    EXPECT_EQ(ours.metadata(), hf.metadata());
    ASSERT_EQ(ours.tensors().size(), hf.tensors().size());
    for (const auto& t : hf.tensors()) {
      ASSERT_TRUE(ours.contains(t.name)) << t.name;
      const SafeTensorInfo& u = ours.info(t.name);
      EXPECT_EQ(u.dtype_name, t.dtype_name) << t.name;
      EXPECT_EQ(u.shape, t.shape) << t.name;
      ASSERT_EQ(u.end - u.begin, t.end - t.begin) << t.name;
      EXPECT_EQ(std::memcmp(ours.raw(u), hf.raw(t), t.end - t.begin), 0) << t.name;
    }
    std::ifstream a(dir / "config.json"), b(o / "config.json");
    std::stringstream sa, sb;
    sa << a.rdbuf();
    sb << b.rdbuf();
    EXPECT_EQ(json::parse(sb.str()), json::parse(sa.str()));
  }
  fs::remove_all(out);
}

}  // namespace
}  // namespace gdn::model
