#include "text/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "gdn/core/error.h"
#include "gdn/core/log.h"

namespace gdn::text {

namespace {

using json = nlohmann::json;

constexpr const char* kHint =
    "gdntrain reads byte-level BPE tokenizers (Qwen3.5, Qwen2/3, GPT-2 style); see docs/DATA.md";

// GPT-2's pattern, what ByteLevel applies when use_regex is true (byte_level.rs).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

void append_utf8(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    s.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    s.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Length of the valid UTF-8 sequence at s[i], or 0 when invalid there. `*bad` receives how many
// bytes form the maximal invalid prefix (Unicode's "maximal subpart", what Rust's from_utf8_lossy
// replaces by one U+FFFD).
size_t utf8_seq(std::string_view s, size_t i, uint32_t* cp, size_t* bad) {
  const auto b = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t c = b(i);
  const size_t n = s.size();
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  size_t len;
  uint8_t lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    *bad = 1;
    return 0;
  }
  uint32_t v = c & (0xFF >> (len + 1));
  for (size_t k = 1; k < len; ++k) {
    const bool ok =
        i + k < n && b(i + k) >= (k == 1 ? lo : 0x80) && b(i + k) <= (k == 1 ? hi : 0xBF);
    if (!ok) {
      *bad = k;
      return 0;
    }
    v = (v << 6) | (b(i + k) & 0x3F);
  }
  *cp = v;
  return len;
}

// Rust's String::from_utf8_lossy: every maximal invalid subpart becomes U+FFFD.
std::string utf8_lossy(std::string_view s) {
  size_t off = 0;
  if (valid_utf8(s, &off)) return std::string(s);
  std::string out;
  out.reserve(s.size() + 8);
  for (size_t i = 0; i < s.size();) {
    uint32_t cp = 0;
    size_t bad = 0;
    const size_t len = utf8_seq(s, i, &cp, &bad);
    if (len > 0) {
      out.append(s.substr(i, len));
      i += len;
    } else {
      append_utf8(out, 0xFFFD);
      i += bad;
    }
  }
  return out;
}

// Whether every code point of `s` (valid UTF-8) is one whose NFC quick-check is Yes with
// canonical combining class 0 and which composes with nothing that follows it in these ranges,
// so that the string is already NFC and utf8proc need not run. Conservative: ASCII, Latin-1 and
// Latin Extended below the combining marks (U+0300), CJK unified ideographs, and precomposed
// Hangul only when no jamo follows (jamo are outside the ranges, so they take the slow path).
bool trivially_nfc(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const uint8_t c = static_cast<uint8_t>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    uint32_t cp = 0;
    size_t bad = 0;
    const size_t len = utf8_seq(s, i, &cp, &bad);
    if (len == 0) return false;
    const bool safe = cp < 0x300 || (cp >= 0x4E00 && cp <= 0x9FFF);
    if (!safe) return false;
    i += len;
  }
  return true;
}

std::string nfc_string(std::string_view s) {
  utf8proc_uint8_t* dst = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(
      reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()),
      &dst, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  GDN_CHECK(n >= 0, "NFC normalization failed: {}", utf8proc_errmsg(n));
  std::string out(reinterpret_cast<const char*>(dst), static_cast<size_t>(n));
  std::free(dst);
  return out;
}

// A compiled PCRE2 pattern (UTF + UCP: \s, \w and \d are Unicode-aware, as Oniguruma's are in
// `tokenizers`), JIT-compiled when the library has a JIT.
struct Regex {
  pcre2_code* code = nullptr;
  std::string pattern;
  Regex(const std::string& pat, bool literal, const std::string& origin) : pattern(pat) {
    int err = 0;
    PCRE2_SIZE erroff = 0;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
    code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pat.data()), pat.size(), opts, &err, &erroff,
                         nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      GDN_FAIL_HINT(kHint, "{}: the Split pattern '{}' does not compile at offset {}: {}", origin,
                    pat, erroff, reinterpret_cast<const char*>(msg));
    }
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // no JIT: pcre2_match interprets
  }
  ~Regex() { pcre2_code_free(code); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
};

