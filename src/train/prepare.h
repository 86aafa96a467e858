// `gdntrain prepare`: text or JSONL files -> a Megatron indexed dataset, with a byte-level
// tokenizer so that real data can be trained on without an external tokenizer.
//
// Byte tokenizer (vocabulary 258):
//   0        pad (never produced by prepare; the tiny config's pad_token_id)
//   1        EOS, appended after every document
//   2..257   the bytes 0x00..0xFF of the UTF-8 text (id = byte + 2)
// With --tokenizer, a Hugging Face tokenizer.json replaces it (src/text/tokenizer.h), and the
// document separator is its EOS (see PrepareOptions::eos).
// Documents: for a text file, one document per line (the '\n' and a trailing '\r' removed); for a
// JSONL file, one document per line holding a JSON object with a string field "text" (the key is
// an option). Inputs may be gzip or zstd compressed (detected from their first bytes). Empty
// documents (empty lines, "text": "") are skipped and counted. One document = one sequence of
// the dataset.
#pragma once

#include <cstdint>
#include <optional>
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

enum class InputFormat { Auto, Text, Jsonl };  // Auto: .jsonl / .json (also .gz/.zst) -> Jsonl

struct PrepareOptions {
  std::vector<std::string> inputs;
  std::string output_prefix;
  // Empty: the byte tokenizer. Else a Hugging Face tokenizer.json (src/text/tokenizer.h).
  std::string tokenizer;
  // The token written after every document. Empty: the byte tokenizer's EOS (1), or for a
  // tokenizer.json "<|endoftext|>" when it has it, else the eos_token of a tokenizer_config.json
  // beside it; an error when none is found.
  std::string eos;
  // Unset: uint16 when every id fits (vocabulary <= 65,536), else int32 (Megatron has no uint32;
  // its own preprocessing writes int32 above 65,535 too).
  std::optional<TokenDType> dtype;
  InputFormat format = InputFormat::Auto;
  std::string json_key = "text";
  int threads = 0;                         // tokenizing threads; 0: the hardware's
  int64_t batch_bytes = int64_t{1} << 20;  // documents are handed to threads in batches this big
  int64_t progress_every_bytes = int64_t{64} << 20;  // non-terminal stderr: a line every N bytes
  bool progress_bar = false;  // a live bar on stderr (MB/s, ETA) instead of progress lines
};

struct PrepareStats {
  int64_t documents = 0;
  int64_t tokens = 0;      // EOS included
  int64_t bytes_read = 0;  // text bytes (decompressed)
  int64_t file_bytes = 0;  // bytes of the input files (compressed size for compressed ones)
  int64_t skipped_empty = 0;
  int64_t vocab_size = 0;  // of the tokenizer used
  int32_t eos_id = 0;
  TokenDType dtype = TokenDType::U16;
  double seconds = 0;
  int threads = 1;
};

// Tokenizes every input in order and writes OUTPUT_PREFIX.bin/.idx atomically: documents come out
// in input order whatever the thread count (the output is byte-identical for any --threads).
// Memory is bounded by the batches in flight (about 2 x threads x batch_bytes), not the corpus.
// A malformed JSONL line, a missing key or invalid UTF-8 (with a tokenizer.json) is an error
// naming the file and the line; nothing is written then.
PrepareStats prepare_dataset(const PrepareOptions& opt);

// Concatenates the documents of several datasets (PREFIX.bin/.idx each) into one, in order.
// dtype unset: uint16 when every input is uint16 (or uint8), else int32.
PrepareStats merge_datasets(const std::vector<std::string>& prefixes,
                            const std::string& output_prefix,
                            std::optional<TokenDType> dtype = std::nullopt);

}  // namespace gdn::train
