// A hand-written driver main for the libFuzzer targets (tests/fuzz/fuzz_*.cpp), so that the cpu
// preset (gcc, no libFuzzer) builds each target's LLVMFuzzerTestOneInput into a small replay test
// that CI runs: every file of the committed seed corpus, then `--mutations N` deterministic
// mutations of them (bit flips, byte overwrites with interesting values, insertions, deletions,
// truncations, splices of two seeds, duplicated blocks). The real fuzzing (millions of executions
// under ASan/UBSan) uses the debug preset's libFuzzer build; docs/FUZZING.md.
//   replay_fuzz_NAME [--mutations N] [--seed S] CORPUS_DIR_OR_FILE...
// A crash or an escaped exception fails the test (std::terminate); a clean run prints the counts.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

using Bytes = std::vector<uint8_t>;

Bytes read_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return Bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void run_one(const Bytes& b) {
  // A copy of exactly `size` bytes, so that an over-read is visible to the sanitizers when the
  // replay itself runs under them.
  std::unique_ptr<uint8_t[]> copy(new uint8_t[std::max<size_t>(b.size(), 1)]);
  if (!b.empty()) std::memcpy(copy.get(), b.data(), b.size());
  LLVMFuzzerTestOneInput(copy.get(), b.size());
}

Bytes mutate(const std::vector<Bytes>& seeds, std::mt19937_64& rng) {
  auto pick = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  Bytes b = seeds[pick(seeds.size())];
  static const uint8_t kInteresting[] = {0x00, 0x01, 0x7f, 0x80, 0xff, '"', '{', '}', '[', ']',
                                         ',',  ':',  '=',  '.',  '-',  'e', '0', '9', '\n'};
  const int rounds = 1 + static_cast<int>(rng() % 4);
  for (int r = 0; r < rounds; ++r) {
    switch (rng() % 8) {
      case 0:  // flip a bit
        if (!b.empty()) b[pick(b.size())] ^= static_cast<uint8_t>(1u << (rng() % 8));
        break;
      case 1:  // an interesting byte
        if (!b.empty()) b[pick(b.size())] = kInteresting[pick(sizeof(kInteresting))];
        break;
      case 2:  // insert bytes
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(pick(b.size() + 1)), 1 + pick(8),
                 kInteresting[pick(sizeof(kInteresting))]);
        break;
      case 3:  // delete a range
        if (!b.empty()) {
          const size_t at = pick(b.size()), n = std::min(b.size() - at, 1 + pick(16));
          b.erase(b.begin() + static_cast<std::ptrdiff_t>(at),
                  b.begin() + static_cast<std::ptrdiff_t>(at + n));
        }
        break;
      case 4:  // truncate
        b.resize(pick(b.size() + 1));
        break;
      case 5: {  // splice: a prefix of this one and a suffix of another seed
        const Bytes& o = seeds[pick(seeds.size())];
        const size_t cut = pick(b.size() + 1), from = pick(o.size() + 1);
        b.resize(cut);
        b.insert(b.end(), o.begin() + static_cast<std::ptrdiff_t>(from), o.end());
        break;
      }
      case 6: {  // overwrite 1, 2, 4 or 8 bytes with a random or extreme value
        if (b.empty()) break;
        const size_t w = size_t{1} << (rng() % 4), at = pick(b.size());
        uint64_t v = (rng() % 3 == 0) ? ~uint64_t{0} : (rng() % 2 ? rng() : rng() % 256);
        std::memcpy(b.data() + at, &v, std::min(w, b.size() - at));
        break;
      }
      default: {  // duplicate a block
        if (b.empty()) break;
        const size_t at = pick(b.size()), n = std::min(b.size() - at, 1 + pick(32));
        Bytes blk(b.begin() + static_cast<std::ptrdiff_t>(at),
                  b.begin() + static_cast<std::ptrdiff_t>(at + n));
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(pick(b.size() + 1)), blk.begin(),
                 blk.end());
        break;
      }
    }
  }
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  long mutations = 2000;
  uint64_t seed = 21;
  std::vector<std::filesystem::path> inputs;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--mutations" && i + 1 < argc) {
      mutations = std::strtol(argv[++i], nullptr, 10);
    } else if (a == "--seed" && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else {
      inputs.emplace_back(a);
    }
  }
  std::vector<Bytes> seeds;
  for (const auto& in : inputs) {
    if (std::filesystem::is_directory(in)) {
      std::vector<std::filesystem::path> files;
      for (const auto& e : std::filesystem::directory_iterator(in))
        if (e.is_regular_file()) files.push_back(e.path());
      std::sort(files.begin(), files.end());  // a deterministic order
      for (const auto& f : files) seeds.push_back(read_bytes(f));
    } else if (std::filesystem::is_regular_file(in)) {
      seeds.push_back(read_bytes(in));
    } else {
      std::fprintf(stderr, "replay: '%s' is not a file or directory\n", in.c_str());
      return 2;
    }
  }
  if (seeds.empty()) {
    std::fprintf(stderr, "replay: no seed inputs (give the corpus directories)\n");
    return 2;
  }
  run_one({});
  for (const Bytes& s : seeds) run_one(s);
  std::mt19937_64 rng(seed);
  for (long i = 0; i < mutations; ++i) run_one(mutate(seeds, rng));
  std::printf("replay: %zu seeds and %ld mutations ran without a crash\n", seeds.size(), mutations);
  return 0;
}
