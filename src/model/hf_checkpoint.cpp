// Hugging Face safetensors checkpoints in and out (weights.h): the HF tensor names, loading (one
// file or a sharded index) and saving (atomic files, shards, untouched tensors kept verbatim).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "gdn/core/error.h"
#include "gdn/core/safetensors.h"
#include "model/weights.h"

namespace gdn::model {

namespace fs = std::filesystem;
using json = nlohmann::json;

// --- names -------------------------------------------------------------------------------------

std::string hf_name(std::string_view canonical, WeightPrefix prefix) {
  constexpr std::string_view kModel = "model.";
  if (prefix == WeightPrefix::Multimodal && canonical.starts_with(kModel)) {
    return "model.language_model." + std::string(canonical.substr(kModel.size()));
  }
  return std::string(canonical);
}

bool is_untouched_family(std::string_view name) {
  return name.starts_with("model.visual.") || name.starts_with("mtp.");
}

// --- loading -----------------------------------------------------------------------------------

namespace {

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

struct SourceTensor {
  const SafeTensorsFile* file = nullptr;
  const SafeTensorInfo* info = nullptr;
};

// Every tensor of a checkpoint (one file or an index with its shards), by name.
struct OpenCheckpoint {
  std::string label;
  std::vector<std::unique_ptr<SafeTensorsFile>> files;
  std::map<std::string, SourceTensor> tensors;
};

json read_json_file(const fs::path& p) {
  std::ifstream in(p);
  GDN_CHECK(in.good(), "cannot open '{}'", p.string());
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return json::parse(ss.str());
  } catch (const json::exception& e) {
    GDN_FAIL("{}: not valid JSON: {}", p.string(), e.what());
  }
}

// weight_map of an index file, validated: {name: plain file name in the same directory}.
std::map<std::string, std::string> read_weight_map(const fs::path& index) {
  json j = read_json_file(index);
  GDN_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
            "{}: no \"weight_map\" object", index.string());
  std::map<std::string, std::string> m;
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    GDN_CHECK(it.value().is_string(), "{}: weight_map entry '{}' is not a file name",
              index.string(), it.key());
    std::string f = it.value().get<std::string>();
    GDN_CHECK(!f.empty() && f.find('/') == std::string::npos && f != "." && f != "..",
              "{}: weight_map entry '{}' names '{}', which is not a file in the same directory",
              index.string(), it.key(), f);
    m[it.key()] = f;
  }
  return m;
}

OpenCheckpoint open_checkpoint(const std::string& path) {
  fs::path p(path);
  fs::path index;
  fs::path single;
  if (fs::is_directory(p)) {
    if (fs::exists(p / kIndexFile)) {
      index = p / kIndexFile;
    } else if (fs::exists(p / kSingleFile)) {
      single = p / kSingleFile;
    } else {
      GDN_FAIL_HINT(
          "a Hugging Face checkpoint directory holds model.safetensors or "
          "model.safetensors.index.json",
          "'{}' has neither {} nor {}", path, kSingleFile, kIndexFile);
    }
  } else if (p.string().ends_with(".index.json")) {
    index = p;
  } else {
    single = p;
  }
  OpenCheckpoint ck;
  if (!single.empty()) {
    ck.label = single.string();
    ck.files.push_back(std::make_unique<SafeTensorsFile>(single.string()));
    for (const auto& t : ck.files[0]->tensors()) ck.tensors[t.name] = {ck.files[0].get(), &t};
    return ck;
  }
  ck.label = index.string();
  const auto weight_map = read_weight_map(index);
  std::map<std::string, const SafeTensorsFile*> by_file;
  for (const auto& [name, file] : weight_map) {
    if (by_file.contains(file)) continue;
    ck.files.push_back(std::make_unique<SafeTensorsFile>((index.parent_path() / file).string()));
    by_file[file] = ck.files.back().get();
  }
  for (const auto& [file, f] : by_file) {
    for (const auto& t : f->tensors()) {
      auto w = weight_map.find(t.name);
      GDN_CHECK(w != weight_map.end(),
                "{}: shard '{}' holds tensor '{}' which the index does not list", ck.label, file,
                t.name);
      GDN_CHECK(w->second == file, "{}: tensor '{}' is in shard '{}' but the index maps it to '{}'",
                ck.label, t.name, file, w->second);
      ck.tensors[t.name] = {f, &t};
    }
  }
  for (const auto& [name, file] : weight_map) {
    GDN_CHECK(ck.tensors.contains(name),
              "{}: the index maps '{}' to '{}', which does not contain it", ck.label, name, file);
  }
  return ck;
}

