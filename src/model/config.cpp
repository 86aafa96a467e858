#include "model/config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "gdn/core/error.h"
#include "gdn/core/log.h"
#include "gdn/core/safetensors.h"

namespace gdn::model {

using json = nlohmann::json;

std::string_view layer_type_name(LayerType t) {
  return t == LayerType::Full ? "full_attention" : "linear_attention";
}

int64_t Qwen35Config::num_full_attention_layers() const {
  int64_t n = 0;
  for (LayerType t : layer_types) n += t == LayerType::Full ? 1 : 0;
  return n;
}

namespace {

// Reads typed fields of one JSON object; every error names the field with its full path
// ("text_config.hidden_size"). A key whose value is null counts as absent, as in HF (None).
class FieldReader {
 public:
  FieldReader(const json& obj, std::string prefix, std::string_view label)
      : obj_(obj), prefix_(std::move(prefix)), label_(label) {}

  std::string path(std::string_view key) const { return prefix_ + std::string(key); }
  const json* find(std::string_view key) const {
    auto it = obj_.find(std::string(key));
    if (it == obj_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  int64_t req_int(std::string_view key) const {
    const json* v = find(key);
    GDN_CHECK_HINT(v != nullptr, "every Qwen3.5 config.json sets the model shape explicitly",
                   "{}: required field '{}' is missing", label_, path(key));
    return as_int(*v, key);
  }
  int64_t opt_int(std::string_view key, int64_t dflt) const {
    const json* v = find(key);
    return v ? as_int(*v, key) : dflt;
  }
  std::optional<int64_t> maybe_int(std::string_view key) const {
    const json* v = find(key);
    if (!v) return std::nullopt;
    return as_int(*v, key);
  }
  double opt_num(std::string_view key, double dflt) const {
    const json* v = find(key);
    if (!v) return dflt;
    GDN_CHECK(v->is_number(), "{}: field '{}' must be a number, got {}", label_, path(key),
              v->type_name());
    return v->get<double>();
  }
  bool opt_bool(std::string_view key, bool dflt) const {
    const json* v = find(key);
    if (!v) return dflt;
    GDN_CHECK(v->is_boolean(), "{}: field '{}' must be true or false, got {}", label_, path(key),
              v->type_name());
    return v->get<bool>();
  }
  std::string opt_str(std::string_view key, std::string dflt) const {
    const json* v = find(key);
    if (!v) return dflt;
    GDN_CHECK(v->is_string(), "{}: field '{}' must be a string, got {}", label_, path(key),
              v->type_name());
    return v->get<std::string>();
  }
  int64_t as_int(const json& v, std::string_view key) const {
    GDN_CHECK(v.is_number_integer(), "{}: field '{}' must be an integer, got {}{}", label_,
              path(key), v.type_name(), v.is_number() ? fmt::format(" {}", v.dump()) : "");
    return v.get<int64_t>();
  }

 private:
  const json& obj_;
  std::string prefix_;
  std::string_view label_;
};

// One RoPE key looked up in its three possible homes (see config.h).
struct RopeSources {
  const json* params = nullptr;   // rope_parameters (or its "full_attention" entry)
  const json* scaling = nullptr;  // rope_scaling
  const json* top = nullptr;      // the text config itself
  std::string params_path, scaling_path, top_prefix;
};

RopeSources rope_sources(const json& text, const std::string& prefix, std::string_view label) {
  RopeSources s;
  s.top = &text;
  s.top_prefix = prefix;
  auto rp = text.find("rope_parameters");
  if (rp != text.end() && !rp->is_null()) {
    GDN_CHECK(rp->is_object(), "{}: field '{}rope_parameters' must be an object, got {}", label,
              prefix, rp->type_name());
    s.params = &*rp;
    s.params_path = prefix + "rope_parameters";
    // HF 5.x allows one RoPE dict per layer type; only full-attention layers use RoPE here.
    auto fa = rp->find("full_attention");
    if (fa != rp->end() && fa->is_object()) {
      s.params = &*fa;
      s.params_path += ".full_attention";
    }
  }
  auto rs = text.find("rope_scaling");
  if (rs != text.end() && !rs->is_null()) {
    GDN_CHECK(rs->is_object(), "{}: field '{}rope_scaling' must be an object, got {}", label,
              prefix, rs->type_name());
    s.scaling = &*rs;
    s.scaling_path = prefix + "rope_scaling";
  }
  return s;
}

// The value of a RoPE key and the path it came from; null when absent everywhere. Values given in
// more than one place must agree.
std::pair<const json*, std::string> rope_value(const RopeSources& s, std::string_view key,
                                               std::string_view label,
                                               std::string_view legacy_key = {}) {
  std::vector<std::pair<const json*, std::string>> found;
  auto look = [&](const json* obj, const std::string& where, std::string_view k, bool top) {
    if (obj == nullptr || k.empty()) return;
    auto it = obj->find(std::string(k));
    if (it == obj->end() || it->is_null()) return;
    found.emplace_back(&*it, top ? where + std::string(k) : where + "." + std::string(k));
  };
  look(s.params, s.params_path, key, false);
  look(s.scaling, s.scaling_path, key, false);
  look(s.scaling, s.scaling_path, legacy_key, false);
  if (key != "rope_type") look(s.top, s.top_prefix, key, true);
  if (found.empty()) return {nullptr, {}};
  for (size_t i = 1; i < found.size(); ++i) {
    GDN_CHECK_HINT(*found[i].first == *found[0].first,
                   "keep one RoPE setting (HF 5.x reads rope_parameters)",
                   "{}: field '{}' = {} disagrees with '{}' = {}", label, found[i].second,
                   found[i].first->dump(), found[0].second, found[0].first->dump());
  }
  return found[0];
}

std::vector<int64_t> int_list(const json& v, const std::string& path, std::string_view label) {
  GDN_CHECK(v.is_array(), "{}: field '{}' must be a list of integers, got {}", label, path,
            v.type_name());
  std::vector<int64_t> out;
  for (const auto& e : v) {
    GDN_CHECK(e.is_number_integer(), "{}: field '{}' must be a list of integers, got an entry {}",
              label, path, e.dump());
    out.push_back(e.get<int64_t>());
  }
  return out;
}

void parse_text(const json& t, const std::string& prefix, std::string_view label, Qwen35Config& c) {
  FieldReader r(t, prefix, label);
  c.vocab_size = r.req_int("vocab_size");
  c.hidden_size = r.req_int("hidden_size");
  c.intermediate_size = r.req_int("intermediate_size");
  c.num_hidden_layers = r.req_int("num_hidden_layers");
  c.num_attention_heads = r.req_int("num_attention_heads");
  c.num_key_value_heads = r.req_int("num_key_value_heads");
  c.linear_num_key_heads = r.req_int("linear_num_key_heads");
  c.linear_num_value_heads = r.req_int("linear_num_value_heads");
  c.linear_key_head_dim = r.req_int("linear_key_head_dim");
  c.linear_value_head_dim = r.req_int("linear_value_head_dim");
  c.head_dim = r.opt_int("head_dim", 256);
  c.linear_conv_kernel_dim = r.opt_int("linear_conv_kernel_dim", 4);
  c.rms_norm_eps = r.opt_num("rms_norm_eps", 1e-6);
  c.initializer_range = r.opt_num("initializer_range", 0.02);
  c.hidden_act = r.opt_str("hidden_act", "silu");
  c.max_position_embeddings = r.opt_int("max_position_embeddings", 32768);
  c.tie_word_embeddings = r.opt_bool("tie_word_embeddings", false);
  c.attention_bias = r.opt_bool("attention_bias", false);
  c.attention_dropout = r.opt_num("attention_dropout", 0.0);
  c.pad_token_id = r.maybe_int("pad_token_id");
  c.bos_token_id = r.maybe_int("bos_token_id");
  c.eos_token_ids.clear();
  if (const json* e = r.find("eos_token_id")) {
    if (e->is_array()) {
      c.eos_token_ids = int_list(*e, r.path("eos_token_id"), label);
    } else {
      c.eos_token_ids.push_back(r.as_int(*e, "eos_token_id"));
    }
  }

  // layer_types wins over full_attention_interval, as in HF.
  c.layer_types.clear();
  if (const json* lt = r.find("layer_types")) {
    GDN_CHECK(lt->is_array(), "{}: field '{}' must be a list of strings, got {}", label,
              r.path("layer_types"), lt->type_name());
    for (size_t i = 0; i < lt->size(); ++i) {
      const json& e = (*lt)[i];
      GDN_CHECK(e.is_string() && (e == "linear_attention" || e == "full_attention"),
                "{}: field '{}[{}]' must be \"linear_attention\" or \"full_attention\", got {}",
                label, r.path("layer_types"), i, e.dump());
      c.layer_types.push_back(e == "full_attention" ? LayerType::Full : LayerType::Linear);
    }
    GDN_CHECK(static_cast<int64_t>(c.layer_types.size()) == c.num_hidden_layers,
              "{}: field '{}' has {} entries but num_hidden_layers is {}", label,
              r.path("layer_types"), c.layer_types.size(), c.num_hidden_layers);
  } else {
    int64_t interval = r.opt_int("full_attention_interval", 4);
    GDN_CHECK(interval >= 1, "{}: field '{}' must be at least 1, got {}", label,
              r.path("full_attention_interval"), interval);
    GDN_CHECK(c.num_hidden_layers >= 0 && c.num_hidden_layers <= 100000,
              "{}: field '{}' = {} is out of range", label, r.path("num_hidden_layers"),
              c.num_hidden_layers);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      c.layer_types.push_back((i + 1) % interval == 0 ? LayerType::Full : LayerType::Linear);
    }
  }

  RopeSources rs = rope_sources(t, prefix, label);
  if (auto [v, p] = rope_value(rs, "rope_type", label, "type"); v) {
    GDN_CHECK(v->is_string(), "{}: field '{}' must be a string, got {}", label, p, v->type_name());
    c.rope_type = v->get<std::string>();
  }
  if (auto [v, p] = rope_value(rs, "rope_theta", label); v) {
    GDN_CHECK(v->is_number(), "{}: field '{}' must be a number, got {}", label, p, v->type_name());
    c.rope_theta = v->get<double>();
  }
  if (auto [v, p] = rope_value(rs, "partial_rotary_factor", label); v) {
    GDN_CHECK(v->is_number(), "{}: field '{}' must be a number, got {}", label, p, v->type_name());
    c.partial_rotary_factor = v->get<double>();
  }
  if (auto [v, p] = rope_value(rs, "mrope_section", label); v) {
    c.mrope_section = int_list(*v, p, label);
  }
  if (auto [v, p] = rope_value(rs, "mrope_interleaved", label); v) {
    GDN_CHECK(v->is_boolean(), "{}: field '{}' must be true or false, got {}", label, p,
              v->type_name());
    c.mrope_interleaved = v->get<bool>();
  }
}

}  // namespace

void validate(const Qwen35Config& c, std::string_view label) {
  const std::string pre = c.nested ? "text_config." : "";
  auto positive = [&](std::string_view key, int64_t v) {
    GDN_CHECK(v > 0, "{}: field '{}{}' must be positive, got {}", label, pre, key, v);
  };
  positive("vocab_size", c.vocab_size);
  positive("hidden_size", c.hidden_size);
  positive("intermediate_size", c.intermediate_size);
  positive("num_hidden_layers", c.num_hidden_layers);
  positive("num_attention_heads", c.num_attention_heads);
  positive("num_key_value_heads", c.num_key_value_heads);
  positive("head_dim", c.head_dim);
  positive("linear_num_key_heads", c.linear_num_key_heads);
  positive("linear_num_value_heads", c.linear_num_value_heads);
  positive("linear_key_head_dim", c.linear_key_head_dim);
  positive("linear_value_head_dim", c.linear_value_head_dim);
  positive("linear_conv_kernel_dim", c.linear_conv_kernel_dim);
  positive("max_position_embeddings", c.max_position_embeddings);
  // Sizes multiply into tensor shapes and int32 token ids: keep them far from overflow.
  GDN_CHECK(c.vocab_size < (int64_t{1} << 31) && c.hidden_size < (int64_t{1} << 20) &&
                c.intermediate_size < (int64_t{1} << 22) && c.num_hidden_layers <= 4096 &&
                c.head_dim <= 4096 && c.linear_key_head_dim <= 4096 &&
                c.linear_value_head_dim <= 4096 && c.linear_conv_kernel_dim <= 64 &&
                c.num_attention_heads <= 4096 && c.linear_num_value_heads <= 4096,
            "{}: a size field is implausibly large (vocab {}, hidden {}, intermediate {}, layers "
            "{}, head_dim {}, linear head dims {}/{}, conv {})",
            label, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
            c.head_dim, c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim);
  GDN_CHECK(c.num_attention_heads % c.num_key_value_heads == 0,
            "{}: field '{}num_key_value_heads' ({}) does not divide num_attention_heads ({})",
            label, pre, c.num_key_value_heads, c.num_attention_heads);
  GDN_CHECK(c.linear_num_value_heads % c.linear_num_key_heads == 0,
            "{}: field '{}linear_num_key_heads' ({}) does not divide linear_num_value_heads ({})",
            label, pre, c.linear_num_key_heads, c.linear_num_value_heads);
  GDN_CHECK(static_cast<int64_t>(c.layer_types.size()) == c.num_hidden_layers,
            "{}: field '{}layer_types' has {} entries but num_hidden_layers is {}", label, pre,
            c.layer_types.size(), c.num_hidden_layers);
  GDN_CHECK(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps > 0,
            "{}: field '{}rms_norm_eps' must be positive, got {}", label, pre, c.rms_norm_eps);
  GDN_CHECK(std::isfinite(c.initializer_range) && c.initializer_range > 0,
            "{}: field '{}initializer_range' must be positive, got {}", label, pre,
            c.initializer_range);
  GDN_CHECK(
      std::isfinite(c.attention_dropout) && c.attention_dropout >= 0 && c.attention_dropout < 1,
      "{}: field '{}attention_dropout' must be in [0, 1), got {}", label, pre, c.attention_dropout);
  GDN_CHECK_HINT(c.hidden_act == "silu" || c.hidden_act == "swish",
                 "Qwen3.5 uses silu for the MLP and the GDN conv",
                 "{}: field '{}hidden_act' = \"{}\" is not supported (only silu)", label, pre,
                 c.hidden_act);
  GDN_CHECK_HINT(!c.attention_bias, "Qwen3.5 has no biases anywhere in the text model",
                 "{}: field '{}attention_bias' = true is not supported", label, pre);
  GDN_CHECK_HINT(c.rope_type == "default" || c.rope_type == "mrope",
                 "text-only training uses plain RoPE (M-RoPE with equal position streams)",
                 "{}: rope_type \"{}\" is not supported", label, c.rope_type);
  GDN_CHECK(std::isfinite(c.rope_theta) && c.rope_theta > 0,
            "{}: field 'rope_theta' must be positive, got {}", label, c.rope_theta);
  GDN_CHECK(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1,
            "{}: field 'partial_rotary_factor' must be in (0, 1], got {}", label,
            c.partial_rotary_factor);
  GDN_CHECK(c.rotary_dim() >= 2 && c.rotary_dim() % 2 == 0,
            "{}: rotary dimension int(head_dim {} * partial_rotary_factor {}) = {} must be even "
            "and at least 2",
            label, c.head_dim, c.partial_rotary_factor, c.rotary_dim());
  if (c.pad_token_id) {
    GDN_CHECK(*c.pad_token_id >= 0 && *c.pad_token_id < c.vocab_size,
              "{}: field '{}pad_token_id' = {} is outside the vocabulary [0, {})", label, pre,
              *c.pad_token_id, c.vocab_size);
  }
}

Qwen35Config parse_config(const json& j, std::string_view label) {
  GDN_CHECK(j.is_object(), "{}: the config is not a JSON object", label);
  Qwen35Config c;
  FieldReader top(j, "", label);
  const json* mt = top.find("model_type");
  GDN_CHECK_HINT(mt != nullptr,
                 "a Qwen3.5 config.json has \"model_type\": \"qwen3_5\" or \"qwen3_5_text\"",
                 "{}: required field 'model_type' is missing", label);
  std::string model_type = top.opt_str("model_type", "");
  if (model_type == "qwen3_5") {
    const json* t = top.find("text_config");
    GDN_CHECK(t != nullptr, "{}: required field 'text_config' is missing (model_type qwen3_5)",
              label);
    GDN_CHECK(t->is_object(), "{}: field 'text_config' must be an object, got {}", label,
              t->type_name());
    c.nested = true;
    parse_text(*t, "text_config.", label, c);
    bool text_tie = c.tie_word_embeddings;
    c.tie_word_embeddings = top.opt_bool("tie_word_embeddings", false);
    if (FieldReader(*t, "text_config.", label).find("tie_word_embeddings") &&
        text_tie != c.tie_word_embeddings) {
      log::warn(
          "{}: text_config.tie_word_embeddings = {} differs from the top-level flag {}; the "
          "top-level flag decides (as in HF's Qwen3_5ForConditionalGeneration)",
          label, text_tie, c.tie_word_embeddings);
    }
  } else if (model_type == "qwen3_5_text") {
    parse_text(j, "", label, c);
  } else {
    GDN_FAIL_HINT("gdntrain trains dense Qwen3.5 text models (qwen3_5 / qwen3_5_text)",
                  "{}: field 'model_type' = \"{}\" is not supported", label, model_type);
  }
  c.original = j;
  validate(c, label);
  return c;
}

Qwen35Config load_config(const std::string& path) {
  std::filesystem::path p(path);
  if (std::filesystem::is_directory(p)) p /= "config.json";
  std::ifstream in(p);
  GDN_CHECK_HINT(in.good(), "give a config.json file or a checkpoint directory containing one",
                 "cannot open config '{}'", p.string());
  std::stringstream ss;
  ss << in.rdbuf();
  json j;
  try {
    j = json::parse(ss.str());
  } catch (const json::exception& e) {
    GDN_FAIL("{}: not valid JSON: {}", p.string(), e.what());
  }
  return parse_config(j, p.string());
}

Qwen35Config tiny_config() {
  Qwen35Config c;
  c.vocab_size = 258;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 32;
  c.linear_num_key_heads = 2;
  c.linear_num_value_heads = 4;
  c.linear_key_head_dim = 16;
  c.linear_value_head_dim = 16;
  c.linear_conv_kernel_dim = 4;
  c.rms_norm_eps = 1e-6;
  c.initializer_range = 0.02;
  c.max_position_embeddings = 4096;
  c.tie_word_embeddings = true;
  c.rope_theta = 10000.0;
  c.partial_rotary_factor = 0.25;
  c.pad_token_id = 0;  // the byte tokenizer's pad id
  c.eos_token_ids = {1};
  c.layer_types = {LayerType::Linear, LayerType::Linear, LayerType::Linear, LayerType::Full};
  validate(c, "tiny_config");
  return c;
}

}  // namespace gdn::model
