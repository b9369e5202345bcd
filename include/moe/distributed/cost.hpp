#pragma once
/// \file
/// The cost model of a layer plan (README.md, "Cost model"): a roofline per stage of one rank on a
/// Machine (balanced routing): GEMMs, memory traffic, collectives over their links (rank r on node
/// r / ranks_per_node); summed, or max(compute + memory, communication) where overlapped.

#include <moe/distributed/plan.hpp>
#include <moe/error.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace moe::distributed {

/// \brief What the cost model knows of a machine: bandwidths in GB/s (10^9 B/s, one direction,
/// per rank), latencies in microseconds, throughputs in GFLOP/s per rank.
struct Machine {
  std::string name = "h100-ib";
  int ranks_per_node = 8;
  double intra_gbps = 360, inter_gbps = 45;
  double intra_latency_us = 3, inter_latency_us = 8;
  double gemm_gflops_fp32 = 50000, gemm_gflops_fp64 = 55000, gemm_gflops_bf16 = 700000;
  double memory_gbps = 3000;
  bool packs_weights = false;  ///< the GEMM backend repacks each changed weight (oneDNN)

  /// \brief A described machine: `h100-ib` (8 H100 SXM per node, NVLink 4, InfiniBand NDR) or
  /// `cpu-cluster` (two 48-core AVX-512 sockets per node, a rank per socket, HDR IB, oneDNN).
  static Machine preset(std::string const& name) {
    Machine m;
    if (name == "h100-ib") return m;
    if (name == "cpu-cluster") {  // each field by name: a positional list would shift silently
      m.name = name;
      m.ranks_per_node = 2;
      m.intra_gbps = 40;
      m.inter_gbps = 22;
      m.intra_latency_us = 1;
      m.inter_latency_us = 2;
      m.gemm_gflops_fp32 = 4000;
      m.gemm_gflops_fp64 = 2000;
      m.gemm_gflops_bf16 = 30000;
      m.memory_gbps = 250;
      m.packs_weights = true;
      return m;
    }
    throw ConfigError(
        moe::detail::cat("machine='", name, "' is not a described machine (h100-ib, cpu-cluster)"));
  }
  /// The keys set() takes, in order.
  static std::vector<std::string> keys() {
    std::vector<std::string> k{"ranks_per_node"};
    for (auto const& f : number_fields()) k.emplace_back(f.first);
    k.emplace_back("packs_weights");
    return k;
  }
  /// The fields set() takes as a number > 0, by key (in the order of keys() and the JSON).
  static std::vector<std::pair<char const*, double Machine::*>> number_fields() {
    return {{"intra_gbps", &Machine::intra_gbps},
            {"inter_gbps", &Machine::inter_gbps},
            {"intra_latency_us", &Machine::intra_latency_us},
            {"inter_latency_us", &Machine::inter_latency_us},
            {"gemm_gflops_fp32", &Machine::gemm_gflops_fp32},
            {"gemm_gflops_fp64", &Machine::gemm_gflops_fp64},
            {"gemm_gflops_bf16", &Machine::gemm_gflops_bf16},
            {"memory_gbps", &Machine::memory_gbps}};
  }
  /// Sets one field by its key (keys()); ConfigError naming a bad key or value.
  void set(std::string const& key, std::string const& value) {
    if (key == "packs_weights") {
      moe::detail::require<ConfigError>(value == "true" || value == "false",
                                        "machine.packs_weights='", value,
                                        "' must be true or false");
      packs_weights = value == "true";
      return;
    }
    double v = 0;
    std::size_t used = 0;
    try {
      v = std::stod(value, &used);
    } catch (std::exception const&) {
      used = 0;
    }
    moe::detail::require<ConfigError>(used == value.size() && used > 0 && v > 0 && v < 1e30,
                                      "machine.", key, "='", value, "' must be a number > 0");
    if (key == "ranks_per_node") {
      moe::detail::require<ConfigError>(v == double(int(v)), "machine.ranks_per_node='", value,
                                        "' must be an integer");
      ranks_per_node = int(v);
      return;
    }
    for (auto const& [name, field] : number_fields())
      if (key == name) {
        this->*field = v;
        return;
      }
    throw ConfigError(moe::detail::cat("machine.", key, " is not a machine key (",
                                       detail::join(keys(), ", "), ")"));
  }
  /// GEMM throughput for values of `value_bytes` bytes (2: bf16, 4: fp32, 8: fp64), GFLOP/s.
  double gemm_gflops(std::int64_t value_bytes) const {
    return value_bytes == 2   ? gemm_gflops_bf16
           : value_bytes == 8 ? gemm_gflops_fp64
                              : gemm_gflops_fp32;
  }
};

