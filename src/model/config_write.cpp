// Writing a Qwen3.5 config as a Hugging Face config.json (config.h): the document and the file.
#include <filesystem>
#include <optional>
#include <string>

#include "gdn/core/error.h"
#include "gdn/core/safetensors.h"
#include "model/config.h"

namespace gdn::model {

using json = nlohmann::json;

namespace {

json eos_json(const Qwen35Config& c, const json* original) {
  if (c.eos_token_ids.empty()) return nullptr;
  if (c.eos_token_ids.size() == 1 && !(original && original->is_array())) {
    return c.eos_token_ids[0];
  }
  return c.eos_token_ids;
}

json layer_types_json(const Qwen35Config& c) {
  json a = json::array();
  for (LayerType t : c.layer_types) a.push_back(std::string(layer_type_name(t)));
  return a;
}

json optional_json(const std::optional<int64_t>& v) { return v ? json(*v) : json(nullptr); }

}  // namespace

json to_json(const Qwen35Config& c) {
  validate(c, "to_json");
  std::optional<Qwen35Config> base;
  json out;
  if (!c.original.is_null()) {
    base = parse_config(c.original, "the original config");
    GDN_CHECK(base->nested == c.nested,
              "to_json: the config was read as {} but is now marked {}; changing the layout is "
              "not supported",
              base->nested ? "nested" : "flat", c.nested ? "nested" : "flat");
    out = c.original;
  } else if (c.nested) {
    out = json::object();
    out["architectures"] = json::array({"Qwen3_5ForConditionalGeneration"});
    out["model_type"] = "qwen3_5";
    out["text_config"] = json::object({{"model_type", "qwen3_5_text"}});
  } else {
    out = json::object();
    out["architectures"] = json::array({"Qwen3_5ForCausalLM"});
    out["model_type"] = "qwen3_5_text";
  }
  json& t = c.nested ? out["text_config"] : out;

  // put(key, value, base value): write only when there is no original or the value changed.
  auto put = [&](json& obj, const char* key, const json& v, const json& b) {
    if (!base || v != b) obj[key] = v;
  };
  const Qwen35Config& b = base ? *base : c;
  put(t, "vocab_size", c.vocab_size, b.vocab_size);
  put(t, "hidden_size", c.hidden_size, b.hidden_size);
  put(t, "intermediate_size", c.intermediate_size, b.intermediate_size);
  put(t, "num_hidden_layers", c.num_hidden_layers, b.num_hidden_layers);
  put(t, "num_attention_heads", c.num_attention_heads, b.num_attention_heads);
  put(t, "num_key_value_heads", c.num_key_value_heads, b.num_key_value_heads);
  put(t, "head_dim", c.head_dim, b.head_dim);
  put(t, "linear_num_key_heads", c.linear_num_key_heads, b.linear_num_key_heads);
  put(t, "linear_num_value_heads", c.linear_num_value_heads, b.linear_num_value_heads);
  put(t, "linear_key_head_dim", c.linear_key_head_dim, b.linear_key_head_dim);
  put(t, "linear_value_head_dim", c.linear_value_head_dim, b.linear_value_head_dim);
  put(t, "linear_conv_kernel_dim", c.linear_conv_kernel_dim, b.linear_conv_kernel_dim);
  put(t, "rms_norm_eps", c.rms_norm_eps, b.rms_norm_eps);
  put(t, "initializer_range", c.initializer_range, b.initializer_range);
  put(t, "hidden_act", c.hidden_act, b.hidden_act);
  put(t, "max_position_embeddings", c.max_position_embeddings, b.max_position_embeddings);
  put(t, "attention_bias", c.attention_bias, b.attention_bias);
  put(t, "attention_dropout", c.attention_dropout, b.attention_dropout);
  if (!base || c.pad_token_id != b.pad_token_id) t["pad_token_id"] = optional_json(c.pad_token_id);
  if (!base || c.bos_token_id != b.bos_token_id) t["bos_token_id"] = optional_json(c.bos_token_id);
  if (!base || c.eos_token_ids != b.eos_token_ids) {
    auto it = t.find("eos_token_id");
    t["eos_token_id"] = eos_json(c, it != t.end() ? &*it : nullptr);
  }
  if (!base || c.layer_types != b.layer_types) t["layer_types"] = layer_types_json(c);
  if (!base || c.tie_word_embeddings != b.tie_word_embeddings) {
    out["tie_word_embeddings"] = c.tie_word_embeddings;
    // Keep a text_config copy of the flag consistent rather than contradictory.
    if (c.nested && t.contains("tie_word_embeddings")) {
      t["tie_word_embeddings"] = c.tie_word_embeddings;
    }
  }

  // RoPE: write a changed key wherever the original has it (keeping the places consistent);
  // otherwise into rope_parameters (or rope_scaling when only that exists).
  auto put_rope = [&](const char* key, const json& v, bool changed) {
    if (base && !changed) return;
    std::vector<json*> homes;
    json* rp = t.contains("rope_parameters") && t["rope_parameters"].is_object()
                   ? &t["rope_parameters"]
                   : nullptr;
    if (rp && rp->contains("full_attention") && (*rp)["full_attention"].is_object()) {
      rp = &(*rp)["full_attention"];
    }
    json* rs =
        t.contains("rope_scaling") && t["rope_scaling"].is_object() ? &t["rope_scaling"] : nullptr;
    if (rp && rp->contains(key)) homes.push_back(rp);
    if (rs && rs->contains(key)) homes.push_back(rs);
    if (std::string_view(key) == "rope_type" && rs && rs->contains("type")) (*rs)["type"] = v;
    if (std::string_view(key) != "rope_type" && t.contains(key) && !t[key].is_null()) {
      homes.push_back(&t);
    }
    if (homes.empty()) {
      if (!rp && !rs) {
        t["rope_parameters"] = json::object();
        rp = &t["rope_parameters"];
      }
      homes.push_back(rp ? rp : rs);
    }
    for (json* h : homes) (*h)[key] = v;
  };
  put_rope("rope_type", c.rope_type, c.rope_type != b.rope_type);
  put_rope("rope_theta", c.rope_theta, c.rope_theta != b.rope_theta);
  put_rope("partial_rotary_factor", c.partial_rotary_factor,
           c.partial_rotary_factor != b.partial_rotary_factor);
  if (!c.mrope_section.empty() || (base && !b.mrope_section.empty())) {
    put_rope("mrope_section", c.mrope_section, c.mrope_section != b.mrope_section);
    put_rope("mrope_interleaved", c.mrope_interleaved, c.mrope_interleaved != b.mrope_interleaved);
  }
  return out;
}

void save_config(const Qwen35Config& c, const std::string& path) {
  std::filesystem::path p(path);
  if (std::filesystem::is_directory(p)) p /= "config.json";
  json j = to_json(c);
  // The document must read back as the same model: catch a writer bug before it reaches disk.
  Qwen35Config back = parse_config(j, p.string());
  GDN_CHECK(
      back.layer_types == c.layer_types && back.hidden_size == c.hidden_size &&
          back.tie_word_embeddings == c.tie_word_embeddings && back.rope_theta == c.rope_theta &&
          back.partial_rotary_factor == c.partial_rotary_factor,
      "internal: the written config for '{}' does not read back as the same model", p.string());
  write_file_atomic(p.string(), j.dump(2) + "\n");
}

}  // namespace gdn::model