std::string shape_str(const std::vector<int64_t>& s) {
  return fmt::format("[{}]", fmt::join(s, ", "));
}

// "3 missing: a, b, c" with at most 12 names shown.
void append_list(std::string& msg, const char* what, const std::vector<std::string>& names) {
  if (names.empty()) return;
  msg += fmt::format("\n  {} {}:", names.size(), what);
  for (size_t i = 0; i < names.size() && i < 12; ++i) msg += "\n    " + names[i];
  if (names.size() > 12) msg += fmt::format("\n    ... and {} more", names.size() - 12);
}

void check_store_layout(const ParamStore& store, const Qwen35Config& c, std::string_view what) {
  auto want = param_specs(c);
  bool same = want.size() == store.size();
  for (size_t i = 0; same && i < want.size(); ++i) {
    same = want[i].name == store.spec(i).name && want[i].shape == store.spec(i).shape;
  }
  GDN_CHECK(same, "{}: the parameter store was not built from param_specs() of this config", what);
}

}  // namespace

void check_finite(const Tensor& t, std::string_view name, std::string_view label) {
  GDN_CHECK(t.dtype() == DType::F32 && t.device() == Device::CPU && t.is_contiguous(),
            "check_finite: '{}' must be a contiguous F32 host tensor", name);
  const float* p = t.ptr<float>();  // [numel]
  const int64_t n = t.numel();
  int64_t first = -1, count = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(p[i])) [[unlikely]] {
      if (first < 0) first = i;
      ++count;
    }
  }
  if (first < 0) return;
  const std::vector<int64_t> shape = t.shape_vec();
  std::vector<int64_t> index(shape.size());
  int64_t rest = first;
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = shape[d] > 0 ? rest % shape[d] : 0;
    rest = shape[d] > 0 ? rest / shape[d] : 0;
  }
  GDN_FAIL_HINT(
      "the file is corrupt or comes from a diverged run: load an earlier checkpoint",
      "{}: tensor '{}' holds a non-finite value {} at [{}] (element {}; {} of its {} values are "
      "not finite)",
      label, name, p[first], fmt::join(index, ", "), first, count, n);
}

