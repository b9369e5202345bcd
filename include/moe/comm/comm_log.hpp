#pragma once
/// \file
/// CommLog: the record of every collective a distributed step ran (what, which kind, over which
/// mesh axes, bytes this rank sent). Pure bookkeeping, no MPI: the distributed layer appends to
/// it and moe::make_plan predicts the same records from the configuration alone.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moe::comm {

/// \brief One collective a step ran: what, over which mesh axes, and the bytes this rank sent.
struct CommRecord {
  std::string what;               ///< e.g. "gather wi_0", "dispatch", "reduce-scatter d_wo"
  std::string kind;               ///< all-gather | reduce-scatter | all-reduce | all-to-all
  std::vector<std::string> axes;  ///< mesh axes of the group
  std::int64_t bytes = 0;         ///< bytes this rank sends
  bool backward = false;          ///< run by backward() (else by forward())
  std::string stage;              ///< the step-plan stage (its profiling region) that ran it
};

/// Sum of `bytes` over the records (CommRecord, or a plan's predicted ones) of one phase.
template <class Records>
std::int64_t phase_bytes(Records const& records, bool backward) {
  std::int64_t s = 0;
  for (auto const& r : records)
    if (r.backward == backward) s += r.bytes;
  return s;
}

/// \brief The records of one forward + backward step.
struct CommLog {
  std::vector<CommRecord> records;
  bool in_backward = false;  ///< phase that add() tags new records with
  std::string stage;         ///< stage that add() tags new records with ("" outside a step plan)
  void add(std::string what, std::string kind, std::vector<std::string> axes, std::int64_t bytes) {
    records.push_back(
        {std::move(what), std::move(kind), std::move(axes), bytes, in_backward, stage});
  }
  /// Bytes this rank sent in the forward (backward = false) or backward phase.
  std::int64_t bytes(bool backward) const { return phase_bytes(records, backward); }
  std::int64_t total_bytes() const { return bytes(false) + bytes(true); }
};

}  // namespace moe::comm
