// Tests of moe/io/checkpoint.hpp across ranks: blocks split over (and copied on)
// several ranks round-trip, a checkpoint saved with one blocking loads into another (and on another
// number of ranks), and errors are the same exception on every rank, a directory locked by another
// process included.
#include <moe/comm/detail/exchange.hpp>
#include <moe/io/checkpoint.hpp>

#include <gtest/gtest.h>
#include <moe/comm/mpi.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <unistd.h>

namespace fs = std::filesystem;
using moe::io::BlockRef;

namespace {

/// A directory made by rank 0 and known to every rank, removed at scope exit. Collective.
class SharedTempDir {
 public:
  explicit SharedTempDir(moe::comm::Communicator const& comm) : comm_(comm) {
    std::string path;
    if (comm.rank() == 0) {
      std::string tmpl = (fs::temp_directory_path() / "moe_checkpoint_mpi_XXXXXX").string();
      if (::mkdtemp(&tmpl[0])) path = tmpl;
    }
    path_ = moe::comm::detail::broadcast_string(comm, 0, path);
    if (path_.empty()) throw std::runtime_error("mkdtemp failed");
  }
  ~SharedTempDir() {
    MPI_Barrier(comm_.get());
    if (comm_.rank() == 0) {
      std::error_code ec;
      fs::remove_all(path_, ec);
    }
  }
  std::string ckpt() const { return path_ + "/ckpt"; }
  std::string const& path() const { return path_; }

 private:
  moe::comm::Communicator comm_;
  std::string path_;
};

/// Part k of n items split into `parts` nearly equal parts (the first ones one larger).
std::pair<std::int64_t, std::int64_t> part(std::int64_t n, int parts, int k) {
  std::int64_t const base = n / parts, extra = n % parts;
  std::int64_t const size = base + (k < extra ? 1 : 0);
  std::int64_t const start = k * base + std::min<std::int64_t>(k, extra);
  return {start, size};
}

/// The value of element (i, j) of tensor `id`.
double value(int id, std::int64_t i, std::int64_t j) { return id * 1000.0 + i * 10.0 + j * 0.125; }

/// A block of a 2-D (or 0-D) tensor with its own storage, filled from value() or zeros.
struct Block {
  std::string name;
  int id = 0;
  std::string dtype;
  moe::TensorBlock tb;
  std::vector<float> f;
  std::vector<double> d;

  Block(std::string n, int i, std::string dt, moe::TensorBlock b, bool filled)
      : name(std::move(n)), id(i), dtype(std::move(dt)), tb(std::move(b)) {
    std::int64_t numel = 1;
    for (std::int64_t x : tb.local_shape) numel *= x;
    if (dtype == "F32") {
      f.assign(static_cast<std::size_t>(numel), 0.f);
    } else {
      d.assign(static_cast<std::size_t>(numel), 0.0);
    }
    if (filled) {
      for_each([&](std::size_t k, double v) { set(k, v); });
    }
  }

  void set(std::size_t k, double v) {
    if (dtype == "F32") {
      f[k] = static_cast<float>(v);
    } else {
      d[k] = v;
    }
  }
  double get(std::size_t k) const { return dtype == "F32" ? f[k] : d[k]; }

  /// Calls fn(local index, expected value) for every element.
  void for_each(std::function<void(std::size_t, double)> const& fn) const {
    if (tb.global_shape.empty()) {
      fn(0, value(id, 0, 0));
      return;
    }
    std::int64_t const rows = tb.local_shape[0], cols = tb.local_shape[1];
    for (std::int64_t i = 0; i < rows; ++i) {
      for (std::int64_t j = 0; j < cols; ++j) {
        double const v = value(id, tb.offset[0] + i, tb.offset[1] + j);
        fn(static_cast<std::size_t>(i * cols + j),
           dtype == "F32" ? static_cast<double>(static_cast<float>(v)) : v);
      }
    }
  }

