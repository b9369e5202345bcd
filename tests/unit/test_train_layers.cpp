// train_moe's own pieces: every non-MoE layer's backward (embedding, causal token mixing,
// RMSNorm, output projection + cross-entropy) against central finite differences in double; the
// Markov source (stationary distribution, entropy rate, sampling), the per-sequence data streams,
// the learning-rate schedule, and the configuration (default.yml, errors, aliases).
#include <train_moe/config.hpp>
#include <train_moe/data.hpp>
#include <train_moe/model.hpp>

#include <moe_cli.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <csignal>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace {

using Exec = Kokkos::DefaultExecutionSpace;
using Ops = train::ModelOps<double, Exec>;
using V1 = Ops::view1;
using V2 = Ops::view2;
using Tok = moe::View1<std::int32_t>;

std::mt19937_64& gen() {
  static std::mt19937_64 g(7);
  return g;
}
template <class V>
void randn(V const& v, double scale = 1.0) {
  std::normal_distribution<double> d(0.0, scale);
  auto h = Kokkos::create_mirror_view(v);
  for (std::size_t i = 0; i < h.span(); ++i) h.data()[i] = d(gen());
  Kokkos::deep_copy(v, h);
}
Tok tokens(std::int64_t T, int V) {
  Tok t("tokens", T);
  auto h = Kokkos::create_mirror_view(t);
  for (std::int64_t i = 0; i < T; ++i) h(i) = std::int32_t(gen()() % std::uint64_t(V));
  Kokkos::deep_copy(t, h);
  return t;
}
template <class V>
std::vector<double> values(V const& v) {
  auto h = Kokkos::create_mirror_view(v);
  Kokkos::deep_copy(h, v);
  return std::vector<double>(h.data(), h.data() + h.span());
}
/// sum(a * b) over all elements.
template <class V>
double dot(V const& a, V const& b) {
  auto x = values(a), y = values(b);
  double s = 0;
  for (std::size_t i = 0; i < x.size(); ++i) s += x[i] * y[i];
  return s;
}

/// Compares `analytic` (the gradient of f w.r.t. the parameter view p) with central differences.
template <class V>
void check_gradient(std::string const& what, V const& p, std::function<double()> const& f,
                    std::vector<double> const& analytic, double tol = 1e-7) {
  auto h = Kokkos::create_mirror_view(p);
  Kokkos::deep_copy(h, p);
  ASSERT_EQ(analytic.size(), h.span()) << what;
  double worst = 0, scale = 1e-12;
  for (std::size_t i = 0; i < h.span(); ++i) {
    double const x0 = h.data()[i], eps = 1e-6 * std::max(1.0, std::abs(x0));
    h.data()[i] = x0 + eps;
    Kokkos::deep_copy(p, h);
    double const fp = f();
    h.data()[i] = x0 - eps;
    Kokkos::deep_copy(p, h);
    double const fm = f();
    h.data()[i] = x0;
    Kokkos::deep_copy(p, h);
    double const fd = (fp - fm) / (2 * eps);
    worst = std::max(worst, std::abs(fd - analytic[i]));
    scale = std::max(scale, std::abs(fd));
  }
  EXPECT_LE(worst, tol * scale + 1e-10)
      << what << ": max |fd - analytic| " << worst << " (largest gradient " << scale << ")";
}

TEST(TrainLayers, EmbeddingGradient) {
  int const V = 5, D = 3;
  std::int64_t const T = 11;
  Exec space;
  V2 table("table", V, D), out("out", T, D), R("R", T, D), dtable("dtable", V, D);
  randn(table);
  randn(R);
  auto tok = tokens(T, V);
  auto loss = [&] {
    Ops::embedding_forward(space, table, tok, out);
    return dot(out, R);
  };
  Ops::embedding_backward(space, tok, R, dtable);
  check_gradient("d_table", table, loss, values(dtable));
}

TEST(TrainLayers, CausalMixingGradient) {
  std::int64_t const C = 3, D = 4, S = 5, B = 2, T = B * S;
  Exec space;
  V2 w("w", C, D), in("in", T, D), out("out", T, D), R("R", T, D), din("din", T, D), dw("dw", C, D);
  randn(w);
  randn(in);
  randn(R);
  auto loss = [&] {
    Ops::mix_forward(space, w, in, S, out);
    return dot(out, R);
  };
  Ops::mix_backward(space, w, in, R, S, din, dw);
  check_gradient("d_in", in, loss, values(din));
  check_gradient("d_w", w, loss, values(dw));
  // Causal and per sequence: position 0 of sequence 1 sees only itself.
  Ops::mix_forward(space, w, in, S, out);
  auto o = values(out), x = values(in), wv = values(w);
  for (std::int64_t d = 0; d < D; ++d)
    EXPECT_DOUBLE_EQ(o[std::size_t(S * D + d)], wv[std::size_t(d)] * x[std::size_t(S * D + d)]);
}

