// libFuzzer target for Megatron .idx/.bin datasets (debug preset; replayed by the cpu preset, see
// tests/fuzz/replay_main.cpp):
//   mkdir -p /tmp/corpus && build/debug/tests/fuzz_indexed /tmp/corpus tests/data/fuzz/fuzz_indexed
// Input layout: a little-endian u32 n, then n bytes of PREFIX.idx, then PREFIX.bin (the rest).
// The two files are written to a private directory (in /dev/shm when it exists) and opened with
// the reader, which must either validate them and read every document, or throw gdn::Error; any
// other exception, a crash or a sanitizer report is a bug.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

#include "gdn/core/error.h"
#include "train/indexed_dataset.h"

namespace {
void put(const std::string& path, const uint8_t* p, size_t n) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (n > 0 && std::fwrite(p, 1, n, f) != n) std::abort();
  if (std::fclose(f) != 0) std::abort();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string prefix = [] {
    namespace fs = std::filesystem;
    const fs::path root = fs::exists("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    const fs::path d = root / ("gdn_fuzz_indexed_" + std::to_string(::getpid()));
    fs::create_directories(d);
    return (d / "ds").string();
  }();
  if (size < 4) return 0;
  uint32_t n = 0;
  std::memcpy(&n, data, 4);
  data += 4;
  size -= 4;
  if (n > size) n = static_cast<uint32_t>(size);
  put(prefix + ".idx", data, n);
  put(prefix + ".bin", data + n, size - n);
  try {
    gdn::train::IndexedDataset ds(prefix);
    size_t tokens = 0;
    for (int64_t d = 0; d < ds.num_documents(); ++d) tokens += ds.document(d).size();
    for (int64_t s = 0; s < ds.num_sequences(); ++s) tokens += ds.sequence(s).size();
    (void)ds.document_lengths();
    (void)tokens;
  } catch (const gdn::Error&) {
  }
  return 0;
}