/// \brief The predicted cost of one stage of one rank.
struct StageCost {
  std::string region;  ///< the stage's profiling region
  bool backward = false;
  double flops = 0;              ///< GEMM FLOPs
  std::int64_t bytes_sent = 0;   ///< by its collectives
  std::int64_t bytes_moved = 0;  ///< workspace bytes it writes and reads back
  double compute_s = 0, memory_s = 0, comm_s = 0;
  double seconds = 0;  ///< predicted time of the stage
  bool overlapped = false;
};

/// \brief The predicted cost of one training step (forward + backward) of one rank.
struct StepCost {
  std::string to_text() const;             ///< the machine, one line per stage, the step
  moe::detail::ordered_json json() const;  ///< as JSON (`moe-shard --plan --json --machine`)

  Machine machine;
  std::vector<StageCost> stages;  ///< forward then backward, in order
  double seconds = 0;             ///< the step: the stages in sequence
  std::size_t dominant = 0;       ///< index of the slowest stage
  double flops = 0;
  std::int64_t bytes_sent = 0;
  double forward_seconds() const {
    double s = 0;
    for (auto const& c : stages)
      if (!c.backward) s += c.seconds;
    return s;
  }
};

namespace detail {

/// Seconds of one collective of this rank on `m` (see the file comment).
inline double collective_seconds(LayerPlan const& plan, PlannedCollective const& c,
                                 Machine const& m) {
  if (c.parts <= 1 || c.bytes == 0) return 0;
  auto const members = plan.layout.mesh.group_members(plan.layout.rank, c.axes);
  int const node = plan.layout.rank / m.ranks_per_node;
  std::int64_t same = 0;
  for (int r : members) same += r / m.ranks_per_node == node ? 1 : 0;
  std::int64_t const P = std::int64_t(members.size());
  bool const spans = same < P;
  double const steps = c.kind == "all-reduce" ? 2.0 * double(P - 1) : double(P - 1);
  double const lat = (spans ? m.inter_latency_us : m.intra_latency_us) * 1e-6 * steps;
  double const bytes = double(c.bytes);
  if (c.kind == "all-to-all" && spans) {
    // The share for peers on this node over its links, the rest over the network, concurrently.
    double const near = bytes * double(same - 1) / double(P - 1);
    return std::max(near / (m.intra_gbps * 1e9), (bytes - near) / (m.inter_gbps * 1e9)) + lat;
  }
  return bytes / ((spans ? m.inter_gbps : m.intra_gbps) * 1e9) + lat;
}

}  // namespace detail

/// \brief One training step's predicted cost on `machine` (`weights_updated`: weights changed).
inline StepCost estimate_step_cost(LayerPlan const& plan, Machine const& machine,
                                   bool weights_updated = true) {
  StepCost out;
  out.machine = machine;
  std::int64_t const s = std::int64_t(plan.scalar_bytes);
  // A weight's compute block: bytes, rebuilt every step (gathered or sliced), expert ([E, D, F]).
  struct ComputeWeight {
    std::int64_t bytes = 0;
    bool moved = false, expert = false;
  };
  auto weight = [&](std::uint8_t id) {
    auto const& t = plan.tensor(to_string(static_cast<Weight>(id)));
    return ComputeWeight{s * detail::product(t.compute_shape), t.compute_shape != t.local_shape,
                         t.compute_shape.size() == 3};
  };
  double const gemm = machine.gemm_gflops(s) * 1e9, mem = machine.memory_gbps * 1e9;
  for (auto const* phase : {&plan.step.forward, &plan.step.backward})
    for (auto const& st : *phase) {
      StageCost c{st.region, st.backward, st.flops, 0, 0, 0, 0, 0, 0, st.overlapped};
      for (auto const& col : st.collectives) {
        c.bytes_sent += col.bytes;
        c.comm_s += detail::collective_seconds(plan, col, machine);
        // A reduction reads each received element twice and writes it once.
        if (col.kind == "reduce-scatter" || col.kind == "all-reduce")
          c.bytes_moved += 3 * (col.kind == "all-reduce" ? col.bytes / 2 : col.bytes);
      }
      // Its buffers and the compute blocks it gathers or slices: written now, read once later.
      for (auto const& w : st.writes) {
        if (w.form == Ref::Form::compute)
          if (auto const cw = weight(w.id); cw.moved) c.bytes_moved += 2 * cw.bytes;
        if (w.form != Ref::Form::buffer) continue;
        if (auto const* d = plan.step.find(static_cast<Buf>(w.id)); d && d->dims.size() == 2)
          c.bytes_moved += 2 * d->dims[0].n * d->dims[1].n * elem_bytes(d->elem, s);
      }
      // A gradient reduction reads and lays out each compute-block gradient once.
      if (!st.collectives.empty())
        for (auto const& r : st.reads)
          if (r.form == Ref::Form::grad) c.bytes_moved += 2 * weight(r.id).bytes;
      // A grouped GEMM on new expert weights packs them first (read and written once).
      if (machine.packs_weights && !plan.step.dense && st.flops > 0)
        for (auto const& r : st.reads) {
          if (r.form != Ref::Form::compute) continue;
          auto const cw = weight(r.id);
          if (cw.expert && (weights_updated || cw.moved)) c.bytes_moved += 2 * cw.bytes;
        }
      c.compute_s = c.flops / gemm;
      c.memory_s = double(c.bytes_moved) / mem;
      c.seconds = c.overlapped ? std::max(c.compute_s + c.memory_s, c.comm_s)
                               : c.compute_s + c.memory_s + c.comm_s;
      out.flops += c.flops;
      out.bytes_sent += c.bytes_sent;
      out.seconds += c.seconds;
      out.stages.push_back(std::move(c));
    }
  for (std::size_t i = 1; i < out.stages.size(); ++i)
    if (out.stages[i].seconds > out.stages[out.dominant].seconds) out.dominant = i;
  return out;
}