// Hand-written open-addressing map (pair of ids) -> (rank, merged id): the merge loop's only
// lookup, so it is kept flat and branch-light.
class MergeMap {
 public:
  struct Value {
    int32_t rank = -1;
    int32_t id = -1;
  };
  void build(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n + 16) cap <<= 1;
    keys_.assign(cap, kEmpty);
    vals_.assign(cap, Value{});
    mask_ = cap - 1;
  }
  // Later duplicates overwrite earlier ones, as a Rust HashMap collected from the merges does.
  void put(int32_t a, int32_t b, Value v) {
    const uint64_t k = key(a, b);
    size_t i = slot(k);
    while (keys_[i] != kEmpty && keys_[i] != k) i = (i + 1) & mask_;
    keys_[i] = k;
    vals_[i] = v;
  }
  const Value* get(int32_t a, int32_t b) const {
    const uint64_t k = key(a, b);
    for (size_t i = slot(k);; i = (i + 1) & mask_) {
      if (keys_[i] == k) return &vals_[i];
      if (keys_[i] == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  static uint64_t key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  size_t slot(uint64_t k) const {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return static_cast<size_t>(k) & mask_;
  }
  std::vector<uint64_t> keys_;
  std::vector<Value> vals_;
  size_t mask_ = 0;
};

// Added tokens, matched leftmost-longest (AhoCorasick MatchKind::LeftmostLongest in
// added_vocabulary.rs); candidates are bucketed by their first byte, longest first.
class AddedMatcher {
 public:
  void add(const std::string& content, int32_t id) {
    auto& b = buckets_[static_cast<uint8_t>(content[0])];
    b.push_back({content, id});
    std::stable_sort(b.begin(), b.end(),
                     [](const auto& x, const auto& y) { return x.first.size() > y.first.size(); });
    first_[static_cast<uint8_t>(content[0])] = true;
    any_ = true;
  }
  bool empty() const { return !any_; }
  // Calls text(piece) for the text between matches and token(id) for each match, in order.
  template <class TextFn, class TokenFn>
  void split(std::string_view s, TextFn&& text, TokenFn&& token) const {
    size_t start = 0;
    for (size_t i = 0; any_ && i < s.size(); ++i) {
      const uint8_t c = static_cast<uint8_t>(s[i]);
      if (!first_[c]) continue;
      for (const auto& [content, id] : buckets_[c]) {
        if (s.compare(i, content.size(), content) == 0) {
          if (i > start) text(s.substr(start, i - start));
          token(id);
          start = i + content.size();
          i = start - 1;
          break;
        }
      }
    }
    if (start < s.size()) text(s.substr(start));
  }

 private:
  bool first_[256] = {};
  bool any_ = false;
  std::vector<std::pair<std::string, int32_t>> buckets_[256];
};

struct PreStep {
  enum Kind { Split, ByteLevel } kind = Split;
  int regex = -1;  // index into Impl::regexes
  bool removed = false;
  bool add_prefix_space = false;
};

struct StrHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  GDN_CHECK_HINT(f.good(), "give the path of a Hugging Face tokenizer.json",
                 "cannot open tokenizer '{}'", path);
  std::ostringstream ss;
  ss << f.rdbuf();
  GDN_CHECK(!f.bad(), "reading tokenizer '{}' failed", path);
  return ss.str();
}

std::string type_of(const json& j) {
  if (j.is_object() && j.contains("type") && j["type"].is_string()) return j["type"];
  return "?";
}

}  // namespace

uint32_t byte_to_char(uint8_t b) {
  // Printable ranges keep their code point; the rest go to 256, 257, ... in byte order.
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    uint32_t next = 256;
    for (int c = 0; c < 256; ++c) {
      const bool printable = (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE;
      t[static_cast<size_t>(c)] = printable ? static_cast<uint32_t>(c) : next++;
    }
    return t;
  }();
  return table[b];
}

bool valid_utf8(std::string_view s, size_t* bad_offset) {
  for (size_t i = 0; i < s.size();) {
    // Eight ASCII bytes at a time: most text is mostly ASCII.
    if (i + 8 <= s.size()) {
      uint64_t w;
      std::memcpy(&w, s.data() + i, 8);
      if ((w & 0x8080808080808080ULL) == 0) {
        i += 8;
        continue;
      }
    }
    uint32_t cp = 0;
    size_t bad = 0;
    const size_t len = utf8_seq(s, i, &cp, &bad);
    if (len == 0) {
      if (bad_offset != nullptr) *bad_offset = i;
      return false;
    }
    i += len;
  }
  return true;
}

// --- per-thread state ----------------------------------------------------------------------------

