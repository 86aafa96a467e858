// safetensors: round trips, raw (untouched) tensors, atomic writes, and the corpus of malformed
// files in tests/data/safetensors_bad (each must give a gdn::Error with the expected message).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "gdn/core/rng.h"
#include "gdn/core/safetensors.h"

namespace gdn {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir() {
  fs::path d = fs::temp_directory_path() /
               fmt::format("gdn_st_{}_{}", ::getpid(),
                           ::testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

TEST(SafeTensors, RoundTripEveryDtypeWithMetadataAndRawTensors) {
  fs::path dir = temp_dir();
  std::vector<OwnedTensor> keep;
  std::vector<NamedTensor> ts;
  int i = 0;
  for (DType dt :
       {DType::F64, DType::F32, DType::BF16, DType::F16, DType::I32, DType::I64, DType::I16}) {
    OwnedTensor src = OwnedTensor::empty(DType::F64, {3, 5});
    rng::fill_normal(src, 7, static_cast<uint64_t>(i), 0, 100);
    OwnedTensor t = dtype_is_float(dt) ? convert(src, dt) : OwnedTensor::empty(dt, {3, 5});
    if (!dtype_is_float(dt))
      for (int j = 0; j < 15; ++j) {
        if (dt == DType::I32)
          t.ptr<int32_t>()[j] = j * 1000 - 7;
        else if (dt == DType::I16)
          t.ptr<int16_t>()[j] = static_cast<int16_t>(j * 2000 - 32768);
        else
          t.ptr<int64_t>()[j] = (int64_t{1} << 40) + j;
      }
    ts.push_back({fmt::format("t.{}", dtype_name(dt)), t, {}, {}, nullptr, 0});
    keep.push_back(std::move(t));
    ++i;
  }
  const unsigned char fp8[6] = {1, 2, 3, 4, 5, 250};
  ts.push_back({"mtp.fp8", Tensor(), "F8_E4M3", {2, 3}, fp8, 6});
  OwnedTensor scalar = OwnedTensor::empty(DType::F32, {});
  scalar.ptr<float>()[0] = 2.5f;
  ts.push_back({"scalar", scalar, {}, {}, nullptr, 0});
  OwnedTensor empty = OwnedTensor::empty(DType::F32, {0, 4});
  ts.push_back({"empty", empty, {}, {}, nullptr, 0});
  std::string path = (dir / "x.safetensors").string();
  write_safetensors(path, ts, {{"format", "pt"}});

  SafeTensorsFile f(path);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  ASSERT_EQ(f.tensors().size(), ts.size());
  for (size_t k = 0; k < keep.size(); ++k) {
    Tensor v = f.view(ts[k].name);
    EXPECT_EQ(v.shape_str(), "[3, 5]");
    EXPECT_EQ(v.dtype(), keep[k].view().dtype());
    EXPECT_EQ(std::memcmp(v.data(), keep[k].view().data(), static_cast<size_t>(v.nbytes())), 0)
        << ts[k].name;
  }
  const SafeTensorInfo& raw = f.info("mtp.fp8");
  EXPECT_FALSE(raw.known_dtype);
  EXPECT_EQ(raw.dtype_name, "F8_E4M3");
  EXPECT_EQ(std::memcmp(f.raw(raw), fp8, 6), 0);
  EXPECT_THROW(f.view("mtp.fp8"), Error);
  EXPECT_EQ(f.load("scalar", DType::F64).ptr<double>()[0], 2.5);
  EXPECT_EQ(f.view("empty").numel(), 0);
  // Header padded to 8 bytes: every tensor starts aligned.
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ(n % 8, 0u);
  // Conversion on load: BF16 on disk -> F32.
  OwnedTensor as32 = f.load("t.BF16", DType::F32);
  EXPECT_EQ(to_f64_vector(as32), to_f64_vector(keep[2]));
  fs::remove_all(dir);
}

TEST(SafeTensors, AtomicWriteLeavesNoTemporaryAndKeepsTheOldFileOnFailure) {
  fs::path dir = temp_dir();
  std::string path = (dir / "w.safetensors").string();
  OwnedTensor a = OwnedTensor::zeros(DType::F32, {4});
  write_safetensors(path, {{"a", a, {}, {}, nullptr, 0}});
  auto before = fs::file_size(path);
  // A failing write must not touch the old file.
  std::vector<NamedTensor> bad = {{"a", a, {}, {}, nullptr, 0},
                                  {"a", a, {}, {}, nullptr, 0}};  // duplicate name
  EXPECT_THROW(write_safetensors(path, bad), Error);
  EXPECT_EQ(fs::file_size(path), before);
  SafeTensorsFile ok(path);
  EXPECT_TRUE(ok.contains("a"));
  int entries = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    (void)e;
    ++entries;
  }
  EXPECT_EQ(entries, 1) << "a temporary file was left behind";
  EXPECT_THROW(write_safetensors((dir / "no_such_dir" / "x.safetensors").string(),
                                 {{"a", a, {}, {}, nullptr, 0}}),
               Error);
  fs::remove_all(dir);
}

TEST(SafeTensors, MissingFileAndDirectoryAreClearErrors) {
  try {
    SafeTensorsFile f("/nonexistent/x.safetensors");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot open '/nonexistent/x.safetensors'"),
              std::string::npos);
  }
  EXPECT_THROW(SafeTensorsFile f("/tmp"), Error);
}

TEST(SafeTensors, MalformedCorpusGivesTheExpectedErrors) {
  fs::path dir = fs::path(GDN_TEST_DATA_DIR) / "safetensors_bad";
  std::ifstream manifest(dir / "MANIFEST.tsv");
  ASSERT_TRUE(manifest.good());
  std::string line;
  int cases = 0;
  while (std::getline(manifest, line)) {
    if (line.empty()) continue;
    auto tab = line.find('\t');
    std::string file = line.substr(0, tab), fragment = line.substr(tab + 1);
    try {
      SafeTensorsFile f((dir / file).string());
      ADD_FAILURE() << file << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
          << file << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << "error names the file";
    }
    ++cases;
  }
  EXPECT_GE(cases, 20);
  SafeTensorsFile good((dir / "good.safetensors").string());
  EXPECT_EQ(good.tensors().size(), 2u);
}

TEST(SafeTensors, EveryTruncationOfAValidFileIsRejectedCleanly) {
  fs::path dir = fs::path(GDN_TEST_DATA_DIR) / "safetensors_bad";
  std::ifstream in(dir / "good.safetensors", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 16u);
  for (size_t n = 0; n < bytes.size(); ++n)
    EXPECT_THROW(SafeTensorsFile::from_bytes(bytes.data(), n, "truncated"), Error) << n;
  // Single-byte corruptions never crash: either a clean error or a valid parse.
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::string c = bytes;
    c[i] = static_cast<char>(c[i] ^ 0x5a);
    try {
      SafeTensorsFile::from_bytes(c.data(), c.size(), "corrupt");
    } catch (const Error&) {
    }
  }
}

}  // namespace
}  // namespace gdn
