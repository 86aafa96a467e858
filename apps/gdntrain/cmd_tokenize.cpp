// gdntrain tokenize: quick checks of a tokenizer.json: text in, ids out (and back with --decode).
#include <cstdio>
#include <iostream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "commands.h"
#include "gdn/core/error.h"
#include "text/tokenizer.h"

namespace gdn::cli {

namespace {

std::string read_all(std::istream& in) {
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<int32_t> parse_ids(std::string_view s, int64_t line) {
  std::vector<int32_t> ids;
  std::istringstream in{std::string(s)};
  std::string tok;
  while (in >> tok) {
    char* end = nullptr;
    const long long v = std::strtoll(tok.c_str(), &end, 10);
    GDN_CHECK_HINT(end != nullptr && *end == '\0' && v >= 0 && v <= INT32_MAX,
                   "--decode reads whitespace-separated non-negative ids",
                   "line {}: '{}' is not a token id", line, tok);
    ids.push_back(static_cast<int32_t>(v));
  }
  return ids;
}

}  // namespace

void add_tokenize_command(CLI::App& app, Commands& cmds) {
  struct Args {
    std::string tokenizer;
    bool decode = false;
    bool json_lines = false;
    bool info = false;
    std::string text;
  };
  auto args = std::make_shared<Args>();
  auto* sub = app.add_subcommand(
      "tokenize",
      "Encode text from stdin (or --text) with a Hugging Face tokenizer.json and print the ids; "
      "--decode reads ids and prints the text");
  sub->add_option("--tokenizer", args->tokenizer, "Path of a Hugging Face tokenizer.json")
      ->required()
      ->check(CLI::ExistingFile);
  sub->add_flag("--decode", args->decode, "Read ids (whitespace-separated), print their text");
  sub->add_flag("--json", args->json_lines,
                "One document a line, as JSON: encode reads JSON strings and prints JSON arrays "
                "of ids; --decode reads arrays and prints strings");
  sub->add_option("--text", args->text, "Encode this text instead of reading stdin");
  sub->add_flag("--info", args->info, "Print what the tokenizer is made of, then exit");
  sub->callback([&cmds, args] {
    cmds.selected = [args] {
      const text::Tokenizer tok = text::Tokenizer::from_file(args->tokenizer);
      if (args->info) {
        std::printf("%s\n", tok.describe().c_str());
        return 0;
      }
      auto state = tok.make_state();
      if (!args->json_lines) {
        const std::string in = args->text.empty() ? read_all(std::cin) : args->text;
        if (args->decode) {
          const std::string s = tok.decode(parse_ids(in, 1));
          std::fwrite(s.data(), 1, s.size(), stdout);
        } else {
          std::vector<int32_t> ids;
          tok.encode(in, ids, *state);
          std::string line;
          for (size_t i = 0; i < ids.size(); ++i) {
            if (i > 0) line += ' ';
            line += std::to_string(ids[i]);
          }
          std::printf("%s\n", line.c_str());
        }
        return 0;
      }
      std::string line;
      int64_t lineno = 0;
      std::vector<int32_t> ids;
      while (std::getline(std::cin, line)) {
        ++lineno;
        nlohmann::json j;
        try {
          j = nlohmann::json::parse(line);
        } catch (const nlohmann::json::exception& e) {
          GDN_FAIL("stdin line {}: not valid JSON: {}", lineno, e.what());
        }
        if (args->decode) {
          GDN_CHECK(j.is_array(), "stdin line {}: expected a JSON array of ids", lineno);
          const std::string s = tok.decode(j.get<std::vector<int32_t>>());
          std::printf("%s\n", nlohmann::json(s).dump().c_str());
        } else {
          GDN_CHECK(j.is_string(), "stdin line {}: expected a JSON string", lineno);
          ids.clear();
          tok.encode(j.get<std::string>(), ids, *state);
          std::printf("%s\n", nlohmann::json(ids).dump().c_str());
        }
      }
      return 0;
    };
  });
}

}  // namespace gdn::cli
