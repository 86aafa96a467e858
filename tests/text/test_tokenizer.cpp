// The tokenizer.json reader piece by piece, on small tokenizers written here: the Qwen3.5 and
// Qwen2 split patterns (the `(?!\S)` lookahead, \p{M}), NFC, added tokens inside text, the merge
// order, the byte-level decoder, and a clear error for every unsupported component. Expected
// pieces were produced by HF tokenizers 0.23 (pre_tokenizers.Split(...).pre_tokenize_str); the
// full exactness check against HF is test_tokenizer_vs_hf (tests/text/check_tokenizer_vs_hf.py).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "gdn/core/error.h"
#include "text/tokenizer.h"

namespace gdn::text {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

constexpr const char* kQwen35 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::string byte_char(uint8_t b) {
  std::string s;
  const uint32_t cp = byte_to_char(b);
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}
std::string mapped(const std::string& raw) {
  std::string s;
  for (char c : raw) s += byte_char(static_cast<uint8_t>(c));
  return s;
}

// A byte-level BPE whose ids 0..255 are the bytes, then the merges' results in order, then the
// added tokens. `merges` are pairs of raw byte strings.
json make_tokenizer(const std::string& pattern,
                    const std::vector<std::pair<std::string, std::string>>& merges = {},
                    const std::vector<std::string>& added = {"<|endoftext|>", "<|im_start|>"}) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(static_cast<uint8_t>(b))] = b;
  json m = json::array();
  int next = 256;
  for (const auto& [a, b] : merges) {
    m.push_back(json::array({mapped(a), mapped(b)}));
    if (!vocab.contains(mapped(a + b))) vocab[mapped(a + b)] = next++;
  }
  json add = json::array();
  for (const auto& a : added)
    add.push_back({{"id", next++},
                   {"content", a},
                   {"single_word", false},
                   {"lstrip", false},
                   {"rstrip", false},
                   {"normalized", false},
                   {"special", true}});
  json pre = json::array();
  if (!pattern.empty())
    pre.push_back({{"type", "Split"},
                   {"pattern", {{"Regex", pattern}}},
                   {"behavior", "Isolated"},
                   {"invert", false}});
  pre.push_back({{"type", "ByteLevel"},
                 {"add_prefix_space", false},
                 {"trim_offsets", false},
                 {"use_regex", pattern.empty()}});
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", add},
          {"normalizer", {{"type", "NFC"}}},
          {"pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", pre}}},
          {"post_processor",
           {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}}},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"ignore_merges", false},
            {"vocab", vocab},
            {"merges", m}}}};
}

Tokenizer load(const json& j) { return Tokenizer::from_json_text(j.dump(), "test.json"); }

std::string error_of(const json& j) {
  try {
    load(j);
  } catch (const Error& e) {
    return e.message();
  }
  return "(no error)";
}

using Pieces = std::vector<std::string>;

TEST(Tokenizer, Qwen35SplitMatchesHfIncludingTheLookahead) {
  const Tokenizer t = load(make_tokenizer(kQwen35));
  // \s+(?!\S) leaves the last space of a run to the next word; \s*[\r\n]+ takes newline runs.
  EXPECT_EQ(t.pre_tokenize("Hello world!  It's   3.14\n\n\tx"),
            (Pieces{"Hello", " world", "!", " ", " It", "'s", "  ", " ", "3", ".", "1", "4", "\n\n",
                    "\tx"}));
  EXPECT_EQ(t.pre_tokenize("a   b\r\n\r\n  c  "),
            (Pieces{"a", "  ", " b", "\r\n\r\n", " ", " c", "  "}));
  // \p{M}: Devanagari vowel signs and viramas stay inside the word (Qwen2's pattern splits them).
  EXPECT_EQ(t.pre_tokenize("नमस्ते दुनिया"), (Pieces{"नमस्ते", " दुनिया"}));
  EXPECT_EQ(t.pre_tokenize("I'VE 'ſ ok\u3000end"),
            (Pieces{"I", "'VE", " '", "ſ", " ok", "\u3000end"}));
  EXPECT_EQ(t.pre_tokenize("1\u0301 x\u0301y 12345"),
            (Pieces{"1", "\u0301", " x\u0301y", " ", "1", "2", "3", "4", "5"}));
}

