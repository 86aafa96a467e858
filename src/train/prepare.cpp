#include "train/prepare.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "gdn/core/arena.h"
#include "gdn/core/error.h"
#include "gdn/core/log.h"
#include "text/input_reader.h"
#include "text/tokenizer.h"

namespace gdn::train {

void ByteTokenizer::encode(std::string_view text, std::vector<int32_t>& out) {
  out.reserve(out.size() + text.size());
  for (char ch : text) out.push_back(static_cast<unsigned char>(ch) + kByteOffset);
}

std::string ByteTokenizer::decode(std::span<const int32_t> ids) {
  std::string s;
  for (int32_t id : ids) {
    GDN_CHECK(id >= 0 && id < kVocabSize, "ByteTokenizer: id {} is outside the vocabulary [0, {})",
              id, kVocabSize);
    if (id >= kByteOffset) s.push_back(static_cast<char>(id - kByteOffset));
  }
  return s;
}

namespace {

bool is_jsonl(std::string path, InputFormat f) {
  if (f != InputFormat::Auto) return f == InputFormat::Jsonl;
  for (const char* z : {".gz", ".zst", ".zstd"})
    if (path.ends_with(z)) path.resize(path.size() - std::strlen(z));
  return path.ends_with(".jsonl") || path.ends_with(".json");
}

// A batch of raw lines from one file, tokenized by one thread.
struct Batch {
  int64_t seq = 0;
  size_t file = 0;
  int64_t first_line = 0;  // 1-based line number of the first line
  bool jsonl = false;
  std::string data;            // the lines back to back
  std::vector<uint32_t> ends;  // end offset of each line in data
  std::vector<uint8_t> blank;  // JSONL lines that are blank (skipped, not counted)
};

struct Result {
  std::vector<int32_t> tokens;
  std::vector<int32_t> lengths;  // per document, EOS included
  int64_t skipped = 0;
  int64_t text_bytes = 0;
  std::exception_ptr error;
};

// What turns a document's text into ids, per thread.
class Encoder {
 public:
  Encoder(const text::Tokenizer* tok) : tok_(tok) {
    if (tok_ != nullptr) state_ = tok_->make_state();
  }
  void encode(std::string_view s, std::vector<int32_t>& out) {
    if (tok_ == nullptr) {
      ByteTokenizer::encode(s, out);
    } else {
      tok_->encode(s, out, *state_);
    }
  }

