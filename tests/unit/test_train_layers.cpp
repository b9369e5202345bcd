// train_moe's own pieces: every non-MoE layer's backward (embedding, causal token mixing,
// RMSNorm, output projection + cross-entropy) against central finite differences in double; the
// Markov source (stationary distribution, entropy rate, sampling), the per-sequence data streams,
// the learning-rate schedule, and the configuration (default.yml, errors, aliases).
#include <train_moe/config.hpp>
#include <train_moe/data.hpp>
#include <train_moe/model.hpp>
#include <train_moe/optimizer.hpp>

#include <moe_cli.hpp>
#include <moe_maxtext_config.hpp>

#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
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
  EXPECT_NE(message([] { train::TrainConfig().set("dtype", "float16"); }).find("dtype"),
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

namespace {

/// The message of the moe::ConfigError `f` throws ("no ConfigError" when it throws none).
std::string config_message(std::function<void()> const& f) {
  try {
    f();
  } catch (moe::ConfigError const& e) {
    return e.what();
  }
  return "no ConfigError";
}

/// A TrainConfig with `kv` set in order, then validated.
void set_and_validate(std::vector<std::pair<std::string, std::string>> const& kv) {
  train::TrainConfig c;
  c.apply(kv);
  c.validate();
}

TEST(TrainConfig, PrecisionKeysParseAndSetTheLayersDtype) {
  train::TrainConfig c;
  EXPECT_EQ(c.dtype, "float32");
  EXPECT_EQ(c.weight_dtype, "float32");
  EXPECT_EQ(c.grad_dtype, "float32");
  EXPECT_EQ(c.mu_dtype, "");
  EXPECT_EQ(c.layer.dtype, moe::ComputeDtype::Native);
  // train_moe's dtype shadows the layer's key (one `dtype` among all the keys) and sets it.
  auto const all = train::TrainConfig::all_keys();
  EXPECT_EQ(std::count(all.begin(), all.end(), "dtype"), 1);
  c.set("dtype", "bfloat16");
  EXPECT_EQ(c.dtype, "bfloat16");
  EXPECT_TRUE(c.layer.bf16());
  EXPECT_FALSE(c.bf16_weights() || c.bf16_mu() || c.bf16_nu());  // MaxText's defaults: fp32
  EXPECT_NO_THROW(c.validate());
  c.set("weight_dtype", "bfloat16");
  EXPECT_TRUE(c.bf16_weights());
  EXPECT_EQ(c.mu_storage(), "bfloat16");  // mu_dtype "" follows weight_dtype
  EXPECT_TRUE(c.bf16_mu());
  EXPECT_TRUE(c.bf16_nu());  // nu is stored as the weights are (MaxText)
  EXPECT_NO_THROW(c.validate());
  c.set("mu_dtype", "float32");
  EXPECT_FALSE(c.bf16_mu());
  EXPECT_TRUE(c.bf16_nu());
  c.set("weight_dtype", "float32");
  c.set("mu_dtype", "bfloat16");
  EXPECT_TRUE(c.bf16_mu());
  EXPECT_FALSE(c.bf16_nu());
  c.set("grad_dtype", "float32");
  EXPECT_NO_THROW(c.validate());
  c.set("mu_dtype", "");
  EXPECT_EQ(c.mu_dtype, "");
  c.set("dtype", "float32");
  EXPECT_EQ(c.layer.dtype, moe::ComputeDtype::Native);
  c.set("dtype", "bfloat16");
  c.set("dtype", "float64");
  EXPECT_EQ(c.layer.dtype, moe::ComputeDtype::Native);
  // Values that do not parse name the key, the value and the choices.
  EXPECT_EQ(config_message([] { train::TrainConfig().set("dtype", "float16"); }),
            "dtype=float16 is not supported (float32 | float64 | bfloat16)");
  EXPECT_EQ(config_message([] { train::TrainConfig().set("weight_dtype", "int8"); }),
            "weight_dtype=int8 is not supported (float32 | bfloat16 | float64)");
  EXPECT_EQ(config_message([] { train::TrainConfig().set("grad_dtype", "fp8"); }),
            "grad_dtype=fp8 is not supported (float32 | bfloat16 | float64)");
  EXPECT_EQ(config_message([] { train::TrainConfig().set("mu_dtype", "half"); }),
            "mu_dtype=half is not supported (\"\" | float32 | bfloat16 | float64)");
  // Combinations that make no sense: a ConfigError naming the values and the rule.
  struct Bad {
    char const *dtype, *key, *value, *message;
  };
  for (auto const& b : std::vector<Bad>{
           {"float32", "weight_dtype", "bfloat16",
            "weight_dtype=bfloat16 with dtype=float32 (bf16 weights with fp32 compute): bf16 "
            "weights need dtype=bfloat16"},
           {"float64", "weight_dtype", "bfloat16",
            "weight_dtype=bfloat16 with dtype=float64 (bf16 weights with fp64 compute)"},
           {"float32", "weight_dtype", "float64",
            "weight_dtype=float64 with dtype=float32 (fp64 weights with fp32 compute): float64 "
            "weights need dtype=float64"},
           {"bfloat16", "weight_dtype", "float64",
            "weight_dtype=float64 with dtype=bfloat16 (fp64 weights with bf16 compute)"},
           {"bfloat16", "grad_dtype", "bfloat16",
            "grad_dtype=bfloat16 is not supported: moe accumulates and reduces gradients in "
            "float32"},
           {"float32", "grad_dtype", "bfloat16", "grad_dtype=bfloat16 is not supported"},
           {"float32", "grad_dtype", "float64",
            "grad_dtype=float64 with dtype=float32 (fp64 gradients with fp32 compute)"},
           {"float64", "mu_dtype", "bfloat16",
            "mu_dtype=bfloat16 with dtype=float64 (bf16 moments with fp64 compute)"},
           {"bfloat16", "mu_dtype", "float64",
            "mu_dtype=float64 with dtype=bfloat16 (fp64 moments with bf16 compute)"},
       }) {
    std::string const m = config_message([&] {
      set_and_validate({{"dtype", b.dtype}, {b.key, b.value}});
    });
    EXPECT_NE(m.find(b.message), std::string::npos)
        << b.dtype << " " << b.key << "=" << b.value << ": " << m;
  }
  // Combinations that do.
  for (auto const& kv : std::vector<std::vector<std::pair<std::string, std::string>>>{
           {{"dtype", "float64"},
            {"weight_dtype", "float64"},
            {"grad_dtype", "float64"},
            {"mu_dtype", "float64"}},
           {{"dtype", "float64"}},  // the float32 defaults: a float64 run stays float64
           {{"dtype", "float32"}, {"mu_dtype", "bfloat16"}},
           {{"dtype", "bfloat16"}, {"weight_dtype", "bfloat16"}, {"mu_dtype", "float32"}},
       })
    EXPECT_EQ(config_message([&] { set_and_validate(kv); }), "no ConfigError");
  // bf16 runs keep float storage: the float32 range check applies to them.
  std::string const m = config_message([] {
    set_and_validate({{"dtype", "bfloat16"}, {"adam_eps", "1e-50"}});
  });
  EXPECT_NE(m.find("adam_eps=1e-50 becomes 0 in float32 (dtype=bfloat16)"), std::string::npos) << m;
}

TEST(TrainConfig, MaxTextPrecisionKeysKeepTheirMeaning) {
  // base.yml's precision lines and a few of models/mixtral-8x7b.yml's (written here), then
  // small-shape overrides, read as train_moe reads them.
  auto const dir = std::filesystem::temp_directory_path() /
                   ("moe_train_precision_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto write = [&](char const* name, char const* text) {
    std::ofstream((dir / name).string()) << text;
    return (dir / name).string();
  };
  std::string const base = write("base.yml",
                                 "grad_dtype: \"float32\"\n"
                                 "dtype: \"bfloat16\"\n"
                                 "matmul_precision: \"default\"\n"
                                 "activations_in_float32: false\n"
                                 "weight_dtype: \"float32\"\n"
                                 "float32_weight_sum: true\n"
                                 "float32_gate_logits: false\n"
                                 "opt_type: \"adamw\"\n"
                                 "mu_dtype: \"\"\n");
  std::string const model = write("mixtral.yml",
                                  "base_emb_dim: 4096\n"
                                  "base_moe_mlp_dim: 14336\n"
                                  "base_num_decoder_layers: 32\n"
                                  "mlp_activations: [\"silu\",\"linear\"]\n"
                                  "num_experts: 8\n"
                                  "num_experts_per_tok: 2\n"
                                  "decoder_block: \"mixtral\"\n");
  auto const tool_has_key = [](std::string const& key) {  // as train_moe's main
    return train::TrainConfig::table().find(key) != nullptr || moe::LayerConfig::has_key(key) ||
           moe::ParallelConfig::has_key(key);
  };
  auto load = [&](moe::cli::KeyValues overrides) {
    overrides.insert(
        overrides.begin(),
        {{"base_emb_dim", "32"}, {"base_moe_mlp_dim", "64"}, {"base_num_decoder_layers", "1"}});
    auto const l = moe::cli::maxtext::load({base, model}, overrides, tool_has_key,
                                           train::TrainConfig::all_keys());
    train::TrainConfig c;
    c.apply(l.apply);
    c.validate();
    return std::make_pair(c, l);
  };
  auto const [c, l] = load({});
  EXPECT_EQ(c.dtype, "bfloat16");
  EXPECT_TRUE(c.layer.bf16());
  EXPECT_TRUE(c.layer.float32_weight_sum);
  EXPECT_FALSE(c.layer.float32_gate_logits);
  EXPECT_EQ(c.weight_dtype, "float32");
  EXPECT_EQ(c.grad_dtype, "float32");
  EXPECT_EQ(c.mu_dtype, "");
  EXPECT_FALSE(c.bf16_weights() || c.bf16_mu() || c.bf16_nu());
  EXPECT_EQ(c.layer.base_emb_dim, 32);
  // The precision keys are applied, not ignored; MaxText's others of the category are ignored.
  ASSERT_TRUE(l.ignored.count("dtypes"));
  EXPECT_EQ(l.ignored.at("dtypes"),
            (std::vector<std::string>{"matmul_precision", "activations_in_float32"}));
  // MaxText's bf16 weights: both moments bf16 (mu_dtype "" = weight_dtype).
  auto const w = load({{"weight_dtype", "bfloat16"}}).first;
  EXPECT_TRUE(w.bf16_weights() && w.bf16_mu() && w.bf16_nu());
  auto const mu = load({{"mu_dtype", "bfloat16"}}).first;
  EXPECT_TRUE(mu.bf16_mu() && !mu.bf16_nu() && !mu.bf16_weights());
  // An override of dtype wins over base.yml's (and the layer follows).
  auto const f = load({{"dtype", "float32"}}).first;
  EXPECT_EQ(f.dtype, "float32");
  EXPECT_FALSE(f.layer.bf16());
  // MaxText values moe refuses: the ConfigError names them.
  EXPECT_NE(config_message([&] {
              load({{"grad_dtype", "bfloat16"}});
            })
                .find("grad_dtype=bfloat16 is not supported: moe accumulates and reduces "
                      "gradients in float32"),
            std::string::npos);
  EXPECT_NE(config_message([&] {
              load({{"dtype", "float32"}, {"weight_dtype", "bfloat16"}});
            }).find("bf16 weights with fp32 compute"),
            std::string::npos);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

/// One AdamW parameter block of n float elements, moments in float or bf16.
train::detail::Param<float> adam_block(std::int64_t n, bool mu16, bool nu16, bool bf16_weights) {
  using P = train::detail::Param<float>;
  P q;
  q.name = "w";
  q.block = moe::TensorBlock{{n}, {n}, {0}};
  q.p = P::view1("p", n);
  q.g = P::view1("g", n);
  if (mu16)
    q.m16 = P::view16("m16", n);
  else
    q.m = P::view1("m", n);
  if (nu16)
    q.v16 = P::view16("v16", n);
  else
    q.v = P::view1("v", n);
  q.bf16_weights = bf16_weights;
  q.p_host = Kokkos::create_mirror_view(q.p);
  q.init = train::detail::Init{train::detail::Init::Normal, 0.5};
  train::detail::initialise(q, 11);
  return q;
}

/// The stored moment (first or second) of q as double (bf16: exact).
std::vector<double> moment_values(train::detail::Param<float> const& q, bool first) {
  auto const& f = first ? q.m : q.v;
  auto const& h = first ? q.m16 : q.v16;
  if (!h.data()) return values(f);
  auto m = Kokkos::create_mirror_view(h);
  Kokkos::deep_copy(m, h);
  std::vector<double> out;
  for (std::size_t i = 0; i < m.extent(0); ++i) out.push_back(double(float(m(i))));
  return out;
}

double bf16_round(double x) { return double(float(moe::bf16(float(x)))); }
bool bf16_representable(double x) { return bf16_round(x) == x; }

/// Steps of train_moe's AdamW against AdamW in double from the same stored state, whose new
/// moments (and, bf16 weights, parameters) are rounded to bf16 where the block stores bf16.
void check_adamw_against_double(bool mu16, bool nu16, bool bf16_weights) {
  std::int64_t const n = 4096;
  std::vector<train::detail::Param<float>> params = {adam_block(n, mu16, nu16, bf16_weights)};
  auto& q = params[0];
  if (bf16_weights) {
    for (double x : values(q.p)) ASSERT_TRUE(bf16_representable(x)) << "initial " << x;
  }
  train::TrainConfig cfg;
  cfg.adam_weight_decay = 0.1;
  double const lr = 1e-2, gs = 0.7;
  std::size_t exact_mu = 0, exact_nu = 0, total = 0;
  for (std::int64_t t = 1; t <= 5; ++t) {
    randn(q.g, t == 3 ? 1e-3 : 1.0);  // one step of small gradients
    auto const p0 = values(q.p), g = values(q.g);
    auto const m0 = moment_values(q, true), v0 = moment_values(q, false);
    train::detail::adamw_step(Exec(), cfg, params, lr, gs, t);
    auto const p1 = values(q.p);
    auto const m1 = moment_values(q, true), v1 = moment_values(q, false);
    double const b1 = cfg.adam_b1, b2 = cfg.adam_b2, eps = cfg.adam_eps, wd = 0.1;
    double const c1 = 1 / (1 - std::pow(b1, double(t))), c2 = 1 / (1 - std::pow(b2, double(t)));
    for (std::int64_t i = 0; i < n; ++i) {
      double const gi = gs * g[i];
      double const m = b1 * m0[i] + (1 - b1) * gi, v = b2 * v0[i] + (1 - b2) * gi * gi;
      double const u = m * c1 / (std::sqrt(v * c2) + eps);
      double const w = p0[i] - lr * (u + wd * p0[i]);
      // A stored bf16 moment is the reference's rounded to bf16 (one bf16 step apart where the
      // float and double values straddle a rounding boundary: rare).
      // float's error: relative to the terms summed (m may cancel).
      double const m_err = 1e-6 * (b1 * std::abs(m0[i]) + (1 - b1) * std::abs(gi));
      double const v_err = 1e-6 * v;
      auto check_moment = [&](double got, double ref, double err, bool b16, std::size_t& exact,
                              char const* what) {
        if (!b16) {
          EXPECT_NEAR(got, ref, err) << what << " " << i;
          return;
        }
        EXPECT_TRUE(bf16_representable(got)) << what << " " << i;
        EXPECT_LE(std::abs(got - ref), std::ldexp(std::abs(ref), -8) + err) << what << " " << i;
        exact += got == bf16_round(ref) ? 1 : 0;
      };
      check_moment(m1[i], m, m_err, mu16, exact_mu, "mu");
      check_moment(v1[i], v, v_err, nu16, exact_nu, "nu");
      ++total;
      // The update uses the unrounded moments; bf16 weights are rounded after it.
      double const tol =
          1e-6 * std::abs(w) + lr * (1e-5 + 4 * m_err * c1 / (std::sqrt(v * c2) + eps));
      if (bf16_weights) {
        EXPECT_TRUE(bf16_representable(p1[i])) << "p " << i << " step " << t;
        EXPECT_LE(std::abs(p1[i] - w), std::ldexp(std::abs(w), -8) + tol) << i;
      } else {
        EXPECT_NEAR(p1[i], w, tol) << "p " << i << " step " << t;
      }
    }
  }
  if (mu16) {
    EXPECT_GE(double(exact_mu), 0.999 * double(total));
  }
  if (nu16) {
    EXPECT_GE(double(exact_nu), 0.999 * double(total));
  }
}

TEST(TrainOptimizer, Bf16MomentsAreSixteenBitAndMatchADoubleReference) {
  std::int64_t const n = 4096;
  // The optimizer state's bytes: 4 + 4 per element in float, 2 per bf16 moment.
  EXPECT_EQ(adam_block(n, false, false, false).moment_bytes(), 8 * n);
  EXPECT_EQ(adam_block(n, true, false, false).moment_bytes(), 6 * n);  // mu_dtype=bfloat16
  EXPECT_EQ(adam_block(n, true, true, true).moment_bytes(), 4 * n);    // weight_dtype=bfloat16
  EXPECT_EQ(sizeof(train::detail::Param<float>::view16::value_type), 2u);
  {
    SCOPED_TRACE("float moments");
    check_adamw_against_double(false, false, false);
  }
  {
    SCOPED_TRACE("mu_dtype=bfloat16");
    check_adamw_against_double(true, false, false);
  }
  {
    SCOPED_TRACE("weight_dtype=bfloat16 (mu and nu bf16)");
    check_adamw_against_double(true, true, true);
  }
  {
    SCOPED_TRACE("bf16 weights, float moments");
    check_adamw_against_double(false, false, true);
  }
}

TEST(TrainOptimizer, Bf16MomentsRoundTripThroughTheirHostMirrors) {
  // Checkpoints write bf16 moments as float and load them back: exactly the stored values.
  std::vector<train::detail::Param<float>> params = {adam_block(64, true, true, true)};
  auto& q = params[0];
  train::TrainConfig cfg;
  randn(q.g);
  train::detail::adamw_step(Exec(), cfg, params, 1e-2, 1.0, 1);
  auto const m = moment_values(q, true), v = moment_values(q, false), p = values(q.p);
  train::detail::to_host(q);
  ASSERT_EQ(q.m_host.extent(0), 64u);
  for (std::size_t i = 0; i < 64; ++i) EXPECT_EQ(double(q.m_host(i)), m[i]);
  Kokkos::deep_copy(q.m16, moe::bf16(1.0f));
  Kokkos::deep_copy(q.v16, moe::bf16(1.0f));
  train::detail::from_host(q);
  train::detail::release_moment_mirrors(q);
  EXPECT_EQ(q.m_host.extent(0), 0u);
  EXPECT_EQ(moment_values(q, true), m);
  EXPECT_EQ(moment_values(q, false), v);
  EXPECT_EQ(values(q.p), p);
}

}  // namespace

namespace {

TEST(TrainOptimizer, WeightRoundingIsTiesToEven) {
  // The optimizer rounds weights with moe::bf16 (bit-exact against a reference in
  // test_bf16.cpp). Ties to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7, 1 + 3 x 2^-8
  // between 1 + 2^-7 and 1 + 2^-6; float's largest value is past bf16's and rounds to Inf.
  EXPECT_EQ(train::detail::round_bf16(1.0f + 1.0f / 256), 1.0f);
  EXPECT_EQ(train::detail::round_bf16(1.0f + 3.0f / 256), 1.0f + 1.0f / 64);
  EXPECT_EQ(train::detail::round_bf16(std::numeric_limits<float>::max()),
            std::numeric_limits<float>::infinity());
}

}  // namespace
