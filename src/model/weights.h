// Qwen3.5 trained parameters: the Hugging Face tensor names and shapes (gdn_spec.md §1.8), a
// single-allocation fp32 parameter store, HF-rule initialisation, and HF safetensors load/save.
//
// Names. A parameter's canonical name is its Qwen3_5ForCausalLM (text-only) state-dict name:
// "model.embed_tokens.weight", "model.layers.{i}.linear_attn.A_log", "model.norm.weight",
// "lm_head.weight". Official checkpoints (Qwen3_5ForConditionalGeneration) put the text model
// under "model.language_model." instead of "model."; hf_name() maps between the two. lm_head is
// absent when the config ties the embeddings.
//
// Shapes are the HF shapes, conv1d.weight included: [conv_dim, 1, W] (depthwise Conv1d). The
// contiguous data is the same as a [conv_dim, W] matrix; ops reshape the view.
//
// Initialisation (HF's Qwen3_5PreTrainedModel._init_weights on top of PreTrainedModel's):
//   Linear / Conv1d weights, embed_tokens, lm_head   normal(0, initializer_range)
//   embed_tokens row pad_token_id (when set)           0   (nn.Embedding padding_idx)
//   zero-centred RMSNorms (input_layernorm, post_attention_layernorm, model.norm,
//     self_attn.q_norm, self_attn.k_norm)              0   (the norm multiplies by 1 + w)
//   linear_attn.norm (gated, plain)                    1
//   linear_attn.dt_bias                                1
//   linear_attn.A_log                                  log(uniform(0.01, 16))  (the 0.01 floor is
//                                                      HF's current Qwen3.5 rule; it keeps log
//                                                      finite)
// Values come from the counter RNG (core/rng.h) with stream = rng::stream_id(canonical name) and
// index = element index, so a tensor's values depend only on (seed, name): the same in any order,
// on any thread count, and whether or not other tensors exist.
//
// Checkpoint files (engine_notes.md §A.7.1): a directory with model.safetensors, or sharded
// model-0000i-of-0000n.safetensors + model.safetensors.index.json ({"metadata": {"total_size"},
// "weight_map": {name: file}}). Trained tensors may be F32, BF16, F16 or F64 on disk and are
// converted to fp32 on load. Tensors of parts gdntrain does not train (model.visual.*, mtp.*) are
// kept as raw bytes and written back untouched. Anything else that is missing, unexpected or
// mis-shaped is one error listing every offending name.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gdn/core/arena.h"
#include "gdn/core/tensor.h"
#include "model/config.h"

namespace gdn::model {

enum class InitKind : uint8_t {
  Normal,     // normal(0, initializer_range)
  Embedding,  // normal(0, initializer_range), row pad_token_id zeroed
  Zeros,      // zero-centred RMSNorm weight
  Ones,       // gated-norm weight, dt_bias
  ALog,       // log(uniform(0.01, 16))
};

struct ParamSpec {
  std::string name;            // canonical (text-only) HF name
  std::vector<int64_t> shape;  // HF shape
  InitKind init = InitKind::Normal;
  int64_t numel() const;
};

// Every trained parameter of the config, in the stable order: embed_tokens; per layer
// input_layernorm, the mixer (GDN: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, dt_bias,
// A_log, norm, out_proj; attention: q_proj, k_proj, v_proj, o_proj, q_norm, k_norm),
// post_attention_layernorm, mlp gate_proj, up_proj, down_proj; model.norm; lm_head (untied only).
std::vector<ParamSpec> param_specs(const Qwen35Config& c);

// Named fp32 host tensors in one contiguous allocation (ARCHITECTURE.md §7). Each tensor starts
// on a 64-byte boundary; the gaps (< 16 floats each) are zero and stay zero under any elementwise
// update of flat() by a same-layout gradient store, so optimizers may run over flat() directly.
// Two stores built from the same specs have the same layout (same offsets).
class ParamStore {
 public:
  ParamStore() = default;
  explicit ParamStore(std::vector<ParamSpec> specs);  // zero-filled
  ParamStore(ParamStore&& o) noexcept;
  ParamStore& operator=(ParamStore&& o) noexcept;
  ParamStore(const ParamStore&) = delete;
  ParamStore& operator=(const ParamStore&) = delete;

  size_t size() const { return specs_.size(); }
  const std::vector<ParamSpec>& specs() const { return specs_; }
  const ParamSpec& spec(size_t i) const { return specs_.at(i); }
  // F32 host view of parameter i / of the named parameter (throws naming an unknown name).
  Tensor tensor(size_t i) const;
  Tensor tensor(std::string_view name) const { return tensor(index(name)); }
  std::optional<size_t> find(std::string_view name) const;
  size_t index(std::string_view name) const;
  int64_t offset(size_t i) const { return offsets_.at(i); }  // in floats from flat().data()

  // The whole buffer, padding included.
  std::span<float> flat() { return {base_, static_cast<size_t>(flat_numel_)}; }
  std::span<const float> flat() const { return {base_, static_cast<size_t>(flat_numel_)}; }
  int64_t numel() const { return numel_; }  // parameter elements, padding excluded

