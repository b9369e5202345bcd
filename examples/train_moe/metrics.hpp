#pragma once
// What train_moe reports: the metrics of one step and of a run (StepMetrics, TrainResult), rank
// 0's progress lines and closing summary, and the metrics_file (one JSON object per step).

#include "config.hpp"
#include "data.hpp"

#include <moe/comm/collectives.hpp>
#include <moe/comm/communicator.hpp>
#include <moe/sharding/mesh.hpp>
#include <moe/threads.hpp>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
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
  /// a step run alone (see expert_gemm_seconds in gemm_time.hpp); 0 when nothing was timed.
  double expert_gemm_seconds = 0;
  std::int64_t memory_estimate_bytes = 0;   ///< train::estimate_memory's total for one rank
  std::int64_t peak_resident_bytes = 0;     ///< the largest peak resident set over the ranks
  std::int64_t peak_above_start_bytes = 0;  ///< the largest over the ranks of their peak
                                            ///< resident set less what they held at the start
  std::int64_t layer_bytes_per_step = 0;    ///< MoE layers' comm log, this rank
  std::int64_t layer_bytes_per_step_all_ranks = 0;  ///< summed over ranks
  bool replicas_consistent = true;  ///< ranks holding the same parameter block agree bitwise
  /// What oneDNN ran on rank 0 (moe::gmm::OneDnnStats::summary(): ISA, executions per kernel).
  std::string gemm_kernels;
  /// Executions of a oneDNN reference implementation, summed over ranks (0; a rank that ran one
  /// also writes its warning, naming the shape, to stderr).
  std::int64_t reference_runs_all_ranks = 0;
  /// The signal that stopped the run at a step boundary (0: it ran to `steps`).
  int stopped_by_signal = 0;
  /// The step of the checkpoint written when it stopped (-1: none, checkpointing off).
  std::int64_t stop_checkpoint = -1;
};

/// train_moe's exit code after a stop by save_on_signal (sysexits' EX_TEMPFAIL: requeue the job
/// and it resumes from the checkpoint it saved).
constexpr int kExitStoppedBySignal = 75;
/// train_moe's exit code when its watchdog ends a rank that waited in one MPI call longer than
/// collective_timeout_s (that of timeout(1)).
constexpr int kExitWatchdog = 124;

/// \brief Options of run_training that are not part of the configuration.
struct RunOptions {
  std::ostream* out = &std::cout;  ///< rank 0's progress log (nullptr: silent)
  /// Seconds spent in MPI so far on this rank (train_moe's main measures them through the MPI
  /// profiling interface); empty: the communication share of the step time is not reported.
  std::function<double()> comm_seconds;
  /// The save_on_signal signal this rank has received so far (0: none); empty: never stops. Read
  /// at every step boundary and agreed over the ranks (a signal may reach only some of them).
  std::function<int()> stop_signal;
  /// Called with each step's number before the step runs (train_moe's watchdog names it).
  std::function<void(std::int64_t)> on_step;
};

namespace detail {

inline double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

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

/// The calling process's resident set now (/proc/self/statm; 0 where it cannot be read).
inline std::int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::int64_t pages = 0, resident = 0;
  if (!(statm >> pages >> resident)) return 0;
  return resident * std::int64_t(::sysconf(_SC_PAGESIZE));
}

/// The calling process's peak resident set so far (getrusage; 0 where it fails).
inline std::int64_t peak_resident_bytes() {
  rusage use{};
  return ::getrusage(RUSAGE_SELF, &use) == 0 ? std::int64_t(use.ru_maxrss) * 1024 : 0;
}

inline std::string json_number(double v) {
  return std::isfinite(v) ? fmt("%.17g", v) : std::string("null");
}