HfExtras load_hf_weights(const std::string& path, const Qwen35Config& c, ParamStore& store) {
  check_store_layout(store, c, "load_hf_weights");
  OpenCheckpoint ck = open_checkpoint(path);
  HfExtras ex;
  bool multimodal = false;
  for (const auto& [name, src] : ck.tensors) {
    if (name.starts_with("model.language_model.")) multimodal = true;
  }
  ex.prefix = multimodal ? WeightPrefix::Multimodal : WeightPrefix::Text;

  std::vector<std::string> missing, unexpected, misshaped;
  std::set<std::string> expected;
  for (const ParamSpec& s : store.specs()) {
    const std::string n = hf_name(s.name, ex.prefix);
    expected.insert(n);
    auto it = ck.tensors.find(n);
    if (it == ck.tensors.end()) {
      missing.push_back(n);
      continue;
    }
    const SafeTensorInfo& info = *it->second.info;
    if (!info.known_dtype || !dtype_is_float(info.dtype)) {
      misshaped.push_back(
          fmt::format("{} has dtype {}, expected a float dtype", n, info.dtype_name));
    } else if (info.shape != s.shape) {
      misshaped.push_back(fmt::format("{} has shape {}, expected {}", n, shape_str(info.shape),
                                      shape_str(s.shape)));
    }
  }
  const SourceTensor* tied_head = nullptr;
  for (const auto& [name, src] : ck.tensors) {
    if (expected.contains(name)) continue;
    if (is_untouched_family(name)) continue;
    if (c.tie_word_embeddings && name == "lm_head.weight") {
      tied_head = &src;
      continue;
    }
    unexpected.push_back(name);
  }
  if (!missing.empty() || !unexpected.empty() || !misshaped.empty()) {
    std::string msg =
        fmt::format("{}: the checkpoint does not match the config ({} layout, prefix '{}')",
                    ck.label, c.nested ? "nested" : "flat",
                    ex.prefix == WeightPrefix::Multimodal ? "model.language_model." : "model.");
    append_list(msg, "missing", missing);
    append_list(msg, "unexpected", unexpected);
    append_list(msg, "mis-shaped", misshaped);
    GDN_FAIL_HINT(
        "check that config.json belongs to these weights (layer_types, head counts, "
        "tie_word_embeddings)",
        "{}", msg);
  }

  for (size_t i = 0; i < store.size(); ++i) {
    const std::string n = hf_name(store.spec(i).name, ex.prefix);
    const SourceTensor& src = ck.tensors.at(n);
    OwnedTensor v = src.file->load(n, DType::F32);
    check_finite(v.view(), n, ck.label);
    std::memcpy(store.tensor(i).data(), v.view().data(), static_cast<size_t>(v.view().nbytes()));
    ex.disk_dtypes[n] = src.info->dtype_name;
  }
  if (tied_head != nullptr) {
    // HF unties (with a warning) when both tensors exist and differ; gdntrain cannot, so a
    // tied config must come with an identical or absent lm_head.
    const SafeTensorInfo& info = *tied_head->info;
    Tensor embed = store.tensor("model.embed_tokens.weight");
    bool same = info.known_dtype && dtype_is_float(info.dtype) && info.shape == embed.shape_vec();
    if (same) {
      OwnedTensor head = tied_head->file->load("lm_head.weight", DType::F32);
      same =
          std::memcmp(head.view().data(), embed.data(), static_cast<size_t>(embed.nbytes())) == 0;
    }
    GDN_CHECK_HINT(
        same, "set \"tie_word_embeddings\": false in config.json to train a separate head",
        "{}: the config ties the embeddings but the checkpoint has an lm_head.weight that "
        "differs from {}",
        ck.label, hf_name("model.embed_tokens.weight", ex.prefix));
  }
  for (const auto& [name, src] : ck.tensors) {
    if (!is_untouched_family(name)) continue;
    RawTensor r;
    r.name = name;
    r.dtype = src.info->dtype_name;
    r.shape = src.info->shape;
    const auto* b = static_cast<const uint8_t*>(src.file->raw(*src.info));
    r.bytes.assign(b, b + (src.info->end - src.info->begin));
    ex.untouched.push_back(std::move(r));
  }
  return ex;
}

// --- saving ------------------------------------------------------------------------------------

