#pragma once
// run_training: the train_moe driver as a library function. A small decoder-only MoE language
// model trained with AdamW under MPI on any layout of the DistributedMoeLayer:
//
//   tokens -> embedding [V,D] -> causal token mixing [C,D]
//          -> base_num_decoder_layers x (x = x + MoE(RMSNorm(x)))
//          -> RMSNorm -> output projection [D,V] -> softmax cross-entropy
//   loss = mean cross-entropy over the global batch's next-token predictions + sum of the
//          layers' load-balance losses
//
// Layout: each rank holds the sequences of the layer's block of x ([B,S,D], rows = sequences) and
// runs the non-MoE layers on them; non-MoE parameters are replicated and their gradients are
// summed over the ranks that hold other sequences (the layer's batch axes). MoE parameters are
// the layer's blocks; their gradients come out of backward() already reduced. Every collective is
// deterministic, so a run is bitwise reproducible and every layout computes the same losses up to
// floating-point reassociation.

#include "config.hpp"
#include "data.hpp"
#include "model.hpp"

#include <moe/comm/collectives.hpp>
#include <moe/comm/communicator.hpp>
#include <moe/detail/hash.hpp>
#include <moe/distributed/layer.hpp>
#include <moe/io/checkpoint.hpp>
#include <moe/threads.hpp>

#include <Kokkos_Core.hpp>
#include <Kokkos_Random.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace train {

/// \brief What one optimizer step measured (the same on every rank except `seconds`).
struct StepMetrics {
  std::int64_t step = 0;  ///< 0-based index of the step
  double loss = 0;        ///< ce_loss + lb_loss
  double ce_loss = 0;     ///< mean next-token cross-entropy over the global batch (nats)
  double lb_loss = 0;     ///< sum of the MoE layers' load-balance losses
  double perplexity = 0;  ///< exp(ce_loss)
  double seconds = 0;     ///< wall time of the step on this rank
  double tokens_per_s_per_device = 0;
  double learning_rate = 0;
  double grad_norm = 0;  ///< global gradient norm before clipping
};

/// \brief The outcome of run_training.
struct TrainResult {
  std::vector<StepMetrics> history;  ///< every step this call ran
  std::int64_t start_step = 0;       ///< first step run (the checkpoint's step after a resume)
  bool resumed = false;              ///< whether a checkpoint was loaded
  std::int64_t global_batch = 0;     ///< sequences per step
  std::string mesh;                  ///< the layer's mesh
  double entropy_rate = std::numeric_limits<double>::quiet_NaN();  ///< NaN: unknown (text)
  double final_loss = std::numeric_limits<double>::quiet_NaN();    ///< of the last step
  double final_ce_loss = std::numeric_limits<double>::quiet_NaN();
  double final_lb_loss = std::numeric_limits<double>::quiet_NaN();
  double tail_ce_loss = std::numeric_limits<double>::quiet_NaN();  ///< mean of the last 10 steps
  double entropy_gap_percent = std::numeric_limits<double>::quiet_NaN();  ///< of tail_ce_loss
  double tokens_per_s_per_device = 0;  ///< mean over the steps after the first
  double gemm_fraction = 0;            ///< step time in the MoE layers' BLAS GEMMs
  double comm_fraction = std::numeric_limits<double>::quiet_NaN();  ///< in MPI (NaN: unknown)
  double step_seconds = 0;  ///< mean step time over the steps after the first
  /// The yardstick of the step time: seconds of the routed-expert GEMMs of one device's share of
  /// a step run alone (see Trainer::expert_gemm_seconds); 0 when nothing was timed.
  double expert_gemm_seconds = 0;
  std::int64_t layer_bytes_per_step = 0;            ///< MoE layers' comm log, this rank
  std::int64_t layer_bytes_per_step_all_ranks = 0;  ///< summed over ranks
  bool replicas_consistent = true;  ///< ranks holding the same parameter block agree bitwise
  /// What oneDNN ran on rank 0 (moe::gmm::OneDnnStats::summary(): ISA, executions per kernel).
  std::string gemm_kernels;
  /// Executions of a oneDNN reference implementation, summed over ranks (0; a rank that ran one
  /// also writes its warning, naming the shape, to stderr).
  std::int64_t reference_runs_all_ranks = 0;
};

/// \brief Options of run_training that are not part of the configuration.
struct RunOptions {
  std::ostream* out = &std::cout;  ///< rank 0's progress log (nullptr: silent)
  /// Seconds spent in MPI so far on this rank (train_moe's main measures them through the MPI
  /// profiling interface); empty: the communication share of the step time is not reported.
  std::function<double()> comm_seconds;
};