TEST(Tokenizer, Qwen2SplitsCombiningMarksOff) {
  const Tokenizer t = load(make_tokenizer(kQwen2));
  EXPECT_EQ(t.pre_tokenize("नमस्ते दुनिया"), (Pieces{"नमस", "्त", "े", " द", "ुन", "िय", "ा"}));
  EXPECT_EQ(t.pre_tokenize("1\u0301 x\u0301y"), (Pieces{"1", "\u0301", " x", "\u0301y"}));
}

TEST(Tokenizer, Gpt2ByteLevelRegex) {
  const Tokenizer t = load(make_tokenizer(""));  // ByteLevel(use_regex: true)
  EXPECT_EQ(t.pre_tokenize("Hello  world's 123!!"),
            (Pieces{"Hello", " ", " world", "'s", " 123", "!!"}));
}

TEST(Tokenizer, UnicodeWhitespaceIsOniguruma) {
  // \s as Oniguruma (HF) has it: NBSP, U+3000, NEL, VT are spaces; ZWSP is not.
  const Tokenizer t = load(make_tokenizer(kQwen35));
  EXPECT_EQ(t.pre_tokenize("a\u00a0\u3000b"), (Pieces{"a", "\u00a0", "\u3000b"}));
  // A non-letter before letters joins them ([^\r\n\p{L}\p{N}]? comes before the \s branches).
  EXPECT_EQ(t.pre_tokenize("a\u0085b"), (Pieces{"a", "\u0085b"}));
  EXPECT_EQ(t.pre_tokenize("a\u200bb"), (Pieces{"a", "\u200bb"}));
  EXPECT_EQ(t.pre_tokenize("a\x0b b"), (Pieces{"a", "\x0b", " b"}));
}

TEST(Tokenizer, NfcBeforeSplitting) {
  const Tokenizer t = load(make_tokenizer(kQwen35));
  EXPECT_EQ(t.pre_tokenize("cafe\u0301 A\u030a"), (Pieces{"caf\u00e9", " \u00c5"}));
  // Hangul jamo compose into a syllable.
  EXPECT_EQ(t.pre_tokenize("\u1100\u1161\u11a8"), (Pieces{"\uac01"}));
  // NFC keeps compatibility characters (that is NFKC's job).
  EXPECT_EQ(t.pre_tokenize("\ufb01"), (Pieces{"\ufb01"}));
}

TEST(Tokenizer, AddedTokensAreMatchedBeforeAnythingElse) {
  const Tokenizer t = load(make_tokenizer(kQwen35));
  const int32_t eot = *t.token_to_id("<|endoftext|>");
  const int32_t ims = *t.token_to_id("<|im_start|>");
  EXPECT_EQ(eot, 256);
  EXPECT_EQ(ims, 257);
  EXPECT_EQ(t.pre_tokenize("a<|im_start|>user<|endoftext|><|endoftext|>"),
            (Pieces{"a", "<|im_start|>", "user", "<|endoftext|>", "<|endoftext|>"}));
  EXPECT_EQ(t.encode("x<|endoftext|>y"), (std::vector<int32_t>{'x', eot, 'y'}));
  // Near misses are plain text.
  EXPECT_EQ(t.encode("<|endoftext|"), t.encode("<|endoftext|"));
  for (int32_t id : t.encode("<|endoftext| <|im_start")) EXPECT_LT(id, 256);
  // Leftmost-longest: of two added tokens starting at one place, the longer one wins.
  const Tokenizer t2 = load(make_tokenizer(kQwen35, {}, {"<a>", "<a><b>"}));
  EXPECT_EQ(t2.encode("x<a><b><a>"), (std::vector<int32_t>{'x', 257, 256}));
}

