// Qwen3.5 config.json: flat and nested parsing, HF defaults and RoPE locations, errors that name
// the field, and the writer (only changed fields rewritten, everything else kept).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "gdn/core/error.h"
#include "model/config.h"

namespace gdn::model {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

std::string fixture(const std::string& name) {
  return std::string(GDN_TEST_DATA_DIR) + "/configs/" + name;
}

json read_fixture(const std::string& name) {
  std::ifstream in(fixture(name));
  std::stringstream ss;
  ss << in.rdbuf();
  return json::parse(ss.str());
}

// The message of the gdn::Error that parsing `j` throws ("" and a test failure if none).
std::string parse_error(const json& j) {
  try {
    parse_config(j, "cfg.json");
  } catch (const Error& e) {
    return e.message();
  }
  ADD_FAILURE() << "parse_config accepted " << j.dump();
  return "";
}

std::filesystem::path temp_dir(const std::string& tag) {
  auto d = std::filesystem::temp_directory_path() /
           ("gdn_test_config_" + tag + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

TEST(Config, ParsesFlatTextConfig) {
  Qwen35Config c = load_config(fixture("qwen35_text_flat.json"));
  EXPECT_FALSE(c.nested);
  EXPECT_EQ(c.vocab_size, 300);
  EXPECT_EQ(c.hidden_size, 48);
  EXPECT_EQ(c.intermediate_size, 96);
  EXPECT_EQ(c.num_hidden_layers, 5);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.num_key_value_heads, 1);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.linear_num_key_heads, 2);
  EXPECT_EQ(c.linear_num_value_heads, 6);
  EXPECT_EQ(c.linear_key_head_dim, 8);
  EXPECT_EQ(c.linear_value_head_dim, 12);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.initializer_range, 0.03);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(c.partial_rotary_factor, 0.5);
  EXPECT_EQ(c.rope_type, "default");
  EXPECT_TRUE(c.mrope_section.empty());
  EXPECT_EQ(c.bos_token_id, std::optional<int64_t>(2));
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{1, 3}));
  EXPECT_FALSE(c.pad_token_id.has_value());  // null counts as absent
  std::vector<LayerType> want = {LayerType::Linear, LayerType::Full, LayerType::Linear,
                                 LayerType::Linear, LayerType::Full};
  EXPECT_EQ(c.layer_types, want);
  // Derived sizes (gdn_spec.md §1.5/§1.6).
  EXPECT_EQ(c.key_dim(), 16);
  EXPECT_EQ(c.value_dim(), 72);
  EXPECT_EQ(c.conv_dim(), 2 * 16 + 72);
  EXPECT_EQ(c.gqa_ratio(), 3);
  EXPECT_EQ(c.rotary_dim(), 8);
  EXPECT_EQ(c.q_proj_rows(), 2 * 4 * 16);
  EXPECT_EQ(c.num_full_attention_layers(), 2);
  EXPECT_EQ(c.num_linear_attention_layers(), 3);
}

TEST(Config, ParsesNestedConfigAndTopLevelTieFlag) {
  Qwen35Config c = load_config(fixture("qwen35_nested.json"));
  EXPECT_TRUE(c.nested);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.num_hidden_layers, 8);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e7);
  EXPECT_DOUBLE_EQ(c.partial_rotary_factor, 0.25);
  EXPECT_EQ(c.mrope_section, (std::vector<int64_t>{2, 1, 1}));
  EXPECT_TRUE(c.mrope_interleaved);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{248044}));
  EXPECT_EQ(c.rotary_dim(), 8);
  // full_attention_interval 4: layers 3 and 7 are full attention.
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(c.is_full_attention(i), i == 3 || i == 7) << i;

  // The top-level flag decides for the nested layout, whatever text_config says.
  json j = read_fixture("qwen35_nested.json");
  j["tie_word_embeddings"] = false;
  EXPECT_FALSE(parse_config(j).tie_word_embeddings);
  j.erase("tie_word_embeddings");  // absent -> HF's default False
  EXPECT_FALSE(parse_config(j).tie_word_embeddings);
  j["tie_word_embeddings"] = true;
  j["text_config"]["tie_word_embeddings"] = false;
  EXPECT_TRUE(parse_config(j).tie_word_embeddings);
}