class EncodeState {
 public:
  explicit EncodeState(const std::vector<std::unique_ptr<Regex>>& regexes) {
    jit_stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    mctx = pcre2_match_context_create(nullptr);
    if (jit_stack != nullptr) pcre2_jit_stack_assign(mctx, nullptr, jit_stack);
    for (const auto& r : regexes)
      match.push_back(pcre2_match_data_create_from_pattern(r->code, nullptr));
  }
  ~EncodeState() {
    for (auto* m : match) pcre2_match_data_free(m);
    pcre2_match_context_free(mctx);
    if (jit_stack != nullptr) pcre2_jit_stack_free(jit_stack);
  }
  EncodeState(const EncodeState&) = delete;
  EncodeState& operator=(const EncodeState&) = delete;

  // Pre-token bytes -> [offset, length) in `pool`. Cleared whole when it grows past its bounds
  // (memory stays bounded on any corpus).
  std::unordered_map<std::string, std::pair<uint32_t, uint32_t>, StrHash, std::equal_to<>> cache;
  std::vector<int32_t> pool;
  // Merge-loop scratch.
  struct Sym {
    int32_t id, prev, next;
  };
  std::vector<Sym> syms;
  struct Cand {
    int32_t rank, pos, id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::vector<Cand> heap;
  std::string scratch;
  std::vector<std::string>* pieces = nullptr;  // pre_tokenize(): collect instead of merging
  pcre2_jit_stack* jit_stack = nullptr;
  pcre2_match_context* mctx = nullptr;
  std::vector<pcre2_match_data*> match;
};

// --- the tokenizer -------------------------------------------------------------------------------

struct Tokenizer::Impl {
  std::string origin;
  bool nfc = false;
  std::vector<std::unique_ptr<Regex>> regexes;
  std::vector<PreStep> steps;
  std::string pre_desc, norm_desc;
  // Model.
  std::unordered_map<std::string, int32_t, StrHash, std::equal_to<>> vocab;  // byte-level strings
  std::vector<std::string> id_bytes;                                         // id -> decoded bytes
  std::vector<bool> id_known;
  std::vector<bool> id_special;
  int32_t byte_sym[256];  // byte -> id of its one-character token, -1 when absent
  MergeMap merges;
  int64_t num_merges = 0;
  int32_t unk = -1;
  bool fuse_unk = false;
  bool ignore_merges = false;
  AddedMatcher added_raw, added_norm;
  std::unordered_map<std::string, int32_t, StrHash, std::equal_to<>> added_ids;
  std::unordered_map<int32_t, std::string> added_content;
  bool decoder_byte_level = false;
  std::string decoder_type = "null";
  int64_t vocab_size = 0;

  void parse(const json& j);
  void parse_normalizer(const json& n);
  void parse_pre_tokenizer(const json& p, bool top);
  void parse_model(const json& m);
  void parse_added(const json& a);