TEST(Tokenizer, MergesApplyByRankNotByPosition) {
  // Ranks: "b c" before "a b": "abc" -> a + bc, not ab + c.
  const Tokenizer t = load(make_tokenizer(kQwen35, {{"b", "c"}, {"a", "b"}, {"a", "bc"}}));
  EXPECT_EQ(t.encode("abc"), (std::vector<int32_t>{258}));  // a + bc merged at rank 2
  const Tokenizer u = load(make_tokenizer(kQwen35, {{"b", "c"}, {"a", "b"}}));
  EXPECT_EQ(u.encode("abc"), (std::vector<int32_t>{'a', 256}));
  EXPECT_EQ(u.encode("abab"), (std::vector<int32_t>{257, 257}));
  // Equal ranks: leftmost first ("aaa" -> aa + a).
  const Tokenizer v = load(make_tokenizer(kQwen35, {{"a", "a"}}));
  EXPECT_EQ(v.encode("aaa"), (std::vector<int32_t>{256, 'a'}));
  EXPECT_EQ(v.encode("aaaa"), (std::vector<int32_t>{256, 256}));
  // Merges never cross pre-token boundaries: " a" and "a" are different pieces in "a a".
  const Tokenizer w = load(make_tokenizer(kQwen35, {{"a", " "}}));
  EXPECT_EQ(w.encode("a a"), (std::vector<int32_t>{'a', ' ', 'a'}));
}

TEST(Tokenizer, DecodeInvertsEncode) {
  const Tokenizer t = load(make_tokenizer(kQwen35, {{"h", "e"}, {"l", "l"}, {" ", "w"}}));
  for (const std::string s : {"hello world", "中文 日本語 한국어 العربية हिन्दी ไทย",
                              "👨‍👩‍👧‍👦 🏳️‍🌈", "a\r\n\tb   c\n",
                              "x<|endoftext|>y", "\x01\x7f"}) {
    EXPECT_EQ(t.decode(t.encode(s)), s);
  }
  // Decomposed input comes back composed (NFC), as from HF.
  EXPECT_EQ(t.decode(t.encode("e\u0301")), "\u00e9");
  // A partial UTF-8 sequence decodes to U+FFFD (HF's from_utf8_lossy).
  EXPECT_EQ(t.decode(std::vector<int32_t>{0xE4, 0xB8, 'a'}), "\ufffda");
  try {
    t.decode(std::vector<int32_t>{99999});
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("id 99999 is not in the vocabulary"));
  }
}

TEST(Tokenizer, InvalidUtf8IsAnError) {
  const Tokenizer t = load(make_tokenizer(kQwen35));
  for (const std::string& bad : {std::string("ab\xff"), std::string("\xc3"),
                                 std::string("\xed\xa0\x80"), std::string("\xc0\xaf")}) {
    try {
      t.encode(bad);
      FAIL() << "accepted invalid UTF-8";
    } catch (const Error& e) {
      EXPECT_THAT(e.message(), HasSubstr("not valid UTF-8"));
    }
  }
  EXPECT_TRUE(valid_utf8("\xf0\x9f\x98\x80 ok"));
  EXPECT_FALSE(valid_utf8("\xf4\x90\x80\x80"));  // above U+10FFFF
}

TEST(Tokenizer, VocabSizeCoversAddedTokensAndUnknownBytesFollowHf) {
  json j = make_tokenizer(kQwen35);
  j["added_tokens"].push_back(
      {{"id", 248319}, {"content", "<|big|>"}, {"special", true}, {"normalized", false}});
  const Tokenizer t = load(j);
  EXPECT_EQ(t.vocab_size(), 248320);
  EXPECT_EQ(t.encode("a<|big|>"), (std::vector<int32_t>{'a', 248319}));
  EXPECT_THAT(t.describe(), HasSubstr("NFC"));
}