TEST(TrainLayers, RmsNormGradient) {
  std::int64_t const T = 6, D = 5;
  Exec space;
  V2 x("x", T, D), y("y", T, D), R("R", T, D), dx("dx", T, D);
  V1 g("g", D), inv("inv", T), dg("dg", D);
  randn(x);
  randn(g);
  randn(R);
  double const eps = 1e-5;
  auto loss = [&] {
    Ops::rms_forward(space, x, g, eps, y, inv);
    return dot(y, R);
  };
  loss();
  Ops::rms_backward(space, x, g, inv, R, dx, false, dg);
  check_gradient("d_x", x, loss, values(dx));
  check_gradient("d_scale", g, loss, values(dg));
  // accumulate = true adds to what dx holds.
  auto const first = values(dx);
  loss();
  Ops::rms_backward(space, x, g, inv, R, dx, true, dg);
  auto const twice = values(dx);
  for (std::size_t i = 0; i < first.size(); ++i) EXPECT_DOUBLE_EQ(twice[i], 2 * first[i]);
  // Rows come out with unit root-mean-square before the scale.
  V1 ones("ones", D);
  Kokkos::deep_copy(ones, 1.0);
  Ops::rms_forward(space, x, ones, 0.0, y, inv);
  auto yv = values(y);
  for (std::int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (std::int64_t d = 0; d < D; ++d)
      ss += yv[std::size_t(t * D + d)] * yv[std::size_t(t * D + d)];
    EXPECT_NEAR(ss / double(D), 1.0, 1e-12);
  }
}

TEST(TrainLayers, ProjectionCrossEntropyGradient) {
  std::int64_t const T = 7, D = 4, V = 6;
  Exec space;
  V2 z("z", T, D), W("W", D, V), logits("logits", T, V), dlogits("dlogits", T, V), dz("dz", T, D),
      dW("dW", D, V);
  V1 loss_t("loss", T);
  randn(z);
  randn(W);
  auto tgt = tokens(T, int(V));
  double const scale = 1.0 / 3.0;
  auto loss = [&] {
    Ops::project(space, z, W, logits);
    Ops::cross_entropy(space, logits, tgt, scale, loss_t, dlogits);
    double s = 0;
    for (double v : values(loss_t)) s += v;
    return scale * s;
  };
  loss();
  Ops::project_backward(space, z, W, dlogits, dz, dW);
  check_gradient("d_z", z, loss, values(dz));
  check_gradient("d_W", W, loss, values(dW));
  // The loss is -log softmax at the target.
  loss();
  auto l = values(logits), lt = values(loss_t);
  auto th = Kokkos::create_mirror_view(tgt);
  Kokkos::deep_copy(th, tgt);
  for (std::int64_t t = 0; t < T; ++t) {
    double den = 0;
    for (std::int64_t v = 0; v < V; ++v) den += std::exp(l[std::size_t(t * V + v)]);
    EXPECT_NEAR(lt[std::size_t(t)], -std::log(std::exp(l[std::size_t(t * V + th(t))]) / den),
                1e-12);
  }
}

// ------------------------------------------------------------------ data
// --------------------------

