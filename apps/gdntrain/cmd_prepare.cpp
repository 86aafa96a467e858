// gdntrain prepare: text / JSONL files (plain, gzip or zstd) -> Megatron .bin/.idx, with the byte
// tokenizer or a Hugging Face tokenizer.json; --merge concatenates prepared datasets.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <memory>

#include "commands.h"
#include "gdn/core/error.h"
#include "train/prepare.h"

namespace gdn::cli {

void add_prepare_command(CLI::App& app, Commands& cmds) {
  struct Args {
    std::vector<std::string> inputs;
    std::string output;
    std::string tokenizer;
    std::string eos;
    std::string dtype = "auto";
    std::string format = "auto";
    std::string json_key = "text";
    int threads = 0;
    double batch_kb = 1024;
    double progress_mb = 64;
    bool merge = false;
    bool no_progress = false;
  };
  auto args = std::make_shared<Args>();
  auto* sub = app.add_subcommand(
      "prepare",
      "Tokenize text (a document per line) or JSONL files, plain or gzip/zstd compressed, into a "
      "Megatron .bin/.idx dataset: with a Hugging Face tokenizer.json (--tokenizer), or the byte "
      "tokenizer (vocab 258: 0 pad, 1 EOS, byte b -> b+2). --merge concatenates datasets.");
  sub->add_option("--input", args->inputs,
                  "Input files, read in order (with --merge: dataset prefixes)")
      ->required();
  sub->add_option("--output", args->output, "Output prefix: writes PREFIX.bin and PREFIX.idx")
      ->required();
  sub->add_option("--tokenizer", args->tokenizer,
                  "A Hugging Face tokenizer.json (byte-level BPE, e.g. Qwen3.5's); default: the "
                  "byte tokenizer")
      ->check(CLI::ExistingFile);
  sub->add_option("--eos", args->eos,
                  "Token appended after every document (default: <|endoftext|>, else the "
                  "eos_token of tokenizer_config.json beside the tokenizer)");
  sub->add_option("--dtype", args->dtype,
                  "Token type on disk (auto: uint16 when the vocabulary fits, else int32)")
      ->check(CLI::IsMember({"auto", "uint16", "int32"}))
      ->capture_default_str();
  sub->add_option("--format", args->format,
                  "Input format (auto: .jsonl/.json, also .gz/.zst, are JSONL)")
      ->check(CLI::IsMember({"auto", "text", "jsonl"}))
      ->capture_default_str();
  sub->add_option("--json-key", args->json_key, "JSONL field holding the document text")
      ->capture_default_str();
  sub->add_option("--threads", args->threads,
                  "Tokenizing threads (0: all cores); the output is the same for any count")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  sub->add_option("--batch-kb", args->batch_kb, "Text handed to a thread at a time, in KiB")
      ->check(positive_real())
      ->capture_default_str();
  sub->add_option("--progress-mb", args->progress_mb,
                  "When stderr is not a terminal: a progress line every N MiB read")
      ->check(positive_real())
      ->capture_default_str();
  sub->add_flag("--no-progress", args->no_progress, "No progress bar on a terminal");
  sub->add_flag("--merge", args->merge,
                "Concatenate the datasets named by --input (prefixes) into --output");
  sub->callback([&cmds, args] {
    cmds.selected = [args] {
      std::optional<train::TokenDType> dtype;
      if (args->dtype != "auto") dtype = train::token_dtype_from_name(args->dtype);
      if (args->merge) {
        GDN_CHECK_HINT(args->tokenizer.empty() && args->eos.empty(),
                       "--merge copies ids; tokenize each shard first",
                       "--merge takes no --tokenizer or --eos");
        train::PrepareStats st = train::merge_datasets(args->inputs, args->output, dtype);
        std::printf(
            "merged %zu datasets: %lld documents, %lld tokens (%s) in %.2f s -> %s.bin / "
            "%s.idx\n",
            args->inputs.size(), static_cast<long long>(st.documents),
            static_cast<long long>(st.tokens),
            std::string(train::token_dtype_name(st.dtype)).c_str(), st.seconds,
            args->output.c_str(), args->output.c_str());
        return 0;
      }
      train::PrepareOptions opt;
      opt.inputs = args->inputs;
      opt.output_prefix = args->output;
      opt.tokenizer = args->tokenizer;
      opt.eos = args->eos;
      opt.dtype = dtype;
      opt.json_key = args->json_key;
      opt.threads = args->threads;
      opt.batch_bytes = std::max<int64_t>(1, std::llround(args->batch_kb * 1024.0));
      opt.format = args->format == "text"    ? train::InputFormat::Text
                   : args->format == "jsonl" ? train::InputFormat::Jsonl
                                             : train::InputFormat::Auto;
      opt.progress_every_bytes =
          std::max<int64_t>(1, static_cast<int64_t>(std::llround(args->progress_mb * 1048576.0)));
      opt.progress_bar = !args->no_progress && ::isatty(STDERR_FILENO) != 0;
      train::PrepareStats st = train::prepare_dataset(opt);
      const double mb = static_cast<double>(st.bytes_read) / 1e6;
      std::printf(
          "prepared %lld documents, %lld tokens (%s, %s vocab %lld, EOS %d) from %lld bytes; "
          "%lld empty skipped; %.2f s (%.1f MB/s, %.0f tokens/s, %d threads) -> %s.bin / "
          "%s.idx\n",
          static_cast<long long>(st.documents), static_cast<long long>(st.tokens),
          std::string(train::token_dtype_name(st.dtype)).c_str(),
          args->tokenizer.empty() ? "byte tokenizer" : "tokenizer.json",
          static_cast<long long>(st.vocab_size), st.eos_id, static_cast<long long>(st.bytes_read),
          static_cast<long long>(st.skipped_empty), st.seconds,
          st.seconds > 0 ? mb / st.seconds : 0.0,
          st.seconds > 0 ? static_cast<double>(st.tokens) / st.seconds : 0.0, st.threads,
          args->output.c_str(), args->output.c_str());
      return 0;
    };
  });
}

}  // namespace gdn::cli