 private:
  const text::Tokenizer* tok_;
  text::EncodeStatePtr state_;
};

void process(const Batch& b, const std::vector<std::string>& paths, const std::string& key,
             int32_t eos, Encoder& enc, Result& r) {
  try {
    size_t start = 0;
    nlohmann::json j;
    for (size_t i = 0; i < b.ends.size(); ++i) {
      std::string_view line(b.data.data() + start, b.ends[i] - start);
      start = b.ends[i];
      const int64_t lineno = b.first_line + static_cast<int64_t>(i);
      if (b.jsonl && b.blank[i]) continue;
      std::string_view text = line;
      std::string owned;
      if (b.jsonl) {
        try {
          j = nlohmann::json::parse(line);
        } catch (const nlohmann::json::exception& e) {
          GDN_FAIL("prepare: {}:{}: not valid JSON: {}", paths[b.file], lineno, e.what());
        }
        auto it = j.is_object() ? j.find(key) : j.end();
        GDN_CHECK_HINT(j.is_object() && it != j.end() && it->is_string(),
                       "choose the field with --json-key",
                       "prepare: {}:{}: expected an object with a string field \"{}\"",
                       paths[b.file], lineno, key);
        owned = it->get<std::string>();
        text = owned;
      } else if (!text.empty() && text.back() == '\r') {
        text.remove_suffix(1);
      }
      r.text_bytes += static_cast<int64_t>(text.size());
      if (text.empty()) {
        ++r.skipped;
        continue;
      }
      const size_t before = r.tokens.size();
      try {
        enc.encode(text, r.tokens);
      } catch (const Error& e) {
        GDN_FAIL_HINT(e.hint(), "prepare: {}:{}: {}", paths[b.file], lineno, e.message());
      }
      r.tokens.push_back(eos);
      r.lengths.push_back(static_cast<int32_t>(r.tokens.size() - before));
    }
  } catch (...) {
    r.error = std::current_exception();
  }
}

// Resolves the document separator of a tokenizer.json (see PrepareOptions::eos).
int32_t resolve_eos(const text::Tokenizer& tok, const std::string& path, const std::string& eos) {
  if (!eos.empty()) {
    auto id = tok.token_to_id(eos);
    GDN_CHECK_HINT(id.has_value(), "give a token of the tokenizer's vocabulary, e.g. <|endoftext|>",
                   "--eos '{}' is not a token of {}", eos, path);
    return *id;
  }
  if (auto id = tok.token_to_id("<|endoftext|>")) return *id;
  const auto cfg = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
  std::ifstream f(cfg);
  if (f.good()) {
    try {
      nlohmann::json j = nlohmann::json::parse(f);
      std::string name;
      if (j.contains("eos_token") && j["eos_token"].is_string()) name = j["eos_token"];
      if (j.contains("eos_token") && j["eos_token"].is_object())
        name = j["eos_token"].value("content", "");
      if (auto id = name.empty() ? std::nullopt : tok.token_to_id(name)) return *id;
    } catch (const nlohmann::json::exception&) {
      // fall through to the error below
    }
  }
  GDN_FAIL_HINT("name the document separator with --eos TOKEN",
                "{} has no <|endoftext|> token and no usable eos_token in {}", path, cfg.string());
}

std::string format_eta(double s) {
  if (!std::isfinite(s) || s < 0) return "--:--";
  const auto t = static_cast<int64_t>(s);
  return t >= 3600 ? fmt::format("{}:{:02d}:{:02d}", t / 3600, (t / 60) % 60, t % 60)
                   : fmt::format("{:02d}:{:02d}", t / 60, t % 60);
}

// The tokenizer (--tokenizer, else the byte tokenizer), its document separator and the output
// dtype, into `st`.
std::optional<text::Tokenizer> open_tokenizer(const PrepareOptions& opt, PrepareStats& st) {
  std::optional<text::Tokenizer> tok;
  if (!opt.tokenizer.empty()) {
    tok.emplace(text::Tokenizer::from_file(opt.tokenizer));
    st.vocab_size = tok->vocab_size();
    st.eos_id = resolve_eos(*tok, opt.tokenizer, opt.eos);
  } else {
    GDN_CHECK_HINT(opt.eos.empty(), "--eos needs --tokenizer",
                   "prepare: --eos '{}' given without a tokenizer (the byte tokenizer's EOS is 1)",
                   opt.eos);
    st.vocab_size = ByteTokenizer::kVocabSize;
    st.eos_id = ByteTokenizer::kEos;
  }
  st.dtype = opt.dtype.value_or(st.vocab_size <= 65536 ? TokenDType::U16 : TokenDType::I32);
  GDN_CHECK_HINT(st.dtype != TokenDType::U16 || st.vocab_size <= 65536,
                 "use --dtype int32 (or leave --dtype unset)",
                 "prepare: the tokenizer has {} ids, too many for uint16", st.vocab_size);
  return tok;
}

// Tokenizing threads: the reader pushes batches in input order, each thread tokenizes whole
// batches, and take(seq) hands back batch seq's result, so the caller writes them in order.
// Destruction (or stop()) lets the threads finish the batches already queued and joins them.
class WorkerPool {
 public:
  WorkerPool(int threads, const text::Tokenizer* tok, const PrepareOptions& opt, int32_t eos) {
    try {
      start(threads, tok, opt, eos);
    } catch (...) {
      stop();  // a thread that failed to start: join the started ones
      throw;
    }
  }
  ~WorkerPool() { stop(); }
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  void push(std::shared_ptr<Batch> b) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.push_back(std::move(b));
    }
    cv_work_.notify_one();
  }
  // Waits for batch `seq`'s result.
  Result take(int64_t seq) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_done_.wait(lk, [&] { return done_.count(seq) > 0; });
    Result r = std::move(done_[seq]);
    done_.erase(seq);
    return r;
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      closing_ = true;
    }
    cv_work_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
  }

 private:
  void start(int threads, const text::Tokenizer* tok, const PrepareOptions& opt, int32_t eos) {
    for (int t = 0; t < threads; ++t) {
      workers_.emplace_back([this, tok, &opt, eos] {
        Encoder enc(tok);
        for (;;) {
          std::shared_ptr<Batch> b;
          {
            std::unique_lock<std::mutex> lk(mu_);
            cv_work_.wait(lk, [&] { return closing_ || !queue_.empty(); });
            if (queue_.empty()) return;
            b = queue_.front();
            queue_.pop_front();
          }
          Result r;
          process(*b, opt.inputs, opt.json_key, eos, enc, r);
          {
            std::lock_guard<std::mutex> lk(mu_);
            done_.emplace(b->seq, std::move(r));
          }
          cv_done_.notify_all();
        }
      });
    }
  }
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  std::deque<std::shared_ptr<Batch>> queue_;
  std::map<int64_t, Result> done_;
  bool closing_ = false;
  std::vector<std::thread> workers_;
};