TEST(TrainData, MarkovStationaryDistributionAndEntropyRate) {
  train::MarkovSource src(16, 2, 3, 5);
  auto const& pi = src.pi();
  std::int64_t const C = src.contexts(), V = src.vocab();
  ASSERT_EQ(C, 256);
  double total = 0, h = 0;
  std::vector<double> next(std::size_t(C), 0.0);
  for (std::int64_t c = 0; c < C; ++c) {
    total += pi[std::size_t(c)];
    double hp = 0;
    for (int j = 0; j < src.branching(); ++j) {
      double const p = src.next_probs(c)[j];
      next[std::size_t((c % (C / V)) * V + src.next_tokens(c)[j])] += pi[std::size_t(c)] * p;
      hp -= p * std::log(p);
    }
    h += pi[std::size_t(c)] * hp;
  }
  EXPECT_NEAR(total, 1.0, 1e-12);
  for (std::int64_t c = 0; c < C; ++c) EXPECT_NEAR(next[std::size_t(c)], pi[std::size_t(c)], 1e-12);
  EXPECT_NEAR(src.entropy_rate(), h, 1e-12);
  EXPECT_GT(h, 0.2);
  EXPECT_LT(h, std::log(3.0) + 1e-12);
  // Sampled sequences use only the source's transitions, and their mean -log p is the entropy
  // rate (stationary start) within a few standard errors.
  double nll = 0, nll2 = 0;
  std::int64_t n = 0;
  std::vector<std::int32_t> seq(65);
  for (int s = 0; s < 400; ++s) {
    train::CounterRng rng(1, std::uint64_t(s));
    src.sample(rng, seq.data(), 65);
    for (std::size_t i = 2; i < seq.size(); ++i) {
      std::int64_t const c = seq[i - 2] * V + seq[i - 1];
      double p = 0;
      for (int j = 0; j < src.branching(); ++j)
        if (src.next_tokens(c)[j] == seq[i]) p = src.next_probs(c)[j];
      ASSERT_GT(p, 0.0) << "transition outside the source";
      nll -= std::log(p);
      nll2 += std::log(p) * std::log(p);
      ++n;
    }
  }
  double const mean = nll / double(n), sd = std::sqrt(nll2 / double(n) - mean * mean);
  EXPECT_NEAR(mean, h, 5 * sd / std::sqrt(double(n)));
}

TEST(TrainData, SequencesDependOnlyOnSeedStepAndIndex) {
  for (auto kind : {train::Dataset::Kind::Markov, train::Dataset::Kind::Synthetic}) {
    train::Dataset data(kind, 16, 2, 3, 9);
    std::int64_t const len = 17, B = 8;
    std::vector<std::int32_t> all(std::size_t(B * len)), part(std::size_t(3 * len)),
        other(std::size_t(B * len));
    data.fill(4, 0, B, len, all.data());
    data.fill(4, 2, 3, len, part.data());  // a rank holding sequences 2..4
    for (std::size_t i = 0; i < part.size(); ++i) EXPECT_EQ(part[i], all[std::size_t(2 * len) + i]);
    data.fill(5, 0, B, len, other.data());
    EXPECT_NE(all, other);
    for (auto t : all) EXPECT_TRUE(t >= 0 && t < 16);
  }
  EXPECT_NEAR(train::Dataset(train::Dataset::Kind::Synthetic, 16, 2, 3, 0).entropy_rate(),
              std::log(16.0), 1e-15);
}

TEST(TrainData, TextUsesTheFileBytes) {
  std::string const path = std::string(MOE_SOURCE_DIR) + "/examples/train_moe/default.yml";
  train::Dataset data(train::Dataset::Kind::Text, 16, 2, 3, 1, path);
  EXPECT_EQ(data.vocab(), 256);
  EXPECT_TRUE(std::isnan(data.entropy_rate()));
  std::vector<std::int32_t> seq(32);
  data.fill(0, 0, 1, 32, seq.data());
  for (auto t : seq) EXPECT_TRUE(t >= 0 && t < 256);
  EXPECT_THROW(data.check_length(std::int64_t(data.text_bytes()) + 1), moe::ConfigError);
  EXPECT_THROW(train::Dataset(train::Dataset::Kind::Text, 16, 2, 3, 1, "/no/such/file"),
               moe::ConfigError);
}

// ------------------------------------------------------------------ schedule + config ------------

TEST(TrainConfig, LearningRateSchedule) {
  train::TrainConfig c;
  c.steps = 100;
  c.learning_rate = 1.0;
  c.warmup_steps = 10;
  c.cosine_learning_rate_final_fraction = 0.1;
  EXPECT_DOUBLE_EQ(train::learning_rate_at(c, 0), 0.1);
  EXPECT_DOUBLE_EQ(train::learning_rate_at(c, 9), 1.0);
  EXPECT_DOUBLE_EQ(train::learning_rate_at(c, 10), 1.0);
  EXPECT_NEAR(train::learning_rate_at(c, 55), 0.55, 1e-12);  // half-way down the cosine
  EXPECT_NEAR(train::learning_rate_at(c, 100), 0.1, 1e-12);
  for (std::int64_t s = 11; s < 100; ++s)
    EXPECT_LT(train::learning_rate_at(c, s), train::learning_rate_at(c, s - 1));
  c.warmup_steps = -1;
  c.warmup_steps_fraction = 0.2;
  EXPECT_EQ(c.warmup(), 20);
}