 private:
  std::vector<ParamSpec> specs_;
  std::vector<int64_t> offsets_;
  std::map<std::string, size_t, std::less<>> index_;
  Arena arena_;
  float* base_ = nullptr;  // [flat_numel_]
  int64_t flat_numel_ = 0;
  int64_t numel_ = 0;
};

// Indices (into ParamStore / param_specs) of every parameter, per layer; -1 where a layer of the
// other kind has no such parameter, lm_head -1 when tied (use embed).
struct LayerParamIds {
  LayerType type = LayerType::Linear;
  int64_t input_norm = -1, post_norm = -1, mlp_gate = -1, mlp_up = -1, mlp_down = -1;
  int64_t in_proj_qkv = -1, in_proj_z = -1, in_proj_b = -1, in_proj_a = -1, conv1d = -1,
          dt_bias = -1, a_log = -1, gated_norm = -1, out_proj = -1;                      // GDN
  int64_t q_proj = -1, k_proj = -1, v_proj = -1, o_proj = -1, q_norm = -1, k_norm = -1;  // attn
};
struct ModelParamIds {
  int64_t embed = -1, final_norm = -1, lm_head = -1;
  std::vector<LayerParamIds> layers;
};
ModelParamIds param_ids(const ParamStore& store, const Qwen35Config& c);
// The same from the specs alone (no parameter memory needed).
ModelParamIds param_ids(std::span<const ParamSpec> specs, const Qwen35Config& c);

// Initialises every parameter by HF's rules from `seed` (see the header comment).
void init_params(ParamStore& store, const Qwen35Config& c, uint64_t seed);
// Initialises one tensor (contiguous host F32/F64/BF16) as parameter `spec`.
void init_param(const ParamSpec& spec, const Tensor& t, const Qwen35Config& c, uint64_t seed);

// --- Hugging Face safetensors ------------------------------------------------------------------

enum class WeightPrefix : uint8_t {
  Text,        // "model."                 (Qwen3_5ForCausalLM)
  Multimodal,  // "model.language_model."  (Qwen3_5ForConditionalGeneration, official files)
};
// The prefix HF uses for the config's model class: Multimodal for the nested layout.
inline WeightPrefix prefix_for(const Qwen35Config& c) {
  return c.nested ? WeightPrefix::Multimodal : WeightPrefix::Text;
}
// Maps a canonical name to its name under `prefix` ("lm_head.weight" is the same in both).
std::string hf_name(std::string_view canonical, WeightPrefix prefix);
// True for tensors of parts gdntrain does not train, kept verbatim: "model.visual.*", "mtp.*".
bool is_untouched_family(std::string_view hf_tensor_name);

// A tensor kept as raw bytes (any dtype, F8 included).
struct RawTensor {
  std::string name;
  std::string dtype;  // safetensors dtype name
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// What a load found besides the trained parameters.
struct HfExtras {
  WeightPrefix prefix = WeightPrefix::Text;
  std::vector<RawTensor> untouched;                // name order
  std::map<std::string, std::string> disk_dtypes;  // HF name -> dtype name, trained tensors
};

// Loads `path` (a checkpoint directory, a .safetensors file or a model.safetensors.index.json)
// into `store`, which must have the layout of param_specs(c). The prefix is detected.
// Every loaded tensor is checked to be finite: a NaN or inf weight is an error naming the first
// such tensor and element (a corrupt or diverged checkpoint never loads silently).
HfExtras load_hf_weights(const std::string& path, const Qwen35Config& c, ParamStore& store);

// Throws gdn::Error naming `name`, `label` (the file), the first non-finite element's index and
// value, and how many there are, when the F32 host tensor `t` holds a NaN or inf.
void check_finite(const Tensor& t, std::string_view name, std::string_view label);

struct SaveOptions {
  DType dtype = DType::BF16;                 // F32, BF16 or F16 on disk
  WeightPrefix prefix = WeightPrefix::Text;  // prefix_for(config) is what HF expects
  // Shard when the tensors exceed this many bytes (HF's "5GB" default = 5e9 bytes).
  uint64_t max_shard_bytes = 5'000'000'000ull;
  // Parameters whose canonical name ends with one of these stay F32 on disk whatever `dtype`
  // is: the official Qwen3.5 files keep A_log in F32 (gdn_spec.md §1.5.1).
  std::vector<std::string> f32_suffixes = {"linear_attn.A_log"};
};

// Writes the weights into directory `dir` (created if needed): model.safetensors, or shards plus
// model.safetensors.index.json when larger than max_shard_bytes. Every file is written
// atomically (temporary name, fsync, rename); the index is written after its shards. Files of a
// previous checkpoint in `dir` that the new one does not use (model.safetensors vs shards named
// in the old index) are removed after the new files are complete. `untouched` tensors are
// written byte for byte (their names must be untouched families).
void save_hf_weights(const std::string& dir, const Qwen35Config& c, const ParamStore& store,
                     const SaveOptions& opt, const std::vector<RawTensor>& untouched = {});

// config.json + weights.
struct HfCheckpoint {
  Qwen35Config config;
  ParamStore params;
  HfExtras extras;
};
HfCheckpoint load_hf_checkpoint(const std::string& dir);
void save_hf_checkpoint(const std::string& dir, const Qwen35Config& c, const ParamStore& store,
                        const SaveOptions& opt, const std::vector<RawTensor>& untouched = {});

}  // namespace gdn::model