void save_hf_weights(const std::string& dir, const Qwen35Config& c, const ParamStore& store,
                     const SaveOptions& opt, const std::vector<RawTensor>& untouched) {
  check_store_layout(store, c, "save_hf_weights");
  GDN_CHECK(opt.dtype == DType::F32 || opt.dtype == DType::BF16 || opt.dtype == DType::F16,
            "save_hf_weights: dtype {} is not a checkpoint dtype (use F32, BF16 or F16)",
            dtype_name(opt.dtype));
  GDN_CHECK(opt.max_shard_bytes > 0, "save_hf_weights: max_shard_bytes must be positive");

  struct Item {
    std::string name;
    int64_t param = -1;  // index into store, or -1 for a raw tensor
    const RawTensor* raw = nullptr;
    DType dtype = DType::F32;
    uint64_t bytes = 0;
  };
  std::vector<Item> items;
  std::set<std::string> names;
  for (size_t i = 0; i < store.size(); ++i) {
    const ParamSpec& s = store.spec(i);
    Item it;
    it.name = hf_name(s.name, opt.prefix);
    it.param = static_cast<int64_t>(i);
    it.dtype = opt.dtype;
    for (const auto& suf : opt.f32_suffixes) {
      if (s.name.ends_with(suf)) it.dtype = DType::F32;
    }
    it.bytes = static_cast<uint64_t>(s.numel() * dtype_size(it.dtype));
    names.insert(it.name);
    items.push_back(std::move(it));
  }
  for (const RawTensor& r : untouched) {
    GDN_CHECK(is_untouched_family(r.name),
              "save_hf_weights: raw tensor '{}' is not of an untouched family (model.visual.*, "
              "mtp.*)",
              r.name);
    GDN_CHECK(names.insert(r.name).second, "save_hf_weights: tensor '{}' given twice", r.name);
    items.push_back(Item{r.name, -1, &r, DType::F32, r.bytes.size()});
  }

  // Greedy sharding in the stable order; a tensor larger than the limit gets a shard of its own.
  std::vector<std::vector<size_t>> shards(1);
  uint64_t cur = 0, total = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!shards.back().empty() && cur + items[i].bytes > opt.max_shard_bytes) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(i);
    cur += items[i].bytes;
    total += items[i].bytes;
  }
  const size_t n = shards.size();

  fs::create_directories(dir);
  const fs::path d(dir);
  // Files of the checkpoint being replaced, to remove once the new one is complete.
  std::set<std::string> old_files;
  if (fs::exists(d / kIndexFile)) {
    try {
      for (const auto& [name, file] : read_weight_map(d / kIndexFile)) old_files.insert(file);
    } catch (const Error&) {
      // An unreadable old index is replaced below; its shards are left alone.
    }
    old_files.insert(kIndexFile);
  }
  if (fs::exists(d / kSingleFile)) old_files.insert(kSingleFile);

  json weight_map = json::object();
  std::set<std::string> new_files;
  for (size_t s = 0; s < n; ++s) {
    const std::string file = n == 1 ? std::string(kSingleFile)
                                    : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, n);
    new_files.insert(file);
    std::vector<OwnedTensor> keep;  // converted copies, alive until the shard is written
    std::vector<NamedTensor> tensors;
    for (size_t i : shards[s]) {
      const Item& it = items[i];
      NamedTensor nt;
      nt.name = it.name;
      if (it.raw != nullptr) {
        nt.raw_dtype = it.raw->dtype;
        nt.raw_shape = it.raw->shape;
        nt.raw = it.raw->bytes.data();
        nt.raw_bytes = it.raw->bytes.size();
      } else {
        Tensor v = store.tensor(static_cast<size_t>(it.param));
        if (it.dtype == DType::F32) {
          nt.tensor = v;
        } else {
          keep.push_back(convert(v, it.dtype));
          nt.tensor = keep.back().view();
        }
      }
      weight_map[it.name] = file;
      tensors.push_back(std::move(nt));
    }
    write_safetensors((d / file).string(), tensors, {{"format", "pt"}});
  }
  if (n > 1) {
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_file_atomic((d / kIndexFile).string(), index.dump(2) + "\n");
    new_files.insert(kIndexFile);
  }
  for (const std::string& f : old_files) {
    if (new_files.contains(f)) continue;
    std::error_code ec;
    fs::remove(d / f, ec);
  }
  fsync_directory(dir);
}

HfCheckpoint load_hf_checkpoint(const std::string& dir) {
  HfCheckpoint ck;
  ck.config = load_config(dir);
  ck.params = ParamStore(param_specs(ck.config));
  ck.extras = load_hf_weights(dir, ck.config, ck.params);
  return ck;
}

void save_hf_checkpoint(const std::string& dir, const Qwen35Config& c, const ParamStore& store,
                        const SaveOptions& opt, const std::vector<RawTensor>& untouched) {
  fs::create_directories(dir);
  save_hf_weights(dir, c, store, opt, untouched);
  save_config(c, (fs::path(dir) / "config.json").string());
}

}  // namespace gdn::model