/// The losses of the run's last step and the mean ce_loss of its last 10 steps.
inline void finish_losses(TrainResult& res) {
  if (res.history.empty()) return;
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

/// \brief Rank 0's metrics_file: one JSON object per step. Other ranks and an empty path write
/// nothing. The file is opened without blocking (a FIFO or device that appeared after the
/// up-front path check is refused, never waited on), locked for the job (a second job writing
/// the same file is refused) and every write is checked: a failed write (ENOSPC, EIO, EFBIG)
/// stops the run with an IoError naming the file, on every rank (see Trainer's step boundary).
class MetricsFile {
 public:
  MetricsFile() = default;
  MetricsFile(MetricsFile const&) = delete;
  MetricsFile& operator=(MetricsFile const&) = delete;
  ~MetricsFile() {
    if (fd_ >= 0) ::close(fd_);
  }

  /// Collective: opens `path` on rank 0 (truncating it; after a resume at step `start > 0` the
  /// lines of the steps before `start` are kept, the steps after are run again); a failure is
  /// the same moe::IoError on every rank.
  void open(moe::comm::Communicator const& comm, std::string const& path, std::int64_t start) {
    path_ = path;
    std::string error;
    if (comm.rank() == 0 && !path.empty()) error = open_locked(start);
    moe::comm::any_error(comm, !error.empty(), error, moe::comm::ErrorKind::io);
  }

  /// Appends step m (entropy_rate: the dataset's, written with every step). A failed write is
  /// kept in error() (the file is not written again), not thrown: rank 0 alone writes.
  void write(StepMetrics const& m, double entropy_rate) {
    if (fd_ < 0 || !error_.empty()) return;
    std::string const line =
        "{\"step\": " + std::to_string(m.step) + ", \"loss\": " + json_number(m.loss) +
        ", \"ce_loss\": " + json_number(m.ce_loss) + ", \"lb_loss\": " + json_number(m.lb_loss) +
        ", \"perplexity\": " + json_number(m.perplexity) +
        ", \"seconds\": " + json_number(m.seconds) +
        ", \"tokens_per_s_per_device\": " + json_number(m.tokens_per_s_per_device) +
        ", \"entropy_rate\": " + json_number(entropy_rate) +
        ", \"learning_rate\": " + json_number(m.learning_rate) +
        ", \"grad_norm\": " + json_number(m.grad_norm) + "}\n";
    error_ = append(line, m.step);
  }

  /// Why writing stopped ("" while every write succeeded).
  std::string const& error() const { return error_; }

 private:
  std::string open_locked(std::int64_t start) {
    auto fail = [&](char const* what) {
      std::string const e = "metrics_file='" + path_ + "' " + what + ": " + std::strerror(errno);
      if (fd_ >= 0) ::close(fd_);
      fd_ = -1;
      return e;
    };
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_NONBLOCK | O_CLOEXEC, 0666);
    if (fd_ < 0) return fail("cannot be opened for writing");
    struct stat st {};
    if (::fstat(fd_, &st) != 0) return fail("cannot be examined");
    if (!S_ISREG(st.st_mode)) {
      errno = EINVAL;
      return fail("is not a regular file (a FIFO, device or socket)");
    }
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK) return fail("cannot be locked");
      ::close(fd_);
      fd_ = -1;
      return "metrics_file='" + path_ +
             "' is being written by another job (it holds the file's lock): give this run "
             "another metrics_file";
    }
    // After a resume keep the lines of the steps before it (the steps after are run again).
    std::string keep;
    if (start > 0) {
      std::ifstream in(path_);
      std::string line;
      while (std::getline(in, line)) {
        auto const at = line.find("\"step\": ");
        if (at != std::string::npos && std::atoll(line.c_str() + at + 8) < start)
          keep += line + "\n";
      }
    }
    if (::ftruncate(fd_, 0) != 0) return fail("cannot be truncated");
    if (::fcntl(fd_, F_SETFL, 0) != 0) return fail("cannot be set to blocking writes");
    std::string const e = append(keep, start);
    if (!e.empty()) {
      ::close(fd_);
      fd_ = -1;
    }
    return e;
  }

  /// Writes all of `text` (the line of `step`); the error message if a write fails.
  std::string append(std::string const& text, std::int64_t step) {
    std::size_t done = 0;
    while (done < text.size()) {
      ssize_t const n = ::write(fd_, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        return "metrics_file='" + path_ + "': writing step " + std::to_string(step) +
               " failed: " + std::strerror(n < 0 ? errno : EIO) +
               "; free space or raise the file size limit, or unset metrics_file";
      done += std::size_t(n);
    }
    return "";
  }

  std::string path_;
  int fd_ = -1;
  std::string error_;
};

/// "float32", or for dtype=bfloat16 and bf16 storage what is bf16 and what float32 (the opening
/// line of a run).
inline std::string precision_text(TrainConfig const& c) {
  if (c.dtype != "bfloat16" && !c.bf16_mu()) return c.dtype;
  std::string s = c.dtype == "bfloat16" ? "bfloat16 MoE layers (the rest float32)" : c.dtype;
  s += ", weights " + c.weight_dtype + ", AdamW mu " + c.mu_storage() + " nu " +
       (c.bf16_nu() ? "bfloat16" : "float32");
  return s;
}

