// main() of the fuzz targets when they are not built with libFuzzer (the normal test build):
//
//   fuzz_X [--seconds N] CORPUS_DIR_OR_FILE...
//
// Runs every file of the corpus through LLVMFuzzerTestOneInput, then mutates the corpus inputs
// for N seconds (default 3) with a fixed-seed generator: bit flips, byte inserts and deletes,
// copies inside an input, splices of two inputs, and overwrites with interesting bytes, 64-bit
// little-endian integers and decimal numbers. Prints the number of executions. A finding aborts
// the process (the target calls abort(), or a sanitizer stops it); the input that was running is
// then saved as ./fuzz-crash-<target> (the mutation sequence is deterministic, so a rerun reaches
// it again).

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size);
// Set by the sanitizers' runtime when present: called before a sanitizer ends the process.
extern "C" void __sanitizer_set_death_callback(void (*)(void)) __attribute__((weak));

namespace {

using Bytes = std::vector<std::uint8_t>;

constexpr std::size_t kMaxInput = 1 << 16;

// The input being run and where to save it if the process dies.
Bytes const* g_current = nullptr;
char g_crash_path[256] = "fuzz-crash";

void save_current_input() {
  static bool saved = false;
  if (saved || !g_current) return;
  saved = true;
  int const fd = ::open(g_crash_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  ssize_t const w = ::write(fd, g_current->data(), g_current->size());
  ::close(fd);
  char const msg[] = "\nfuzz replay: the failing input is saved as ";
  if (w >= 0 && ::write(2, msg, sizeof(msg) - 1) > 0 &&
      ::write(2, g_crash_path, std::strlen(g_crash_path)) > 0)
    (void)!::write(2, "\n", 1);
}

void on_fatal_signal(int sig) {
  save_current_input();
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

void run_one(Bytes const& in) {
  g_current = &in;
  LLVMFuzzerTestOneInput(in.data(), in.size());
  g_current = nullptr;
}

Bytes read_file(std::filesystem::path const& p) {
  std::ifstream f(p, std::ios::binary);
  return Bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// ---- mutations ---------------------------------------------------------------------------------

class Mutator {
 public:
  explicit Mutator(std::vector<Bytes> const& seeds) : seeds_(seeds) {}

  Bytes next() {
    Bytes b = seeds_.empty() ? Bytes{} : seeds_[pick(seeds_.size())];
    int const rounds = 1 + static_cast<int>(pick(4));
    for (int i = 0; i < rounds; ++i) mutate(b);
    if (b.size() > kMaxInput) b.resize(kMaxInput);
    return b;
  }

 private:
  std::size_t pick(std::size_t n) { return n == 0 ? 0 : static_cast<std::size_t>(rng_() % n); }

  void mutate(Bytes& b) {
    static std::uint8_t const bytes[] = {0x00, 0x01, 0x7f, 0x80, 0xff, '"', '\\', '{', '}',
                                         '[',  ']',  ',',  ':',  '-',  '=', '\n', ' ', '0'};
    static std::uint64_t const ints[] = {0,
                                         1,
                                         8,
                                         0x7f,
                                         0xffffffffull,
                                         0x100000000ull,
                                         0x7fffffffffffffffull,
                                         0x8000000000000000ull,
                                         0xffffffffffffffffull,
                                         100000001};
    static char const* const numbers[] = {"0",
                                          "-1",
                                          "-0",
                                          "1e308",
                                          "1e-320",
                                          "nan",
                                          "inf",
                                          "2147483648",
                                          "-2147483649",
                                          "4294967296",
                                          "9223372036854775807",
                                          "9223372036854775808",
                                          "-9223372036854775808",
                                          "18446744073709551616",
                                          "1.5"};
    std::size_t const pos = pick(b.size() + 1);
    switch (pick(9)) {
      case 0:  // flip a bit
        if (!b.empty()) b[pick(b.size())] ^= static_cast<std::uint8_t>(1u << pick(8));
        break;
      case 1:  // set a byte to any value
        if (!b.empty()) b[pick(b.size())] = static_cast<std::uint8_t>(rng_());
        break;
      case 2:  // insert bytes
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(pos), 1 + pick(4),
                 static_cast<std::uint8_t>(rng_()));
        break;
      case 3: {  // delete a range
        std::size_t const n = std::min(b.size() - std::min(pos, b.size()), 1 + pick(16));
        b.erase(b.begin() + static_cast<std::ptrdiff_t>(pos),
                b.begin() + static_cast<std::ptrdiff_t>(pos + n));
        break;
      }
      case 4: {  // copy a range of the input elsewhere into it
        if (b.empty()) break;
        std::size_t const from = pick(b.size());
        std::size_t const n = 1 + pick(std::min<std::size_t>(b.size() - from, 64));
        Bytes const piece(b.begin() + static_cast<std::ptrdiff_t>(from),
                          b.begin() + static_cast<std::ptrdiff_t>(from + n));
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(pick(b.size() + 1)), piece.begin(),
                 piece.end());
        break;
      }
      case 5: {  // splice: this input's head, another seed's tail
        if (seeds_.empty()) break;
        Bytes const& other = seeds_[pick(seeds_.size())];
        std::size_t const cut = pick(other.size() + 1);
        b.resize(std::min(pos, b.size()));
        b.insert(b.end(), other.begin() + static_cast<std::ptrdiff_t>(cut), other.end());
        break;
      }
      case 6:  // an interesting byte
        if (!b.empty()) b[pick(b.size())] = bytes[pick(std::size(bytes))];
        break;
      case 7: {  // an interesting 64-bit little-endian integer
        std::uint64_t const v = ints[pick(std::size(ints))];
        for (std::size_t i = 0; i < 8 && pos + i < b.size(); ++i)
          b[pos + i] = static_cast<std::uint8_t>(v >> (8 * i));
        break;
      }
      default: {  // an interesting number replaces the number at pos (or is inserted there)
        std::string const num = numbers[pick(std::size(numbers))];
        std::size_t end = pos;
        while (end < b.size() && std::strchr("0123456789+-.eE", b[end]) && b[end] != 0) ++end;
        b.erase(b.begin() + static_cast<std::ptrdiff_t>(pos),
                b.begin() + static_cast<std::ptrdiff_t>(end));
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(pos), num.begin(), num.end());
        break;
      }
    }
  }

  std::vector<Bytes> const& seeds_;
  std::mt19937_64 rng_{0x6d6f652d66757a7aull};  // fixed: the same sequence on every run
};

}  // namespace

