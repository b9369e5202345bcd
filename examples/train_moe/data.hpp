#pragma once
// Data sources of train_moe. Every sequence is a pure function of (seed, step, sequence index), so
// a rank generates only the sequences of its batch block and the global batch of a step is the
// same on every mesh.
//
//  * markov: a seeded sparse Markov source of order k over V tokens. Each context (the last k
//    tokens) has `branching` possible next tokens with seeded Dirichlet(1) probabilities. Its
//    entropy rate sum_c pi(c) H(next | c) is computed exactly from the stationary distribution pi
//    over contexts (power iteration to convergence); sequences start from a context drawn from
//    pi, so the process is stationary and the entropy rate is the best achievable loss.
//  * synthetic: independent uniform tokens (entropy rate log V): for throughput runs.
//  * text: the bytes of a file as tokens (V = 256); sequence (step, i) starts at an offset drawn
//    from the same counter-based generator.

#include <moe/error.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

namespace train {

/// \brief Counter-based random numbers: a SplitMix64 stream whose start is a hash of a key, so
/// any (seed, step, index) stream can be produced directly, on any rank, in any order.
class CounterRng {
 public:
  /// Stream for the key (a, b, c, d).
  CounterRng(std::uint64_t a, std::uint64_t b = 0, std::uint64_t c = 0, std::uint64_t d = 0)
      : state_(mix(mix(mix(mix(a ^ 0x6a09e667f3bcc909ULL) ^ b) ^ c) ^ d)) {}

