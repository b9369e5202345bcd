#pragma once
// The model train_moe trains and its training step (see train.hpp for the model): Model<Scalar>
// builds the MoE layers, the parameters (its own replicated ones and the layers' blocks) and the
// activation buffers of one rank, and runs one optimizer step: data, forward, backward, gradient
// all-reduce, loss, clipping, AdamW and DeepSeek's bias update.

#include "config.hpp"
#include "data.hpp"
#include "gemm_time.hpp"
#include "metrics.hpp"
#include "model.hpp"
#include "optimizer.hpp"
#include "params.hpp"

#include <moe/comm/collectives.hpp>
#include <moe/comm/communicator.hpp>
#include <moe/distributed/layer.hpp>
#include <moe/threads.hpp>

#include <Kokkos_Core.hpp>

#include <cmath>
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <type_traits>
#include <vector>

namespace train::detail {

/// The line that stops a run at step `step` whose `what` is not finite.
inline std::string divergence_message(std::int64_t step, double learning_rate,
                                      std::string const& what) {
  return moe::detail::cat("step ", step, " (learning_rate ", learning_rate, ") diverged: ", what,
                          "; its update was not applied and nothing of it was saved; lower "
                          "learning_rate or gradient_clipping_threshold and resume from the last "
                          "checkpoint");
}

/// \brief One rank's share of the model, its parameters and buffers, and the training step.
template <class Scalar>
class Model {
 public:
  using Exec = Kokkos::DefaultExecutionSpace;
  using Layer = moe::DistributedMoeLayer<Scalar>;
  using Ops = ModelOps<Scalar, Exec>;
  using view1 = typename Ops::view1;
  using view2 = typename Ops::view2;
  using params_type = typename Layer::params_type;
  using host1 = typename view1::HostMirror;
  using Param = detail::Param<Scalar>;

  /// Collective: validates cfg, builds the dataset, layers, parameters (initialised) and
  /// buffers; `out` (rank 0's log, null elsewhere) gets the run's opening lines.
  Model(moe::comm::Communicator const& comm, TrainConfig const& cfg, std::ostream* out)
      : comm_(comm), cfg_(cfg), out_(out), P_(comm.size()), rank_(comm.rank()) {
    setup();
  }

  std::vector<Param>& params() { return params_; }
  std::vector<std::unique_ptr<Layer>> const& layers() const { return layers_; }
  Dataset const& dataset() const { return *dataset_; }
  std::int64_t global_batch() const { return B_; }
  int num_layers() const { return L_; }
  double tokens_per_device() const { return double(B_) * double(S_) / double(P_); }
  /// Bytes of the AdamW moments of this rank (bf16 moments: 2 an element).
  std::int64_t optimizer_state_bytes() const { return moments_.bytes(); }
  /// Tells the layers that their weights were written through raw pointers (packed copies are
  /// stale).
  void weights_changed() {
    for (auto& l : layers_) l->weights_changed();
  }

  /// Collective: optimizer step `step` (0-based); returns its metrics.
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
    m.learning_rate = learning_rate_at(cfg_, step);
    // The divergence guard (always on, check_finite or not): a step whose loss (here, agreed
    // over the ranks before the backward) or gradient norm (below) is not finite stops the run
    // before its update, so no checkpoint ever holds it.
    if (moe::comm::any_rank(comm_, !std::isfinite(m.loss)))
      diverged(m, std::isfinite(m.loss) ? "the loss is not finite on another rank"
                                        : moe::detail::cat("the loss is ", m.loss));
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
    m.grad_norm = global_grad_norm(space, comm_, params_);
    if (!std::isfinite(m.grad_norm))
      diverged(m, moe::detail::cat("the global gradient norm is ", m.grad_norm));
    double const clip = cfg_.gradient_clipping_threshold;
    double const scale = clip > 0 && m.grad_norm > clip ? clip / m.grad_norm : 1.0;
    adamw_step(space, cfg_, params_, m.learning_rate, scale, step + 1);
    // The optimizer wrote the MoE weights through raw pointers: packed copies are stale.
    weights_changed();
    // DeepSeek loss-free balancing: the layer's global bias update, after the optimizer step.
    for (auto& l : layers_) {
      auto const& u = l->bias_update();
      auto bias = l->parameters().gate_bias;
      if (u.empty() || !bias.data()) continue;
      auto h = Kokkos::create_mirror_view(bias);
      Kokkos::deep_copy(space, h, bias);
      moe::detail::fence(space, "train::bias_update: read");
      std::int64_t const off = l->block("gate_bias").offset[0];
      for (std::size_t e = 0; e < h.extent(0); ++e) {
        h(e) += Scalar(u[std::size_t(off) + e]);
        if (cfg_.bf16_weights()) h(e) = round_bf16(h(e));  // a parameter like the others
      }
      Kokkos::deep_copy(space, bias, h);
    }
    moe::detail::fence(space, "train::step: done");
    m.seconds = now() - t0;
    m.tokens_per_s_per_device = tokens_per_device() / m.seconds;
    return m;
  }

 private:
  /// Stops the run at a step that diverged (every rank calls it alike).
  [[noreturn]] static void diverged(StepMetrics const& m, std::string const& what) {
    throw moe::NumericError(divergence_message(
        m.step, m.learning_rate,
        moe::detail::cat(what, " (ce_loss ", m.ce_loss, ", lb_loss ", m.lb_loss, ")")));
  }

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
    if (auto* o = out_) {
      std::int64_t n = 0, moe_n = 0;
      for (auto const& p : params_) {
        n += numel(p.block.global_shape);
        if (p.name.find(".moe.") != std::string::npos) moe_n += numel(p.block.global_shape);
      }
      print_opening(*o, cfg_, P_, mesh_text(mesh), moe::to_string(layers_[0]->expert_route()), B_,
                    V_, n, moe_n, *dataset_);
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
    moments_ = Moments<Scalar>(cfg_, params_);
    for (auto& q : params_) {
      q.bf16_weights = cfg_.bf16_weights();
      q.p_host = Kokkos::create_mirror_view(q.p);
      initialise(q, cfg_.seed);
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

  moe::comm::Communicator const& comm_;
  TrainConfig cfg_;
  std::ostream* out_ = nullptr;  // rank 0's log (null elsewhere)
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
  view1 dense_p_, dense_g_;
  Moments<Scalar> moments_;
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
};

}  // namespace train::detail
