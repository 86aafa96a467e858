// gdntrain prepare: text / JSONL files -> Megatron .bin/.idx with the byte tokenizer.
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
    std::string dtype = "uint16";
    std::string format = "auto";
    double progress_mb = 64;
  };
  auto args = std::make_shared<Args>();
  auto* sub = app.add_subcommand(
      "prepare",
      "Tokenize text (a document per line) or JSONL (field \"text\") files with the byte "
      "tokenizer (vocab 258: 0 pad, 1 EOS, byte b -> b+2) into a Megatron .bin/.idx dataset");
  sub->add_option("--input", args->inputs, "Input files, read in order")
      ->required()
      ->check(CLI::ExistingFile);
  sub->add_option("--output", args->output, "Output prefix: writes PREFIX.bin and PREFIX.idx")
      ->required();
  sub->add_option("--dtype", args->dtype, "Token type on disk")
      ->check(CLI::IsMember({"uint16", "int32"}))
      ->capture_default_str();
  sub->add_option("--format", args->format, "Input format (auto: .jsonl/.json are JSONL)")
      ->check(CLI::IsMember({"auto", "text", "jsonl"}))
      ->capture_default_str();
  sub->add_option("--progress-mb", args->progress_mb, "Progress line on stderr every N MiB read")
      ->check(positive_real())
      ->capture_default_str();
  sub->callback([&cmds, args] {
    cmds.selected = [args] {
      train::PrepareOptions opt;
      opt.inputs = args->inputs;
      opt.output_prefix = args->output;
      opt.dtype = train::token_dtype_from_name(args->dtype);
      opt.format = args->format == "text"    ? train::InputFormat::Text
                   : args->format == "jsonl" ? train::InputFormat::Jsonl
                                             : train::InputFormat::Auto;
      opt.progress_every_bytes =
          std::max<int64_t>(1, static_cast<int64_t>(std::llround(args->progress_mb * 1048576.0)));
      train::PrepareStats st = train::prepare_dataset(opt);
      std::printf(
          "prepared %lld documents, %lld tokens (%s, byte tokenizer vocab %lld) from %lld bytes; "
          "%lld empty skipped -> %s.bin / %s.idx\n",
          static_cast<long long>(st.documents), static_cast<long long>(st.tokens),
          args->dtype.c_str(), static_cast<long long>(train::ByteTokenizer::kVocabSize),
          static_cast<long long>(st.bytes_read), static_cast<long long>(st.skipped_empty),
          args->output.c_str(), args->output.c_str());
      return 0;
    };
  });
}

}  // namespace gdn::cli