int main(int argc, char** argv) {
  double seconds = 3;
  std::vector<std::filesystem::path> paths;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--seconds" && i + 1 < argc) {
      seconds = std::atof(argv[++i]);
    } else if (a == "-h" || a == "--help") {
      std::printf("usage: %s [--seconds N] CORPUS_DIR_OR_FILE...\n", argv[0]);
      return 0;
    } else {
      paths.emplace_back(a);
    }
  }
  std::string const name = std::filesystem::path(argv[0]).filename().string();
  std::snprintf(g_crash_path, sizeof(g_crash_path), "fuzz-crash-%s", name.c_str());
  for (int sig : {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL}) std::signal(sig, on_fatal_signal);
  if (__sanitizer_set_death_callback) __sanitizer_set_death_callback(save_current_input);

  std::vector<std::filesystem::path> files;
  for (auto const& p : paths) {
    if (std::filesystem::is_directory(p)) {
      for (auto const& e : std::filesystem::directory_iterator(p))
        if (e.is_regular_file()) files.push_back(e.path());
    } else if (std::filesystem::is_regular_file(p)) {
      files.push_back(p);
    } else {
      std::fprintf(stderr, "%s: no such file or directory: %s\n", name.c_str(), p.c_str());
      return 2;
    }
  }
  std::sort(files.begin(), files.end());
  std::vector<Bytes> seeds;
  for (auto const& f : files) seeds.push_back(read_file(f));

  long long runs = 0;
  for (auto const& s : seeds) run_one(s), ++runs;
  Mutator mutator(seeds);
  auto const start = std::chrono::steady_clock::now();
  auto const until = start + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < until) {
    for (int i = 0; i < 16; ++i) run_one(mutator.next()), ++runs;
  }
  double const took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%s: %zu corpus inputs, %lld executions (%.1f s of mutations), no finding\n",
              name.c_str(), seeds.size(), runs, took);
  return 0;
}