  BlockRef ref() {
    return {name, tb, dtype, dtype == "F32" ? static_cast<void*>(f.data()) : d.data()};
  }
};

std::vector<BlockRef> refs(std::vector<Block>& blocks) {
  std::vector<BlockRef> out;
  for (Block& b : blocks) out.push_back(b.ref());
  return out;
}

/// Counts the elements of \p blocks that differ from value().
int mismatches(std::vector<Block> const& blocks) {
  int bad = 0;
  for (Block const& b : blocks) {
    b.for_each([&](std::size_t k, double want) {
      if (b.get(k) != want) ++bad;
    });
  }
  return bad;
}

moe::TensorBlock rows_of(std::int64_t R, std::int64_t C, int parts, int k) {
  auto const [start, size] = part(R, parts, k);
  return {{R, C}, {size, C}, {start, 0}};
}
moe::TensorBlock cols_of(std::int64_t R, std::int64_t C, int parts, int k) {
  auto const [start, size] = part(C, parts, k);
  return {{R, C}, {R, size}, {0, start}};
}
moe::TensorBlock all_of(std::int64_t R, std::int64_t C) { return {{R, C}, {R, C}, {0, 0}}; }

/// Runs fn on every rank; expects E on every rank with the same message containing \p what.
template <class E>
void expect_same_error(moe::comm::Communicator const& comm, std::function<void()> const& fn,
                       std::string const& what) {
  std::string msg = "(no exception)";
  try {
    fn();
  } catch (E const& e) {
    msg = e.what();
  } catch (std::exception const& e) {
    msg = std::string("(other exception) ") + e.what();
  }
  EXPECT_NE(msg.find(what), std::string::npos) << "rank " << comm.rank() << ": " << msg;
  EXPECT_NO_THROW(moe::comm::check_agreement(comm, "error message", msg));
}

}  // namespace

TEST(CheckpointMpi, SplitAndCopiedBlocksRoundTrip) {
  moe::comm::Communicator const comm(MPI_COMM_WORLD);
  int const P = comm.size(), r = comm.rank();
  SharedTempDir tmp(comm);
  int const groups = (P + 1) / 2;  // ranks 2g and 2g+1 hold the same column block
  auto layout = [&](bool filled) {
    std::vector<Block> b;
    b.emplace_back("rows", 1, "F32", rows_of(2 * P + 1, 5, P, r), filled);
    b.emplace_back("cols", 2, "F64", cols_of(3, 3 * groups + 1, groups, r / 2), filled);
    b.emplace_back("replicated", 3, "F64", all_of(4, 3), filled);
    b.emplace_back("sparse", 4, "F32", rows_of(1, 3, P, r), filled);  // empty on ranks > 0
    if (r == P - 1) b.emplace_back("scalar", 5, "F64", moe::TensorBlock{{}, {}, {}}, filled);
    return b;
  };
  std::vector<Block> saved = layout(true);
  std::map<std::string, std::string> const meta{
      {"step", "12"}, {"rng", "seed=5;draws=77"}, {"long", std::string(100000, 'x')}};
  moe::io::save_checkpoint(comm, tmp.ckpt(), 12, refs(saved), meta, 2);

  std::vector<Block> loaded = layout(false);
  ASSERT_GT(mismatches(loaded), 0);
  std::map<std::string, std::string> got_meta;
  std::int64_t step = -1;
  ASSERT_TRUE(moe::io::load_latest_checkpoint(comm, tmp.ckpt(), refs(loaded), got_meta, step));
  EXPECT_EQ(step, 12);
  EXPECT_EQ(got_meta, meta);
  EXPECT_EQ(mismatches(loaded), 0) << "rank " << r;

  if (r == 0) {  // the file holds the global tensors
    moe::io::File const f = moe::io::File::read(tmp.ckpt() + "/step_00000012/model.safetensors");
    EXPECT_EQ(f.names(),
              (std::vector<std::string>{"cols", "replicated", "rows", "scalar", "sparse"}));
    std::vector<float> const rows = f.get<float>("rows");
    for (std::int64_t i = 0; i < 2 * P + 1; ++i) {
      for (std::int64_t j = 0; j < 5; ++j)
        ASSERT_EQ(rows[i * 5 + j], static_cast<float>(value(1, i, j)));
    }
    EXPECT_EQ(f.get<double>("scalar"), std::vector<double>{value(5, 0, 0)});
  }
}