  /// The SplitMix64 output function: a bijective 64-bit mixer.
  static std::uint64_t mix(std::uint64_t z) {
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  std::uint64_t next() {
    state_ += 0x9e3779b97f4a7c15ULL;
    std::uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, 1) with 53 random bits.
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }
  /// Uniform in (0, 1].
  double uniform_open0() { return double((next() >> 11) + 1) * 0x1.0p-53; }
  /// Uniform integer in [0, n), n > 0 (multiply-shift: no modulo bias worth noting for n << 2^32).
  std::uint64_t below(std::uint64_t n) { return std::uint64_t(uniform() * double(n)) % n; }
  /// Standard normal (Box-Muller, one value per call).
  double normal() {
    double const u1 = uniform_open0(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  std::uint64_t state_;
};

/// \brief A seeded sparse Markov source of order `order` over `vocab` tokens.
class MarkovSource {
 public:
  /// \param vocab V >= 2; \param order k >= 1 (V^k contexts, at most 2^22);
  /// \param branching possible next tokens per context, in [1, V]; \param seed the source seed.
  MarkovSource(int vocab, int order, int branching, std::uint64_t seed)
      : V_(vocab), k_(order), m_(branching) {
    using moe::detail::cat;
    moe::detail::require<moe::ConfigError>(V_ >= 2, "vocab_size=", V_, " must be >= 2");
    moe::detail::require<moe::ConfigError>(k_ >= 1 && k_ <= 8, "markov_order=", k_,
                                           " must be in [1, 8]");
    moe::detail::require<moe::ConfigError>(m_ >= 1 && m_ <= V_, "markov_branching=", m_,
                                           " must be in [1, vocab_size=", V_, "]");
    double const n = std::pow(double(V_), k_);
    moe::detail::require<moe::ConfigError>(n <= double(1 << 22), "vocab_size^markov_order = ", n,
                                           " contexts is too many (at most 2^22)");
    C_ = std::int64_t(n);
    next_.resize(std::size_t(C_ * m_));
    prob_.resize(std::size_t(C_ * m_));
    // Per context: m distinct next tokens (partial Fisher-Yates) and Dirichlet(1) probabilities.
    std::vector<int> perm(static_cast<std::size_t>(V_));
    for (std::int64_t c = 0; c < C_; ++c) {
      CounterRng rng(seed, 0x4d41524b4f56ULL, std::uint64_t(c));  // "MARKOV"
      for (int v = 0; v < V_; ++v) perm[std::size_t(v)] = v;
      double total = 0;
      for (int j = 0; j < m_; ++j) {
        int const pick = j + int(rng.below(std::uint64_t(V_ - j)));
        std::swap(perm[std::size_t(j)], perm[std::size_t(pick)]);
        next_[std::size_t(c * m_ + j)] = perm[std::size_t(j)];
        double const e = -std::log(rng.uniform_open0());
        prob_[std::size_t(c * m_ + j)] = e;
        total += e;
      }
      for (int j = 0; j < m_; ++j) prob_[std::size_t(c * m_ + j)] /= total;
    }
    stationary();
  }

  int vocab() const { return V_; }
  std::int64_t contexts() const { return C_; }
  /// Stationary distribution over contexts.
  std::vector<double> const& pi() const { return pi_; }
  /// Iterations the power iteration took to converge.
  int power_iterations() const { return iterations_; }
  /// Possible next tokens of context c ([branching]); their probabilities: next_probs(c).
  int const* next_tokens(std::int64_t c) const { return next_.data() + c * m_; }
  double const* next_probs(std::int64_t c) const { return prob_.data() + c * m_; }
  int branching() const { return m_; }
  int order() const { return k_; }
  /// H(next | context) in nats.
  double context_entropy(std::int64_t c) const {
    double h = 0;
    for (int j = 0; j < m_; ++j) {
      double const p = prob_[std::size_t(c * m_ + j)];
      if (p > 0) h -= p * std::log(p);
    }
    return h;
  }
  /// Entropy rate sum_c pi(c) H(next | c), nats per token.
  double entropy_rate() const {
    double h = 0;
    for (std::int64_t c = 0; c < C_; ++c) h += pi_[std::size_t(c)] * context_entropy(c);
    return h;
  }

  /// Writes n tokens of one stationary sequence drawn with `rng`.
  void sample(CounterRng& rng, std::int32_t* out, std::int64_t n) const {
    // Start context from pi (binary search in the cumulative distribution).
    double const u = rng.uniform();
    std::int64_t c = std::int64_t(std::upper_bound(cdf_.begin(), cdf_.end(), u) - cdf_.begin());
    c = std::min(c, C_ - 1);
    std::int64_t const top = C_ / V_;  // V^(k-1)
    // The context's k tokens, oldest first.
    std::int64_t rest = c, scale = top;
    for (std::int64_t i = 0; i < std::min<std::int64_t>(k_, n); ++i) {
      out[i] = std::int32_t(rest / scale);
      rest %= scale;
      scale = std::max<std::int64_t>(scale / V_, 1);
    }
    for (std::int64_t i = k_; i < n; ++i) {
      double const r = rng.uniform();
      double acc = 0;
      int j = 0;
      for (; j < m_ - 1; ++j) {
        acc += prob_[std::size_t(c * m_ + j)];
        if (r < acc) break;
      }
      int const y = next_[std::size_t(c * m_ + j)];
      out[i] = y;
      c = (c % top) * V_ + y;
    }
  }

 private:
  /// pi = pi P by power iteration on the lazy chain (I + P) / 2, which has the same stationary
  /// distributions and is aperiodic, from the uniform distribution until the L1 change is below
  /// 1e-14.
  void stationary() {
    std::vector<double> pi(static_cast<std::size_t>(C_), 1.0 / double(C_));
    std::vector<double> nxt(static_cast<std::size_t>(C_));
    std::int64_t const top = C_ / V_;
    constexpr int max_iterations = 1000000;
    double change = 1;
    int it = 0;
    for (; it < max_iterations && change > 1e-14; ++it) {
      for (std::int64_t c = 0; c < C_; ++c) nxt[std::size_t(c)] = 0.5 * pi[std::size_t(c)];
      for (std::int64_t c = 0; c < C_; ++c) {
        double const w = 0.5 * pi[std::size_t(c)];
        for (int j = 0; j < m_; ++j)
          nxt[std::size_t((c % top) * V_ + next_[std::size_t(c * m_ + j)])] +=
              w * prob_[std::size_t(c * m_ + j)];
      }
      double total = 0;
      for (double v : nxt) total += v;
      change = 0;
      for (std::int64_t c = 0; c < C_; ++c) {
        double const v = nxt[std::size_t(c)] / total;
        change += std::abs(v - pi[std::size_t(c)]);
        pi[std::size_t(c)] = v;
      }
    }
    moe::detail::require<moe::Error>(change <= 1e-14, "markov source: the stationary distribution ",
                                     "did not converge in ", max_iterations, " iterations");
    iterations_ = it;
    pi_ = pi;
    cdf_.resize(std::size_t(C_));
    double acc = 0;
    for (std::int64_t c = 0; c < C_; ++c) cdf_[std::size_t(c)] = acc += pi[std::size_t(c)];
  }

  int V_, k_, m_;
  std::int64_t C_ = 0;
  std::vector<int> next_;
  std::vector<double> prob_, pi_, cdf_;
  int iterations_ = 0;
};

/// \brief The data source of a run: fills this rank's sequences of a step.
class Dataset {
 public:
  enum class Kind { Markov, Synthetic, Text };

  static Kind parse_kind(std::string const& s) {
    if (s == "markov") return Kind::Markov;
    if (s == "synthetic") return Kind::Synthetic;
    if (s == "text") return Kind::Text;
    throw moe::ConfigError(
        moe::detail::cat("dataset_type=", s, " is not supported (markov | synthetic | text)"));
  }

  /// \param path file of dataset_type=text; vocab is forced to 256 there.
  Dataset(Kind kind, int vocab, int markov_order, int markov_branching, std::uint64_t seed,
          std::string const& path = "")
      : kind_(kind), V_(kind == Kind::Text ? 256 : vocab), seed_(seed) {
    if (kind == Kind::Markov) markov_.emplace_back(vocab, markov_order, markov_branching, seed);
    if (kind == Kind::Text) {
      std::ifstream in(path, std::ios::binary);
      moe::detail::require<moe::ConfigError>(bool(in), "dataset_path='", path,
                                             "' cannot be read (dataset_type=text needs a file)");
      text_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
  }

  Kind kind() const { return kind_; }
  char const* name() const {
    return kind_ == Kind::Markov ? "markov" : kind_ == Kind::Synthetic ? "synthetic" : "text";
  }
  int vocab() const { return V_; }
  /// Entropy rate in nats/token: exact for markov and synthetic, NaN (unknown) for text.
  double entropy_rate() const {
    if (kind_ == Kind::Markov) return markov_[0].entropy_rate();
    if (kind_ == Kind::Synthetic) return std::log(double(V_));
    return std::numeric_limits<double>::quiet_NaN();
  }
  MarkovSource const* markov() const { return markov_.empty() ? nullptr : &markov_[0]; }
  std::size_t text_bytes() const { return text_.size(); }

  /// Checks that sequences of `len` tokens can be drawn (text: the file is long enough).
  void check_length(std::int64_t len) const {
    if (kind_ == Kind::Text)
      moe::detail::require<moe::ConfigError>(
          std::int64_t(text_.size()) >= len, "dataset_path holds ", text_.size(),
          " bytes but a sequence needs max_target_length + 1 = ", len);
  }

  /// Sequences [first, first + count) of step `step`, `len` tokens each, row-major into out.
  void fill(std::int64_t step, std::int64_t first, std::int64_t count, std::int64_t len,
            std::int32_t* out) const {
    for (std::int64_t s = 0; s < count; ++s) {
      std::int64_t const index = first + s;
      CounterRng rng(seed_, 0x44415441ULL, std::uint64_t(step), std::uint64_t(index));  // "DATA"
      std::int32_t* row = out + s * len;
      switch (kind_) {
        case Kind::Markov:
          markov_[0].sample(rng, row, len);
          break;
        case Kind::Synthetic:
          for (std::int64_t i = 0; i < len; ++i)
            row[i] = std::int32_t(rng.below(std::uint64_t(V_)));
          break;
        case Kind::Text: {
          std::uint64_t const span = text_.size() - std::uint64_t(len) + 1;
          std::uint64_t const at = rng.next() % span;
          for (std::int64_t i = 0; i < len; ++i)
            row[i] = std::int32_t(static_cast<unsigned char>(text_[at + std::uint64_t(i)]));
          break;
        }
      }
    }
  }

 private:
  Kind kind_;
  int V_;
  std::uint64_t seed_;
  std::vector<MarkovSource> markov_;
  std::string text_;
};

}  // namespace train
