// Qwen3.5 text-model configuration, read from and written to a Hugging Face config.json.
//
// Two layouts are accepted (gdn_spec.md §1.1):
//   * flat:   {"model_type": "qwen3_5_text", "hidden_size": ..., ...}      (Qwen3_5ForCausalLM)
//   * nested: {"model_type": "qwen3_5", "text_config": {...}, "vision_config": {...}, ...}
//             (Qwen3_5ForConditionalGeneration, the class of the official checkpoints)
// Only the text model is read; every other key is kept verbatim in `original` and written back.
//
// Required fields (no silent 9B default for a shape): vocab_size, hidden_size, intermediate_size,
// num_hidden_layers, num_attention_heads, num_key_value_heads, linear_num_key_heads,
// linear_num_value_heads, linear_key_head_dim, linear_value_head_dim.
// Optional fields take HF's defaults (configuration_qwen3_5.py): head_dim 256,
// linear_conv_kernel_dim 4, rms_norm_eps 1e-6, initializer_range 0.02, hidden_act "silu",
// max_position_embeddings 32768, tie_word_embeddings false, attention_bias false,
// attention_dropout 0, layer_types from full_attention_interval (default 4: layer i is full
// attention iff (i+1) % interval == 0), partial_rotary_factor 0.25, rope_theta 10000 (HF's
// generic default; every published config sets 1e7), rope_type "default".
//
// RoPE parameters are looked up, per key, in `rope_parameters` (HF 5.x), then `rope_scaling`
// (HF 4.x), then the top level of the text config (rope_theta / partial_rotary_factor). A key
// given in two places with different values is an error naming both places.
//
// tie_word_embeddings: HF 5.x reads the flag of the config the model class owns
// (PreTrainedModel.get_expanded_tied_weights_keys reads self.config.tie_word_embeddings). For the
// nested layout that is Qwen3_5ForConditionalGeneration's top-level config, so the TOP-LEVEL flag
// decides (default false); a different text_config flag is ignored with a warning. For the flat
// layout the flag of the (only) config decides.
//
// Not supported (clear error): hidden_act other than silu, attention_bias true, a rope_type other
// than default/mrope (text-only M-RoPE with equal position streams is plain 1-D RoPE, §1.6).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace gdn::model {

enum class LayerType : uint8_t { Linear, Full };  // "linear_attention" (GDN), "full_attention"
std::string_view layer_type_name(LayerType t);

struct Qwen35Config {
  bool nested = false;  // "qwen3_5" with text_config (true) or flat "qwen3_5_text" (false)

  int64_t vocab_size = 0;         // V
  int64_t hidden_size = 0;        // D
  int64_t intermediate_size = 0;  // I
  int64_t num_hidden_layers = 0;
  // Full (gated) attention.
  int64_t num_attention_heads = 0;  // Hq
  int64_t num_key_value_heads = 0;  // Hkv
  int64_t head_dim = 256;           // hd
  // Gated DeltaNet.
  int64_t linear_num_key_heads = 0;    // Hk
  int64_t linear_num_value_heads = 0;  // Hv
  int64_t linear_key_head_dim = 0;     // dk
  int64_t linear_value_head_dim = 0;   // dv
  int64_t linear_conv_kernel_dim = 4;  // W

  double rms_norm_eps = 1e-6;
  double initializer_range = 0.02;
  std::string hidden_act = "silu";
  int64_t max_position_embeddings = 32768;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  double attention_dropout = 0.0;

  // RoPE.
  std::string rope_type = "default";
  double rope_theta = 10000.0;
  double partial_rotary_factor = 0.25;
  std::vector<int64_t> mrope_section;  // empty when absent
  bool mrope_interleaved = false;

  std::optional<int64_t> pad_token_id;  // HF zeroes this embedding row at init
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;  // HF allows an int or a list

  std::vector<LayerType> layer_types;  // [num_hidden_layers]

  // The JSON this config was read from (null for a config built in code). The writer starts
  // from it so that every key gdntrain does not model survives a load/save round trip.
  nlohmann::json original;

  // --- derived sizes (gdn_spec.md §1.5, §1.6) ---
  int64_t key_dim() const { return linear_num_key_heads * linear_key_head_dim; }        // Hk·dk
  int64_t value_dim() const { return linear_num_value_heads * linear_value_head_dim; }  // Hv·dv
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
  int64_t gqa_ratio() const { return linear_num_value_heads / linear_num_key_heads; }  // r
  int64_t rotary_dim() const {
    return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor);
  }
  int64_t q_proj_rows() const { return 2 * num_attention_heads * head_dim; }  // query + gate
  bool is_full_attention(int64_t layer) const {
    return layer_types.at(static_cast<size_t>(layer)) == LayerType::Full;
  }
  int64_t num_full_attention_layers() const;
  int64_t num_linear_attention_layers() const {
    return num_hidden_layers - num_full_attention_layers();
  }
};

// Parses a config.json document. `label` (usually the path) prefixes every error message, and
// every message names the field, e.g. "config.json: field 'text_config.hidden_size' must be an
// integer, got string". The result is validated.
Qwen35Config parse_config(const nlohmann::json& j, std::string_view label = "config.json");
// Reads `path`: a config.json file, or a directory containing one.
Qwen35Config load_config(const std::string& path);

// Checks the invariants (positive sizes, heads dividing, layer_types length, supported options);
// throws gdn::Error naming the field. parse_config calls it; call it after editing a config.
void validate(const Qwen35Config& c, std::string_view label = "config");

// The config.json document for `c`: `c.original` with only the fields whose values differ from
// what `original` says rewritten (in the place they were read from); for a config built in code,
// a complete flat qwen3_5_text document that transformers can load.
nlohmann::json to_json(const Qwen35Config& c);
// Writes to_json(c) atomically to `path` (a file path; a directory gets config.json inside).
void save_config(const Qwen35Config& c, const std::string& path);

// A tiny Qwen3.5 for tests and the built-in default task: vocab 258 (the byte tokenizer of
// `gdntrain prepare`), D=64, I=128, 4 layers (GDN, GDN, GDN, full attention), attention 4/2
// heads of 32 (rotary 8), GDN Hk=2, Hv=4 (grouped, r=2), dk=dv=16, W=4, tied embeddings,
// rope_theta 10000.
Qwen35Config tiny_config();

}  // namespace gdn::model