  void encode_text(std::string_view s, std::vector<int32_t>& out, EncodeState& st) const;
  void encode_normalized(std::string_view s, std::vector<int32_t>& out, EncodeState& st) const;
  void pretokenize(size_t step, std::string_view s, std::vector<int32_t>& out,
                   EncodeState& st) const;
  template <class Fn>
  void regex_split(int regex, bool removed, std::string_view s, EncodeState& st, Fn&& fn) const;
  void bpe(std::string_view word, std::vector<int32_t>& out, EncodeState& st) const;
  void merge_word(std::string_view word, std::vector<int32_t>& out, EncodeState& st) const;
};

void Tokenizer::Impl::parse(const json& j) {
  GDN_CHECK_HINT(j.is_object(), kHint, "{}: the top level is not a JSON object", origin);
  GDN_CHECK_HINT(j.contains("model") && j["model"].is_object(), kHint,
                 "{}: no \"model\" object: not a Hugging Face tokenizer.json", origin);
  parse_model(j["model"]);
  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    parse_normalizer(j["normalizer"]);
  } else {
    norm_desc = "none";
  }
  GDN_CHECK_HINT(j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null(), kHint,
                 "{}: no pre_tokenizer; only byte-level BPE (a ByteLevel pre-tokenizer) is "
                 "supported",
                 origin);
  parse_pre_tokenizer(j["pre_tokenizer"], true);
  int byte_levels = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    if (steps[i].kind == PreStep::ByteLevel) {
      ++byte_levels;
      GDN_CHECK_HINT(i + 1 == steps.size(), kHint,
                     "{}: pre_tokenizer: ByteLevel must be the last step of the Sequence", origin);
    }
  }
  GDN_CHECK_HINT(byte_levels == 1, kHint,
                 "{}: pre_tokenizer has no ByteLevel step: only byte-level BPE is supported "
                 "(character-level BPE with byte_fallback, as in Llama/Mistral, is not)",
                 origin);
  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) parse_added(j["added_tokens"]);
  if (j.contains("post_processor") && !j["post_processor"].is_null()) {
    const std::string t = type_of(j["post_processor"]);
    GDN_CHECK_HINT(t == "ByteLevel", kHint,
                   "{}: post_processor '{}' is not supported (it would add tokens to every "
                   "sequence); supported: null, ByteLevel",
                   origin, t);
  }
  for (const char* k : {"truncation", "padding"}) {
    if (j.contains(k) && !j[k].is_null())
      log::warn("{}: '{}' is set in the tokenizer and ignored (documents are kept whole)", origin,
                k);
  }
  if (j.contains("decoder") && !j["decoder"].is_null()) {
    decoder_type = type_of(j["decoder"]);
    decoder_byte_level = decoder_type == "ByteLevel";
  }
  // Decoded bytes of every id: the ByteLevel decoder maps each character back to its byte; a
  // token with a character outside the map is taken as its UTF-8 bytes (decoders/byte_level.rs).
  std::unordered_map<uint32_t, uint8_t> char_byte;
  for (int b = 0; b < 256; ++b)
    char_byte[byte_to_char(static_cast<uint8_t>(b))] = static_cast<uint8_t>(b);
  auto decode_token = [&](std::string_view tok) {
    std::string out;
    for (size_t i = 0; i < tok.size();) {
      uint32_t cp = 0;
      size_t bad = 0;
      const size_t len = utf8_seq(tok, i, &cp, &bad);
      auto it = len > 0 ? char_byte.find(cp) : char_byte.end();
      if (it == char_byte.end()) return std::string(tok);
      out.push_back(static_cast<char>(it->second));
      i += len;
    }
    return out;
  };
  id_bytes.assign(static_cast<size_t>(vocab_size), {});
  id_known.assign(static_cast<size_t>(vocab_size), false);
  id_special.assign(static_cast<size_t>(vocab_size), false);
  for (const auto& [tok, id] : vocab) {
    id_bytes[static_cast<size_t>(id)] = decode_token(tok);
    id_known[static_cast<size_t>(id)] = true;
  }
  for (const auto& a : j.value("added_tokens", json::array())) {
    const auto id = static_cast<size_t>(a["id"].get<int64_t>());
    id_bytes[id] = decode_token(a["content"].get<std::string>());
    id_known[id] = true;
    id_special[id] = a.value("special", false);
  }
}

void Tokenizer::Impl::parse_normalizer(const json& n) {
  const std::string t = type_of(n);
  if (t == "NFC") {
    nfc = true;
    norm_desc = "NFC";
  } else if (t == "Sequence" && n.contains("normalizers") && n["normalizers"].is_array()) {
    for (const auto& c : n["normalizers"]) parse_normalizer(c);
    if (norm_desc.empty()) norm_desc = "none";
  } else {
    GDN_FAIL_HINT(kHint, "{}: normalizer '{}' is not supported (supported: NFC, a Sequence of NFC)",
                  origin, t);
  }
}