namespace detail {

/// Sum over i of g(i)^2 in double (free function: nvcc forbids KOKKOS_LAMBDA in private members).
template <class Exec, class V>
double sum_of_squares(Exec const& space, V const& g) {
  double s = 0;
  Kokkos::parallel_reduce(
      "train::grad_norm", Kokkos::RangePolicy<Exec>(space, 0, g.extent(0)),
      KOKKOS_LAMBDA(std::int64_t i, double& acc) { acc += double(g(i)) * double(g(i)); }, s);
  return s;
}

/// Coefficients of one AdamW step (c1, c2: the bias corrections 1 / (1 - b^t)).
template <class Scalar>
struct AdamW {
  Scalar b1 = 0, b2 = 0, eps = 0, rate = 0, grad_scale = 1, decay = 0, c1 = 1, c2 = 1;
};

/// AdamW on flat views (decoupled weight decay, bias-corrected moments): raw pointers and one
/// load / one store per array and element, so the loop vectorises.
template <class Exec, class Scalar, class V>
void adamw_update(Exec const& space, AdamW<Scalar> const& a, V const& param, V const& grad,
                  V const& mom1, V const& mom2) {
  Scalar* p = param.data();
  Scalar const* g = grad.data();
  Scalar* mu = mom1.data();
  Scalar* nu = mom2.data();
  Scalar const b1 = a.b1, b2 = a.b2, eps = a.eps, rate = a.rate, gs = a.grad_scale, wd = a.decay,
               c1 = a.c1, c2 = a.c2;
  Kokkos::parallel_for(
      "train::adamw", Kokkos::RangePolicy<Exec>(space, 0, param.extent(0)),
      KOKKOS_LAMBDA(std::int64_t i) {
        Scalar const gi = gs * g[i];
        Scalar const m = b1 * mu[i] + (Scalar(1) - b1) * gi;
        Scalar const v = b2 * nu[i] + (Scalar(1) - b2) * gi * gi;
        Scalar const u = m * c1 / (moe::detail::sqrt(v * c2) + eps);
        Scalar const w = p[i];
        mu[i] = m;
        nu[i] = v;
        p[i] = w - rate * (u + wd * w);
      });
}

inline double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Time spent in GEMMs (the library's "moe::gmm::*" and "moe::gemm" profiling regions, and
/// Kokkos Kernels' "KokkosBlas::gemm") while `active`, through Kokkos Tools region callbacks.
struct GemmClock {
  static inline bool active = false;
  static inline bool installed = false;
  static inline double seconds = 0;
  static inline double t0 = 0;
  static inline int depth = 0;            // open GEMM regions
  static inline std::vector<char> stack;  // per open region: 0 other, 1 GEMM, 2 timed GEMM

  static void push(char const* name) {
    bool const gemm = std::strncmp(name, "moe::gmm::", 10) == 0 ||
                      std::strcmp(name, "moe::gemm") == 0 ||
                      std::strncmp(name, "KokkosBlas::gemm", 16) == 0;
    char kind = 0;
    if (gemm) {
      kind = 1;
      if (depth++ == 0 && active) {
        kind = 2;
        t0 = now();
      }
    }
    stack.push_back(kind);
  }
  static void pop() {
    if (stack.empty()) return;
    char const kind = stack.back();
    stack.pop_back();
    if (kind == 0) return;
    --depth;
    if (kind == 2) seconds += now() - t0;
  }
  /// Installs the callbacks unless a Kokkos Tools library is loaded; returns whether it did.
  static bool install() {
    if (Kokkos::Tools::profileLibraryLoaded()) return false;
    Kokkos::Tools::Experimental::set_push_region_callback(&push);
    Kokkos::Tools::Experimental::set_pop_region_callback(&pop);
    installed = true;
    stack.clear();
    depth = 0;
    return true;
  }
  static void uninstall() {
    if (!installed) return;
    Kokkos::Tools::Experimental::set_push_region_callback(nullptr);
    Kokkos::Tools::Experimental::set_pop_region_callback(nullptr);
    installed = false;
  }
};

inline std::int64_t numel(std::vector<std::int64_t> const& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

/// Row-major index in the global tensor of the local element i of block b.
inline std::int64_t global_index(moe::TensorBlock const& b, std::int64_t i) {
  std::size_t const r = b.local_shape.size();
  std::int64_t coord[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (std::size_t d = r; d-- > 0;) {
    coord[d] = i % b.local_shape[d];
    i /= b.local_shape[d];
  }
  std::int64_t g = 0;
  for (std::size_t d = 0; d < r; ++d) g = g * b.global_shape[d] + b.offset[d] + coord[d];
  return g;
}

using moe::detail::fnv1a;

inline std::string fmt(char const* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}
/// The mesh axes of size > 1 ("expert=2 x data=2"), "1 rank" when there are none.
inline std::string mesh_text(moe::sharding::Mesh const& mesh) {
  std::string s;
  for (auto const& [name, size] : mesh.axes())
    if (size > 1) s += (s.empty() ? "" : " x ") + name + "=" + std::to_string(size);
  return s.empty() ? std::string("1 rank") : s;
}
inline std::string json_number(double v) {
  return std::isfinite(v) ? fmt("%.17g", v) : std::string("null");
}

/// How a parameter is initialised (element-wise, from its global index: layout-independent).
struct Init {
  enum Kind { Normal, Ones, Zeros, Window } kind = Normal;
  double std = 1;        ///< Normal: N(0, std^2); Window: row 0 is 1, rows j > 0 N(0, std^2)
  std::int64_t row = 1;  ///< Window: elements per row
};

/// The trainer of one dtype.
template <class Scalar>
class Trainer {
 public:
  using Exec = Kokkos::DefaultExecutionSpace;
  using Layer = moe::DistributedMoeLayer<Scalar>;
  using Ops = ModelOps<Scalar, Exec>;
  using view1 = typename Ops::view1;
  using view2 = typename Ops::view2;
  using params_type = typename Layer::params_type;
  using host1 = typename view1::HostMirror;

  Trainer(moe::comm::Communicator const& comm, TrainConfig const& cfg, RunOptions const& opts)
      : comm_(comm), cfg_(cfg), opts_(opts), P_(comm.size()), rank_(comm.rank()) {}

  TrainResult run() {
    setup();
    TrainResult res;
    res.global_batch = B_;
    res.mesh = mesh_text(layers_[0]->mesh());
    res.entropy_rate = dataset_->entropy_rate();
    std::int64_t start = 0;
    if (cfg_.enable_checkpointing) start = resume(res);
    res.start_step = start;
    open_metrics(start);
    GemmClock::seconds = 0;
    bool const gemm_timed = GemmClock::install();
    double t_steps = 0, t_gemm = 0, t_comm = 0;
    std::int64_t timed = 0, bytes = 0;
    try {
      for (std::int64_t step = start; step < cfg_.steps; ++step) {
        double const g0 = GemmClock::seconds, c0 = comm_clock();
        StepMetrics m = train_step(step);
        if (step > start || cfg_.steps - start == 1) {
          t_steps += m.seconds;
          t_gemm += GemmClock::seconds - g0;
          t_comm += comm_clock() - c0;
          ++timed;
        }
        bytes = 0;
        for (auto const& l : layers_) bytes += l->comm_log().total_bytes();
        res.history.push_back(m);
        report(m);
        std::int64_t const done = step + 1;
        if (cfg_.enable_checkpointing && (done % cfg_.checkpoint_period == 0 || done == cfg_.steps))
          save(done);
      }
    } catch (...) {
      GemmClock::uninstall();
      throw;
    }
    GemmClock::uninstall();
    if (!res.history.empty()) {
      auto const& last = res.history.back();
      res.final_loss = last.loss;
      res.final_ce_loss = last.ce_loss;
      res.final_lb_loss = last.lb_loss;
      std::size_t const k = std::min<std::size_t>(10, res.history.size());
      double s = 0;
      for (std::size_t i = res.history.size() - k; i < res.history.size(); ++i)
        s += res.history[i].ce_loss;
      res.tail_ce_loss = s / double(k);
      res.entropy_gap_percent = 100.0 * (res.tail_ce_loss - res.entropy_rate) / res.entropy_rate;
    }
    if (t_steps > 0) {
      res.step_seconds = t_steps / double(timed);
      res.expert_gemm_seconds = expert_gemm_seconds();
      res.tokens_per_s_per_device = double(timed) * tokens_per_device() / t_steps;
      res.gemm_fraction = gemm_timed ? t_gemm / t_steps : std::numeric_limits<double>::quiet_NaN();
      if (opts_.comm_seconds) res.comm_fraction = t_comm / t_steps;
    }
    res.layer_bytes_per_step = bytes;
    moe::View1<std::int64_t, Kokkos::HostSpace> b("train::bytes", 1);
    b(0) = bytes;
    moe::comm::all_reduce(comm_, Kokkos::DefaultHostExecutionSpace(), b);
    res.layer_bytes_per_step_all_ranks = b(0);
    res.replicas_consistent = replicas_consistent();
    auto const kernels = moe::gmm::onednn_stats();
    res.gemm_kernels = kernels.summary();
    if (kernels.reference_runs > 0)
      std::cerr << "train_moe: rank " << rank_ << ": " << kernels.warning() << std::endl;
    b(0) = std::int64_t(kernels.reference_runs);
    moe::comm::all_reduce(comm_, Kokkos::DefaultHostExecutionSpace(), b);
    res.reference_runs_all_ranks = b(0);
    summary(res);
    return res;
  }

 private:
  /// One parameter block and its gradient and AdamW moments (contiguous device memory).
  struct Param {
    std::string name;
    moe::TensorBlock block;
    view1 p, g, m, v;
    host1 p_host, m_host, v_host;
    bool decay = true;
    double replicas = 1;  ///< ranks that hold this same block
    Init init;
  };

  std::ostream* out() const { return rank_ == 0 ? opts_.out : nullptr; }
  double comm_clock() const { return opts_.comm_seconds ? opts_.comm_seconds() : 0.0; }
  double tokens_per_device() const { return double(B_) * double(S_) / double(P_); }

  // ------------------------------------------------------------------ setup -------------------
  void setup() {
    // Data and shapes (a failure on any rank is the same error on every rank).
    moe::comm::collective_guard(comm_, [&] {
      cfg_.validate();
      double const b = cfg_.per_device_batch_size * double(P_);
      moe::detail::require<moe::ConfigError>(
          std::abs(b - std::round(b)) < 1e-9 && std::round(b) >= 1,
          "per_device_batch_size=", cfg_.per_device_batch_size, " x ", P_, " ranks = ", b,
          " must be a whole number of sequences (the global batch)");
      B_ = std::int64_t(std::llround(b));
      dataset_ = std::make_unique<Dataset>(Dataset::parse_kind(cfg_.dataset_type), cfg_.vocab_size,
                                           cfg_.markov_order, cfg_.markov_branching, cfg_.seed,
                                           cfg_.dataset_path);
      dataset_->check_length(cfg_.max_target_length + 1);
    });
    S_ = cfg_.max_target_length;
    D_ = cfg_.layer.base_emb_dim;
    V_ = dataset_->vocab();
    C_ = cfg_.context_length;
    L_ = cfg_.base_num_decoder_layers;
    for (int l = 0; l < L_; ++l)
      layers_.push_back(std::make_unique<Layer>(comm_.get(), cfg_.layer, cfg_.par, B_, S_));
    auto const xb = layers_[0]->block("x");
    b_local_ = xb.local_shape[0];
    first_seq_ = xb.offset[0];
    T_ = b_local_ * S_;
    // Ranks that hold other sequences: the layer's batch axes, ordered by batch block.
    auto const& mesh = layers_[0]->mesh();
    auto const& axes = layers_[0]->batch_axes();
    batch_comm_ = std::make_unique<moe::comm::Communicator>(
        comm_.split(mesh.group_index(rank_, axes), mesh.rank_in_group(rank_, axes)));
    // EP-TP: the layers take and give D / ep columns of the tokens; the driver slices its full-D
    // activations and all-gathers the layers' outputs over the axes the columns are split over.
    Dl_ = xb.local_shape[2];
    if (Dl_ != D_) {
      mesh_comm_ = std::make_unique<moe::comm::MeshComm>(comm_, mesh);
      emb_group_ = &mesh_comm_->group(layers_[0]->layout().emb_axes);
    }
    make_params();
    make_buffers();
    if (auto* o = out()) {
      std::int64_t n = 0, moe_n = 0;
      for (auto const& p : params_) {
        n += numel(p.block.global_shape);
        if (p.name.find(".moe.") != std::string::npos) moe_n += numel(p.block.global_shape);
      }
      *o << "train_moe: " << P_ << " rank" << (P_ > 1 ? "s" : "") << ", mesh " << mesh_text(mesh)
         << ", experts via " << moe::to_string(layers_[0]->expert_route()) << ", global batch "
         << B_ << " x " << S_ << " tokens, " << cfg_.dtype << "\n"
         << "model: vocab " << V_ << ", emb " << D_ << ", " << L_ << " MoE layers ("
         << cfg_.layer.num_experts << " experts of " << cfg_.layer.base_moe_mlp_dim << ", top-"
         << cfg_.layer.num_experts_per_tok << ", " << cfg_.layer.shared_experts
         << " shared), context " << C_ << ": " << n << " parameters (" << moe_n << " in MoE)\n"
         << moe::describe_gemm() << "\n";
      *o << "dataset: " << dataset_->name() << ", entropy rate: ";
      if (std::isfinite(dataset_->entropy_rate()))
        *o << fmt("%.4f", dataset_->entropy_rate()) << " nats/token\n";
      else
        *o << "unknown\n";
      o->flush();
    }
  }

  void add_param(std::string const& name, moe::TensorBlock const& block, Scalar* p, Scalar* g,
                 bool decay, Init init) {
    Param q;
    q.name = name;
    q.block = block;
    std::int64_t const n = numel(block.local_shape);
    q.p = view1(p, n);
    q.g = view1(g, n);
    q.decay = decay;
    q.replicas = double(P_) * double(n) / double(numel(block.global_shape));
    q.init = init;
    params_.push_back(q);
  }

  void make_params() {
    // Non-MoE parameters: replicated, in one flat buffer (one all-reduce for their gradients).
    struct Spec {
      std::string name;
      std::vector<std::int64_t> shape;
      bool decay;
      Init init;
    };
    std::vector<Spec> specs;
    double const sd = 1.0 / std::sqrt(double(D_));
    specs.push_back({"token_embedding", {V_, D_}, true, {Init::Normal, 1.0}});
    specs.push_back({"token_mixing", {C_, D_}, true, {Init::Window, 0.5, D_}});
    for (int l = 0; l < L_; ++l)
      specs.push_back(
          {"layers_" + std::to_string(l) + ".pre_norm.scale", {D_}, false, {Init::Ones}});
    specs.push_back({"final_norm.scale", {D_}, false, {Init::Ones}});
    specs.push_back({"output_projection", {D_, V_}, true, {Init::Normal, sd}});
    std::int64_t total = 0;
    for (auto const& s : specs) total += numel(s.shape);
    dense_p_ = view1("train::dense_params", total);
    dense_g_ = view1("train::dense_grads", total);
    std::int64_t at = 0;
    for (auto const& s : specs) {
      moe::TensorBlock b{s.shape, s.shape, std::vector<std::int64_t>(s.shape.size(), 0)};
      add_param(s.name, b, dense_p_.data() + at, dense_g_.data() + at, s.decay, s.init);
      at += numel(s.shape);
    }
    // MoE parameters: the layers' blocks; gradients in blocks of the same shapes.
    double const F = cfg_.layer.base_moe_mlp_dim, Fs = cfg_.layer.shared_mlp_dim();
    grads_.resize(std::size_t(L_));
    for (int l = 0; l < L_; ++l) {
      auto& layer = *layers_[std::size_t(l)];
      auto& g = grads_[std::size_t(l)];
      auto const& p = layer.parameters();
      g = std::decay_t<decltype(g)>::allocated(
          layer.config(), "train::d_", [&](char const* n) { return layer.block(n).local_shape; });
      std::vector<Scalar*> gp;
      g.for_each([&](char const*, auto const& v) { gp.push_back(v.data()); });
      std::size_t i = 0;
      p.for_each([&](char const* name, auto const& v) {
        std::string const n = name;
        Init init{Init::Normal, sd};
        if (n == "gate_bias") init = Init{Init::Zeros};
        if (n == "wo") init = Init{Init::Normal, 1.0 / std::sqrt(F)};
        if (n == "shared_wo") init = Init{Init::Normal, 1.0 / std::sqrt(Fs)};
        add_param("layers_" + std::to_string(l) + ".moe." + n, layer.block(n), v.data(), gp[i++],
                  n != "gate_bias", init);
      });
    }
    // AdamW moments of every parameter, and host mirrors for checkpoints.
    std::int64_t n_all = 0;
    for (auto const& q : params_) n_all += q.p.extent(0);
    moments_m_ = view1("train::adam_mu", n_all);
    moments_v_ = view1("train::adam_nu", n_all);
    at = 0;
    for (auto& q : params_) {
      std::int64_t const n = q.p.extent(0);
      q.m = view1(moments_m_.data() + at, n);
      q.v = view1(moments_v_.data() + at, n);
      q.p_host = Kokkos::create_mirror_view(q.p);
      q.m_host = Kokkos::create_mirror_view(q.m);
      q.v_host = Kokkos::create_mirror_view(q.v);
      at += n;
      initialise(q);
    }
    // Views of the non-MoE parameters and gradients.
    auto find = [&](std::string const& n) -> Param& {
      for (auto& q : params_)
        if (q.name == n) return q;
      throw moe::Error("train: no parameter " + n);
    };
    auto v2 = [](view1 const& f, std::int64_t r, std::int64_t c) { return view2(f.data(), r, c); };
    auto& emb = find("token_embedding");
    emb_ = v2(emb.p, V_, D_), d_emb_ = v2(emb.g, V_, D_);
    auto& mix = find("token_mixing");
    mix_ = v2(mix.p, C_, D_), d_mix_ = v2(mix.g, C_, D_);
    for (int l = 0; l < L_; ++l) {
      auto& s = find("layers_" + std::to_string(l) + ".pre_norm.scale");
      norm_.push_back(s.p), d_norm_.push_back(s.g);
    }
    auto& fn = find("final_norm.scale");
    final_norm_ = fn.p, d_final_norm_ = fn.g;
    auto& wo = find("output_projection");
    out_w_ = v2(wo.p, D_, V_), d_out_w_ = v2(wo.g, D_, V_);
  }

  void initialise(Param& q) {
    std::uint64_t const id = fnv1a(q.name);
    std::int64_t const n = q.p_host.extent(0);
    for (std::int64_t i = 0; i < n; ++i) {
      std::int64_t const g = global_index(q.block, i);
      double v = 0;
      switch (q.init.kind) {
        case Init::Ones:
          v = 1;
          break;
        case Init::Zeros:
          v = 0;
          break;
        case Init::Window:
          v = g < q.init.row ? 1.0
                             : q.init.std * CounterRng(cfg_.seed, id, std::uint64_t(g)).normal();
          break;
        default:
          v = q.init.std * CounterRng(cfg_.seed, id, std::uint64_t(g)).normal();
      }
      q.p_host(i) = Scalar(v);
    }
    Kokkos::deep_copy(q.p, q.p_host);
    Kokkos::deep_copy(q.m, Scalar(0));
    Kokkos::deep_copy(q.v, Scalar(0));
  }

  void make_buffers() {
    auto mat = [&](char const* label, std::int64_t c) { return view2(std::string(label), T_, c); };
    tokens_host_.resize(std::size_t(b_local_ * (S_ + 1)));
    tok_in_ = moe::View1<std::int32_t>("train::tokens", T_);
    tok_tgt_ = moe::View1<std::int32_t>("train::targets", T_);
    tok_in_host_ = Kokkos::create_mirror_view(tok_in_);
    tok_tgt_host_ = Kokkos::create_mirror_view(tok_tgt_);
    e_ = mat("train::embedded", D_);
    for (int l = 0; l <= L_; ++l) xs_.push_back(mat("train::residual", D_));
    for (int l = 0; l < L_; ++l) {
      ns_.push_back(mat("train::normed", D_));
      ys_.push_back(mat("train::moe_out", D_));
      inv_.push_back(view1("train::inv_rms", T_));
    }
    z_ = mat("train::final_normed", D_);
    inv_f_ = view1("train::final_inv_rms", T_);
    logits_ = mat("train::logits", V_);
    dlogits_ = mat("train::d_logits", V_);
    loss_t_ = view1("train::token_loss", T_);
    loss_host_ = Kokkos::create_mirror_view(loss_t_);
    dz_ = mat("train::d_final_normed", D_);
    dx_ = mat("train::d_residual", D_);
    dn_ = mat("train::d_normed", D_);
    if (Dl_ != D_)
      for (char const* n : {"train::moe_in_cols", "train::moe_out_cols"})
        cols_.push_back(mat(n, Dl_));
    de_ = mat("train::d_embedded", D_);
  }

  // ------------------------------------------------------------------ one step ----------------
  /// Layer l: ys_[l] = MoE(ns_[l]) (EP-TP: through this rank's D columns, outputs all-gathered).
  void moe_forward(Exec const& space, int l) {
    if (Dl_ == D_) {
      layers_[l]->forward(layer_view(ns_[l]), layer_view(ys_[l]));
      return;
    }
    moe::distributed::slice_dim(space, emb_group_->size(), emb_group_->rank(), ns_[l], cols_[0], 1);
    layers_[l]->forward(layer_view(cols_[0]), layer_view(cols_[1]));
    moe::distributed::gather_dim(space, *emb_group_, cols_[1], ys_[l], 1, nullptr, "");
  }
  /// Layer l's backward: dn_ from dx_ (EP-TP: through this rank's D columns, as moe_forward).
  void moe_backward(Exec const& space, int l) {
    if (Dl_ == D_) {
      layers_[l]->backward(layer_view(dx_), layer_view(dn_), grads_[l]);
      return;
    }
    moe::distributed::slice_dim(space, emb_group_->size(), emb_group_->rank(), dx_, cols_[0], 1);
    layers_[l]->backward(layer_view(cols_[0]), layer_view(cols_[1]), grads_[l]);
    moe::distributed::gather_dim(space, *emb_group_, cols_[1], dn_, 1, nullptr, "");
  }
  typename Layer::view3 layer_view(view2 const& v) const {
    return typename Layer::view3(v.data(), b_local_, S_, v.extent(1));
  }

  StepMetrics train_step(std::int64_t step) {
    double const t0 = now();
    Exec const space;
    // This rank's sequences: S + 1 tokens each, inputs [0, S) and targets [1, S].
    dataset_->fill(step, first_seq_, b_local_, S_ + 1, tokens_host_.data());
    for (std::int64_t b = 0; b < b_local_; ++b)
      for (std::int64_t p = 0; p < S_; ++p) {
        tok_in_host_(b * S_ + p) = tokens_host_[std::size_t(b * (S_ + 1) + p)];
        tok_tgt_host_(b * S_ + p) = tokens_host_[std::size_t(b * (S_ + 1) + p + 1)];
      }
    Kokkos::deep_copy(space, tok_in_, tok_in_host_);
    Kokkos::deep_copy(space, tok_tgt_, tok_tgt_host_);
    double const eps = cfg_.normalization_layer_epsilon;
    // Forward.
    Ops::embedding_forward(space, emb_, tok_in_, e_);
    Ops::mix_forward(space, mix_, e_, S_, xs_[0]);
    for (int l = 0; l < L_; ++l) {
      Ops::rms_forward(space, xs_[l], norm_[l], eps, ns_[l], inv_[l]);
      GemmClock::active = true;
      moe_forward(space, l);
      GemmClock::active = false;
      Kokkos::deep_copy(space, xs_[l + 1], xs_[l]);
      Ops::add_into(space, ys_[l], xs_[l + 1]);
    }
    Ops::rms_forward(space, xs_[L_], final_norm_, eps, z_, inv_f_);
    Ops::project(space, z_, out_w_, logits_);
    double const n_tokens = double(B_) * double(S_);
    Ops::cross_entropy(space, logits_, tok_tgt_, 1.0 / n_tokens, loss_t_, dlogits_);
    // Backward.
    Ops::project_backward(space, z_, out_w_, dlogits_, dz_, d_out_w_);
    Ops::rms_backward(space, xs_[L_], final_norm_, inv_f_, dz_, dx_, false, d_final_norm_);
    for (int l = L_ - 1; l >= 0; --l) {
      GemmClock::active = true;
      moe_backward(space, l);
      GemmClock::active = false;
      Ops::rms_backward(space, xs_[l], norm_[l], inv_[l], dn_, dx_, true, d_norm_[l]);
    }
    Ops::mix_backward(space, mix_, e_, dx_, S_, de_, d_mix_);
    Ops::embedding_backward(space, tok_in_, de_, d_emb_);
    // Replicated parameters: sum the gradients of the ranks that hold other sequences.
    moe::comm::all_reduce(*batch_comm_, space, dense_g_);
    // Loss: this rank's token losses in order, then summed over the batch axes.
    Kokkos::deep_copy(space, loss_host_, loss_t_);
    moe::detail::fence(space, "train::step: token losses");
    moe::View1<double, Kokkos::HostSpace> ce("train::ce_sum", 1);
    for (std::int64_t t = 0; t < T_; ++t) ce(0) += double(loss_host_(t));
    moe::comm::all_reduce(*batch_comm_, Kokkos::DefaultHostExecutionSpace(), ce);
    StepMetrics m;
    m.step = step;
    m.ce_loss = ce(0) / n_tokens;
    for (auto const& l : layers_) m.lb_loss += l->lb_loss();
    m.loss = m.ce_loss + m.lb_loss;
    m.perplexity = std::exp(m.ce_loss);
    // Global gradient norm: every block counted once (divided by the ranks holding it).
    moe::View1<double, Kokkos::HostSpace> sq("train::grad_norm_sq", 1);
    for (auto const& q : params_) {
      sq(0) += detail::sum_of_squares(space, q.g) / q.replicas;
    }
    moe::comm::all_reduce(comm_, Kokkos::DefaultHostExecutionSpace(), sq);
    m.grad_norm = std::sqrt(sq(0));
    double const clip = cfg_.gradient_clipping_threshold;
    double const scale = clip > 0 && m.grad_norm > clip ? clip / m.grad_norm : 1.0;
    m.learning_rate = learning_rate_at(cfg_, step);
    for (auto& q : params_) adamw(space, q, m.learning_rate, scale, step + 1);
    // The optimizer wrote the MoE weights through raw pointers: packed copies are stale.
    for (auto& l : layers_) l->weights_changed();
    // DeepSeek loss-free balancing: the layer's global bias update, after the optimizer step.
    for (auto& l : layers_) {
      auto const& u = l->bias_update();
      auto bias = l->parameters().gate_bias;
      if (u.empty() || !bias.data()) continue;
      auto h = Kokkos::create_mirror_view(bias);
      Kokkos::deep_copy(space, h, bias);
      moe::detail::fence(space, "train::bias_update: read");
      std::int64_t const off = l->block("gate_bias").offset[0];
      for (std::size_t e = 0; e < h.extent(0); ++e) h(e) += Scalar(u[std::size_t(off) + e]);
      Kokkos::deep_copy(space, bias, h);
    }
    moe::detail::fence(space, "train::step: done");
    m.seconds = now() - t0;
    m.tokens_per_s_per_device = tokens_per_device() / m.seconds;
    return m;
  }

  /// AdamW (decoupled weight decay, bias-corrected moments) on the clipped gradient.
  void adamw(Exec const& space, Param& q, double lr, double grad_scale, std::int64_t t) {
    detail::AdamW<Scalar> a;
    a.b1 = Scalar(cfg_.adam_b1);
    a.b2 = Scalar(cfg_.adam_b2);
    a.eps = Scalar(cfg_.adam_eps);
    a.rate = Scalar(lr);
    a.grad_scale = Scalar(grad_scale);
    a.decay = q.decay ? Scalar(cfg_.adam_weight_decay) : Scalar(0);
    a.c1 = Scalar(1.0 / (1.0 - std::pow(cfg_.adam_b1, double(t))));
    a.c2 = Scalar(1.0 / (1.0 - std::pow(cfg_.adam_b2, double(t))));
    detail::adamw_update(space, a, q.p, q.g, q.m, q.v);
  }

  // ------------------------------------------------------------------ checkpoints -------------
  // What a checkpoint of train_moe holds: every parameter and both AdamW moments, as blocks of the
  // global tensors (moe/io/checkpoint.hpp gathers them into global tensors and cuts them out).
  std::vector<moe::io::BlockRef> block_refs() {
    std::string const dt = std::is_same_v<Scalar, float> ? "F32" : "F64";
    std::vector<moe::io::BlockRef> refs;
    for (auto& q : params_) refs.push_back({"params." + q.name, q.block, dt, q.p_host.data()});
    for (auto& q : params_)
      refs.push_back({"opt_state.mu." + q.name, q.block, dt, q.m_host.data()});
    for (auto& q : params_)
      refs.push_back({"opt_state.nu." + q.name, q.block, dt, q.v_host.data()});
    return refs;
  }

  std::map<std::string, std::string> metadata(std::int64_t step) const {
    std::map<std::string, std::string> md;
    md["format"] = "train_moe/1";
    md["step"] = std::to_string(step);
    md["data_position"] = std::to_string(step);  // data of step s = f(seed, s, sequence)
    md["rng"] = "counter-based (seed, step, sequence index)";
    md["mesh"] = mesh_text(layers_[0]->mesh());
    md["ranks"] = std::to_string(P_);
    for (auto const& [k, v] : cfg_.architecture()) md["model." + k] = v;
    for (auto const& [k, v] : cfg_.run_identity(P_)) md["run." + k] = v;
    return md;
  }

  void save(std::int64_t step) {
    for (auto& q : params_) {
      Kokkos::deep_copy(q.p_host, q.p);
      Kokkos::deep_copy(q.m_host, q.m);
      Kokkos::deep_copy(q.v_host, q.v);
    }
    moe::io::save_checkpoint(comm_, cfg_.checkpoint_dir, step, block_refs(), metadata(step),
                             cfg_.checkpoint_keep);
    if (auto* o = out())
      *o << "saved checkpoint: step " << step << " in " << cfg_.checkpoint_dir << "\n";
  }

  /// Loads the latest checkpoint of checkpoint_dir (any layout); returns the step to start at.
  std::int64_t resume(TrainResult& res) {
    std::map<std::string, std::string> md;
    std::int64_t step = 0;
    if (!moe::io::load_latest_checkpoint(comm_, cfg_.checkpoint_dir, block_refs(), md, step)) {
      // Nothing loadable. Step directories that are there anyway belong to another model or are
      // damaged (the loader said why): training from scratch next to them would mix two runs.
      std::string found;
      if (rank_ == 0) {
        std::error_code ec;
        for (std::filesystem::directory_iterator it(cfg_.checkpoint_dir, ec), end; !ec && it != end;
             it.increment(ec)) {
          std::string const n = it->path().filename().string();
          if (n.size() > 5 && n.compare(0, 5, "step_") == 0 &&
              n.find_first_not_of("0123456789", 5) == std::string::npos)
            found += (found.empty() ? "" : ", ") + n;
        }
      }
      moe::comm::any_error(comm_, !found.empty(),
                           "checkpoint_dir='" + cfg_.checkpoint_dir + "' holds " + found +
                               " but none fits this model (see the messages above): use another "
                               "checkpoint_dir, or remove them to start from scratch",
                           moe::comm::ErrorKind::config);
      return 0;
    }
    // The same metadata on every rank: checks throw alike everywhere.
    std::string mismatch;
    if (md.count("format") == 0 || md.at("format") != "train_moe/1")
      mismatch = " (not a train_moe checkpoint)";
    for (auto const& [k, v] : cfg_.architecture()) {
      auto it = md.find("model." + k);
      if (it == md.end() || it->second != v)
        mismatch += " " + k + "=" + (it == md.end() ? std::string("?") : it->second) +
                    " (this run: " + v + ")";
    }
    moe::detail::require<moe::ConfigError>(
        mismatch.empty(), "checkpoint_dir='", cfg_.checkpoint_dir, "' holds step ", step,
        " of another model:", mismatch,
        "; use another checkpoint_dir or enable_checkpointing=false");
    // The checksums prove the bytes are the ones written, not that they are usable: every value
    // is checked before training on it (finite; second moments >= 0), on every rank's blocks.
    moe::comm::collective_guard(comm_, [&] {
      auto check = [&](auto const& v, std::string const& name, bool nonneg) {
        for (std::size_t i = 0; i < v.extent(0); ++i)
          if (!std::isfinite(double(v(i))) || (nonneg && v(i) < 0))
            throw moe::InputError(moe::detail::cat(
                "checkpoint step ", step, " in '", cfg_.checkpoint_dir, "': ", name, " holds ",
                double(v(i)), " at element ", i, " of this rank's block",
                nonneg ? ": second moments must be finite and >= 0"
                       : ": a checkpoint must hold finite values",
                "; use an earlier checkpoint or another checkpoint_dir"));
      };
      for (auto const& q : params_) {
        check(q.p_host, "params." + q.name, false);
        check(q.m_host, "opt_state.mu." + q.name, false);
        check(q.v_host, "opt_state.nu." + q.name, true);
      }
    });
    for (auto& q : params_) {
      Kokkos::deep_copy(q.p, q.p_host);
      Kokkos::deep_copy(q.m, q.m_host);
      Kokkos::deep_copy(q.v, q.v_host);
    }
    for (auto& l : layers_) l->weights_changed();  // written through raw pointers
    res.resumed = true;
    if (auto* o = out()) {
      *o << "resumed from checkpoint: step " << step << " in " << cfg_.checkpoint_dir
         << " (written on " << (md.count("mesh") ? md.at("mesh") : std::string("?")) << ")\n";
      std::string changed;
      for (auto const& [k, v] : cfg_.run_identity(P_)) {
        auto it = md.find("run." + k);
        if (it != md.end() && it->second != v) changed += " " + k + " " + it->second + " -> " + v;
      }
      if (!changed.empty())
        *o << "note: this run differs from the checkpoint's in" << changed
           << ": it continues the training, but not the same run\n";
    }
    return step;
  }

  // ------------------------------------------------------------------ reporting ---------------
  void open_metrics(std::int64_t start) {
    bool failed = false;
    std::string msg;
    if (rank_ == 0 && !cfg_.metrics_file.empty()) {
      // After a resume keep the lines of the steps before it (the steps after are run again).
      std::vector<std::string> keep;
      if (start > 0) {
        std::ifstream in(cfg_.metrics_file);
        std::string line;
        while (std::getline(in, line)) {
          auto const at = line.find("\"step\": ");
          if (at != std::string::npos && std::atoll(line.c_str() + at + 8) < start)
            keep.push_back(line);
        }
      }
      metrics_.open(cfg_.metrics_file, std::ios::trunc);
      failed = !metrics_;
      msg = "metrics_file='" + cfg_.metrics_file + "' cannot be written";
      for (auto const& l : keep) metrics_ << l << "\n";
    }
    moe::comm::any_error(comm_, failed, msg, moe::comm::ErrorKind::io);
  }

  void report(StepMetrics const& m) {
    if (rank_ != 0) return;
    if (metrics_.is_open()) {
      metrics_ << "{\"step\": " << m.step << ", \"loss\": " << json_number(m.loss)
               << ", \"ce_loss\": " << json_number(m.ce_loss)
               << ", \"lb_loss\": " << json_number(m.lb_loss)
               << ", \"perplexity\": " << json_number(m.perplexity)
               << ", \"seconds\": " << json_number(m.seconds)
               << ", \"tokens_per_s_per_device\": " << json_number(m.tokens_per_s_per_device)
               << ", \"entropy_rate\": " << json_number(dataset_->entropy_rate())
               << ", \"learning_rate\": " << json_number(m.learning_rate)
               << ", \"grad_norm\": " << json_number(m.grad_norm) << "}\n";
      metrics_.flush();
    }
    auto* o = out();
    if (!o || !(m.step % cfg_.log_period == 0 || m.step == cfg_.steps - 1)) return;
    *o << "completed step: " << m.step << ", seconds: " << fmt("%.3f", m.seconds)
       << ", tokens/s/device: " << fmt("%.1f", m.tokens_per_s_per_device)
       << ", loss: " << fmt("%.4f", m.loss) << ", perplexity: " << fmt("%.4f", m.perplexity) << "\n"
       << "  lb_loss: " << fmt("%.4f", m.lb_loss) << ", ce_loss: " << fmt("%.4f", m.ce_loss)
       << ", learning_rate: " << fmt("%.3g", m.learning_rate)
       << ", grad_norm: " << fmt("%.3f", m.grad_norm) << "\n";
    o->flush();
  }

  /// The yardstick of the step time: seconds of the routed-expert GEMMs of one device's share of
  /// a step, run alone, as on one rank: tokens_per_device x K rows spread evenly over all E
  /// experts, for every MoE layer the 3 GEMMs of the forward and the 6 of the backward
  /// (gmm/tgmm of ExpertFfn, the layers' Auto policy), on random data; median of 3 after a warm-up.
  /// Every rank measures at the same time, so each has the CPU share it had during the steps; the
  /// figure is rank 0's. Scratch of about 512 MB at most (one expert's worth if that is more): the
  /// experts are timed in chunks. Collective.
  double expert_gemm_seconds() {
    namespace mg = moe::gmm;
    auto const& lc = cfg_.layer;
    std::int64_t const E = lc.num_experts, D = D_, F = lc.base_moe_mlp_dim;
    std::int64_t const rows =
        std::int64_t(std::llround(tokens_per_device())) * lc.num_experts_per_tok;
    // Bounded memory: the experts are timed in chunks of Ec that fit kBudget bytes (weights,
    // their gradients and the chunk's activations); with balanced rows every chunk is the same
    // work, so one chunk is timed and scaled by E / Ec.
    constexpr double kBudget = 512.0 * 1024 * 1024;
    double const per_expert =
        double(sizeof(Scalar)) *
        (6.0 * double(D) * double(F) + 3.0 * double(rows) / double(E) * double(D + F));
    std::int64_t const Ec =
        std::max<std::int64_t>(1, std::min<std::int64_t>(E, std::int64_t(kBudget / per_expert)));
    std::int64_t const rows_c = std::max<std::int64_t>(1, (rows * Ec + E / 2) / E);
    std::vector<std::int64_t> sizes(std::size_t(Ec), rows_c / Ec);
    for (std::int64_t e = 0; e < rows_c % Ec; ++e) ++sizes[std::size_t(e)];
    auto const groups = mg::make_groups<typename Exec::memory_space>(sizes);
    using v2 = moe::View2<Scalar, typename Exec::memory_space>;
    using v3 = moe::View3<Scalar, typename Exec::memory_space>;
    v2 xs("train::yard::xs", rows_c, D), dys("train::yard::dys", rows_c, D),
        dxs("train::yard::dxs", rows_c, D);
    v2 h0("train::yard::h0", rows_c, F), h1("train::yard::h1", rows_c, F),
        a("train::yard::a", rows_c, F);
    v3 w0("train::yard::w0", Ec, D, F), w1("train::yard::w1", Ec, D, F),
        wo("train::yard::wo", Ec, F, D);
    v3 g0("train::yard::g0", Ec, D, F), g1("train::yard::g1", Ec, D, F),
        go("train::yard::go", Ec, F, D);
    Kokkos::Random_XorShift64_Pool<Exec> pool(std::uint64_t(cfg_.seed) + 1);
    for (auto const* v : {&xs, &dys}) Kokkos::fill_random(*v, pool, Scalar(-1), Scalar(1));
    for (auto const* v : {&h0, &h1, &a}) Kokkos::fill_random(*v, pool, Scalar(-1), Scalar(1));
    for (auto const* v : {&w0, &w1, &wo}) Kokkos::fill_random(*v, pool, Scalar(-0.1), Scalar(0.1));
    Exec space;
    mg::GmmOptions tr, tr_acc;
    tr.transpose_rhs = tr_acc.transpose_rhs = true;
    tr_acc.accumulate = true;
    auto one_layer = [&] {
      mg::gmm(space, mg::Auto{}, xs, w0, groups, h0);  // forward
      mg::gmm(space, mg::Auto{}, xs, w1, groups, h1);
      mg::gmm(space, mg::Auto{}, a, wo, groups, dxs);
      mg::tgmm(space, mg::Auto{}, a, dys, groups, go);  // backward
      mg::gmm(space, mg::Auto{}, dys, wo, groups, a, tr);
      mg::tgmm(space, mg::Auto{}, xs, a, groups, g0);
      mg::tgmm(space, mg::Auto{}, xs, h1, groups, g1);
      mg::gmm(space, mg::Auto{}, a, w0, groups, dxs, tr);
      mg::gmm(space, mg::Auto{}, h1, w1, groups, dxs, tr_acc);
    };
    std::vector<double> times;
    for (int r = 0; r < 4; ++r) {
      moe::comm::detail::check_mpi(MPI_Barrier(comm_.get()), "MPI_Barrier");
      double const t0 = now();
      for (int l = 0; l < L_; ++l) one_layer();
      moe::detail::fence(space, "train::expert_gemm_seconds");
      if (r > 0) times.push_back(now() - t0);  // r = 0 warms up (BLAS threads, first touch)
    }
    std::sort(times.begin(), times.end());
    moe::View1<double, Kokkos::HostSpace> t("train::yard::t", 1);
    t(0) = rank_ == 0 ? times[1] * double(E) / double(Ec) : 0.0;
    moe::comm::all_reduce(comm_, Kokkos::DefaultHostExecutionSpace(), t);
    return t(0);
  }

  void summary(TrainResult const& r) {
    auto* o = out();
    if (!o) return;
    auto pct = [](double f) { return std::isfinite(f) ? fmt("%.1f%%", 100 * f) : "n/a"; };
    if (r.history.empty()) {
      *o << "summary: nothing to train (start step " << r.start_step << ", steps " << cfg_.steps
         << ")\n";
      return;
    }
    *o << "summary: final loss " << fmt("%.4f", r.final_loss) << " (ce_loss "
       << fmt("%.4f", r.final_ce_loss) << ", lb_loss " << fmt("%.4f", r.final_lb_loss)
       << ") at step " << r.history.back().step << "\n";
    *o << "summary: entropy rate ";
    if (std::isfinite(r.entropy_rate))
      *o << fmt("%.4f", r.entropy_rate) << " nats/token, mean ce_loss of the last "
         << std::min<std::size_t>(10, r.history.size()) << " steps " << fmt("%.4f", r.tail_ce_loss)
         << ", gap " << fmt("%.1f%%", r.entropy_gap_percent) << "\n";
    else
      *o << "unknown (dataset " << dataset_->name() << ")\n";
    double const gemm = std::isfinite(r.gemm_fraction) ? r.gemm_fraction : 0;
    double const comm = std::isfinite(r.comm_fraction) ? r.comm_fraction : 0;
    *o << "summary: tokens/s/device " << fmt("%.1f", r.tokens_per_s_per_device)
       << "; step time: expert GEMMs " << pct(r.gemm_fraction) << ", communication "
       << pct(r.comm_fraction) << ", rest " << pct(1 - gemm - comm) << "\n";
    if (r.expert_gemm_seconds > 0)
      *o << "summary: step " << fmt("%.1f", 1e3 * r.step_seconds)
         << " ms; the expert GEMMs of one rank's share alone "
         << fmt("%.1f", 1e3 * r.expert_gemm_seconds) << " ms; ratio "
         << fmt("%.2f", r.step_seconds / r.expert_gemm_seconds) << "\n";
    *o << "summary: MoE layer bytes per step " << r.layer_bytes_per_step << " sent by rank 0, "
       << r.layer_bytes_per_step_all_ranks << " by all ranks (" << L_ << " layers, " << r.mesh
       << ")\n";
    *o << "summary: gemm kernels (rank 0) " << r.gemm_kernels << "\n";
    if (r.reference_runs_all_ranks > 0)
      *o << "warning: oneDNN ran a reference implementation " << r.reference_runs_all_ranks
         << " times over all ranks (each such rank named the shape on stderr)\n";
    if (!r.replicas_consistent)
      *o << "warning: ranks holding the same parameter block disagree bitwise\n";
    o->flush();
  }

  /// Collective: whether every parameter block is bitwise identical on the ranks that hold it.
  bool replicas_consistent() {
    std::vector<std::uint64_t> mine;
    for (auto& q : params_) {
      Kokkos::deep_copy(q.p_host, q.p);
      std::uint64_t key = fnv1a(q.name);
      key = fnv1a(q.block.offset.data(), q.block.offset.size() * sizeof(std::int64_t), key);
      mine.push_back(key);
      mine.push_back(fnv1a(q.p_host.data(), q.p_host.extent(0) * sizeof(Scalar)));
    }
    std::vector<std::uint64_t> all(mine.size() * std::size_t(P_));
    moe::comm::detail::check_mpi(
        MPI_Allgather(mine.data(), int(mine.size()), MPI_UINT64_T, all.data(), int(mine.size()),
                      MPI_UINT64_T, comm_.get()),
        "MPI_Allgather");
    std::map<std::uint64_t, std::uint64_t> seen;
    for (std::size_t i = 0; i < all.size(); i += 2) {
      auto [it, fresh] = seen.emplace(all[i], all[i + 1]);
      if (!fresh && it->second != all[i + 1]) return false;
    }
    return true;
  }

  moe::comm::Communicator const& comm_;
  TrainConfig cfg_;
  RunOptions opts_;
  int P_ = 1, rank_ = 0;
  std::int64_t B_ = 0, S_ = 0, D_ = 0, V_ = 0, C_ = 0, T_ = 0, b_local_ = 0, first_seq_ = 0;
  std::int64_t Dl_ = 0;  ///< columns of the layers' tokens (EP-TP: D / ep)
  std::unique_ptr<moe::comm::MeshComm> mesh_comm_;          // EP-TP only
  moe::distributed::AxisGroup const* emb_group_ = nullptr;  // the axes D is split over
  std::vector<view2> cols_;  // EP-TP: a layer's input and output columns
  int L_ = 0;
  std::unique_ptr<Dataset> dataset_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<params_type> grads_;
  std::unique_ptr<moe::comm::Communicator> batch_comm_;
  std::vector<Param> params_;
  view1 dense_p_, dense_g_, moments_m_, moments_v_;
  view2 emb_, d_emb_, mix_, d_mix_, out_w_, d_out_w_;
  std::vector<view1> norm_, d_norm_;
  view1 final_norm_, d_final_norm_;
  std::vector<std::int32_t> tokens_host_;
  moe::View1<std::int32_t> tok_in_, tok_tgt_;
  typename moe::View1<std::int32_t>::HostMirror tok_in_host_, tok_tgt_host_;
  view2 e_, z_, logits_, dlogits_, dz_, dx_, dn_, de_;
  std::vector<view2> xs_, ns_, ys_;
  std::vector<view1> inv_;
  view1 inv_f_, loss_t_;
  host1 loss_host_;
  std::ofstream metrics_;
};

}  // namespace detail

/// \brief Collective over `comm`: trains the model `cfg` describes and returns its metrics.
///
/// Every rank must pass the same configuration (checked). Configuration errors and errors on any
/// rank are raised as the same moe::Error on every rank (ConfigError for keys and values).
inline TrainResult run_training(moe::comm::Communicator const& comm, TrainConfig const& cfg,
                                RunOptions const& opts = {}) {
  moe::comm::check_agreement(comm, "train_moe configuration", cfg.describe());
  if (cfg.dataset_type == "text") {
    // Every rank reads dataset_path itself: the same path must hold the same bytes everywhere.
    std::ifstream in(cfg.dataset_path, std::ios::binary);
    std::string const bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    moe::comm::check_agreement(comm, "dataset_path file (its size and content hash)",
                               "dataset=" + std::to_string(bytes.size()) + " bytes, hash " +
                                   std::to_string(moe::detail::fnv1a(bytes)));
  }
  moe::io::CheckpointDirLock lock;  // one job per checkpoint_dir, held until training returns
  if (cfg.enable_checkpointing) lock = moe::io::CheckpointDirLock(comm, cfg.checkpoint_dir);
  if (cfg.dtype == "float64") return detail::Trainer<double>(comm, cfg, opts).run();
  return detail::Trainer<float>(comm, cfg, opts).run();
}

}  // namespace train
