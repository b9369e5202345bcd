#pragma once
// Blocks of global tensors for the command-line tools: cut this rank's block out of a global
// row-major tensor (take_block), write a block back (place_block), and assemble a global tensor on
// one rank from the blocks the ranks hold (gather_blocks, collective).

#include <moe/comm/communicator.hpp>
#include <moe/distributed/layer.hpp>
#include <moe/error.hpp>
#include <moe/tensor_block.hpp>

#include <moe/comm/mpi.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace moe::cli {

using moe::numel;  // elements of a row-major shape (moe/tensor_block.hpp)

namespace detail {

/// Calls f(global_index, local_index, run_length) for every contiguous run (the last dimension)
/// of block `b` in its row-major global tensor.
template <class F>
void for_each_run(TensorBlock const& b, F&& f) {
  std::size_t const r = b.local_shape.size();
  if (r == 0) {
    f(std::int64_t(0), std::int64_t(0), std::int64_t(1));
    return;
  }
  std::int64_t const run = b.local_shape[r - 1];
  std::int64_t const runs = run == 0 ? 0 : numel(b.local_shape) / run;
  std::vector<std::int64_t> c(r, 0);  // local index of the run's first element
  for (std::int64_t i = 0; i < runs; ++i) {
    std::int64_t g = 0;
    for (std::size_t d = 0; d < r; ++d) g = g * b.global_shape[d] + b.offset[d] + c[d];
    f(g, i * run, run);
    for (std::size_t d = r - 1; d-- > 0;) {  // odometer over the leading dims
      if (++c[d] < b.local_shape[d]) break;
      c[d] = 0;
    }
  }
}

inline std::string shape_text(std::vector<std::int64_t> const& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace detail

/// The block `b` of the row-major tensor `global` (of shape b.global_shape).
template <class T>
std::vector<T> take_block(std::vector<T> const& global, TensorBlock const& b) {
  moe::detail::require<ShapeError>(std::int64_t(global.size()) == numel(b.global_shape),
                                   "take_block: the tensor has ", global.size(),
                                   " elements but its shape ", detail::shape_text(b.global_shape),
                                   " needs ", numel(b.global_shape));
  std::vector<T> out(static_cast<std::size_t>(numel(b.local_shape)));
  detail::for_each_run(b, [&](std::int64_t g, std::int64_t l, std::int64_t n) {
    std::copy(global.begin() + g, global.begin() + g + n, out.begin() + l);
  });
  return out;
}

/// Writes `local` (the elements of block `b`) into the row-major tensor `global`.
template <class T>
void place_block(std::vector<T>& global, TensorBlock const& b, std::vector<T> const& local) {
  detail::for_each_run(b, [&](std::int64_t g, std::int64_t l, std::int64_t n) {
    std::copy(local.begin() + l, local.begin() + l + n, global.begin() + g);
  });
}

/// \brief Collective: assembles the global tensor of shape b.global_shape on `root` from the blocks
/// the ranks hold (`local` = this rank's block `b`, row-major).
///
/// Ranks that hold the same block (same offset) are expected to hold the same values; the lowest
/// such rank sends it, the others send nothing. The blocks must tile the tensor (disjoint, inside
/// it, covering it): otherwise every rank throws the same moe::Error. Returns the global tensor on
/// `root` and an empty vector elsewhere. Messages are at most 2^30 elements, so any size works.
template <class T>
std::vector<T> gather_blocks(comm::Communicator const& comm, TensorBlock const& b,
                             std::vector<T> const& local, std::string const& name, int root = 0) {
  int const P = comm.size(), me = comm.rank();
  std::size_t const r = b.global_shape.size();
  comm::any_error(comm,
                  b.local_shape.size() != r || b.offset.size() != r ||
                      std::int64_t(local.size()) != numel(b.local_shape),
                  moe::detail::cat("gather of ", name, ": this rank's block ",
                                   detail::shape_text(b.local_shape), " does not match its ",
                                   local.size(), " elements or the rank of the tensor"));
  // Every rank learns every block: [offset..., local_shape...] per rank.
  std::vector<std::int64_t> mine(b.offset);
  mine.insert(mine.end(), b.local_shape.begin(), b.local_shape.end());
  mine.push_back(std::int64_t(r));
  std::vector<std::int64_t> all(mine.size() * std::size_t(P));
  comm::check_mpi(MPI_Allgather(mine.data(), int(mine.size()), MPI_INT64_T, all.data(),
                                int(mine.size()), MPI_INT64_T, comm.get()),
                  "MPI_Allgather");
  auto block_of = [&](int q) {
    TensorBlock t;
    t.global_shape = b.global_shape;
    auto const* m = all.data() + std::size_t(q) * mine.size();
    t.offset.assign(m, m + r);
    t.local_shape.assign(m + r, m + 2 * r);
    return t;
  };
  // The owner of a block is the lowest rank holding it; the owned blocks must tile the tensor.
  // Every rank runs the same checks on the same data, so they all throw alike.
  std::vector<int> owner(static_cast<std::size_t>(P));
  std::vector<TensorBlock> owned;
  for (int q = 0; q < P; ++q) {
    auto const t = block_of(q);
    moe::detail::require<Error>(all[std::size_t(q) * mine.size() + 2 * r] == std::int64_t(r),
                                "gather of ", name, ": rank ", q, " holds a block of another rank");
    owner[q] = q;
    for (int p = 0; p < q; ++p)
      if (block_of(p).offset == t.offset) {
        owner[q] = p;
        moe::detail::require<Error>(block_of(p).local_shape == t.local_shape, "gather of ", name,
                                    ": ranks ", p, " and ", q,
                                    " hold blocks at the same offset with different shapes");
        break;
      }
    if (owner[q] != q) continue;
    for (std::size_t d = 0; d < r; ++d)
      moe::detail::require<Error>(t.offset[d] >= 0 && t.local_shape[d] >= 0 &&
                                      t.offset[d] + t.local_shape[d] <= t.global_shape[d],
                                  "gather of ", name, ": the block of rank ", q,
                                  " lies outside the tensor");
    for (auto const& o : owned) {
      bool overlap = numel(o.local_shape) > 0 && numel(t.local_shape) > 0;
      for (std::size_t d = 0; d < r && overlap; ++d)
        overlap = o.offset[d] < t.offset[d] + t.local_shape[d] &&
                  t.offset[d] < o.offset[d] + o.local_shape[d];
      moe::detail::require<Error>(!overlap, "gather of ", name, ": the block of rank ", q,
                                  " overlaps another block");
    }
    owned.push_back(t);
  }
  std::int64_t covered = 0;
  for (auto const& o : owned) covered += numel(o.local_shape);
  moe::detail::require<Error>(covered == numel(b.global_shape), "gather of ", name,
                              ": the ranks' blocks cover ", covered, " of ", numel(b.global_shape),
                              " elements");

  constexpr std::int64_t piece = std::int64_t(1) << 30;
  constexpr int tag = 0x6d72;
  MPI_Datatype const type = comm::mpi_type<T>();
  std::vector<T> global;
  if (me == root) {
    global.resize(std::size_t(numel(b.global_shape)));
    std::vector<T> buf;
    for (int q = 0; q < P; ++q) {
      if (owner[q] != q) continue;
      auto const t = block_of(q);
      if (q == me) {
        place_block(global, t, local);
        continue;
      }
      buf.resize(std::size_t(numel(t.local_shape)));
      for (std::int64_t at = 0; at < std::int64_t(buf.size()); at += piece) {
        int const n = int(std::min<std::int64_t>(piece, std::int64_t(buf.size()) - at));
        comm::check_mpi(MPI_Recv(buf.data() + at, n, type, q, tag, comm.get(), MPI_STATUS_IGNORE),
                        "MPI_Recv");
      }
      place_block(global, t, buf);
    }
  } else if (owner[me] == me) {
    for (std::int64_t at = 0; at < std::int64_t(local.size()); at += piece) {
      int const n = int(std::min<std::int64_t>(piece, std::int64_t(local.size()) - at));
      comm::check_mpi(MPI_Send(local.data() + at, n, type, root, tag, comm.get()), "MPI_Send");
    }
  }
  return global;
}

}  // namespace moe::cli