TEST(TrainConfig, DefaultYamlMatchesTheBuiltInDefaults) {
  train::TrainConfig from_file;
  from_file.apply(
      moe::cli::read_yaml(std::string(MOE_SOURCE_DIR) + "/examples/train_moe/default.yml"));
  EXPECT_EQ(from_file.describe(), train::TrainConfig().describe());
  EXPECT_NO_THROW(from_file.validate());
}

TEST(TrainConfig, KeysValuesAndErrors) {
  train::TrainConfig c;
  c.set("grad_clip", "0.5");
  EXPECT_EQ(c.gradient_clipping_threshold, 0.5);
  c.set("weight_decay", "0.2");
  EXPECT_EQ(c.adam_weight_decay, 0.2);
  c.set("seed", "42");
  EXPECT_EQ(c.seed, 42u);
  EXPECT_EQ(c.layer.seed, 42u);
  c.set("num_experts", "4");
  EXPECT_EQ(c.layer.num_experts, 4);
  // One fill axis: the latest -1 wins.
  EXPECT_EQ(c.par.ici_expert_parallelism, -1);
  c.set("ici_fsdp_parallelism", "-1");
  EXPECT_EQ(c.par.ici_expert_parallelism, 1);
  EXPECT_EQ(c.par.ici_fsdp_parallelism, -1);
  auto message = [](auto&& f) {
    try {
      f();
    } catch (moe::ConfigError const& e) {
      return std::string(e.what());
    }
    return std::string("no ConfigError");
  };
  EXPECT_NE(message([] { train::TrainConfig().set("stepz", "3"); }).find("stepz"),
            std::string::npos);
  EXPECT_NE(message([] { train::TrainConfig().set("dtype", "bfloat16"); }).find("dtype"),
            std::string::npos);
  EXPECT_NE(message([] { train::TrainConfig().set("steps", "many"); }).find("steps"),
            std::string::npos);
  EXPECT_NE(message([] {
              train::TrainConfig t;
              t.set("learning_rate", "-1");
              t.validate();
            }).find("learning_rate"),
            std::string::npos);
  EXPECT_NE(message([] {
              train::TrainConfig t;
              t.set("dataset_type", "text");
              t.validate();
            }).find("dataset_path"),
            std::string::npos);
  EXPECT_NE(message([] {
              train::TrainConfig t;
              t.set("dataset_type", "text");
              t.set("dataset_path", "x");
              t.set("vocab_size", "16");
              t.validate();
            }).find("vocab_size"),
            std::string::npos);
  EXPECT_NE(message([] {
              train::TrainConfig t;
              t.set("num_experts_per_tok", "9");
              t.validate();
            }).find("num_experts_per_tok"),
            std::string::npos);
}

}  // namespace

// The preemption and resume keys (#32): what they accept, and each refusal naming the value.
TEST(TrainConfig, SaveOnSignalAndResumeAllowChanged) {
  EXPECT_EQ(*train::stop_signal_numbers("SIGTERM,SIGUSR1"), (std::vector<int>{SIGTERM, SIGUSR1}));
  EXPECT_TRUE(train::stop_signal_numbers("none")->empty());
  EXPECT_TRUE(train::stop_signal_numbers("")->empty());
  EXPECT_FALSE(train::stop_signal_numbers("SIGKILL").has_value());
  EXPECT_FALSE(train::stop_signal_numbers("SIGTERM,").has_value());
  auto message = [](auto&& set) {
    train::TrainConfig c;
    set(c);
    try {
      c.validate();
    } catch (moe::ConfigError const& e) {
      return std::string(e.what());
    }
    return std::string("no ConfigError");
  };
  auto has = [](std::string const& m, char const* s) { return m.find(s) != std::string::npos; };
  std::string m = message([](auto& c) { c.set("save_on_signal", "SIGTERM,SIGKILL"); });
  EXPECT_TRUE(has(m, "save_on_signal='SIGTERM,SIGKILL' must list SIGTERM")) << m;
  m = message([](auto& c) { c.set("resume_allow_changed", "num_experts_per_tok,steps"); });
  EXPECT_TRUE(has(m, "resume_allow_changed names 'steps', which is not a model key")) << m;
  EXPECT_TRUE(has(m, "mlp_activations")) << m;  // the list of keys it may name
  m = message([](auto& c) { c.set("dataset_path", "tokens.bin"); });
  EXPECT_TRUE(has(m, "dataset_path='tokens.bin' is read only with dataset_type=text")) << m;
  EXPECT_EQ(message([](auto& c) {
              c.set("save_on_signal", "none");
              c.set("resume_allow_changed", "num_experts_per_tok,dataset_hash");
            }),
            "no ConfigError");
  // The model keys cover the ones that keep every tensor's shape, not the run's checks.
  train::TrainConfig const c;
  std::set<std::string> keys;
  for (auto const& kv : c.model_keys()) keys.insert(kv.first);
  for (char const* k : {"num_experts_per_tok", "mlp_activations", "decoder_block",
                        "use_random_routing", "capacity_factor", "vocab_size", "dtype"})
    EXPECT_EQ(keys.count(k), 1u) << k;
  for (char const* k : {"seed", "check_finite", "sparse_matmul", "steps"})
    EXPECT_EQ(keys.count(k), 0u) << k;
}