void Tokenizer::Impl::parse_pre_tokenizer(const json& p, bool top) {
  const std::string t = type_of(p);
  if (t == "Sequence") {
    GDN_CHECK_HINT(top && p.contains("pretokenizers") && p["pretokenizers"].is_array(), kHint,
                   "{}: pre_tokenizer Sequence is malformed or nested", origin);
    for (const auto& c : p["pretokenizers"]) parse_pre_tokenizer(c, false);
    return;
  }
  if (!pre_desc.empty()) pre_desc += " + ";
  if (t == "Split") {
    GDN_CHECK_HINT(p.contains("pattern") && p["pattern"].is_object(), kHint,
                   "{}: Split pre-tokenizer without a pattern", origin);
    const json& pat = p["pattern"];
    const bool is_regex = pat.contains("Regex") && pat["Regex"].is_string();
    const bool is_string = pat.contains("String") && pat["String"].is_string();
    GDN_CHECK_HINT(is_regex || is_string, kHint,
                   "{}: Split pattern must be {{\"Regex\": ...}} or {{\"String\": ...}}", origin);
    const std::string behavior = p.value("behavior", std::string("?"));
    GDN_CHECK_HINT(behavior == "Isolated" || behavior == "Removed", kHint,
                   "{}: Split behavior '{}' is not supported (supported: Isolated, Removed)",
                   origin, behavior);
    GDN_CHECK_HINT(!p.value("invert", false), kHint, "{}: Split with invert: true is not supported",
                   origin);
    const std::string s =
        is_regex ? pat["Regex"].get<std::string>() : pat["String"].get<std::string>();
    regexes.push_back(std::make_unique<Regex>(s, !is_regex, origin));
    PreStep step;
    step.kind = PreStep::Split;
    step.regex = static_cast<int>(regexes.size()) - 1;
    step.removed = behavior == "Removed";
    steps.push_back(step);
    pre_desc += fmt::format("Split({}, {})", is_regex ? "regex" : "string", behavior);
  } else if (t == "ByteLevel") {
    PreStep step;
    step.kind = PreStep::ByteLevel;
    step.add_prefix_space = p.value("add_prefix_space", false);
    if (p.value("use_regex", true)) {
      regexes.push_back(std::make_unique<Regex>(kGpt2Pattern, false, origin));
      step.regex = static_cast<int>(regexes.size()) - 1;
    }
    steps.push_back(step);
    pre_desc += fmt::format("ByteLevel(prefix space {}, regex {})", step.add_prefix_space,
                            step.regex >= 0 ? "GPT-2" : "none");
  } else {
    GDN_FAIL_HINT(kHint,
                  "{}: pre-tokenizer '{}' is not supported (supported: Split, ByteLevel, a "
                  "Sequence of them)",
                  origin, t);
  }
}

void Tokenizer::Impl::parse_model(const json& m) {
  std::string t = type_of(m);
  if (t == "?" && m.contains("merges")) t = "BPE";  // older files omit the type
  GDN_CHECK_HINT(t == "BPE", kHint,
                 "{}: model type '{}' is not supported (only BPE; Unigram, WordPiece and WordLevel "
                 "are not)",
                 origin, t);
  auto null_or = [&](const char* k) { return !m.contains(k) || m[k].is_null(); };
  GDN_CHECK_HINT(
      null_or("dropout") || (m["dropout"].is_number() && m["dropout"].get<double>() == 0), kHint,
      "{}: BPE dropout is not supported (it makes encoding random)", origin);
  GDN_CHECK_HINT(null_or("byte_fallback") || !m["byte_fallback"].get<bool>(), kHint,
                 "{}: BPE byte_fallback is not supported", origin);
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    GDN_CHECK_HINT(null_or(k) || (m[k].is_string() && m[k].get<std::string>().empty()), kHint,
                   "{}: BPE {} is not supported", origin, k);
  }
  fuse_unk = m.value("fuse_unk", false);
  ignore_merges = m.value("ignore_merges", false);
  GDN_CHECK_HINT(m.contains("vocab") && m["vocab"].is_object(), kHint,
                 "{}: BPE model without a \"vocab\" object", origin);
  for (const auto& [tok, idj] : m["vocab"].items()) {
    GDN_CHECK_HINT(idj.is_number_integer(), kHint, "{}: vocab entry '{}' has a non-integer id",
                   origin, tok);
    const int64_t id = idj.get<int64_t>();
    GDN_CHECK_HINT(id >= 0 && id < (int64_t{1} << 31) - 1, kHint,
                   "{}: vocab entry '{}' has id {} outside [0, 2^31 - 1)", origin, tok, id);
    vocab.emplace(tok, static_cast<int32_t>(id));
    vocab_size = std::max(vocab_size, id + 1);
  }
  for (int b = 0; b < 256; ++b) {
    std::string c;
    append_utf8(c, byte_to_char(static_cast<uint8_t>(b)));
    auto it = vocab.find(c);
    byte_sym[b] = it == vocab.end() ? -1 : it->second;
  }
  if (!null_or("unk_token")) {
    const std::string u = m["unk_token"].get<std::string>();
    auto it = vocab.find(u);
    GDN_CHECK_HINT(it != vocab.end(), kHint, "{}: unk_token '{}' is not in the vocabulary", origin,
                   u);
    unk = it->second;
  }
  GDN_CHECK_HINT(m.contains("merges") && m["merges"].is_array(), kHint,
                 "{}: BPE model without a \"merges\" array", origin);
  const json& ms = m["merges"];
  merges.build(ms.size());
  int32_t rank = 0;
  for (const auto& e : ms) {
    std::string a, b;
    if (e.is_string()) {
      const std::string s = e.get<std::string>();
      const size_t sp = s.find(' ');
      GDN_CHECK_HINT(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos, kHint,
                     "{}: merge {} '{}' is not two tokens separated by one space", origin, rank, s);
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      GDN_CHECK_HINT(e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string(), kHint,
                     "{}: merge {} is neither \"a b\" nor [\"a\", \"b\"]", origin, rank);
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    }
    auto ia = vocab.find(a), ib = vocab.find(b), ic = vocab.find(a + b);
    GDN_CHECK_HINT(ia != vocab.end() && ib != vocab.end() && ic != vocab.end(), kHint,
                   "{}: merge {} ('{}' '{}') uses a token that is not in the vocabulary", origin,
                   rank, a, b);
    merges.put(ia->second, ib->second, {rank, ic->second});
    ++rank;
  }
  num_merges = rank;
}

