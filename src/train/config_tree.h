// Training configuration: defaults (JSON) ← a config file (JSON, or TOML-like `key = value` lines
// with [section] headers) ← `--set key.path=value` overrides. Every key a user sets must exist in
// the defaults: a typo is an error naming the closest known key. The effective tree is printed and
// saved with the run.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace gdn::train {

class ConfigTree {
 public:
  explicit ConfigTree(nlohmann::json defaults);
  // Merges a file: `.json` as JSON; anything else as simple TOML (sections, key = value, values
  // parsed as JSON scalars/arrays or bare strings, # comments).
  void merge_file(const std::string& path);
  // The same for a file's text: `json` picks the format, `path` names it in errors.
  void merge_text(const std::string& text, bool json, const std::string& path);
  // "optim.lr=1e-3", "data.path=/x", "model.layers=[1,2]".
  void set(const std::string& assignment);
  const nlohmann::json& json() const { return tree_; }

  // Typed access by dotted path; errors name the key and the expected type.
  double get_double(const std::string& path) const;
  int64_t get_int(const std::string& path) const;
  bool get_bool(const std::string& path) const;
  std::string get_string(const std::string& path) const;
  const nlohmann::json& at(const std::string& path) const;

 private:
  void merge(const nlohmann::json& src, nlohmann::json& dst, const std::string& prefix);
  void set_value(const std::string& path, const nlohmann::json& value);
  nlohmann::json tree_;
};

}  // namespace gdn::train
