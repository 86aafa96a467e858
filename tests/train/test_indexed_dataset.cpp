// Megatron .bin/.idx: write -> read round trips (uint16, int32, multi-sequence documents), the
// exact byte layout, clear errors on corrupted files, and `gdntrain prepare` through the CLI.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "gdn/core/error.h"
#include "gdn/core/rng.h"
#include "support/error_of.h"
#include "train/indexed_dataset.h"
#include "train/prepare.h"

namespace gdn::train {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

fs::path temp_dir(const std::string& tag) {
  auto d = fs::temp_directory_path() / ("gdn_test_idx_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

using gdn::testing::error_of;

std::vector<unsigned char> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<unsigned char>(std::istreambuf_iterator<char>(in), {});
}
void write_bytes(const fs::path& p, const std::vector<unsigned char>& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}
template <class T>
void put(std::vector<unsigned char>& b, T v) {
  unsigned char x[sizeof(T)];
  std::memcpy(x, &v, sizeof(T));
  b.insert(b.end(), x, x + sizeof(T));
}

int files_in(const fs::path& d) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(d)) {
    (void)e;
    ++n;
  }
  return n;
}

// Documents of 1..3 sequences (some empty), random tokens below `vocab`.
std::vector<std::vector<std::vector<int32_t>>> random_docs(uint64_t seed, int32_t vocab) {
  std::vector<std::vector<std::vector<int32_t>>> docs;
  uint64_t k = 0;
  for (int d = 0; d < 23; ++d) {
    std::vector<std::vector<int32_t>> doc;
    int nseq = 1 + static_cast<int>(rng::bits(seed, 1, k++) % 3);
    for (int s = 0; s < nseq; ++s) {
      int len = static_cast<int>(rng::bits(seed, 2, k++) % 40);
      std::vector<int32_t> seq;
      for (int i = 0; i < len; ++i) {
        seq.push_back(static_cast<int32_t>(rng::bits(seed, 3, k++) % static_cast<uint32_t>(vocab)));
      }
      doc.push_back(seq);
    }
    docs.push_back(doc);
  }
  docs[3][0].push_back(vocab - 1);  // the largest id survives
  return docs;
}

