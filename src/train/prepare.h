// `gdntrain prepare`: text or JSONL files -> a Megatron indexed dataset, with a byte-level
// tokenizer so that real data can be trained on without an external tokenizer.
//
// Byte tokenizer (vocabulary 258):
//   0        pad (never produced by prepare; the tiny config's pad_token_id)
//   1        EOS, appended after every document
//   2..257   the bytes 0x00..0xFF of the UTF-8 text (id = byte + 2)
// Documents: for a text file, one document per line (the '\n' and a trailing '\r' removed); for a
// JSONL file, one document per line holding a JSON object with a string field "text". Empty
// documents (empty lines, "text": "") are skipped and counted. One document = one sequence of
// the dataset.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "train/indexed_dataset.h"

namespace gdn::train {

struct ByteTokenizer {
  static constexpr int32_t kPad = 0;
  static constexpr int32_t kEos = 1;
  static constexpr int32_t kByteOffset = 2;
  static constexpr int64_t kVocabSize = 258;
  // Appends the ids of `text`'s bytes to `out`.
  static void encode(std::string_view text, std::vector<int32_t>& out);
  // The bytes of the byte ids in `ids` (pad/EOS dropped; ids outside the vocabulary throw).
  static std::string decode(std::span<const int32_t> ids);
};

enum class InputFormat { Auto, Text, Jsonl };  // Auto: .jsonl / .json -> Jsonl, else Text

struct PrepareOptions {
  std::vector<std::string> inputs;
  std::string output_prefix;
  TokenDType dtype = TokenDType::U16;
  InputFormat format = InputFormat::Auto;
  int64_t progress_every_bytes = int64_t{64} << 20;  // a progress line on stderr every N bytes
};

struct PrepareStats {
  int64_t documents = 0;
  int64_t tokens = 0;  // EOS included
  int64_t bytes_read = 0;
  int64_t skipped_empty = 0;
};

// Tokenizes every input in order and writes OUTPUT_PREFIX.bin/.idx atomically. A malformed
// JSONL line is an error naming the file and the line number; nothing is written then.
PrepareStats prepare_dataset(const PrepareOptions& opt);

}  // namespace gdn::train