void Tokenizer::Impl::parse_added(const json& a) {
  GDN_CHECK_HINT(a.is_array(), kHint, "{}: added_tokens is not an array", origin);
  for (const auto& t : a) {
    GDN_CHECK_HINT(t.is_object() && t.contains("id") && t["id"].is_number_integer() &&
                       t.contains("content") && t["content"].is_string(),
                   kHint, "{}: an added token lacks an integer id or a string content", origin);
    const std::string content = t["content"].get<std::string>();
    const int64_t id = t["id"].get<int64_t>();
    GDN_CHECK_HINT(!content.empty() && valid_utf8(content), kHint,
                   "{}: added token {} is empty or not UTF-8", origin, id);
    GDN_CHECK_HINT(id >= 0 && id < (int64_t{1} << 31) - 1, kHint,
                   "{}: added token '{}' has id {} outside [0, 2^31 - 1)", origin, content, id);
    for (const char* k : {"single_word", "lstrip", "rstrip"}) {
      GDN_CHECK_HINT(!t.value(k, false), kHint,
                     "{}: added token '{}' sets {}, which is not supported", origin, content, k);
    }
    auto it = vocab.find(content);
    GDN_CHECK_HINT(it == vocab.end() || it->second == id, kHint,
                   "{}: added token '{}' has id {} but the vocabulary gives it {}", origin, content,
                   id, it == vocab.end() ? -1 : it->second);
    // normalized: true tokens are matched in the normalized text; `special` ones default to
    // false (AddedToken::from with special = true).
    const bool normalized = t.value("normalized", !t.value("special", false));
    (normalized && nfc ? added_norm : added_raw).add(content, static_cast<int32_t>(id));
    added_ids[content] = static_cast<int32_t>(id);
    added_content[static_cast<int32_t>(id)] = content;
    vocab_size = std::max(vocab_size, id + 1);
  }
}

// --- encoding -----------------------------------------------------------------------------------

template <class Fn>
void Tokenizer::Impl::regex_split(int regex, bool removed, std::string_view s, EncodeState& st,
                                  Fn&& fn) const {
  // Isolated: matches and the gaps between them are all pieces; Removed: only the gaps. Empty
  // pieces are dropped (pattern.rs find_matches + PreTokenizedString::split).
  pcre2_code* code = regexes[static_cast<size_t>(regex)]->code;
  pcre2_match_data* md = st.match[static_cast<size_t>(regex)];
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  size_t prev = 0, pos = 0;
  while (pos < s.size()) {
    const int rc = pcre2_match(code, subject, s.size(), pos, PCRE2_NO_UTF_CHECK, md, st.mctx);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof(msg));
      GDN_FAIL("{}: pre-tokenizer regex failed on a piece of {} bytes: {}", origin, s.size(),
               reinterpret_cast<const char*>(msg));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t ms = ov[0], me = ov[1];
    if (me == ms) {  // an empty match: step over one character
      pos = ms + 1;
      while (pos < s.size() && (static_cast<uint8_t>(s[pos]) & 0xC0) == 0x80) ++pos;
      continue;
    }
    if (ms > prev) fn(s.substr(prev, ms - prev));
    if (!removed) fn(s.substr(ms, me - ms));
    prev = pos = me;
  }
  if (prev < s.size()) fn(s.substr(prev));
}