/// Rank 0's opening lines: ranks, mesh, route, batch and precision; the model (n parameters,
/// moe_n of them in MoE layers); the GEMM backend; the dataset.
inline void print_opening(std::ostream& o, TrainConfig const& c, int ranks, std::string const& mesh,
                          std::string const& route, std::int64_t batch, std::int64_t vocab,
                          std::int64_t n, std::int64_t moe_n, Dataset const& data) {
  auto const& l = c.layer;
  o << "train_moe: " << ranks << " rank" << (ranks > 1 ? "s" : "") << ", mesh " << mesh
    << ", experts via " << route << ", global batch " << batch << " x " << c.max_target_length
    << " tokens, " << precision_text(c) << "\n"
    << "model: vocab " << vocab << ", emb " << l.base_emb_dim << ", " << c.base_num_decoder_layers
    << " MoE layers (" << l.num_experts << " experts of " << l.base_moe_mlp_dim << ", top-"
    << l.num_experts_per_tok << ", " << l.shared_experts << " shared), context " << c.context_length
    << ": " << n << " parameters (" << moe_n << " in MoE)\n"
    << moe::describe_gemm() << "\n";
  o << "dataset: " << data.name() << ", entropy rate: ";
  if (std::isfinite(data.entropy_rate()))
    o << fmt("%.4f", data.entropy_rate()) << " nats/token\n";
  else
    o << "unknown\n";
  o.flush();
}

/// The two progress lines of a logged step.
inline void print_step(std::ostream& o, StepMetrics const& m) {
  o << "completed step: " << m.step << ", seconds: " << fmt("%.3f", m.seconds)
    << ", tokens/s/device: " << fmt("%.1f", m.tokens_per_s_per_device)
    << ", loss: " << fmt("%.4f", m.loss) << ", perplexity: " << fmt("%.4f", m.perplexity) << "\n"
    << "  lb_loss: " << fmt("%.4f", m.lb_loss) << ", ce_loss: " << fmt("%.4f", m.ce_loss)
    << ", learning_rate: " << fmt("%.3g", m.learning_rate)
    << ", grad_norm: " << fmt("%.3f", m.grad_norm) << "\n";
  o.flush();
}

/// The closing "summary:" lines of a run (steps: the configured count; dataset: its name;
/// layers: the MoE layers).
inline void print_summary(std::ostream& o, TrainResult const& r, std::int64_t steps,
                          std::string const& dataset, int layers) {
  auto pct = [](double f) { return std::isfinite(f) ? fmt("%.1f%%", 100 * f) : "n/a"; };
  if (r.history.empty()) {
    o << "summary: nothing to train (start step " << r.start_step << ", steps " << steps << ")\n";
    return;
  }
  o << "summary: final loss " << fmt("%.4f", r.final_loss) << " (ce_loss "
    << fmt("%.4f", r.final_ce_loss) << ", lb_loss " << fmt("%.4f", r.final_lb_loss) << ") at step "
    << r.history.back().step << "\n";
  o << "summary: entropy rate ";
  if (std::isfinite(r.entropy_rate))
    o << fmt("%.4f", r.entropy_rate) << " nats/token, mean ce_loss of the last "
      << std::min<std::size_t>(10, r.history.size()) << " steps " << fmt("%.4f", r.tail_ce_loss)
      << ", gap " << fmt("%.1f%%", r.entropy_gap_percent) << "\n";
  else
    o << "unknown (dataset " << dataset << ")\n";
  double const gemm = std::isfinite(r.gemm_fraction) ? r.gemm_fraction : 0;
  double const comm = std::isfinite(r.comm_fraction) ? r.comm_fraction : 0;
  o << "summary: tokens/s/device " << fmt("%.1f", r.tokens_per_s_per_device)
    << "; step time: expert GEMMs " << pct(r.gemm_fraction) << ", communication "
    << pct(r.comm_fraction) << ", rest " << pct(1 - gemm - comm) << "\n";
  if (r.expert_gemm_seconds > 0)
    o << "summary: step " << fmt("%.1f", 1e3 * r.step_seconds)
      << " ms; the expert GEMMs of one rank's share alone "
      << fmt("%.1f", 1e3 * r.expert_gemm_seconds) << " ms; ratio "
      << fmt("%.2f", r.step_seconds / r.expert_gemm_seconds) << "\n";
  if (r.peak_resident_bytes > 0) {
    auto gib = [](std::int64_t b) {
      return fmt("%.3f", double(b) / double(std::int64_t(1) << 30));
    };
    o << "summary: memory per rank: estimate " << gib(r.memory_estimate_bytes)
      << " GiB; peak resident set " << gib(r.peak_resident_bytes) << " GiB, "
      << gib(r.peak_above_start_bytes) << " GiB above the start (largest over the ranks)\n";
  }
  o << "summary: MoE layer bytes per step " << r.layer_bytes_per_step << " sent by rank 0, "
    << r.layer_bytes_per_step_all_ranks << " by all ranks (" << layers << " layers, " << r.mesh
    << ")\n";
  o << "summary: gemm kernels (rank 0) " << r.gemm_kernels << "\n";
  if (r.reference_runs_all_ranks > 0)
    o << "warning: oneDNN ran a reference implementation " << r.reference_runs_all_ranks
      << " times over all ranks (each such rank named the shape on stderr)\n";
  if (!r.replicas_consistent)
    o << "warning: ranks holding the same parameter block disagree bitwise\n";
  o.flush();
}

}  // namespace detail
}  // namespace train
