// train_moe: trains a small MoE language model under mpirun (DESIGN.md section 7).
//
//   mpirun -np N train_moe [CFG.yml ...] [key=value ...]
//
// The configuration is examples/train_moe/default.yml (compiled in), then the CFG.yml files in
// order, then the key=value overrides (later wins), read as MaxText reads them
// (moe_maxtext_config.hpp): MaxText's base.yml and model files as they are, model_name=NAME for a
// published model's MoE shapes, the files' mesh_axes / logical_axis_rules as the layout's rules;
// MaxText keys train_moe does not use are summarised in one line on rank 0. Rank 0 prints one line
// per logged step,
//   completed step: N, seconds: S, tokens/s/device: R, loss: L, perplexity: P
// and a closing summary. Errors on any rank become the same one-line message on every rank and
// exit code 2.
//
// The share of step time spent in communication is measured here, through the MPI profiling
// interface: the MPI calls moe makes are wrapped and timed (PMPI_*).
#include "memory.hpp"
#include "train.hpp"

#include <moe_cli.hpp>
#include <moe_maxtext_config.hpp>
#include <train_moe_default_yml.hpp>

#include <yaml-cpp/yaml.h>
#include <moe/comm/mpi.hpp>

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace {

// ---- Time in MPI, and the collective watchdog (collective_timeout_s) ---------------------------
// The MPI calls moe makes are interposed below through MPI's profiling interface: each adds its
// wall time to g_mpi_seconds (the communication share of the step), and while one runs,
// g_mpi_since_ns / g_mpi_call say since when and which. The watchdog thread ends the process when
// one call has waited longer than collective_timeout_s: a rank that is stopped, dead or stuck
// leaves the others in a collective, and without it they would wait for ever, silently.
// Without MPI (MOE_ENABLE_MPI=0) there is one process and nothing to wait for.
double g_mpi_seconds = 0;
std::atomic<std::int64_t> g_step{-1};  // the step running (-1: before the first)

#if MOE_ENABLE_MPI
std::atomic<std::int64_t> g_mpi_since_ns{0};  // 0: not in an MPI call
std::atomic<char const*> g_mpi_call{""};

std::int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int g_mpi_depth = 0;

/// Adds the wall time of the outermost MPI call in its scope to g_mpi_seconds and shows it to
/// the watchdog.
struct MpiTimed {
  double t0 = 0;
  explicit MpiTimed(char const* call) {
    if (g_mpi_depth++ == 0) {
      t0 = PMPI_Wtime();
      g_mpi_call = call;
      g_mpi_since_ns = steady_ns();
    }
  }
  ~MpiTimed() {
    if (--g_mpi_depth == 0) {
      g_mpi_since_ns = 0;
      g_mpi_seconds += PMPI_Wtime() - t0;
    }
  }
  MpiTimed(MpiTimed const&) = delete;
  MpiTimed& operator=(MpiTimed const&) = delete;
};
#endif

#if MOE_ENABLE_MPI
/// The collective watchdog of one rank (collective_timeout_s): a thread that every timeout/10
/// (10 ms .. 1 s) looks at the MPI call this rank is in. One that has waited longer than the
/// limit ends the process with one line on stderr (which call, how long, which step, and which
/// ranks are not where this one waits) and train::kExitWatchdog; mpirun then ends the other
/// ranks, the stuck one included.
///
/// Naming the missing ranks needs a channel outside the collective that hangs: where MPI gives
/// MPI_THREAD_MULTIPLE, the thread owns a duplicate of the world communicator on which it
/// answers other ranks' questions (where it is: in which MPI call since when, at which step) and,
/// when its own wait runs out, asks every other rank and waits up to half the limit (0.5 .. 5 s)
/// for the answers. A stopped or dead rank does not answer; one computing (not in MPI) answers
/// so; one in another call or step answers which. Without MPI_THREAD_MULTIPLE the line says
/// "another rank is stopped, gone or stuck". Nothing is sent on the side channel unless a wait
/// has run out, so a healthy run pays one MPI_Iprobe per poll. The thread calls PMPI_ directly
/// (its calls are not the step's). Stopped and joined before MPI_Finalize (the destructor).
class Watchdog {
 public:
  Watchdog(double timeout_s, int rank, int size) : timeout_s_(timeout_s), rank_(rank), size_(size) {
    int level = MPI_THREAD_SINGLE;
    PMPI_Query_thread(&level);
    if (level == MPI_THREAD_MULTIPLE) {  // the same on every rank (one MPI library, one request)
      PMPI_Comm_dup(MPI_COMM_WORLD, &side_);
      PMPI_Comm_set_errhandler(side_, MPI_ERRORS_RETURN);  // a dead peer is an answer, not a crash
    }
    thread_ = std::thread([this] { loop(); });
  }
  ~Watchdog() {
    stop_ = true;
    thread_.join();
  }
  Watchdog(Watchdog const&) = delete;
  Watchdog& operator=(Watchdog const&) = delete;

 private:
  static constexpr int kAsk = 1, kAnswer = 2;
  /// Where a rank is: in `call` since `waited_ns` (0: not in an MPI call), at `step`.
  struct Where {
    std::int64_t step = -1, waited_ns = 0;
    char call[32] = {};
  };
  static Where here() {
    Where w;
    w.step = g_step.load();
    std::int64_t const since = g_mpi_since_ns.load();
    w.waited_ns = since == 0 ? 0 : std::max<std::int64_t>(1, steady_ns() - since);
    std::snprintf(w.call, sizeof w.call, "%s", g_mpi_call.load());
    return w;
  }
  /// Answers every question waiting on the side channel (blocking sends of a few bytes: eager).
  void answer() {
    for (;;) {
      int flag = 0;
      MPI_Status st;
      if (PMPI_Iprobe(MPI_ANY_SOURCE, kAsk, side_, &flag, &st) != MPI_SUCCESS || flag == 0) return;
      char none = 0;
      PMPI_Recv(&none, 0, MPI_BYTE, st.MPI_SOURCE, kAsk, side_, MPI_STATUS_IGNORE);
      Where const w = here();
      PMPI_Send(&w, int(sizeof w), MPI_BYTE, st.MPI_SOURCE, kAnswer, side_);
    }
  }
  /// Asks every other rank where it is; what this one waits in is `mine`. Returns the ranks that
  /// are elsewhere, e.g. "rank 1 gave no answer (stopped, gone or stuck outside MPI)".
  std::string ask(Where const& mine) {
    std::vector<MPI_Request> asks;
    char none = 0;
    for (int r = 0; r < size_; ++r)
      if (r != rank_) {
        asks.emplace_back();
        PMPI_Isend(&none, 0, MPI_BYTE, r, kAsk, side_, &asks.back());
      }
    std::vector<Where> where(static_cast<std::size_t>(size_));
    std::vector<char> answered(static_cast<std::size_t>(size_), 0);
    int missing = size_ - 1;
    auto const wait = std::clamp(timeout_s_ / 2, 0.5, 5.0);
    auto const until = steady_ns() + std::int64_t(wait * 1e9);
    while (missing > 0 && steady_ns() < until) {
      answer();  // the others ask too
      int flag = 0;
      MPI_Status st;
      if (PMPI_Iprobe(MPI_ANY_SOURCE, kAnswer, side_, &flag, &st) == MPI_SUCCESS && flag != 0) {
        auto const r = std::size_t(st.MPI_SOURCE);
        PMPI_Recv(&where[r], int(sizeof(Where)), MPI_BYTE, st.MPI_SOURCE, kAnswer, side_,
                  MPI_STATUS_IGNORE);
        where[r].call[sizeof where[r].call - 1] = 0;
        missing -= answered[r] == 0;
        answered[r] = 1;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    std::string out;
    int named = 0, more = 0;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      Where const& w = where[std::size_t(r)];
      std::string what;
      if (answered[std::size_t(r)] == 0)
        what = "gave no answer (stopped, gone or stuck outside MPI)";
      else if (w.waited_ns == 0)
        what = moe::detail::cat("is not in an MPI call (step ", w.step, ")");
      else if (w.step != mine.step || std::string(w.call) != mine.call)
        what = moe::detail::cat("waits in ", w.call, " (step ", w.step, ")");
      if (what.empty()) continue;
      if (named++ < 8)
        out += moe::detail::cat(out.empty() ? "" : ", ", "rank ", r, " ", what);
      else
        ++more;
    }
    if (more > 0) out += moe::detail::cat(" and ", more, " more");
    return out.empty()
               ? moe::detail::cat("every rank waits in ", mine.call, " (step ", mine.step, ")")
               : out;
  }
  void loop() {
    auto const limit = std::int64_t(std::min(timeout_s_, 1e9) * 1e9);  // 1e9 s: no limit
    auto const poll = std::chrono::milliseconds(
        std::clamp<std::int64_t>(std::int64_t(timeout_s_ * 100), 10, 1000));
    while (!stop_) {
      std::this_thread::sleep_for(poll);
      if (side_ != MPI_COMM_NULL) answer();
      Where const mine = here();
      if (mine.waited_ns < limit) continue;
      std::string const others = side_ != MPI_COMM_NULL
                                     ? ask(mine)
                                     : std::string("another rank is stopped, gone or stuck");
      char waited[32];
      std::snprintf(waited, sizeof waited, "%.1f", double(mine.waited_ns) * 1e-9);
      std::string const line = moe::detail::cat(
          "train_moe: rank ", rank_, ": waited ", waited, " s in ", mine.call, " (step ", mine.step,
          "), longer than collective_timeout_s=", timeout_s_, ": ", others,
          "; ending the job (exit code ", train::kExitWatchdog, ")\n");
      ssize_t const ignored = ::write(2, line.data(), line.size());
      (void)ignored;
      std::_Exit(train::kExitWatchdog);
    }
  }

  double timeout_s_;
  int rank_, size_;
  MPI_Comm side_ = MPI_COMM_NULL;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};
#endif

// ---- Preemption (save_on_signal) ---------------------------------------------------------------
// SIGTERM, SIGINT, SIGHUP and SIGUSR1 are blocked in main() before MPI_Init, so every thread
// (MPI's, OpenMP's, Kokkos') inherits the mask and none runs a handler; one thread of its own
// takes them with sigwait. No handler ever runs inside a compute kernel: oneDNN 2.6.3's sgemm
// kernels move the stack pointer into a heap workspace, where a handler's frame would land.
// The first signal that save_on_signal names asks the run to stop at the next step boundary
// (train.hpp agrees on it across the ranks and saves); a second one, or one it does not name,
// ends the process at once with exit code 128 + signal.
std::atomic<int> g_stop_signal{0};
std::atomic<unsigned> g_save_mask{~0u};  // bit s: signal s saves (all until the config is read)

void start_signal_watcher() {
  sigset_t set;
  sigemptyset(&set);
  for (int s : {SIGTERM, SIGINT, SIGHUP, SIGUSR1}) sigaddset(&set, s);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set] {
    for (;;) {
      int sig = 0;
      if (sigwait(&set, &sig) != 0) continue;
      int none = 0;
      if ((g_save_mask.load() >> sig & 1u) != 0 && g_stop_signal.compare_exchange_strong(none, sig))
        continue;
      char const msg[] = "train_moe: stopping at once on a signal (exit code 128 + signal)\n";
      ssize_t const ignored = ::write(2, msg, sizeof msg - 1);
      (void)ignored;
      std::_Exit(128 + sig);
    }
  }).detach();
}

}  // namespace

