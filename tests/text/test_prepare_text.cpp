// Real text through `prepare`: a tokenizer.json (the committed Qwen3.5-style fixture, 2,048 ids,
// made by scripts/make_tokenizer_fixture.py), gzip and zstd inputs, output identical for any
// thread count, shard merge, int32 ids above 65,535, clear errors for bad input, the trainer's
// vocabulary check, and training end to end on prepared real text (a frozen copy of the
// repository's docs).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "gdn/core/error.h"
#include "model/config.h"
#include "support/error_of.h"
#include "text/input_reader.h"
#include "text/tokenizer.h"
#include "train/indexed_dataset.h"
#include "train/prepare.h"
#include "train/trainer.h"

namespace gdn::train {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

const std::string kTok = std::string(GDN_TEST_DATA_DIR) + "/tokenizer/qwen35_style_2k.json";
const fs::path kCorpus = fs::path(GDN_TEST_DATA_DIR) / "text" / "docs_corpus.jsonl";

fs::path temp_dir(const std::string& tag) {
  fs::path d = fs::temp_directory_path() / fmt::format("gdn_pt_{}_{}", ::getpid(), tag);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

using gdn::testing::error_of;

// Real English text as JSONL: every paragraph of the repository's docs is a document.
// The paragraphs (over 40 characters) of the repository's docs as they stood on 2026-12-01, frozen
// in tests/data/text/docs_corpus.jsonl (one {"text": ...} per line), so that the docs changing
// never changes what these tests tokenize and train on.
std::vector<std::string> doc_paragraphs(size_t max_docs) {
  std::vector<std::string> out;
  std::istringstream in(slurp(kCorpus));
  std::string line;
  while (out.size() < max_docs && std::getline(in, line))
    out.push_back(nlohmann::json::parse(line).at("text").get<std::string>());
  return out;
}

void write_jsonl(const fs::path& p, const std::vector<std::string>& docs) {
  std::ofstream f(p, std::ios::binary);
  for (const auto& d : docs) f << nlohmann::json{{"text", d}}.dump() << "\n";
}

PrepareOptions opts(std::vector<std::string> in, const fs::path& out, int threads = 1) {
  PrepareOptions o;
  o.inputs = std::move(in);
  o.output_prefix = out.string();
  o.tokenizer = kTok;
  o.threads = threads;
  o.batch_bytes = 2000;  // many batches even on a small corpus
  return o;
}

TEST(PrepareText, TokenizerIdsWithEosAndAnyThreadCountGivesTheSameFiles) {
  const auto dir = temp_dir("threads");
  const auto docs = doc_paragraphs(400);
  ASSERT_GT(docs.size(), 100u);
  write_jsonl(dir / "c.jsonl", docs);
  const text::Tokenizer tok = text::Tokenizer::from_file(kTok);
  const int32_t eos = *tok.token_to_id("<|endoftext|>");
  PrepareStats s1 = prepare_dataset(opts({(dir / "c.jsonl").string()}, dir / "t1", 1));
  PrepareStats s3 = prepare_dataset(opts({(dir / "c.jsonl").string()}, dir / "t3", 3));
  EXPECT_EQ(s1.documents, static_cast<int64_t>(docs.size()));
  EXPECT_EQ(s1.tokens, s3.tokens);
  EXPECT_EQ(s1.dtype, TokenDType::U16);  // 2,048 ids
  EXPECT_EQ(s1.eos_id, eos);
  EXPECT_EQ(slurp(dir / "t1.bin"), slurp(dir / "t3.bin"));
  EXPECT_EQ(slurp(dir / "t1.idx"), slurp(dir / "t3.idx"));
  IndexedDataset ds((dir / "t3").string());
  ASSERT_EQ(ds.num_documents(), static_cast<int64_t>(docs.size()));
  for (size_t d = 0; d < docs.size(); d += 37) {
    std::vector<int32_t> want = tok.encode(docs[d]);
    want.push_back(eos);
    EXPECT_EQ(ds.document(static_cast<int64_t>(d)), want) << d;
  }
  fs::remove_all(dir);
}

TEST(PrepareText, GzipAndZstdInputsMatchThePlainFile) {
  const auto dir = temp_dir("comp");
  write_jsonl(dir / "c.jsonl", doc_paragraphs(200));
  const std::string plain = slurp(dir / "c.jsonl");
  {
    // Two gzip members back to back (as `cat a.gz b.gz` makes).
    gzFile g = gzopen((dir / "c.jsonl.gz").c_str(), "wb");
    const size_t half = plain.find('\n', plain.size() / 2) + 1;
    gzwrite(g, plain.data(), static_cast<unsigned>(half));
    gzclose(g);
    g = gzopen((dir / "c.jsonl.gz").c_str(), "ab");
    gzwrite(g, plain.data() + half, static_cast<unsigned>(plain.size() - half));
    gzclose(g);
    std::string z(ZSTD_compressBound(plain.size()), '\0');
    z.resize(ZSTD_compress(z.data(), z.size(), plain.data(), plain.size(), 3));
    std::ofstream(dir / "c.jsonl.zst", std::ios::binary) << z;
    std::ofstream(dir / "cut.jsonl.zst", std::ios::binary) << z.substr(0, z.size() / 2);
  }
  prepare_dataset(opts({(dir / "c.jsonl").string()}, dir / "p", 2));
  prepare_dataset(opts({(dir / "c.jsonl.gz").string()}, dir / "g", 2));
  prepare_dataset(opts({(dir / "c.jsonl.zst").string()}, dir / "z", 2));
  EXPECT_EQ(slurp(dir / "p.bin"), slurp(dir / "g.bin"));
  EXPECT_EQ(slurp(dir / "p.bin"), slurp(dir / "z.bin"));
  EXPECT_EQ(slurp(dir / "p.idx"), slurp(dir / "z.idx"));
  EXPECT_EQ(text::LineReader((dir / "c.jsonl.gz").string()).compression(), text::Compression::Gzip);
  // A truncated stream is an error, and nothing is written.
  EXPECT_THAT(
      error_of([&] { prepare_dataset(opts({(dir / "cut.jsonl.zst").string()}, dir / "x")); }),
      HasSubstr("truncated"));
  EXPECT_FALSE(fs::exists(dir / "x.idx"));
  EXPECT_FALSE(fs::exists(dir / "x.bin"));
  fs::remove_all(dir);
}

TEST(PrepareText, ShardsMergeIntoOneDataset) {
  const auto dir = temp_dir("merge");
  const auto docs = doc_paragraphs(120);
  write_jsonl(dir / "a.jsonl", {docs.begin(), docs.begin() + 50});
  write_jsonl(dir / "b.jsonl", {docs.begin() + 50, docs.end()});
  prepare_dataset(opts({(dir / "a.jsonl").string()}, dir / "a"));
  prepare_dataset(opts({(dir / "b.jsonl").string()}, dir / "b"));
  prepare_dataset(opts({(dir / "a.jsonl").string(), (dir / "b.jsonl").string()}, dir / "ab"));
  PrepareStats m =
      merge_datasets({(dir / "a").string(), (dir / "b").string()}, (dir / "m").string());
  EXPECT_EQ(m.documents, static_cast<int64_t>(docs.size()));
  EXPECT_EQ(slurp(dir / "m.bin"), slurp(dir / "ab.bin"));
  EXPECT_EQ(slurp(dir / "m.idx"), slurp(dir / "ab.idx"));
  // Through the CLI too.
  const std::string cmd = std::string(GDN_GDNTRAIN_BIN) + " prepare --merge --input " +
                          (dir / "a").string() + " " + (dir / "b").string() + " --output " +
                          (dir / "m2").string() + " > /dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  EXPECT_EQ(slurp(dir / "m2.bin"), slurp(dir / "ab.bin"));
  fs::remove_all(dir);
}

TEST(PrepareText, LargeVocabulariesWriteInt32AndTheTrainerRefusesIdsAboveItsVocab) {
  const auto dir = temp_dir("big");
  // The fixture plus an end-of-document token at id 248,319 (Qwen3.5's vocabulary is 248,320).
  nlohmann::json j = nlohmann::json::parse(slurp(kTok));
  j["added_tokens"].push_back(
      {{"id", 248319}, {"content", "<|doc_end|>"}, {"special", true}, {"normalized", false}});
  std::ofstream(dir / "big.json") << j.dump();
  std::ofstream(dir / "c.txt") << "first line of text\nsecond line<|doc_end|>\nthird\n";
  PrepareOptions o = opts({(dir / "c.txt").string()}, dir / "d");
  o.tokenizer = (dir / "big.json").string();
  o.eos = "<|doc_end|>";
  PrepareStats st = prepare_dataset(o);
  EXPECT_EQ(st.dtype, TokenDType::I32);
  EXPECT_EQ(st.vocab_size, 248320);
  IndexedDataset ds((dir / "d").string());
  EXPECT_EQ(ds.dtype(), TokenDType::I32);
  ASSERT_EQ(ds.num_documents(), 3);
  EXPECT_EQ(ds.document(1).back(), 248319);
  EXPECT_EQ(ds.document(1)[ds.document(1).size() - 2], 248319);  // the one inside the text
  // uint16 cannot hold it: refused before any work.
  o.dtype = TokenDType::U16;
  EXPECT_THAT(error_of([&] { prepare_dataset(o); }), HasSubstr("too many for uint16"));
  // The tiny model (vocabulary 258) refuses the dataset, naming the token.
  ConfigTree c(default_train_config());
  c.set(fmt::format("run.dir=\"{}\"", (dir / "run").string()));
  c.set("train.steps=1");
  c.set("train.micro_batch_tokens=64");
  c.set("data.kind=\"indexed\"");
  c.set(fmt::format("data.path=\"{}\"", (dir / "d").string()));
  c.set("eval.every=0");
  TrainOptions quiet;
  quiet.quiet = true;
  EXPECT_THAT(error_of([&] { run_training(c, quiet); }),
              HasSubstr("is outside the model vocabulary [0, 258)"));
  fs::remove_all(dir);
}

TEST(PrepareText, BadInputGivesErrorsNamingFileAndLine) {
  const auto dir = temp_dir("bad");
  std::ofstream(dir / "u.txt", std::ios::binary) << "fine\nbad \xff byte\n";
  EXPECT_THAT(error_of([&] { prepare_dataset(opts({(dir / "u.txt").string()}, dir / "x")); }),
              HasSubstr("u.txt:2: the text is not valid UTF-8"));
  std::ofstream(dir / "k.jsonl") << R"({"content": "x"})"
                                 << "\n";
  PrepareOptions o = opts({(dir / "k.jsonl").string()}, dir / "x");
  EXPECT_THAT(error_of([&] { prepare_dataset(o); }),
              HasSubstr("k.jsonl:1: expected an object with a string field \"text\""));
  o.json_key = "content";
  EXPECT_EQ(prepare_dataset(o).documents, 1);
  o.eos = "<|no_such_token|>";
  EXPECT_THAT(error_of([&] { prepare_dataset(o); }), HasSubstr("is not a token of"));
  std::ofstream(dir / "bad_tok.json") << R"({"model": {"type": "Unigram", "vocab": []}})";
  o = opts({(dir / "k.jsonl").string()}, dir / "x");
  o.tokenizer = (dir / "bad_tok.json").string();
  EXPECT_THAT(error_of([&] { prepare_dataset(o); }), HasSubstr("model type 'Unigram'"));
  EXPECT_FALSE(fs::exists(dir / "x.idx") && fs::exists(dir / "x.bin") &&
               IndexedDataset((dir / "x").string()).num_documents() != 1);
  // The CLI exits non-zero with the message and a hint.
  const std::string cmd = std::string(GDN_GDNTRAIN_BIN) + " prepare --tokenizer " + kTok +
                          " --input " + (dir / "u.txt").string() + " --output " +
                          (dir / "y").string() + " > /dev/null 2> " + (dir / "err").string();
  EXPECT_NE(std::system(cmd.c_str()), 0);
  EXPECT_THAT(slurp(dir / "err"), HasSubstr("not valid UTF-8"));
  EXPECT_THAT(slurp(dir / "err"), HasSubstr("hint:"));
  EXPECT_FALSE(fs::exists(dir / "y.bin"));
  fs::remove_all(dir);
}

// Training end to end on real text: the docs, tokenized with the fixture, train the tiny model
// (its vocabulary set to the tokenizer's); the loss falls well below its start.
TEST(PrepareText, TrainingOnPreparedRealTextLowersTheLoss) {
  const auto dir = temp_dir("train");
  write_jsonl(dir / "c.jsonl", doc_paragraphs(100000));
  PrepareStats st = prepare_dataset(opts({(dir / "c.jsonl").string()}, dir / "docs", 2));
  ASSERT_GT(st.tokens, 20000);
  model::Qwen35Config mc = model::tiny_config();
  mc.vocab_size = st.vocab_size;
  model::save_config(mc, (dir / "config.json").string());
  ConfigTree c(default_train_config());
  c.set(fmt::format("model.config=\"{}\"", (dir / "config.json").string()));
  c.set(fmt::format("run.dir=\"{}\"", (dir / "run").string()));
  c.set("train.steps=24");
  c.set("train.micro_batch_tokens=384");
  c.set("optim.lr=0.01");
  c.set("optim.warmup_steps=4");
  c.set("data.kind=\"indexed\"");
  c.set(fmt::format("data.path=\"{}\"", (dir / "docs").string()));
  c.set("data.eval_fraction=0.05");
  c.set("eval.every=0");
  c.set("checkpoint.every=1000");
  c.set("checkpoint.at_end=false");
  TrainOptions quiet;
  quiet.quiet = true;
  TrainResult r = run_training(c, quiet);
  ASSERT_EQ(r.losses.size(), 24u);
  auto mean = [&](size_t a, size_t b) {
    double s = 0;
    for (size_t i = a; i < b; ++i) s += r.losses[i];
    return s / static_cast<double>(b - a);
  };
  const double first = mean(0, 3), last = mean(20, 24);
  std::printf("loss: first 3 steps %.3f, last 4 steps %.3f (uniform: %.3f)\n", first, last,
              std::log(2048.0));
  EXPECT_NEAR(first, std::log(2048.0), 1.0);  // starts near uniform over the vocabulary
  EXPECT_LT(last, first - 1.5) << "first " << first << " last " << last;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace gdn::train