// Progress on stderr: a live bar (a terminal), else a log line every progress_every_bytes.
class Progress {
 public:
  Progress(const PrepareOptions& opt, int64_t total_file_bytes)
      : opt_(opt), total_(total_file_bytes), next_report_(opt.progress_every_bytes) {}
  // `fb`: input file bytes consumed so far; `t`: seconds since the start.
  void report(const PrepareStats& st, int64_t fb, double t, bool final) {
    if (opt_.progress_bar) {
      if (!final && t - last_bar_ < 0.25) return;
      last_bar_ = t;
      const double frac = total_ > 0 ? std::min(1.0, static_cast<double>(fb) / total_) : 1.0;
      const int width = 30, filled = static_cast<int>(frac * width);
      const double rate = t > 0 ? static_cast<double>(fb) / t : 0;
      std::fprintf(stderr, "\r[%s%s] %5.1f%%  %.1f MB/s  ETA %s  %lld docs  %lld tokens%s",
                   std::string(static_cast<size_t>(filled), '#').c_str(),
                   std::string(static_cast<size_t>(width - filled), '.').c_str(), 100 * frac,
                   rate / 1e6, format_eta(rate > 0 ? (total_ - fb) / rate : -1).c_str(),
                   static_cast<long long>(st.documents), static_cast<long long>(st.tokens),
                   final ? "\n" : "");
      std::fflush(stderr);
    } else if (st.bytes_read >= next_report_) {
      log::info("prepare: {} read, {} documents, {} tokens, {:.1f} MB/s",
                format_bytes(static_cast<double>(st.bytes_read)), st.documents, st.tokens,
                t > 0 ? static_cast<double>(fb) / t / 1e6 : 0.0);
      while (next_report_ <= st.bytes_read) next_report_ += opt_.progress_every_bytes;
    }
  }

 private:
  const PrepareOptions& opt_;
  const int64_t total_;
  int64_t next_report_;
  double last_bar_ = -1;
};

// Cuts input file `fi` into batches of whole lines (about opt.batch_bytes each, never 2^31 or
// more) and hands each to `submit`; `cur_file_bytes` follows the file's bytes read at each
// batch-size cut. Returns the file's bytes read.
int64_t read_file(const PrepareOptions& opt, size_t fi, int64_t& cur_file_bytes,
                  const std::function<void(std::shared_ptr<Batch>)>& submit) {
  text::LineReader reader(opt.inputs[fi]);
  const bool jsonl = is_jsonl(opt.inputs[fi], opt.format);
  int64_t lineno = 0;
  auto batch = std::make_shared<Batch>();
  auto fresh = [&] {
    batch = std::make_shared<Batch>();
    batch->file = fi;
    batch->jsonl = jsonl;
    batch->first_line = lineno + 1;
  };
  fresh();
  std::string line;
  while (reader.next_line(line)) {
    ++lineno;
    GDN_CHECK(line.size() < (size_t{1} << 31), "prepare: {}:{}: a line of {} bytes is too long",
              opt.inputs[fi], lineno, line.size());
    if (batch->data.size() + line.size() > (size_t{1} << 31)) {
      submit(batch);
      fresh();
      batch->first_line = lineno;
    }
    batch->data += line;
    batch->ends.push_back(static_cast<uint32_t>(batch->data.size()));
    if (jsonl) batch->blank.push_back(line.find_first_not_of(" \t\r") == std::string::npos);
    if (static_cast<int64_t>(batch->data.size()) >= opt.batch_bytes) {
      cur_file_bytes = reader.file_bytes_read();
      submit(batch);
      fresh();
    }
  }
  submit(batch);
  return reader.file_bytes_read();
}

}  // namespace