// The same, with every message cut into 13-byte pieces.
TEST(CheckpointMpi, SmallMessagePieces) {
  moe::comm::Communicator const comm(MPI_COMM_WORLD);
  int const P = comm.size(), r = comm.rank();
  SharedTempDir tmp(comm);
  struct Pieces {  // moe/comm/bytes.hpp sends at most count_limit() bytes per MPI call
    std::int64_t old = moe::comm::detail::count_limit();
    Pieces() { moe::comm::detail::count_limit() = 13; }
    ~Pieces() { moe::comm::detail::count_limit() = old; }
  } const pieces;
  std::vector<Block> saved;
  saved.emplace_back("a", 1, "F64", rows_of(3 * P, 5, P, r), true);
  saved.emplace_back("b", 2, "F32", cols_of(2, 4 * P + 1, P, r), true);
  std::map<std::string, std::string> const meta{{"m", std::string(1001, 'y')}};
  moe::io::save_checkpoint(comm, tmp.ckpt(), 1, refs(saved), meta, 1);
  std::vector<Block> loaded;
  loaded.emplace_back("a", 1, "F64", cols_of(3 * P, 5, P, r), false);
  loaded.emplace_back("b", 2, "F32", all_of(2, 4 * P + 1), false);
  std::map<std::string, std::string> got;
  std::int64_t step = 0;
  ASSERT_TRUE(moe::io::load_latest_checkpoint(comm, tmp.ckpt(), refs(loaded), got, step));
  EXPECT_EQ(got, meta);
  EXPECT_EQ(mismatches(loaded), 0) << "rank " << r;
}

TEST(CheckpointMpi, ReshardingOnLoad) {
  moe::comm::Communicator const comm(MPI_COMM_WORLD);
  int const P = comm.size(), r = comm.rank();
  SharedTempDir tmp(comm);
  std::int64_t const R = 3 * P + 2, C = 2 * P + 1;
  // Saved: w split by rows, v split by columns.
  std::vector<Block> saved;
  saved.emplace_back("w", 1, "F32", rows_of(R, 7, P, r), true);
  saved.emplace_back("v", 2, "F64", cols_of(5, C, P, r), true);
  moe::io::save_checkpoint(comm, tmp.ckpt(), 3, refs(saved), {{"k", "v"}}, 1);

  auto load_into = [&](moe::comm::Communicator const& c, std::vector<Block>& blocks) {
    std::map<std::string, std::string> meta;
    std::int64_t step = -1;
    ASSERT_TRUE(moe::io::load_latest_checkpoint(c, tmp.ckpt(), refs(blocks), meta, step));
    EXPECT_EQ(step, 3);
    EXPECT_EQ(meta, (std::map<std::string, std::string>{{"k", "v"}}));
    EXPECT_EQ(mismatches(blocks), 0) << "rank " << r;
  };
  {  // transposed blocking: w by columns, v by rows
    std::vector<Block> b;
    b.emplace_back("w", 1, "F32", cols_of(R, 7, P, r), false);
    b.emplace_back("v", 2, "F64", rows_of(5, C, P, r), false);
    load_into(comm, b);
  }
  {  // everything on every rank
    std::vector<Block> b;
    b.emplace_back("w", 1, "F32", all_of(R, 7), false);
    b.emplace_back("v", 2, "F64", all_of(5, C), false);
    load_into(comm, b);
  }
  {  // w only, as a 2 x 2 grid of blocks on each rank, on two sub-communicators at once
    moe::comm::Communicator const half = comm.split(r % 2, r);
    std::vector<Block> b;
    for (int k = 0; k < 4; ++k) {
      auto const [r0, rn] = part(R, 2, k / 2);
      auto const [c0, cn] = part(7, 2, k % 2);
      b.emplace_back("w", 1, "F32", moe::TensorBlock{{R, 7}, {rn, cn}, {r0, c0}}, false);
    }
    load_into(half, b);
  }
  {  // a single rank loads alone
    if (r == P - 1) {
      moe::comm::Communicator const self(MPI_COMM_SELF);
      std::vector<Block> b;
      b.emplace_back("v", 2, "F64", moe::TensorBlock{{5, C}, {2, 3}, {1, C - 3}}, false);
      load_into(self, b);
    }
    MPI_Barrier(comm.get());
  }
}

