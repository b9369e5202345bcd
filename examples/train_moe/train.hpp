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

#include "checkpointing.hpp"
#include "config.hpp"
#include "gemm_time.hpp"
#include "memory.hpp"
#include "metrics.hpp"
#include "step.hpp"

#include <moe/comm/collectives.hpp>
#include <moe/comm/communicator.hpp>
#include <moe/detail/hash.hpp>
#include <moe/io/checkpoint_lock.hpp>

#include <Kokkos_Core.hpp>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace train {

namespace detail {

/// dataset_type=text: "<bytes> bytes, hash <fnv1a>" of dataset_path's content ("" otherwise: the
/// keys define the data).
inline std::string dataset_hash(TrainConfig const& cfg) {
  if (cfg.dataset_type != "text") return "";
  std::ifstream in(cfg.dataset_path, std::ios::binary);
  std::string const bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return std::to_string(bytes.size()) + " bytes, hash " + std::to_string(moe::detail::fnv1a(bytes));
}

/// The training loop of one dtype: resume, steps, reports, checkpoints, the closing summary.
template <class Scalar>
class Trainer {
 public:
  /// data_hash: dataset_hash(cfg), already compared across the ranks.
  Trainer(moe::comm::Communicator const& comm, TrainConfig const& cfg, RunOptions const& opts,
          std::string data_hash)
      : comm_(comm),
        cfg_(cfg),
        opts_(opts),
        rank_(comm.rank()),
        resident_at_start_(resident_bytes()),
        model_(comm, cfg, rank_ == 0 ? opts.out : nullptr),
        data_hash_(std::move(data_hash)) {}

  TrainResult run() {
    TrainResult res;
    res.global_batch = model_.global_batch();
    res.mesh = mesh_text(model_.layers()[0]->mesh());
    res.entropy_rate = model_.dataset().entropy_rate();
    std::int64_t start = 0;
    if (cfg_.enable_checkpointing) {
      if (auto const step = detail::resume(comm_, cfg_, model_.params(), data_hash_, out())) {
        start = *step;
        res.resumed = true;
        model_.weights_changed();
      }
    }
    res.start_step = start;
    metrics_.open(comm_, cfg_.metrics_file, start);
    GemmClock::seconds = 0;
    bool const gemm_timed = GemmClock::install();
    double t_steps = 0, t_gemm = 0, t_comm = 0;
    std::int64_t timed = 0, bytes = 0;
    try {
      for (std::int64_t step = start; step < cfg_.steps; ++step) {
        if (opts_.on_step) opts_.on_step(step);
        double const g0 = GemmClock::seconds, c0 = comm_clock();
        StepMetrics m;
        try {
          m = model_.train_step(step);
        } catch (moe::InputError const& e) {
          // The layers' check_finite found a non-finite activation or gradient (collectively):
          // the same stop as the divergence guard's, with the step that caused it.
          throw moe::NumericError(divergence_message(step, learning_rate_at(cfg_, step), e.what()));
        }
        if (step > start || cfg_.steps - start == 1) {
          t_steps += m.seconds;
          t_gemm += GemmClock::seconds - g0;
          t_comm += comm_clock() - c0;
          ++timed;
        }
        bytes = 0;
        for (auto const& l : model_.layers()) bytes += l->comm_log().total_bytes();
        res.history.push_back(m);
        report(m);
        std::int64_t const done = step + 1;
        bool const periodic =
            cfg_.enable_checkpointing && (done % cfg_.checkpoint_period == 0 || done == cfg_.steps);
        if (periodic) detail::save(comm_, cfg_, model_.params(), res.mesh, done, data_hash_, out());
        auto const [sig, metrics_failed] = boundary();
        if (metrics_failed)  // rank 0 could not write metrics_file: every rank stops, with its
                             // message
          moe::comm::any_error(comm_, !metrics_.error().empty(), metrics_.error(),
                               moe::comm::ErrorKind::io);
        if (sig != 0 && done < cfg_.steps) {
          // Preemption: every rank stops after this same step, with a checkpoint of it.
          if (cfg_.enable_checkpointing && !periodic)
            detail::save(comm_, cfg_, model_.params(), res.mesh, done, data_hash_, out());
          res.stopped_by_signal = sig;
          res.stop_checkpoint = cfg_.enable_checkpointing ? done : -1;
          break;
        }
      }
    } catch (...) {
      GemmClock::uninstall();
      throw;
    }
    GemmClock::uninstall();
    if (!cfg_.export_bf16.empty() && res.stopped_by_signal == 0) {
      detail::export_bf16(comm_, model_.params(), cfg_.export_bf16);
      if (auto* o = out()) *o << "exported the parameters as BF16: " << cfg_.export_bf16 << "\n";
    }
    finish_losses(res);
    if (t_steps > 0) {
      double const tokens = model_.tokens_per_device();
      res.step_seconds = t_steps / double(timed);
      res.tokens_per_s_per_device = double(timed) * tokens / t_steps;
      res.gemm_fraction = gemm_timed ? t_gemm / t_steps : std::numeric_limits<double>::quiet_NaN();
      if (opts_.comm_seconds) res.comm_fraction = t_comm / t_steps;
      if (res.stopped_by_signal == 0) {  // a preempted run has no time for the yardstick
        auto const rows = std::int64_t(std::llround(tokens)) * cfg_.layer.num_experts_per_tok;
        res.expert_gemm_seconds = detail::expert_gemm_seconds<Scalar>(
            comm_, cfg_.layer, rows, model_.num_layers(), cfg_.seed);
      }
    }
    res.layer_bytes_per_step = bytes;
    moe::View1<std::int64_t, Kokkos::HostSpace> b("train::bytes", 1);
    b(0) = bytes;
    moe::comm::all_reduce(comm_, Kokkos::DefaultHostExecutionSpace(), b);
    res.layer_bytes_per_step_all_ranks = b(0);
    res.replicas_consistent = detail::replicas_consistent(comm_, model_.params());
    // The estimate train_moe checked before allocating, beside what the ranks used at most.
    res.memory_estimate_bytes = estimate_memory(cfg_, comm_.size()).total();
    std::int64_t const peak = peak_resident_bytes();
    std::int64_t const mine[2] = {peak, peak - resident_at_start_};
    std::int64_t most[2] = {0, 0};
    moe::comm::check_mpi(MPI_Allreduce(mine, most, 2, MPI_INT64_T, MPI_MAX, comm_.get()),
                         "MPI_Allreduce");
    res.peak_resident_bytes = most[0];
    res.peak_above_start_bytes = most[1];
    auto const kernels = moe::gmm::onednn_stats();
    res.gemm_kernels = kernels.summary();
    if (kernels.reference_runs > 0)
      std::cerr << "train_moe: rank " << rank_ << ": " << kernels.warning() << std::endl;
    b(0) = std::int64_t(kernels.reference_runs);
    moe::comm::all_reduce(comm_, Kokkos::DefaultHostExecutionSpace(), b);
    res.reference_runs_all_ranks = b(0);
    if (auto* o = out())
      print_summary(*o, res, cfg_.steps, model_.dataset().name(), model_.num_layers());
    if (auto* o = out(); o && res.stopped_by_signal != 0) {
      *o << "train_moe: stopped by " << signal_name(res.stopped_by_signal) << " after step "
         << res.history.back().step << ": ";
      if (res.stop_checkpoint >= 0)
        *o << "saved checkpoint step " << res.stop_checkpoint << " in " << cfg_.checkpoint_dir
           << "; the same command resumes it";
      else
        *o << "enable_checkpointing=false, nothing saved";
      *o << " (exit code " << kExitStoppedBySignal << ")\n";
      o->flush();
    }
    return res;
  }