void Tokenizer::Impl::pretokenize(size_t step, std::string_view s, std::vector<int32_t>& out,
                                  EncodeState& st) const {
  if (s.empty()) return;
  if (step == steps.size()) {
    bpe(s, out, st);
    return;
  }
  const PreStep& p = steps[step];
  if (p.kind == PreStep::ByteLevel) {
    std::string prefixed;
    if (p.add_prefix_space && s[0] != ' ') {
      prefixed = " ";
      prefixed += s;
      s = prefixed;
    }
    if (p.regex >= 0) {
      regex_split(p.regex, false, s, st, [&](std::string_view w) { bpe(w, out, st); });
    } else {
      bpe(s, out, st);
    }
    return;
  }
  regex_split(p.regex, p.removed, s, st,
              [&](std::string_view w) { pretokenize(step + 1, w, out, st); });
}

void Tokenizer::Impl::bpe(std::string_view word, std::vector<int32_t>& out, EncodeState& st) const {
  if (st.pieces != nullptr) {
    st.pieces->emplace_back(word);
    return;
  }
  if (word.size() == 1 && byte_sym[static_cast<uint8_t>(word[0])] >= 0 && !ignore_merges) {
    out.push_back(byte_sym[static_cast<uint8_t>(word[0])]);
    return;
  }
  auto it = st.cache.find(word);
  if (it != st.cache.end()) {
    out.insert(out.end(), st.pool.begin() + it->second.first,
               st.pool.begin() + it->second.first + it->second.second);
    return;
  }
  const size_t before = out.size();
  merge_word(word, out, st);
  if (st.pool.size() > (size_t{1} << 22) || st.cache.size() > (size_t{1} << 18)) {
    st.cache.clear();
    st.pool.clear();
  }
  const auto off = static_cast<uint32_t>(st.pool.size());
  st.pool.insert(st.pool.end(), out.begin() + static_cast<ptrdiff_t>(before), out.end());
  st.cache.emplace(std::string(word),
                   std::make_pair(off, static_cast<uint32_t>(out.size() - before)));
}

// The merge loop (hand-written; the order is that of models/bpe/word.rs merge_all): a min-heap of
// candidate pairs keyed by (rank, position); a popped candidate whose pair no longer exists is
// skipped; merging a pair adds the candidates it forms with its neighbours.
void Tokenizer::Impl::merge_word(std::string_view word, std::vector<int32_t>& out,
                                 EncodeState& st) const {
  if (ignore_merges) {
    std::string& m = st.scratch;
    m.clear();
    for (char c : word) append_utf8(m, byte_to_char(static_cast<uint8_t>(c)));
    auto v = vocab.find(m);
    if (v != vocab.end()) {
      out.push_back(v->second);
      return;
    }
  }
  auto& syms = st.syms;
  syms.clear();
  // Initial symbols: one per byte; a byte without a token becomes unk (fused when fuse_unk) or
  // is dropped when the model has no unk (models/bpe/model.rs merge_word).
  for (char c : word) {
    int32_t id = byte_sym[static_cast<uint8_t>(c)];
    if (id < 0) {
      if (unk < 0) continue;
      if (fuse_unk && !syms.empty() && syms.back().id == unk) continue;
      id = unk;
    }
    const auto n = static_cast<int32_t>(syms.size());
    syms.push_back({id, n - 1, n + 1});
  }
  if (syms.empty()) return;
  syms.back().next = -1;
  auto& heap = st.heap;
  heap.clear();
  const auto cmp = std::greater<EncodeState::Cand>{};
  auto push = [&](int32_t pos) {
    const int32_t nx = syms[static_cast<size_t>(pos)].next;
    if (nx < 0) return;
    const MergeMap::Value* v =
        merges.get(syms[static_cast<size_t>(pos)].id, syms[static_cast<size_t>(nx)].id);
    if (v == nullptr) return;
    heap.push_back({v->rank, pos, v->id});
    std::push_heap(heap.begin(), heap.end(), cmp);
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(syms.size()); ++i) push(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), cmp);
    const EncodeState::Cand c = heap.back();
    heap.pop_back();
    auto& s = syms[static_cast<size_t>(c.pos)];
    if (s.id < 0 || s.next < 0) continue;  // removed, or no right neighbour any more
    auto& r = syms[static_cast<size_t>(s.next)];
    const MergeMap::Value* v = merges.get(s.id, r.id);
    if (v == nullptr || v->id != c.id) continue;  // the pair changed since it was queued
    s.id = c.id;
    r.id = -1;  // removed
    s.next = r.next;
    if (s.next >= 0) syms[static_cast<size_t>(s.next)].prev = c.pos;
    if (s.prev >= 0) push(s.prev);
    push(c.pos);
  }
  for (int32_t i = 0; i >= 0; i = syms[static_cast<size_t>(i)].next)
    out.push_back(syms[static_cast<size_t>(i)].id);
}