// RMSNorm in float32 on rows far beyond float's square root (#32): the sums run in double, so a
// finite row normalises to unit RMS and its gradient stays finite and nonzero.
TEST(TrainOps, RmsNormOfHugeFloatRows) {
  using F = train::ModelOps<float, Exec>;
  std::int64_t const T = 2, D = 64;
  F::view2 x("x", T, D), y("y", T, D), dy("dy", T, D), dx("dx", T, D);
  F::view1 g("g", D), inv("inv", T), dg("dg", D);
  auto xh = Kokkos::create_mirror_view(x);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t d = 0; d < D; ++d) xh(t, d) = (d % 2 ? 1.0f : -2.0f) * (t ? 3e30f : 1e20f);
  Kokkos::deep_copy(x, xh);
  Kokkos::deep_copy(g, 1.0f);
  Kokkos::deep_copy(dy, 1.0f);
  Exec space;
  F::rms_forward(space, x, g, 1e-5, y, inv);
  F::rms_backward(space, x, g, inv, dy, dx, false, dg);
  auto yh = Kokkos::create_mirror_view(y);
  auto dxh = Kokkos::create_mirror_view(dx);
  Kokkos::deep_copy(yh, y);
  Kokkos::deep_copy(dxh, dx);
  double const rms = std::sqrt((1.0 + 4.0) / 2.0);  // of the pattern (-2, 1, -2, 1, ...)
  for (std::int64_t t = 0; t < T; ++t) {
    EXPECT_NEAR(yh(t, 0), -2.0 / rms, 1e-5) << t;
    EXPECT_NEAR(yh(t, 1), 1.0 / rms, 1e-5) << t;
    // dx = r (dy - x r^2 mean(dy x) ...): finite and of order 1 / |x|, not 0 or NaN.
    double const scale = t ? 3e30 : 1e20;
    double const r = 1.0 / (rms * scale);
    double const mean_dyx = scale * (-2.0 + 1.0) / 2.0;
    double const expect0 = r - r * r * r * mean_dyx * (-2.0 * scale);
    EXPECT_TRUE(std::isfinite(dxh(t, 0)));
    EXPECT_NEAR(dxh(t, 0) / expect0, 1.0, 1e-4) << t;
  }
}

TEST(TrainConfig, Float32NarrowingOfRealKeys) {
  auto message = [](char const* key, char const* value, char const* dtype) {
    train::TrainConfig c;
    c.set("dtype", dtype);
    c.set(key, value);
    try {
      c.validate();
    } catch (moe::ConfigError const& e) {
      return std::string(e.what());
    }
    return std::string("no ConfigError");
  };
  std::string m = message("adam_eps", "1e-50", "float32");
  EXPECT_NE(m.find("adam_eps=1e-50 becomes 0 in float32"), std::string::npos) << m;
  m = message("normalization_layer_epsilon", "1e300", "float32");
  EXPECT_NE(m.find("normalization_layer_epsilon=1e+300 becomes inf in float32"), std::string::npos)
      << m;
  m = message("learning_rate", "1e-40", "float32");  // subnormal in float
  EXPECT_NE(m.find("learning_rate=1e-40 becomes"), std::string::npos) << m;
  EXPECT_EQ(message("adam_eps", "1e-50", "float64"), "no ConfigError");
  EXPECT_EQ(message("adam_weight_decay", "0", "float32"), "no ConfigError");
}