TEST(Config, LegacyRopeLocationsAndDefaults) {
  Qwen35Config c = load_config(fixture("qwen35_legacy_rope.json"));
  EXPECT_DOUBLE_EQ(c.rope_theta, 5e6);  // top-level rope_theta (HF 4.x)
  EXPECT_EQ(c.rope_type, "mrope");      // rope_scaling.type
  EXPECT_EQ(c.mrope_section, (std::vector<int64_t>{1, 1, 0}));
  // full_attention_interval 2: layers 1 and 3.
  EXPECT_EQ(c.layer_types, (std::vector<LayerType>{LayerType::Linear, LayerType::Full,
                                                   LayerType::Linear, LayerType::Full}));
  // HF defaults for the fields the fixture omits.
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.initializer_range, 0.02);
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_FALSE(c.tie_word_embeddings);

  json j = read_fixture("qwen35_legacy_rope.json");
  j.erase("rope_theta");
  j.erase("partial_rotary_factor");
  j.erase("rope_scaling");
  Qwen35Config d = parse_config(j);
  EXPECT_DOUBLE_EQ(d.rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(d.partial_rotary_factor, 0.25);
  EXPECT_EQ(d.rope_type, "default");
  // The same value in two places is fine.
  j["rope_parameters"] = {{"rope_theta", 10000}};
  j["rope_theta"] = 10000.0;
  EXPECT_DOUBLE_EQ(parse_config(j).rope_theta, 10000.0);
  // A per-layer-type rope_parameters dict: the full_attention entry is used.
  j.erase("rope_theta");
  j["rope_parameters"] = {{"full_attention", {{"rope_type", "default"}, {"rope_theta", 123.0}}}};
  EXPECT_DOUBLE_EQ(parse_config(j).rope_theta, 123.0);
}