#if MOE_ENABLE_MPI
extern "C" {
int MPI_Allreduce(const void* s, void* r, int n, MPI_Datatype t, MPI_Op op, MPI_Comm c) {
  MpiTimed timed("MPI_Allreduce");
  return PMPI_Allreduce(s, r, n, t, op, c);
}
int MPI_Allgather(const void* s, int sn, MPI_Datatype st, void* r, int rn, MPI_Datatype rt,
                  MPI_Comm c) {
  MpiTimed timed("MPI_Allgather");
  return PMPI_Allgather(s, sn, st, r, rn, rt, c);
}
int MPI_Allgatherv(const void* s, int sn, MPI_Datatype st, void* r, const int rn[], const int rd[],
                   MPI_Datatype rt, MPI_Comm c) {
  MpiTimed timed("MPI_Allgatherv");
  return PMPI_Allgatherv(s, sn, st, r, rn, rd, rt, c);
}
int MPI_Alltoall(const void* s, int sn, MPI_Datatype st, void* r, int rn, MPI_Datatype rt,
                 MPI_Comm c) {
  MpiTimed timed("MPI_Alltoall");
  return PMPI_Alltoall(s, sn, st, r, rn, rt, c);
}
int MPI_Alltoallv(const void* s, const int sn[], const int sd[], MPI_Datatype st, void* r,
                  const int rn[], const int rd[], MPI_Datatype rt, MPI_Comm c) {
  MpiTimed timed("MPI_Alltoallv");
  return PMPI_Alltoallv(s, sn, sd, st, r, rn, rd, rt, c);
}
int MPI_Bcast(void* b, int n, MPI_Datatype t, int root, MPI_Comm c) {
  MpiTimed timed("MPI_Bcast");
  return PMPI_Bcast(b, n, t, root, c);
}
int MPI_Barrier(MPI_Comm c) {
  MpiTimed timed("MPI_Barrier");
  return PMPI_Barrier(c);
}
int MPI_Send(const void* b, int n, MPI_Datatype t, int dest, int tag, MPI_Comm c) {
  MpiTimed timed("MPI_Send");
  return PMPI_Send(b, n, t, dest, tag, c);
}
int MPI_Recv(void* b, int n, MPI_Datatype t, int src, int tag, MPI_Comm c, MPI_Status* st) {
  MpiTimed timed("MPI_Recv");
  return PMPI_Recv(b, n, t, src, tag, c, st);
}
int MPI_Isend(const void* b, int n, MPI_Datatype t, int dest, int tag, MPI_Comm c, MPI_Request* r) {
  MpiTimed timed("MPI_Isend");
  return PMPI_Isend(b, n, t, dest, tag, c, r);
}
int MPI_Irecv(void* b, int n, MPI_Datatype t, int src, int tag, MPI_Comm c, MPI_Request* r) {
  MpiTimed timed("MPI_Irecv");
  return PMPI_Irecv(b, n, t, src, tag, c, r);
}
int MPI_Wait(MPI_Request* r, MPI_Status* st) {
  MpiTimed timed("MPI_Wait");
  return PMPI_Wait(r, st);
}
int MPI_Waitall(int n, MPI_Request r[], MPI_Status st[]) {
  MpiTimed timed("MPI_Waitall");
  return PMPI_Waitall(n, r, st);
}
}
#endif