 private:
  std::ostream* out() const { return rank_ == 0 ? opts_.out : nullptr; }
  double comm_clock() const { return opts_.comm_seconds ? opts_.comm_seconds() : 0.0; }
  /// Collective, once per step: the largest save_on_signal signal number any rank has received
  /// (0: none), and whether rank 0 failed to write metrics_file (one MPI_Allreduce).
  std::pair<int, bool> boundary() const {
    int const mine[2] = {opts_.stop_signal ? opts_.stop_signal() : 0,
                         metrics_.error().empty() ? 0 : 1};
    int any[2] = {0, 0};
    moe::comm::check_mpi(MPI_Allreduce(mine, any, 2, MPI_INT, MPI_MAX, comm_.get()),
                         "MPI_Allreduce");
    return {any[0], any[1] != 0};
  }

  void report(StepMetrics const& m) {
    if (rank_ != 0) return;
    metrics_.write(m, model_.dataset().entropy_rate());
    if (auto* o = out(); o && (m.step % cfg_.log_period == 0 || m.step == cfg_.steps - 1))
      print_step(*o, m);
  }

  moe::comm::Communicator const& comm_;
  TrainConfig cfg_;
  RunOptions opts_;
  int rank_ = 0;
  std::int64_t resident_at_start_ = 0;  ///< resident_bytes() before the model was built
  Model<Scalar> model_;
  MetricsFile metrics_;
  std::string data_hash_;  ///< dataset_type=text: the file's size and content hash
};

}  // namespace detail

/// \brief Collective over `comm`: trains the model `cfg` describes and returns its metrics.
///
/// Every rank must pass the same configuration (checked). Configuration errors and errors on any
/// rank are raised as the same moe::Error on every rank (ConfigError for keys and values).
inline TrainResult run_training(moe::comm::Communicator const& comm, TrainConfig const& cfg,
                                RunOptions const& opts = {}) {
  moe::comm::check_agreement(comm, "train_moe configuration", cfg.describe());
  std::string const data_hash = detail::dataset_hash(cfg);
  if (!data_hash.empty())  // every rank reads the file: the same path must hold the same bytes
    moe::comm::check_agreement(comm, "dataset_path file (its size and content hash)",
                               "dataset=" + data_hash);
  moe::io::CheckpointDirLock lock;  // one job per checkpoint_dir, held until training returns
  if (cfg.enable_checkpointing) lock = moe::io::CheckpointDirLock(comm, cfg.checkpoint_dir);
  if (cfg.dtype == "float64") return detail::Trainer<double>(comm, cfg, opts, data_hash).run();
  return detail::Trainer<float>(comm, cfg, opts, data_hash).run();
}

}  // namespace train