PrepareStats prepare_dataset(const PrepareOptions& opt) {
  GDN_CHECK(!opt.inputs.empty(), "prepare: no input files");
  GDN_CHECK(!opt.output_prefix.empty(), "prepare: no output prefix");
  GDN_CHECK(opt.progress_every_bytes > 0, "prepare: the progress interval must be positive");
  GDN_CHECK(opt.batch_bytes > 0, "prepare: the batch size must be positive");
  GDN_CHECK(opt.threads >= 0, "prepare: --threads must be >= 0");
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  PrepareStats st;
  const std::optional<text::Tokenizer> tok = open_tokenizer(opt, st);
  // Open every input first so that a typo fails before any work.
  int64_t total_file_bytes = 0;
  for (const auto& in : opt.inputs) {
    text::LineReader probe(in);
    total_file_bytes += text::file_size(in);
  }
  st.threads = opt.threads > 0 ? opt.threads
                               : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  IndexedDatasetWriter writer(opt.output_prefix, st.dtype);

  // Work queue: the reader (this thread) makes batches in input order; workers tokenize them;
  // this thread writes results strictly in batch order, so the output does not depend on the
  // thread count. At most `max_in_flight` batches exist at once (bounded memory).
  const int64_t max_in_flight = 2 * static_cast<int64_t>(st.threads);
  std::optional<WorkerPool> pool;
  if (st.threads > 1) pool.emplace(st.threads, tok ? &*tok : nullptr, opt, st.eos_id);
  Encoder inline_enc(tok && st.threads == 1 ? &*tok : nullptr);

  int64_t next_seq = 0, next_write = 0, file_bytes_done = 0, cur_file_bytes = 0;
  Progress progress(opt, total_file_bytes);
  auto write_result = [&](Result& r) {
    if (r.error) std::rethrow_exception(r.error);
    size_t off = 0;
    for (int32_t len : r.lengths) {
      writer.add_document(
          std::span<const int32_t>(r.tokens.data() + off, static_cast<size_t>(len)));
      off += static_cast<size_t>(len);
    }
    st.documents += static_cast<int64_t>(r.lengths.size());
    st.tokens += static_cast<int64_t>(r.tokens.size());
    st.skipped_empty += r.skipped;
    st.bytes_read += r.text_bytes;
    ++next_write;
    progress.report(st, file_bytes_done + cur_file_bytes, elapsed(), false);
  };
  // Writes the next result in order, waiting for it.
  auto write_next = [&] {
    Result r = pool->take(next_write);
    write_result(r);
  };
  auto submit = [&](std::shared_ptr<Batch> b) {
    if (b->ends.empty()) return;
    b->seq = next_seq++;
    if (st.threads == 1) {
      Result r;
      process(*b, opt.inputs, opt.json_key, st.eos_id, inline_enc, r);
      write_result(r);
      return;
    }
    while (next_seq - 1 - next_write >= max_in_flight) write_next();
    pool->push(std::move(b));
  };

  for (size_t fi = 0; fi < opt.inputs.size(); ++fi) {
    const int64_t file_bytes = read_file(opt, fi, cur_file_bytes, submit);
    file_bytes_done += file_bytes;
    cur_file_bytes = 0;
  }
  while (next_write < next_seq) write_next();
  if (pool) pool->stop();
  writer.finish();
  st.file_bytes = file_bytes_done;
  st.seconds = elapsed();
  progress.report(st, file_bytes_done + cur_file_bytes, elapsed(), true);
  return st;
}

PrepareStats merge_datasets(const std::vector<std::string>& prefixes,
                            const std::string& output_prefix, std::optional<TokenDType> dtype) {
  GDN_CHECK(!prefixes.empty(), "merge: no input datasets");
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<IndexedDataset> in;
  bool all16 = true;
  for (const auto& p : prefixes) {
    in.emplace_back(p);
    all16 = all16 && (in.back().dtype() == TokenDType::U16 || in.back().dtype() == TokenDType::U8);
  }
  PrepareStats st;
  st.dtype = dtype.value_or(all16 ? TokenDType::U16 : TokenDType::I32);
  IndexedDatasetWriter writer(output_prefix, st.dtype);
  std::vector<int32_t> buf;
  for (const auto& ds : in) {
    for (int64_t d = 0; d < ds.num_documents(); ++d) {
      auto [a, b] = ds.document_sequences(d);
      for (int64_t s = a; s < b; ++s) {
        buf.resize(static_cast<size_t>(ds.sequence_length(s)));
        ds.read_sequence(s, 0, static_cast<int64_t>(buf.size()), buf.data());
        writer.add_sequence(buf);
        st.tokens += static_cast<int64_t>(buf.size());
      }
      writer.end_document();
      ++st.documents;
    }
  }
  writer.finish();
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

}  // namespace gdn::train