TEST(IndexedDataset, WriteReadRoundTripBothDtypes) {
  auto dir = temp_dir("roundtrip");
  for (TokenDType dt : {TokenDType::U16, TokenDType::I32}) {
    const int32_t vocab = dt == TokenDType::U16 ? 65536 : 248320;
    auto docs = random_docs(dt == TokenDType::U16 ? 1 : 2, vocab);
    const std::string prefix = (dir / std::string(token_dtype_name(dt))).string();
    {
      IndexedDatasetWriter w(prefix, dt);
      for (const auto& doc : docs) {
        for (const auto& seq : doc) w.add_sequence(seq);
        w.end_document();
      }
      w.finish();
      EXPECT_EQ(w.num_documents(), static_cast<int64_t>(docs.size()));
    }
    EXPECT_EQ(files_in(dir), dt == TokenDType::U16 ? 2 : 4);  // no temporary files left
    IndexedDataset ds(prefix);
    EXPECT_EQ(ds.dtype(), dt);
    EXPECT_FALSE(ds.has_sequence_modes());
    ASSERT_EQ(ds.num_documents(), static_cast<int64_t>(docs.size()));
    int64_t seq = 0, tokens = 0, ptr = 0;
    for (size_t d = 0; d < docs.size(); ++d) {
      auto [a, b] = ds.document_sequences(static_cast<int64_t>(d));
      EXPECT_EQ(a, seq);
      EXPECT_EQ(b - a, static_cast<int64_t>(docs[d].size()));
      std::vector<int32_t> flat;
      for (const auto& s : docs[d]) {
        EXPECT_EQ(ds.sequence(seq), s);
        EXPECT_EQ(ds.sequence_pointer(seq), ptr);  // exclusive prefix sum of bytes
        ptr += static_cast<int64_t>(s.size()) * token_dtype_size(dt);
        tokens += static_cast<int64_t>(s.size());
        flat.insert(flat.end(), s.begin(), s.end());
        ++seq;
      }
      EXPECT_EQ(ds.document(static_cast<int64_t>(d)), flat);
      EXPECT_EQ(ds.document_length(static_cast<int64_t>(d)), static_cast<int64_t>(flat.size()));
      // Every sub-range, crossing sequence boundaries.
      const int64_t n = static_cast<int64_t>(flat.size());
      for (int64_t lo = 0; lo <= n; lo += 7) {
        for (int64_t hi = lo; hi <= n; hi += 5) {
          std::vector<int32_t> part(static_cast<size_t>(hi - lo));
          ds.read_document(static_cast<int64_t>(d), lo, hi, part.data());
          EXPECT_EQ(part, std::vector<int32_t>(flat.begin() + lo, flat.begin() + hi));
        }
      }
    }
    EXPECT_EQ(ds.num_sequences(), seq);
    EXPECT_EQ(ds.total_tokens(), tokens);
    EXPECT_THAT(error_of([&] { ds.sequence(seq); }), HasSubstr("out of range"));
    std::vector<int32_t> buf(100);
    EXPECT_THAT(error_of([&] { ds.read_document(0, 0, ds.document_length(0) + 1, buf.data()); }),
                HasSubstr("of document 0 requested"));
    // Move keeps the mapping.
    const std::vector<int32_t> d2 = ds.document(2);
    IndexedDataset moved = std::move(ds);
    EXPECT_EQ(moved.document(2), d2);
  }
  fs::remove_all(dir);
}

TEST(IndexedDataset, ByteLayoutIsMegatrons) {
  auto dir = temp_dir("layout");
  const std::string prefix = (dir / "d").string();
  IndexedDatasetWriter w(prefix, TokenDType::U16);
  w.add_document(std::vector<int32_t>{5, 6, 7});
  w.add_sequence(std::vector<int32_t>{8});
  w.add_sequence(std::vector<int32_t>{65535, 0});
  w.end_document();
  w.finish();
  std::vector<unsigned char> want = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
  put<uint64_t>(want, 1);  // version
  want.push_back(8);       // uint16
  put<uint64_t>(want, 3);  // sequences
  put<uint64_t>(want, 3);  // document indices (2 documents + 1)
  for (int32_t l : {3, 1, 2}) put<int32_t>(want, l);
  for (int64_t p : {0, 6, 8}) put<int64_t>(want, p);
  for (int64_t d : {0, 1, 3}) put<int64_t>(want, d);
  EXPECT_EQ(read_bytes(prefix + ".idx"), want);
  std::vector<unsigned char> bin;
  for (uint16_t t : {5, 6, 7, 8, 65535, 0}) put<uint16_t>(bin, t);
  EXPECT_EQ(read_bytes(prefix + ".bin"), bin);
  fs::remove_all(dir);
}

// A hand-built valid int64 dataset (a type the writer does not produce): 2 docs, 3 sequences.
std::vector<unsigned char> int64_idx() {
  std::vector<unsigned char> b = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
  put<uint64_t>(b, 1);
  b.push_back(5);
  put<uint64_t>(b, 3);
  put<uint64_t>(b, 3);
  for (int32_t l : {2, 0, 1}) put<int32_t>(b, l);
  for (int64_t p : {0, 16, 16}) put<int64_t>(b, p);
  for (int64_t d : {0, 2, 3}) put<int64_t>(b, d);
  return b;
}
std::vector<unsigned char> int64_bin() {
  std::vector<unsigned char> b;
  for (int64_t t : {11, 248319, 7}) put<int64_t>(b, t);
  return b;
}

