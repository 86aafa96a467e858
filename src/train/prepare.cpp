#include "train/prepare.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "gdn/core/arena.h"
#include "gdn/core/error.h"
#include "gdn/core/log.h"

namespace gdn::train {

void ByteTokenizer::encode(std::string_view text, std::vector<int32_t>& out) {
  out.reserve(out.size() + text.size());
  for (char ch : text) out.push_back(static_cast<unsigned char>(ch) + kByteOffset);
}

std::string ByteTokenizer::decode(std::span<const int32_t> ids) {
  std::string s;
  for (int32_t id : ids) {
    GDN_CHECK(id >= 0 && id < kVocabSize, "ByteTokenizer: id {} is outside the vocabulary [0, {})",
              id, kVocabSize);
    if (id >= kByteOffset) s.push_back(static_cast<char>(id - kByteOffset));
  }
  return s;
}

namespace {
bool is_jsonl(const std::string& path, InputFormat f) {
  if (f != InputFormat::Auto) return f == InputFormat::Jsonl;
  return path.ends_with(".jsonl") || path.ends_with(".json");
}
}  // namespace

PrepareStats prepare_dataset(const PrepareOptions& opt) {
  GDN_CHECK(!opt.inputs.empty(), "prepare: no input files");
  GDN_CHECK(!opt.output_prefix.empty(), "prepare: no output prefix");
  GDN_CHECK(opt.progress_every_bytes > 0, "prepare: the progress interval must be positive");
  // Open every input first so that a typo fails before any work.
  for (const auto& in : opt.inputs) {
    std::ifstream f(in, std::ios::binary);
    GDN_CHECK(f.good(), "prepare: cannot open input '{}': {}", in, std::strerror(errno));
  }
  IndexedDatasetWriter writer(opt.output_prefix, opt.dtype);
  PrepareStats st;
  int64_t next_report = opt.progress_every_bytes;
  std::vector<int32_t> doc;
  std::string line;
  for (const auto& path : opt.inputs) {
    std::ifstream f(path, std::ios::binary);
    GDN_CHECK(f.good(), "prepare: cannot open input '{}'", path);
    const bool jsonl = is_jsonl(path, opt.format);
    int64_t lineno = 0;
    while (std::getline(f, line)) {
      ++lineno;
      st.bytes_read += static_cast<int64_t>(line.size()) + 1;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      std::string_view text = line;
      std::string owned;
      if (jsonl) {
        if (line.find_first_not_of(" \t") == std::string::npos) continue;  // blank line
        nlohmann::json j;
        try {
          j = nlohmann::json::parse(line);
        } catch (const nlohmann::json::exception& e) {
          GDN_FAIL("prepare: {}:{}: not valid JSON: {}", path, lineno, e.what());
        }
        GDN_CHECK(j.is_object() && j.contains("text") && j["text"].is_string(),
                  "prepare: {}:{}: expected an object with a string field \"text\"", path, lineno);
        owned = j["text"].get<std::string>();
        text = owned;
      }
      if (text.empty()) {
        ++st.skipped_empty;
      } else {
        doc.clear();
        ByteTokenizer::encode(text, doc);
        doc.push_back(ByteTokenizer::kEos);
        writer.add_document(doc);
        ++st.documents;
        st.tokens += static_cast<int64_t>(doc.size());
      }
      if (st.bytes_read >= next_report) {
        log::info("prepare: {} read, {} documents, {} tokens",
                  format_bytes(static_cast<double>(st.bytes_read)), st.documents, st.tokens);
        while (next_report <= st.bytes_read) next_report += opt.progress_every_bytes;
      }
    }
    GDN_CHECK(!f.bad(), "prepare: reading '{}' failed", path);
  }
  writer.finish();
  return st;
}

}  // namespace gdn::train
