#include "train/config_tree.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include "gdn/core/env.h"
#include "gdn/core/error.h"

namespace gdn::train {

namespace {
std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  std::stringstream ss(path);
  std::string p;
  while (std::getline(ss, p, '.')) parts.push_back(p);
  return parts;
}

void collect_keys(const nlohmann::json& j, const std::string& prefix,
                  std::vector<std::string>& out) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    std::string k = prefix.empty() ? it.key() : prefix + "." + it.key();
    if (it->is_object())
      collect_keys(*it, k, out);
    else
      out.push_back(k);
  }
}

nlohmann::json parse_value(const std::string& text) {
  nlohmann::json v = nlohmann::json::parse(text, nullptr, false);
  if (!v.is_discarded()) return v;
  return nlohmann::json(text);  // a bare string
}

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r"), e = s.find_last_not_of(" \t\r");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}
}  // namespace

ConfigTree::ConfigTree(nlohmann::json defaults) : tree_(std::move(defaults)) {}

void ConfigTree::set_value(const std::string& path, const nlohmann::json& value) {
  // The tree is printed and saved as JSON, which holds UTF-8 only: refuse other bytes here, where
  // the key can be named (nlohmann's dump() would throw a type_error later, found by fuzz_config).
  try {
    (void)value.dump();
  } catch (const nlohmann::json::type_error&) {
    GDN_FAIL("configuration key '{}': the value is not valid UTF-8", path);
  }
  auto parts = split_path(path);
  nlohmann::json* node = &tree_;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!node->is_object() || !node->contains(parts[i])) {
      std::vector<std::string> keys;
      collect_keys(tree_, "", keys);
      std::string best;
      size_t best_d = SIZE_MAX;
      for (const auto& k : keys) {
        size_t d = env::edit_distance(k, path);
        if (d < best_d) {
          best_d = d;
          best = k;
        }
      }
      GDN_FAIL_HINT(
          fmt::format("did you mean '{}'? The effective configuration printed at start-up "
                      "lists every key",
                      best),
          "unknown configuration key '{}'", path);
    }
    node = &(*node)[parts[i]];
  }
  GDN_CHECK(!node->is_object(), "configuration key '{}' is a section, not a value", path);
  const bool num_ok = node->is_number() && value.is_number();
  GDN_CHECK(node->is_null() || num_ok || node->type() == value.type(),
            "configuration key '{}' expects a {} value, got {}", path, node->type_name(),
            value.dump());
  if (node->is_number_integer() && value.is_number_float()) {
    double d = value.get<double>();
    // The range check comes first: casting a double outside int64's range is undefined (UBSan,
    // found by fuzz_config with 4e42).
    GDN_CHECK(std::isfinite(d) && d >= -9.2e18 && d <= 9.2e18 && d == std::trunc(d),
              "configuration key '{}' expects an integer, got {}", path, value.dump());
    *node = static_cast<int64_t>(d);
  } else {
    *node = value;
  }
}

void ConfigTree::merge(const nlohmann::json& src, nlohmann::json& dst, const std::string& prefix) {
  GDN_CHECK(src.is_object(), "configuration {} must be an object",
            prefix.empty() ? "file" : prefix);
  for (auto it = src.begin(); it != src.end(); ++it) {
    std::string k = prefix.empty() ? it.key() : prefix + "." + it.key();
    if (it->is_object())
      merge(*it, dst, k);
    else
      set_value(k, *it);
  }
}

void ConfigTree::merge_file(const std::string& path) {
  std::ifstream in(path);
  GDN_CHECK_HINT(in.good(), "check the path given with --config", "cannot read config file '{}'",
                 path);
  std::stringstream ss;
  ss << in.rdbuf();
  merge_text(ss.str(), path.size() >= 5 && path.substr(path.size() - 5) == ".json", path);
}

void ConfigTree::merge_text(const std::string& text, bool json, const std::string& path) {
  if (json) {
    nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    GDN_CHECK(!j.is_discarded(), "config file '{}' is not valid JSON", path);
    merge(j, tree_, "");
    return;
  }
  std::string line, section;
  int lineno = 0;
  std::istringstream lines(text);
  while (std::getline(lines, line)) {
    ++lineno;
    auto hash = line.find('#');
    if (hash != std::string::npos) line = line.substr(0, hash);
    line = trim(line);
    if (line.empty()) continue;
    if (line.front() == '[') {
      GDN_CHECK(line.back() == ']', "{}:{}: malformed section header '{}'", path, lineno, line);
      section = trim(line.substr(1, line.size() - 2));
      continue;
    }
    auto eq = line.find('=');
    GDN_CHECK(eq != std::string::npos, "{}:{}: expected 'key = value', got '{}'", path, lineno,
              line);
    std::string key = trim(line.substr(0, eq)), val = trim(line.substr(eq + 1));
    if (val.size() >= 2 && val.front() == '\'' && val.back() == '\'')
      val = "\"" + val.substr(1, val.size() - 2) + "\"";
    set_value(section.empty() ? key : section + "." + key, parse_value(val));
  }
}

void ConfigTree::set(const std::string& assignment) {
  auto eq = assignment.find('=');
  GDN_CHECK_HINT(eq != std::string::npos, "write --set key.path=value, e.g. --set optim.lr=1e-3",
                 "--set '{}' has no '='", assignment);
  set_value(trim(assignment.substr(0, eq)), parse_value(trim(assignment.substr(eq + 1))));
}

const nlohmann::json& ConfigTree::at(const std::string& path) const {
  const nlohmann::json* node = &tree_;
  for (const auto& p : split_path(path)) {
    GDN_CHECK(node->is_object() && node->contains(p), "internal: configuration key '{}' missing",
              path);
    node = &(*node)[p];
  }
  return *node;
}

double ConfigTree::get_double(const std::string& path) const {
  const auto& v = at(path);
  GDN_CHECK(v.is_number(), "configuration key '{}' must be a number, got {}", path, v.dump());
  return v.get<double>();
}

int64_t ConfigTree::get_int(const std::string& path) const {
  const auto& v = at(path);
  GDN_CHECK(v.is_number_integer(), "configuration key '{}' must be an integer, got {}", path,
            v.dump());
  return v.get<int64_t>();
}

bool ConfigTree::get_bool(const std::string& path) const {
  const auto& v = at(path);
  GDN_CHECK(v.is_boolean(), "configuration key '{}' must be true or false, got {}", path, v.dump());
  return v.get<bool>();
}

std::string ConfigTree::get_string(const std::string& path) const {
  const auto& v = at(path);
  GDN_CHECK(v.is_string(), "configuration key '{}' must be a string, got {}", path, v.dump());
  return v.get<std::string>();
}

}  // namespace gdn::train