TEST(IndexedDataset, ReadsOtherIntegerTypesAndSequenceModes) {
  auto dir = temp_dir("int64");
  const fs::path p = dir / "d";
  write_bytes(p.string() + ".bin", int64_bin());
  auto idx = int64_idx();
  write_bytes(p.string() + ".idx", idx);
  {
    IndexedDataset ds(p.string());
    EXPECT_EQ(ds.dtype(), TokenDType::I64);
    EXPECT_EQ(ds.document(0), (std::vector<int32_t>{11, 248319}));
    EXPECT_EQ(ds.document(1), (std::vector<int32_t>{7}));
    EXPECT_EQ(ds.sequence(1), std::vector<int32_t>{});
  }
  idx.insert(idx.end(), {0, 0, 0});  // int8 sequence modes (multimodal datasets)
  write_bytes(p.string() + ".idx", idx);
  IndexedDataset ds(p.string());
  EXPECT_TRUE(ds.has_sequence_modes());
  EXPECT_EQ(ds.total_tokens(), 3);
  fs::remove_all(dir);
}

TEST(IndexedDataset, CorruptedFilesGiveClearErrors) {
  auto dir = temp_dir("corrupt");
  const fs::path p = dir / "d";
  const std::string idx = p.string() + ".idx", bin = p.string() + ".bin";
  auto open_error = [&](std::vector<unsigned char> idx_bytes,
                        std::vector<unsigned char> bin_bytes) {
    write_bytes(idx, idx_bytes);
    write_bytes(bin, bin_bytes);
    return error_of([&] { IndexedDataset ds(p.string()); });
  };
  auto good = int64_idx();
  auto gbin = int64_bin();
  {
    auto b = good;
    b.pop_back();
    EXPECT_THAT(open_error(b, gbin), HasSubstr("need 94 bytes, but the file has 93 (truncated?)"));
    b.insert(b.end(), {0, 0, 0});  // 96 bytes: neither plain nor with sequence modes
    EXPECT_THAT(open_error(b, gbin),
                HasSubstr("96 bytes, expected 94 (or 97 with sequence modes)"));
  }
  EXPECT_THAT(open_error({'M', 'M'}, gbin), HasSubstr("too short for the 34-byte header"));
  {
    auto b = good;
    b[0] = 'X';
    EXPECT_THAT(open_error(b, gbin), HasSubstr("bad magic"));
  }
  {
    auto b = good;
    b[9] = 2;
    EXPECT_THAT(open_error(b, gbin), HasSubstr("version 2 is not supported"));
  }
  {
    auto b = good;
    b[17] = 7;
    EXPECT_THAT(open_error(b, gbin), HasSubstr("dtype code 7 (float32) is not a token type"));
    b[17] = 12;
    EXPECT_THAT(open_error(b, gbin), HasSubstr("unknown dtype code 12"));
  }
  {
    auto b = good;
    b[18 + 7] = 0x10;  // an absurd sequence count
    EXPECT_THAT(open_error(b, gbin), HasSubstr("(truncated?)"));
  }
  {
    auto bb = gbin;
    bb.resize(bb.size() - 8);  // the .bin lost its last token
    EXPECT_THAT(open_error(good, bb), HasSubstr("sequence 2 (bytes 16..24) runs past the end"));
  }
  {
    auto b = good;
    b[34 + 12 * 3 + 8 * 2] = 2;  // last document index 2 != 3 sequences
    EXPECT_THAT(open_error(b, gbin),
                HasSubstr("the last document index is 2 but there are 3 sequences"));
  }
  {
    auto b = good;
    b[34 + 12 * 3 + 8 * 1] = 4;  // document indices 0, 4, 3: not monotone
    EXPECT_THAT(open_error(b, gbin),
                HasSubstr("document_indices[2] = 3 is smaller than the previous"));
  }
  {
    auto b = good;
    b[34 + 12] = 3;  // pointer of sequence 0 not a multiple of 8
    EXPECT_THAT(open_error(b, gbin), HasSubstr("not a multiple of the token size 8"));
  }
  {
    auto b = good;
    b[34] = 0xff;
    b[35] = 0xff;
    b[36] = 0xff;
    b[37] = 0xff;  // length -1
    EXPECT_THAT(open_error(b, gbin), HasSubstr("sequence 0 has negative length -1"));
  }
  fs::remove(bin);
  EXPECT_THAT(error_of([&] { IndexedDataset ds(p.string()); }),
              HasSubstr("cannot open '" + bin + "'"));
  fs::remove_all(dir);
}

