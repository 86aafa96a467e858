// A Hugging Face `tokenizer.json` byte-level BPE tokenizer (Qwen3.5, Qwen2/3, GPT-2 style), exact
// to the `tokenizers` package for the components it accepts, and a clear error for every other.
//
// Supported (anything else in the file is a gdn::Error naming the component):
//   normalizer     null | NFC | Sequence of those
//   pre_tokenizer  Split (Regex or String pattern, behavior Isolated or Removed, invert false)
//                  | ByteLevel (add_prefix_space, use_regex: GPT-2's pattern) | Sequence of those;
//                  exactly one ByteLevel, which must come last (the BPE then works on bytes)
//   model          BPE: vocab, merges ("a b" strings or [a, b] pairs), unk_token / fuse_unk,
//                  ignore_merges; no dropout, no byte_fallback, no subword prefix / suffix
//   added_tokens   matched leftmost-longest before pre-tokenization: on the raw text when
//                  `normalized` is false, on the normalized text when it is true; no lstrip,
//                  rstrip or single_word
//   post_processor null | ByteLevel (ids unchanged); truncation / padding are ignored (logged)
//   decoder        ByteLevel (decode() refuses any other)
//
// Encoding, in the order of tokenizers/src/tokenizer/mod.rs (encode_single_sequence):
//   1. split the text on the non-normalized added tokens (added_vocabulary.rs);
//   2. NFC-normalize each remaining piece (utf8proc), split on the normalized added tokens;
//   3. pre-tokenize each piece: the Split regexes (PCRE2, UTF + UCP, JIT: the `(?!\S)` lookahead
//      and \p{L}/\p{M}/\p{N} need a backtracking engine with Unicode properties, as Oniguruma is
//      in `tokenizers`), then ByteLevel;
//   4. BPE by merge rank on each pre-token's bytes (models/bpe/word.rs, merge_all).
// Steps 2-3 use libraries; the byte-to-symbol table, the merge loop and the added-token matcher
// are hand-written (no Debian library provides them).
//
// Thread safety: a Tokenizer is immutable after loading; encode() from several threads is safe
// when each thread passes its own EncodeState (caches and scratch buffers).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace gdn::text {

class EncodeState;  // per-thread caches; see make_state()
struct EncodeStateDeleter {
  void operator()(EncodeState* s) const;
};
using EncodeStatePtr = std::unique_ptr<EncodeState, EncodeStateDeleter>;

class Tokenizer {
 public:
  // Reads and validates a tokenizer.json; errors name the file and the component.
  static Tokenizer from_file(const std::string& path);
  // The same from the JSON text; `origin` names it in errors.
  static Tokenizer from_json_text(std::string_view json_text, const std::string& origin);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Appends the ids of `text` (valid UTF-8; throws otherwise) to `out`.
  void encode(std::string_view text, std::vector<int32_t>& out, EncodeState& state) const;
  std::vector<int32_t> encode(std::string_view text) const;  // with a temporary state
  EncodeStatePtr make_state() const;

  // The text of `ids` (added tokens included as their content). Throws on an unknown id, or when
  // the decoder is not ByteLevel.
  std::string decode(std::span<const int32_t> ids) const;

  // The pieces the BPE sees (after the added-token split, normalization and pre-tokenization),
  // as UTF-8 bytes; an added token appears as its content. For tests and `tokenize --pieces`.
  std::vector<std::string> pre_tokenize(std::string_view text) const;

  // One more than the largest id (model vocabulary and added tokens).
  int64_t vocab_size() const;
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // One line: model, vocabulary, merges, normalizer, pre-tokenizer.
  std::string describe() const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Whether `s` is valid UTF-8 (no overlongs, surrogates or code points above U+10FFFF); on
// failure `*bad_offset` is the offset of the first invalid byte.
bool valid_utf8(std::string_view s, size_t* bad_offset = nullptr);

// The GPT-2 byte-to-character map of the ByteLevel pre-tokenizer (bytes_char in
// tokenizers/src/pre_tokenizers/byte_level.rs): printable Latin-1 bytes map to themselves, the
// other 68 to U+0100 and up, in byte order. Returns the code point.
uint32_t byte_to_char(uint8_t b);

}  // namespace gdn::text
