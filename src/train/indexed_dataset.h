// Megatron-LM indexed dataset (<prefix>.bin + <prefix>.idx), layout of
// megatron/core/datasets/indexed_dataset.py as written down in engine_notes.md §A.7.2:
//
//   <prefix>.bin   every sequence's tokens back to back, little-endian, no header
//   <prefix>.idx   offset  size  field
//                  0       9     magic "MMIDIDX\0\0"
//                  9       8     u64 version = 1
//                  17      1     u8 dtype code (1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 f64, 7 f32, 8
//                  u16) 18      8     u64 S = number of sequences 26      8     u64 D = number of
//                  document indices (= documents + 1) 34      4·S   i32 sequence lengths (tokens)
//                  34+4S   8·S   i64 sequence pointers (byte offsets into .bin)
//                  34+12S  8·D   i64 document indices: 0, then the sequence count after each
//                                document (the last entry = S)
//                  34+12S+8D S   i8 sequence modes (multimodal datasets only; accepted, ignored)
//
// A document is one or more consecutive sequences (for text, usually one). The reader maps both
// files and validates them completely at open (sizes, magic, version, dtype, monotone document
// indices, every sequence inside .bin): a truncated or inconsistent file is a gdn::Error naming
// the file and the field, never a crash or a silently short read. The header fields sit at
// unaligned offsets (34), so they are read with memcpy, never through typed pointers.
//
// The writer supports the two token types worth writing: uint16 (vocabularies below 65,536, what
// Megatron picks below 65,500) and int32. It streams .bin to a temporary file, writes .idx at
// finish(), and renames .bin then .idx into place (each fsynced), so an .idx that exists always
// describes a complete .bin. A writer destroyed before finish() removes its temporary files.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace gdn::train {

enum class TokenDType : uint8_t {
  U8 = 1,
  I8 = 2,
  I16 = 3,
  I32 = 4,
  I64 = 5,
  F64 = 6,
  F32 = 7,
  U16 = 8
};
int64_t token_dtype_size(TokenDType t);
std::string_view token_dtype_name(TokenDType t);  // "uint16", "int32", ...
// Parses "uint16" / "int32" (the writable types); throws naming the string.
TokenDType token_dtype_from_name(std::string_view name);

class IndexedDataset {
 public:
  // Maps and validates PREFIX.idx and PREFIX.bin.
  explicit IndexedDataset(const std::string& prefix);
  ~IndexedDataset();
  IndexedDataset(IndexedDataset&& o) noexcept;
  IndexedDataset& operator=(IndexedDataset&& o) noexcept;
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  const std::string& prefix() const { return prefix_; }
  TokenDType dtype() const { return dtype_; }
  int64_t num_sequences() const { return num_sequences_; }
  int64_t num_documents() const { return num_doc_indices_ - 1; }
  int64_t total_tokens() const { return total_tokens_; }
  bool has_sequence_modes() const { return has_modes_; }

  int64_t sequence_length(int64_t seq) const;
  int64_t sequence_pointer(int64_t seq) const;  // byte offset in .bin
  // Sequences [first, last) of document `doc`.
  std::pair<int64_t, int64_t> document_sequences(int64_t doc) const;
  int64_t document_length(int64_t doc) const;     // tokens over all its sequences
  std::vector<int64_t> document_lengths() const;  // [num_documents()], for plan_packing()

  // Tokens [begin, end) of a sequence / of a document (across its sequences), as int32.
  void read_sequence(int64_t seq, int64_t begin, int64_t end, int32_t* out) const;  // [end-begin]
  void read_document(int64_t doc, int64_t begin, int64_t end, int32_t* out) const;  // [end-begin]
  std::vector<int32_t> sequence(int64_t seq) const;
  std::vector<int32_t> document(int64_t doc) const;

 private:
  int64_t doc_index(int64_t k) const;
  void release();
  std::string prefix_;
  const unsigned char* idx_ = nullptr;  // mapped .idx
  size_t idx_size_ = 0;
  const unsigned char* bin_ = nullptr;  // mapped .bin
  size_t bin_size_ = 0;
  TokenDType dtype_ = TokenDType::I32;
  int64_t num_sequences_ = 0;
  int64_t num_doc_indices_ = 0;
  int64_t total_tokens_ = 0;
  bool has_modes_ = false;
};

class IndexedDatasetWriter {
 public:
  // `dtype`: U16 or I32.
  IndexedDatasetWriter(std::string prefix, TokenDType dtype);
  ~IndexedDatasetWriter();
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  // One sequence that is a whole document (the plain-text case).
  void add_document(std::span<const int32_t> tokens);
  // A document made of several sequences: add_sequence()... then end_document().
  void add_sequence(std::span<const int32_t> tokens);
  void end_document();
  // Closes an open document, writes .idx, renames both files into place. Idempotent error if
  // called twice.
  void finish();

  int64_t num_documents() const { return static_cast<int64_t>(doc_indices_.size()) - 1; }
  int64_t num_tokens() const { return num_tokens_; }

 private:
  void flush();
  std::string prefix_;
  TokenDType dtype_;
  std::string bin_tmp_, idx_tmp_;
  int fd_ = -1;
  bool finished_ = false;
  std::vector<unsigned char> buffer_;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> pointers_;
  std::vector<int64_t> doc_indices_{0};
  int64_t bin_bytes_ = 0;
  int64_t num_tokens_ = 0;
};

}  // namespace gdn::train