TEST(Tokenizer, UnsupportedComponentsAreNamed) {
  auto with = [](const char* key, json v) {
    json j = make_tokenizer(kQwen35);
    j[key] = std::move(v);
    return j;
  };
  EXPECT_THAT(error_of(with("normalizer", {{"type", "NFKC"}})),
              HasSubstr("normalizer 'NFKC' is not supported"));
  EXPECT_THAT(error_of(with("pre_tokenizer", {{"type", "Metaspace"}})),
              HasSubstr("pre-tokenizer 'Metaspace' is not supported"));
  EXPECT_THAT(error_of(with("pre_tokenizer", {{"type", "Whitespace"}})),
              HasSubstr("pre-tokenizer 'Whitespace' is not supported"));
  EXPECT_THAT(error_of(with("post_processor", {{"type", "TemplateProcessing"}})),
              HasSubstr("post_processor 'TemplateProcessing' is not supported"));
  EXPECT_THAT(error_of(with("model", {{"type", "Unigram"}, {"vocab", json::array()}})),
              HasSubstr("model type 'Unigram' is not supported"));
  EXPECT_THAT(error_of(with("model", {{"type", "WordPiece"}, {"vocab", json::object()}})),
              HasSubstr("model type 'WordPiece' is not supported"));
  json j = make_tokenizer(kQwen35);
  j["model"]["byte_fallback"] = true;
  EXPECT_THAT(error_of(j), HasSubstr("byte_fallback is not supported"));
  j = make_tokenizer(kQwen35);
  j["model"]["dropout"] = 0.1;
  EXPECT_THAT(error_of(j), HasSubstr("dropout is not supported"));
  j = make_tokenizer(kQwen35);
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "MergedWithNext";
  EXPECT_THAT(error_of(j), HasSubstr("Split behavior 'MergedWithNext' is not supported"));
  j = make_tokenizer(kQwen35);
  j["pre_tokenizer"]["pretokenizers"].erase(1);  // no ByteLevel
  EXPECT_THAT(error_of(j), HasSubstr("no ByteLevel step"));
  j = make_tokenizer(kQwen35);
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  EXPECT_THAT(error_of(j), HasSubstr("does not compile"));
  j = make_tokenizer(kQwen35);
  j["added_tokens"][0]["lstrip"] = true;
  EXPECT_THAT(error_of(j), HasSubstr("sets lstrip, which is not supported"));
  j = make_tokenizer(kQwen35);
  j["model"]["merges"] = json::array({"a zz"});
  EXPECT_THAT(error_of(j), HasSubstr("uses a token that is not in the vocabulary"));
  j = make_tokenizer(kQwen35);
  j["model"].erase("merges");
  EXPECT_THAT(error_of(j), HasSubstr("without a \"merges\" array"));
  EXPECT_THAT(error_of(json::array()), HasSubstr("not a JSON object"));
  try {
    Tokenizer::from_json_text("{\"model\": ", "broken.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("broken.json: not valid JSON"));
  }
  // The decoder is only needed by decode().
  j = make_tokenizer(kQwen35);
  j["decoder"] = {{"type", "WordPiece"}};
  const Tokenizer t = load(j);
  EXPECT_EQ(t.encode("ab").size(), 2u);
  try {
    t.decode(std::vector<int32_t>{1});
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("decoder 'WordPiece' is not supported"));
  }
}

TEST(Tokenizer, StringMergesAndTheLegacyFormatLoad) {
  json j = make_tokenizer(kQwen35, {{"a", "b"}});
  j["model"]["merges"] = json::array({"a b"});
  j["model"].erase("type");  // old files: BPE recognised by its merges
  const Tokenizer t = load(j);
  EXPECT_EQ(t.encode("ab"), (std::vector<int32_t>{256}));
}

}  // namespace
}  // namespace gdn::text