TEST(Config, ErrorsNameTheField) {
  json flat = read_fixture("qwen35_text_flat.json");
  json nested = read_fixture("qwen35_nested.json");
  {
    json j = flat;
    j.erase("hidden_size");
    std::string m = parse_error(j);
    EXPECT_THAT(m, HasSubstr("required field 'hidden_size' is missing"));
    EXPECT_THAT(m, HasSubstr("cfg.json"));
  }
  {
    json j = nested;
    j["text_config"].erase("linear_num_value_heads");
    EXPECT_THAT(parse_error(j),
                HasSubstr("required field 'text_config.linear_num_value_heads' is missing"));
  }
  {
    json j = nested;
    j["text_config"]["vocab_size"] = nullptr;  // null counts as missing
    EXPECT_THAT(parse_error(j), HasSubstr("'text_config.vocab_size' is missing"));
  }
  {
    json j = flat;
    j["hidden_size"] = "48";
    EXPECT_THAT(parse_error(j), HasSubstr("field 'hidden_size' must be an integer, got string"));
  }
  {
    json j = flat;
    j["num_hidden_layers"] = 5.5;
    EXPECT_THAT(parse_error(j),
                HasSubstr("field 'num_hidden_layers' must be an integer, got number"));
  }
  {
    json j = flat;
    j["rms_norm_eps"] = "small";
    EXPECT_THAT(parse_error(j), HasSubstr("field 'rms_norm_eps' must be a number, got string"));
  }
  {
    json j = flat;
    j["tie_word_embeddings"] = 1;
    EXPECT_THAT(parse_error(j), HasSubstr("field 'tie_word_embeddings' must be true or false"));
  }
  {
    json j = nested;
    j["text_config"]["layer_types"] = {"linear_attention", "full_attention"};
    EXPECT_THAT(
        parse_error(j),
        HasSubstr("field 'text_config.layer_types' has 2 entries but num_hidden_layers is 8"));
  }
  {
    json j = flat;
    j["layer_types"][2] = "sliding_attention";
    EXPECT_THAT(parse_error(j), HasSubstr("field 'layer_types[2]' must be"));
  }
  {
    json j = flat;
    j["num_key_value_heads"] = 3;
    EXPECT_THAT(
        parse_error(j),
        HasSubstr("field 'num_key_value_heads' (3) does not divide num_attention_heads (4)"));
  }
  {
    json j = nested;
    j["text_config"]["linear_num_key_heads"] = 3;
    EXPECT_THAT(parse_error(j), HasSubstr("field 'text_config.linear_num_key_heads' (3) does not "
                                          "divide linear_num_value_heads (4)"));
  }
  {
    json j = flat;
    j["intermediate_size"] = 0;
    EXPECT_THAT(parse_error(j), HasSubstr("field 'intermediate_size' must be positive, got 0"));
  }
  {
    json j = flat;
    j["model_type"] = "qwen3_next";
    EXPECT_THAT(parse_error(j), HasSubstr("field 'model_type' = \"qwen3_next\" is not supported"));
    j.erase("model_type");
    EXPECT_THAT(parse_error(j), HasSubstr("required field 'model_type' is missing"));
  }
  {
    json j = nested;
    j.erase("text_config");
    EXPECT_THAT(parse_error(j), HasSubstr("required field 'text_config' is missing"));
  }
  {
    json j = flat;
    j["rope_theta"] = 5.0;  // rope_parameters says 1e6
    std::string m = parse_error(j);
    EXPECT_THAT(m, HasSubstr("'rope_theta' = 5.0 disagrees with 'rope_parameters.rope_theta'"));
  }
  {
    json j = flat;
    j["rope_parameters"]["rope_type"] = "yarn";
    EXPECT_THAT(parse_error(j), HasSubstr("rope_type \"yarn\" is not supported"));
  }
  {
    json j = flat;
    j["rope_parameters"]["partial_rotary_factor"] = 0.1;  // int(16 * 0.1) = 1: odd
    EXPECT_THAT(parse_error(j), HasSubstr("rotary dimension"));
  }
  {
    json j = flat;
    j["hidden_act"] = "gelu";
    EXPECT_THAT(parse_error(j), HasSubstr("field 'hidden_act' = \"gelu\" is not supported"));
  }
  {
    json j = flat;
    j["attention_bias"] = true;
    EXPECT_THAT(parse_error(j), HasSubstr("field 'attention_bias' = true is not supported"));
  }
  {
    json j = flat;
    j["pad_token_id"] = 300;
    EXPECT_THAT(parse_error(j), HasSubstr("field 'pad_token_id' = 300 is outside the vocabulary"));
  }
  {
    json j = flat;
    j["eos_token_id"] = {1, "two"};
    EXPECT_THAT(parse_error(j), HasSubstr("field 'eos_token_id' must be a list of integers"));
  }
  EXPECT_THAT(parse_error(json::array()), HasSubstr("not a JSON object"));
  try {
    load_config(fixture("does_not_exist.json"));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("cannot open config"));
  }
}

TEST(Config, WriterKeepsTheOriginalAndRewritesOnlyChangedFields) {
  for (const char* name :
       {"qwen35_text_flat.json", "qwen35_nested.json", "qwen35_legacy_rope.json"}) {
    json orig = read_fixture(name);
    Qwen35Config c = parse_config(orig);
    EXPECT_EQ(to_json(c), orig) << name << ": an unchanged config must be written back verbatim";
  }
  {
    json orig = read_fixture("qwen35_nested.json");
    Qwen35Config c = parse_config(orig);
    c.hidden_size = 128;
    c.rope_theta = 5e5;
    c.tie_word_embeddings = false;
    json out = to_json(c);
    json want = orig;
    want["text_config"]["hidden_size"] = 128;
    want["text_config"]["rope_parameters"]["rope_theta"] = 5e5;
    want["tie_word_embeddings"] = false;
    want["text_config"]["tie_word_embeddings"] = false;  // kept consistent with the top level
    EXPECT_EQ(out, want) << json::diff(out, want).dump();
    Qwen35Config back = parse_config(out);
    EXPECT_EQ(back.hidden_size, 128);
    EXPECT_DOUBLE_EQ(back.rope_theta, 5e5);
    EXPECT_FALSE(back.tie_word_embeddings);
  }
  {
    json orig = read_fixture("qwen35_legacy_rope.json");
    Qwen35Config c = parse_config(orig);
    c.rope_theta = 1e4;       // lives at the top level in this file
    c.num_hidden_layers = 2;  // layer_types must follow
    c.layer_types = {LayerType::Full, LayerType::Linear};
    json out = to_json(c);
    EXPECT_EQ(out["rope_theta"], 1e4);
    EXPECT_FALSE(out.contains("rope_parameters"));
    EXPECT_EQ(out["layer_types"], json({"full_attention", "linear_attention"}));
    EXPECT_EQ(out["full_attention_interval"], 2);  // kept; HF ignores it when layer_types is set
    Qwen35Config back = parse_config(out);
    EXPECT_EQ(back.layer_types, c.layer_types);
    EXPECT_DOUBLE_EQ(back.rope_theta, 1e4);
  }
  {
    // An edited config that no longer validates is refused with the field named.
    Qwen35Config c = load_config(fixture("qwen35_text_flat.json"));
    c.num_hidden_layers = 7;
    try {
      to_json(c);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_THAT(e.message(), HasSubstr("'layer_types' has 5 entries but num_hidden_layers is 7"));
    }
  }
}