TEST(IndexedDataset, WriterRejectsBadInputAndCleansUp) {
  auto dir = temp_dir("writer");
  const std::string prefix = (dir / "w").string();
  {
    IndexedDatasetWriter w(prefix, TokenDType::U16);
    w.add_document(std::vector<int32_t>{1, 2});
    EXPECT_THAT(error_of([&] {
                  w.add_document(std::vector<int32_t>{3, 65536});
                }),
                HasSubstr("token 65536 at position 1 of document 1 is out of range for uint16"));
    EXPECT_EQ(files_in(dir), 1);  // only the temporary .bin
  }
  EXPECT_EQ(files_in(dir), 0);  // destroyed without finish(): nothing left
  {
    IndexedDatasetWriter w(prefix, TokenDType::I32);
    EXPECT_THAT(error_of([&] { w.add_document(std::vector<int32_t>{-4}); }),
                HasSubstr("token -4 at position 0 of document 0 is out of range for int32"));
    w.add_sequence(std::vector<int32_t>{9});  // finish() closes the open document
    w.finish();
    EXPECT_THAT(error_of([&] { w.finish(); }), HasSubstr("finish() called twice"));
  }
  IndexedDataset ds(prefix);
  EXPECT_EQ(ds.num_documents(), 1);
  EXPECT_EQ(ds.document(0), std::vector<int32_t>{9});
  EXPECT_THAT(error_of([&] { IndexedDatasetWriter w(prefix, TokenDType::I64); }),
              HasSubstr("token dtype int64 is not writable"));
  EXPECT_THAT(error_of([&] { token_dtype_from_name("int16"); }),
              HasSubstr("unknown token dtype 'int16'"));
  // An empty dataset is valid.
  {
    IndexedDatasetWriter w(prefix, TokenDType::U16);
    w.finish();
  }
  IndexedDataset empty(prefix);
  EXPECT_EQ(empty.num_documents(), 0);
  EXPECT_EQ(empty.total_tokens(), 0);
  fs::remove_all(dir);
}

TEST(ByteTokenizer, EncodesBytesAboveTheSpecialIds) {
  std::vector<int32_t> ids;
  ByteTokenizer::encode(std::string("A\xff\x00z", 4), ids);
  EXPECT_EQ(ids, (std::vector<int32_t>{65 + 2, 255 + 2, 0 + 2, 122 + 2}));
  ids.push_back(ByteTokenizer::kEos);
  EXPECT_EQ(ByteTokenizer::decode(ids), std::string("A\xff\x00z", 4));
  EXPECT_THAT(error_of([] { ByteTokenizer::decode(std::vector<int32_t>{258}); }),
              HasSubstr("id 258 is outside the vocabulary"));
}

int run(const std::string& cmd) {
  int st = std::system(cmd.c_str());
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}
std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<int32_t> doc_ids(const std::string& text) {
  std::vector<int32_t> v;
  ByteTokenizer::encode(text, v);
  v.push_back(ByteTokenizer::kEos);
  return v;
}