inline std::string StepCost::to_text() const {
  auto fixed = [](char const* format, double v) {
    char b[32];
    std::snprintf(b, sizeof b, format, v);
    return std::string(b);
  };
  auto ms = [&](double s) { return fixed("%.3f", s * 1e3); };
  auto g = [&](double f) { return fixed("%.2f", f * 1e-9); };
  auto const& m = machine;
  std::string o = moe::detail::cat(
      "cost on ", m.name, " (", m.ranks_per_node, " ranks per node; links ", m.intra_gbps,
      " GB/s inside a node, ", m.inter_gbps, " GB/s between nodes, latency ", m.intra_latency_us,
      " / ", m.inter_latency_us, " us; GEMM ", m.gemm_gflops_fp32, " / ", m.gemm_gflops_fp64, " / ",
      m.gemm_gflops_bf16, " GFLOP/s fp32 / fp64 / bf16; memory ", m.memory_gbps, " GB/s",
      m.packs_weights ? "; GEMMs pack their weights" : "",
      "): predicted ms per stage (compute + memory + communication, max where overlapped)\n");
  for (std::size_t i = 0; i < stages.size(); ++i) {
    auto const& c = stages[i];
    o += moe::detail::cat("  ", c.backward ? "B " : "F ", detail::pad(c.region, 46), " ",
                          g(c.flops), " GFLOP  ", c.bytes_sent, " B sent  ", ms(c.seconds), " ms (",
                          ms(c.compute_s), " + ", ms(c.memory_s), " + ", ms(c.comm_s),
                          c.overlapped ? ", overlapped)" : ")",
                          i == dominant ? "  <- dominant" : "", "\n");
  }
  o += moe::detail::cat("  step ", ms(seconds), " ms (forward ", ms(forward_seconds()), "), ",
                        g(flops), " GFLOP, ", bytes_sent, " B sent; dominant stage ",
                        stages.empty() ? std::string("-") : stages[dominant].region, "\n");
  return o;
}

inline moe::detail::ordered_json StepCost::json() const {
  using moe::detail::ordered_json;
  auto const& m = machine;
  ordered_json o;
  auto& mj = o["machine"] = {{"name", m.name}, {"ranks_per_node", m.ranks_per_node}};
  for (auto const& [key, field] : Machine::number_fields()) mj[key] = m.*field;
  mj["packs_weights"] = m.packs_weights;
  auto& st = o["stages"] = ordered_json::array();
  for (auto const& c : stages)
    st.push_back({{"phase", c.backward ? "backward" : "forward"},
                  {"stage", c.region},
                  {"flops", c.flops},
                  {"bytes_sent", c.bytes_sent},
                  {"bytes_moved", c.bytes_moved},
                  {"compute_s", c.compute_s},
                  {"memory_s", c.memory_s},
                  {"comm_s", c.comm_s},
                  {"overlapped", c.overlapped},
                  {"seconds", c.seconds}});
  o["step_seconds"] = seconds;
  o["forward_seconds"] = forward_seconds();
  o["flops"] = flops;
  o["bytes_sent"] = bytes_sent;
  o["dominant_stage"] = stages.empty() ? std::string() : stages[dominant].region;
  return o;
}

}  // namespace moe::distributed

namespace moe {
using distributed::estimate_step_cost, distributed::Machine, distributed::StepCost;
}  // namespace moe