TEST(CheckpointMpi, ErrorsAreTheSameOnEveryRank) {
  moe::comm::Communicator const comm(MPI_COMM_WORLD);
  int const P = comm.size(), r = comm.rank();
  SharedTempDir tmp(comm);
  std::vector<float> buf(64, static_cast<float>(r));
  auto save = [&](std::vector<BlockRef> const& blocks,
                  std::map<std::string, std::string> const& meta = {}) {
    return [&, blocks, meta] { moe::io::save_checkpoint(comm, tmp.ckpt(), 1, blocks, meta, 1); };
  };

  // A row nobody holds.
  {
    auto const [start, size] = part(P, P, r);
    expect_same_error<moe::ConfigError>(
        comm, save({{"w", {{P + 1, 2}, {size, 2}, {start, 0}}, "F32", buf.data()}}),
        "every element must be held by at least one rank");
  }
  // A bad block on the last rank only.
  expect_same_error<moe::ConfigError>(
      comm, save({{"w", {{4, 2}, {4, 2}, {r == P - 1 ? 1 : 0, 0}}, "F32", buf.data()}}),
      "does not lie within the global shape");
  // The directory cannot be created.
  if (r == 0) std::ofstream(tmp.path() + "/file") << "x";
  expect_same_error<moe::IoError>(
      comm,
      [&] {
        auto const [start, size] = part(4, P, r);
        moe::io::save_checkpoint(comm, tmp.path() + "/file/ckpt", 1,
                                 {{"w", {{4, 2}, {size, 2}, {start, 0}}, "F32", buf.data()}}, {},
                                 1);
      },
      "cannot create the checkpoint directory");
  if (P > 1) {
    // Ranks disagree on a global shape.
    expect_same_error<moe::ConfigError>(
        comm, save({{"w", {{4, r == P - 1 ? 3 : 2}, {4, 2}, {0, 0}}, "F32", buf.data()}}),
        "every block of a tensor must give the same dtype and global shape");
    // Copies of a block differ (every rank holds all of w, filled with its rank).
    expect_same_error<moe::ConfigError>(comm,
                                        save({{"w", {{4, 2}, {4, 2}, {0, 0}}, "F32", buf.data()}}),
                                        "copies of a block must be identical");
    // Metadata differs.
    expect_same_error<moe::ConfigError>(comm, save({}, {{"rng", std::to_string(r)}}),
                                        "checkpoint metadata differs across ranks");
    // Loading: ranks disagree on a tensor's dtype.
    std::map<std::string, std::string> meta;
    std::int64_t step = 0;
    std::vector<double> dbuf(8);
    expect_same_error<moe::ConfigError>(
        comm,
        [&] {
          BlockRef const b = r == 0 ? BlockRef{"w", {{4, 2}, {4, 2}, {0, 0}}, "F32", buf.data()}
                                    : BlockRef{"w", {{4, 2}, {4, 2}, {0, 0}}, "F64", dbuf.data()};
          moe::io::load_latest_checkpoint(comm, tmp.ckpt(), {b}, meta, step);
        },
        "every block of a tensor must give the same dtype and global shape");
  }
  // Nothing was written; loading finds nothing on every rank.
  std::map<std::string, std::string> meta;
  std::int64_t step = -1;
  EXPECT_FALSE(moe::io::load_latest_checkpoint(
      comm, tmp.ckpt(), {{"w", {{4, 2}, {4, 2}, {0, 0}}, "F32", buf.data()}}, meta, step));
  // And a valid save after all these errors works.
  std::fill(buf.begin(), buf.end(), 1.f);
  auto const [start, size] = part(4, P, r);
  moe::io::save_checkpoint(comm, tmp.ckpt(), 5,
                           {{"w", {{4, 2}, {size, 2}, {start, 0}}, "F32", buf.data()}}, {}, 1);
  EXPECT_TRUE(moe::io::load_latest_checkpoint(
      comm, tmp.ckpt(), {{"w", {{4, 2}, {4, 2}, {0, 0}}, "F32", buf.data()}}, meta, step));
  EXPECT_EQ(step, 5);
}