TEST(Prepare, TextAndJsonlThroughTheCli) {
  auto dir = temp_dir("cli");
  {
    std::ofstream t(dir / "a.txt", std::ios::binary);
    t << "hello world\n\nsecond line\r\ncaf\xc3\xa9\nno newline at end";
    std::ofstream j(dir / "b.jsonl", std::ios::binary);
    j << R"({"text": "json doc \"one\"\nwith a newline", "id": 3})"
      << "\n\n"
      << R"({"text": ""})"
      << "\n"
      << R"({"text": "last"})"
      << "\n";
  }
  const std::string bin = GDN_GDNTRAIN_BIN;
  const std::string out = (dir / "ds").string();
  int rc =
      run(bin + " prepare --input " + (dir / "a.txt").string() + " " + (dir / "b.jsonl").string() +
          " --output " + out + " --dtype int32 --progress-mb 0.00001 > " +
          (dir / "stdout").string() + " 2> " + (dir / "stderr").string());
  ASSERT_EQ(rc, 0) << slurp(dir / "stderr");
  EXPECT_THAT(slurp(dir / "stdout"), HasSubstr("prepared 6 documents"));
  EXPECT_THAT(slurp(dir / "stdout"), HasSubstr("2 empty skipped"));
  EXPECT_THAT(slurp(dir / "stderr"), HasSubstr("prepare: "));  // progress lines
  IndexedDataset ds(out);
  EXPECT_EQ(ds.dtype(), TokenDType::I32);
  std::vector<std::string> want = {"hello world",
                                   "second line",
                                   "caf\xc3\xa9",
                                   "no newline at end",
                                   "json doc \"one\"\nwith a newline",
                                   "last"};
  ASSERT_EQ(ds.num_documents(), static_cast<int64_t>(want.size()));
  for (size_t d = 0; d < want.size(); ++d)
    EXPECT_EQ(ds.document(static_cast<int64_t>(d)), doc_ids(want[d])) << d;

  // uint16 default; --format text reads a .jsonl file as plain lines.
  rc = run(bin + " prepare --input " + (dir / "b.jsonl").string() + " --format text --output " +
           out + "16 > /dev/null 2>&1");
  ASSERT_EQ(rc, 0);
  IndexedDataset d16(out + "16");
  EXPECT_EQ(d16.dtype(), TokenDType::U16);
  EXPECT_EQ(d16.num_documents(), 3);
  EXPECT_EQ(d16.document(1), doc_ids(R"({"text": ""})"));

  // A malformed JSONL line: an error naming file:line, and no dataset written.
  {
    std::ofstream j(dir / "bad.jsonl");
    j << R"({"text": "fine"})"
      << "\n"
      << R"({"text": oops})"
      << "\n";
  }
  rc = run(bin + " prepare --input " + (dir / "bad.jsonl").string() + " --output " +
           (dir / "bad").string() + " > /dev/null 2> " + (dir / "stderr").string());
  EXPECT_NE(rc, 0);
  EXPECT_THAT(slurp(dir / "stderr"), HasSubstr("bad.jsonl:2: not valid JSON"));
  EXPECT_FALSE(fs::exists(dir / "bad.idx"));
  EXPECT_FALSE(fs::exists(dir / "bad.bin"));
  {
    std::ofstream j(dir / "notext.jsonl");
    j << R"({"content": "x"})"
      << "\n";
  }
  rc = run(bin + " prepare --input " + (dir / "notext.jsonl").string() + " --output " +
           (dir / "bad").string() + " > /dev/null 2> " + (dir / "stderr").string());
  EXPECT_NE(rc, 0);
  EXPECT_THAT(slurp(dir / "stderr"),
              HasSubstr("notext.jsonl:1: expected an object with a string field \"text\""));
  // Missing input, bad dtype: argument errors.
  EXPECT_NE(
      run(bin + " prepare --input " + (dir / "nope.txt").string() + " --output x > /dev/null 2>&1"),
      0);
  EXPECT_NE(run(bin + " prepare --input " + (dir / "a.txt").string() +
                " --output x --dtype int8 > /dev/null 2>&1"),
            0);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace gdn::train