TEST(Config, SaveLoadRoundTripThroughAFile) {
  auto dir = temp_dir("roundtrip");
  Qwen35Config c = load_config(fixture("qwen35_text_flat.json"));
  c.intermediate_size = 200;
  save_config(c, dir.string());  // a directory gets config.json inside
  ASSERT_TRUE(std::filesystem::exists(dir / "config.json"));
  Qwen35Config back = load_config(dir.string());
  EXPECT_EQ(back.intermediate_size, 200);
  EXPECT_EQ(back.layer_types, c.layer_types);
  EXPECT_EQ(back.eos_token_ids, c.eos_token_ids);
  EXPECT_EQ(back.original["custom_key_kept"], json({{"a", {1, 2, 3}}}));
  EXPECT_EQ(back.original["dtype"], "bfloat16");
  // No temporary file is left behind.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 1);
  std::filesystem::remove_all(dir);
}

TEST(Config, TinyConfigIsValidAndWritesACompleteDocument) {
  Qwen35Config c = tiny_config();
  EXPECT_EQ(c.vocab_size, 258);
  EXPECT_EQ(c.num_hidden_layers, 4);
  EXPECT_EQ(c.num_full_attention_layers(), 1);
  EXPECT_TRUE(c.is_full_attention(3));
  EXPECT_EQ(c.gqa_ratio(), 2);
  EXPECT_EQ(c.rotary_dim(), 8);
  EXPECT_TRUE(c.original.is_null());
  json j = to_json(c);
  EXPECT_EQ(j["model_type"], "qwen3_5_text");
  EXPECT_EQ(j["architectures"], json({"Qwen3_5ForCausalLM"}));
  EXPECT_EQ(j["layer_types"].size(), 4u);
  EXPECT_EQ(j["rope_parameters"]["rope_theta"], 10000.0);
  Qwen35Config back = parse_config(j);
  EXPECT_EQ(back.hidden_size, c.hidden_size);
  EXPECT_EQ(back.linear_num_value_heads, c.linear_num_value_heads);
  EXPECT_EQ(back.head_dim, c.head_dim);
  EXPECT_EQ(back.tie_word_embeddings, c.tie_word_embeddings);
  EXPECT_EQ(back.pad_token_id, c.pad_token_id);
  EXPECT_EQ(back.eos_token_ids, c.eos_token_ids);
  EXPECT_EQ(back.layer_types, c.layer_types);
  // The nested skeleton reads back as nested with the tie flag at the top level.
  c.nested = true;
  json n = to_json(c);
  EXPECT_EQ(n["model_type"], "qwen3_5");
  EXPECT_EQ(n["tie_word_embeddings"], true);
  Qwen35Config nb = parse_config(n);
  EXPECT_TRUE(nb.nested);
  EXPECT_TRUE(nb.tie_word_embeddings);
  EXPECT_EQ(nb.layer_types, c.layer_types);
}

}  // namespace
}  // namespace gdn::model