// A directory another process holds (here the last rank, alone) cannot be locked or saved into:
// the same IoError, naming the holder, on every rank, and nothing is written. On one rank the
// holder is this very process: a ConfigError.
TEST(CheckpointMpi, LockedDirectoryFailsOnEveryRank) {
  moe::comm::Communicator const comm(MPI_COMM_WORLD);
  int const P = comm.size(), r = comm.rank();
  SharedTempDir tmp(comm);
  struct Wait {
    double old = moe::io::detail::lock_wait_seconds();
    Wait() { moe::io::detail::lock_wait_seconds() = 0.2; }
    ~Wait() { moe::io::detail::lock_wait_seconds() = old; }
  } const wait;
  std::vector<float> buf(8, 1.f);
  auto const [start, size] = part(4, P, r);
  std::vector<BlockRef> const blocks = {{"w", {{4, 2}, {size, 2}, {start, 0}}, "F32", buf.data()}};
  moe::io::save_checkpoint(comm, tmp.ckpt(), 1, blocks, {}, 1);

  int const holder = P - 1;
  moe::io::CheckpointDirLock other;
  if (r == holder) {
    moe::comm::Communicator const self(MPI_COMM_SELF);
    other = moe::io::CheckpointDirLock(self, tmp.ckpt());
    EXPECT_TRUE(other.held());
  }
  long holder_pid = static_cast<long>(::getpid());
  MPI_Bcast(&holder_pid, 1, MPI_LONG, holder, comm.get());
  auto const lock = [&] { moe::io::CheckpointDirLock const mine(comm, tmp.ckpt()); };
  if (P > 1) {
    std::string const named = "' is in use by another job (hostname=";
    expect_same_error<moe::IoError>(comm, lock, "checkpoint_dir '" + tmp.ckpt() + named);
    expect_same_error<moe::IoError>(comm, lock, ", pid=" + std::to_string(holder_pid) + ", since=");
    // A save (keep = 1 would prune step 1) is refused alike.
    expect_same_error<moe::IoError>(
        comm, [&] { moe::io::save_checkpoint(comm, tmp.ckpt(), 2, blocks, {}, 1); },
        ", pid=" + std::to_string(holder_pid) + ", since=");
  } else {
    expect_same_error<moe::ConfigError>(comm, lock, "' is already locked by this process");
  }
  std::map<std::string, std::string> meta;
  std::int64_t step = -1;
  EXPECT_TRUE(moe::io::load_latest_checkpoint(comm, tmp.ckpt(), blocks, meta, step));
  EXPECT_EQ(step, 1) << "the holder's checkpoint is untouched";

  // The holder lets go: the job locks the directory and saves under its lock.
  other.release();
  MPI_Barrier(comm.get());
  {
    moe::io::CheckpointDirLock const mine(comm, tmp.ckpt());
    EXPECT_EQ(mine.held(), r == 0);
    moe::io::save_checkpoint(comm, tmp.ckpt(), 2, blocks, {}, 1);
  }
  EXPECT_TRUE(moe::io::load_latest_checkpoint(comm, tmp.ckpt(), blocks, meta, step));
  EXPECT_EQ(step, 2);
}