namespace {

char const* const kUsage =
    "usage: mpirun -np N train_moe [CFG.yml ...] [key=value ...]\n"
    "Trains a small MoE language model; the defaults (examples/train_moe/default.yml) are built\n"
    "in, the CFG.yml files (MaxText's base.yml and model files as they are) and the key=value\n"
    "overrides are applied after them, later wins. Keys: see the README\n"
    "(steps, per_device_batch_size, max_target_length, base_emb_dim, num_experts, dtype,\n"
    "weight_dtype, mu_dtype, ici_*_parallelism, dataset_type, enable_checkpointing,\n"
    "metrics_file, ...). dtype=bfloat16 (MaxText's default): the MoE layers compute in bf16,\n"
    "the rest of the model in float32.\n";

moe::cli::KeyValues parse_yaml_text(char const* text) {
  YAML::Node const root = YAML::Load(text);
  moe::cli::KeyValues kv;
  if (root.IsMap())
    for (auto const& it : root) {
      std::string const key = it.first.as<std::string>();
      kv.emplace_back(key, moe::cli::yaml_to_text(it.second, key));
    }
  return kv;
}

int run(int argc, char** argv, moe::comm::Communicator const& world) {
  train::TrainConfig cfg;
  moe::comm::collective_guard(world, [&] {
    std::vector<std::string> files;
    moe::cli::KeyValues overrides;
    for (int i = 1; i < argc; ++i) {
      std::string const a = argv[i];
      if (a.find('=') != std::string::npos)
        overrides.push_back(moe::cli::parse_override(a));
      else if (a.rfind("--", 0) == 0)
        throw moe::ConfigError(moe::detail::cat("unknown flag '", a, "'"));
      else
        files.push_back(a);  // the files are read in order, then the overrides (MaxText's)
    }
    cfg.apply(parse_yaml_text(train::kDefaultYaml));
    cfg.given.clear();  // only what the user gives counts as given
    auto const tool_has_key = [](std::string const& key) {
      return train::TrainConfig::table().find(key) != nullptr || moe::LayerConfig::has_key(key) ||
             moe::ParallelConfig::has_key(key);
    };
    auto const loaded =
        moe::cli::maxtext::load(files, overrides, tool_has_key, train::TrainConfig::all_keys());
    cfg.apply(loaded.apply);
    loaded.apply_sharding(cfg.par);
    cfg.validate();
    // Every path up front, before anything is computed or written.
    if (cfg.dataset_type == "text") moe::cli::require_input_file("dataset_path", cfg.dataset_path);
    if (cfg.enable_checkpointing)
      moe::cli::require_output_dir("checkpoint_dir", cfg.checkpoint_dir);
    if (!cfg.metrics_file.empty()) {
      std::vector<std::pair<std::string, std::string>> inputs = {
          {"dataset_path", cfg.dataset_path}};
      for (auto const& f : files) inputs.emplace_back("the config file", f);
      moe::cli::require_output_file("metrics_file", cfg.metrics_file, inputs);
    }
    moe::cli::maxtext::print_ignored(loaded, "train_moe", world.rank() == 0);
  });
  // Refuse what cannot run before the model is built: tensors past the kernels' index limits,
  // and an estimate (train::estimate_memory) above this rank's share of the node's available
  // memory (host memory spaces only; MOE_SKIP_MEMORY_CHECK=1 skips that comparison).
  moe::comm::collective_guard(world, [&] {
    using Exec = Kokkos::DefaultExecutionSpace;
    train::check_index_limits(cfg, world.size(), moe::IndexLimits::of<Exec>());
    if (moe::detail::runs_on_host<Exec>())
      train::require_fits(train::estimate_memory(cfg, world.size()), moe::available_memory_bytes(),
                          moe::applied_host_threads().local_ranks);
  });
  unsigned mask = 0;
  auto const signals = train::stop_signal_numbers(cfg.save_on_signal);  // validated above
  for (int sig : signals.value_or(std::vector<int>{})) mask |= 1u << sig;
  g_save_mask = mask;
#if MOE_ENABLE_MPI
  std::optional<Watchdog> watchdog;
  if (world.size() > 1 && cfg.collective_timeout_s > 0)
    watchdog.emplace(cfg.collective_timeout_s, world.rank(), world.size());
#endif
  train::RunOptions opts;
  opts.comm_seconds = [] { return g_mpi_seconds; };
  // Test hook of the watchdog: MOE_TRAIN_TEST_STALL=RANK:STEP makes that rank stop computing
  // for ever at the start of that step, outside MPI (a rank stuck in its own code).
  std::int64_t stall_step = -1;
  if (char const* stall = std::getenv("MOE_TRAIN_TEST_STALL")) {
    int r = -1;
    long long st = -1;
    if (std::sscanf(stall, "%d:%lld", &r, &st) == 2 && r == world.rank()) stall_step = st;
  }
  opts.on_step = [stall_step](std::int64_t step) {
    g_step = step;
    while (step == stall_step) std::this_thread::sleep_for(std::chrono::seconds(1));
  };
  opts.stop_signal = [] { return g_stop_signal.load(); };
  auto const r = train::run_training(world, cfg, opts);
  return r.stopped_by_signal != 0 ? train::kExitStoppedBySignal : 0;
}

}  // namespace

int main(int argc, char** argv) {
  start_signal_watcher();
  return moe::cli::tool_main(
      "train_moe", kUsage, argc, argv,
      [&] {
        moe::comm::Communicator world(MPI_COMM_WORLD);
        return run(argc, argv, world);
      },
      /*thread_multiple=*/true);
}