void Tokenizer::Impl::encode_normalized(std::string_view s, std::vector<int32_t>& out,
                                        EncodeState& st) const {
  if (added_norm.empty()) {
    pretokenize(0, s, out, st);
    return;
  }
  added_norm.split(
      s, [&](std::string_view piece) { pretokenize(0, piece, out, st); },
      [&](int32_t id) { out.push_back(id); });
}

void Tokenizer::Impl::encode_text(std::string_view s, std::vector<int32_t>& out,
                                  EncodeState& st) const {
  auto text = [&](std::string_view piece) {
    if (nfc && !trivially_nfc(piece)) {
      const std::string n = nfc_string(piece);
      encode_normalized(n, out, st);
    } else {
      encode_normalized(piece, out, st);
    }
  };
  added_raw.split(s, text, [&](int32_t id) { out.push_back(id); });
}

// --- public -------------------------------------------------------------------------------------

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_json_text(std::string_view json_text, const std::string& origin) {
  auto impl = std::make_unique<Impl>();
  impl->origin = origin;
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    GDN_FAIL_HINT(kHint, "{}: not valid JSON: {}", origin, e.what());
  }
  try {
    impl->parse(j);
  } catch (const json::exception& e) {
    GDN_FAIL_HINT(kHint, "{}: malformed tokenizer.json: {}", origin, e.what());
  }
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  return from_json_text(read_file(path), path);
}

void EncodeStateDeleter::operator()(EncodeState* s) const { delete s; }

EncodeStatePtr Tokenizer::make_state() const {
  return EncodeStatePtr(new EncodeState(impl_->regexes));
}

void Tokenizer::encode(std::string_view text, std::vector<int32_t>& out, EncodeState& state) const {
  size_t bad = 0;
  GDN_CHECK_HINT(valid_utf8(text, &bad), "convert the input to UTF-8 (e.g. with iconv)",
                 "the text is not valid UTF-8 (first invalid byte 0x{:02x} at offset {})",
                 static_cast<uint8_t>(text[bad]), bad);
  impl_->encode_text(text, out, state);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  auto st = make_state();
  std::vector<int32_t> out;
  encode(text, out, *st);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  GDN_CHECK_HINT(impl_->decoder_byte_level, kHint,
                 "{}: decoder '{}' is not supported (decode needs the ByteLevel decoder)",
                 impl_->origin, impl_->decoder_type);
  std::string bytes;
  for (const int32_t id : ids) {
    GDN_CHECK(id >= 0 && id < impl_->vocab_size && impl_->id_known[static_cast<size_t>(id)],
              "decode: id {} is not in the vocabulary of {}", id, impl_->origin);
    bytes += impl_->id_bytes[static_cast<size_t>(id)];
  }
  return utf8_lossy(bytes);
}

std::vector<std::string> Tokenizer::pre_tokenize(std::string_view text) const {
  GDN_CHECK(valid_utf8(text), "pre_tokenize: the text is not valid UTF-8");
  auto st = make_state();
  std::vector<std::string> pieces;
  st->pieces = &pieces;
  std::vector<int32_t> ids;  // added tokens only
  impl_->added_raw.split(
      text,
      [&](std::string_view piece) {
        const std::string n =
            impl_->nfc && !trivially_nfc(piece) ? nfc_string(piece) : std::string(piece);
        impl_->added_norm.split(
            n, [&](std::string_view p) { impl_->pretokenize(0, p, ids, *st); },
            [&](int32_t id) { pieces.push_back(impl_->added_content.at(id)); });
      },
      [&](int32_t id) { pieces.push_back(impl_->added_content.at(id)); });
  return pieces;
}

int64_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  auto a = impl_->added_ids.find(token);
  if (a != impl_->added_ids.end()) return a->second;
  std::string m;
  for (char c : token) append_utf8(m, byte_to_char(static_cast<uint8_t>(c)));
  auto v = impl_->vocab.find(m);
  if (v != impl_->vocab.end()) return v->second;
  return std::nullopt;
}

std::string Tokenizer::describe() const {
  return fmt::format(
      "BPE, {} ids ({} in the model vocabulary, {} added), {} merges; normalizer {}; "
      "pre-tokenizer {}; decoder {}",
      impl_->vocab_size, impl_->vocab.size(), impl_->added_ids.size(), impl_->num_merges,
      impl_->norm_desc, impl_->pre_desc, impl_->decoder_type);
}

}  // namespace gdn::text
