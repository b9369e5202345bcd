// Tests of moe/io/checkpoint.hpp on one rank: round trip, retention, corrupt and
// incomplete checkpoints, argument errors, processes killed in the middle of a save, and the lock
// that keeps a second process out of a checkpoint directory.
#include "mpi_on_demand.hpp"

#include <moe/io/checkpoint.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

namespace fs = std::filesystem;
using moe::io::BlockRef;

namespace {

/// A fresh directory under the system temp dir, removed with everything in it at scope exit.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "moe_checkpoint_XXXXXX").string();
    char* made = ::mkdtemp(&tmpl[0]);
    if (!made) throw std::runtime_error("mkdtemp failed");
    path_ = made;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(TempDir const&) = delete;
  TempDir& operator=(TempDir const&) = delete;
  std::string const& path() const { return path_; }
  std::string ckpt() const { return path_ + "/ckpt"; }

 private:
  std::string path_;
};

moe::TensorBlock whole(std::vector<std::int64_t> shape) {
  return {shape, shape, std::vector<std::int64_t>(shape.size(), 0)};
}

/// A small model: F32 and F64 matrices, an F64 vector, an F64 scalar and an empty F32 tensor.
struct Model {
  std::vector<float> w;
  std::vector<double> m, b;
  double s = 0;
  std::vector<float> e;

  explicit Model(double seed) : w(5 * 7), m(3 * 4), b(6) {
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(seed + 0.25 * i);
    for (std::size_t i = 0; i < m.size(); ++i) m[i] = seed * 1e-3 - 1.0 / (1.0 + i);
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = -seed + 3.0 * i;
    s = seed * 0.5;
  }

  std::vector<BlockRef> refs() {
    return {{"layer.w", whole({5, 7}), "F32", w.data()},
            {"layer.m", whole({3, 4}), "F64", m.data()},
            {"bias", whole({6}), "F64", b.data()},
            {"scale", whole({}), "F64", &s},
            {"empty", whole({0, 4}), "F32", nullptr}};
  }

  bool operator==(Model const& o) const { return w == o.w && m == o.m && b == o.b && s == o.s; }
  bool operator!=(Model const& o) const { return !(*this == o); }
};

std::map<std::string, std::string> meta_of(std::int64_t step) {
  return {{"step", std::to_string(step)},
          {"data_position", std::to_string(step * 64)},
          {"rng", "mt19937:" + std::to_string(step * 7919)},
          {"config", "{\"k\": 2, \"unicode\": \"\xc3\xa9\"}"}};
}

std::string step_dir(TempDir const& t, std::int64_t step) {
  return t.ckpt() + "/" + moe::io::checkpoint_step_name(step);
}

/// The entries of \p dir but the lock file LOCK.
std::set<std::string> entries(std::string const& dir) {
  std::set<std::string> out;
  for (auto const& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  out.erase("LOCK");
  return out;
}

std::string slurp(std::string const& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void spit(std::string const& path, std::string const& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

class Checkpoint : public ::testing::Test {
 protected:
  moe::comm::Communicator comm{moe_test::self_comm()};
  TempDir tmp;

  void save(std::int64_t step, Model& model, int keep = 3) {
    moe::io::save_checkpoint(comm, tmp.ckpt(), step, model.refs(), meta_of(step), keep);
  }

  /// Loads into a fresh model; returns the step (-1 if none) and the captured stderr.
  std::int64_t load(Model& into, std::string* err = nullptr) {
    std::map<std::string, std::string> meta{{"untouched", "yes"}};
    std::int64_t step = -1;
    ::testing::internal::CaptureStderr();
    bool const found = moe::io::load_latest_checkpoint(comm, tmp.ckpt(), into.refs(), meta, step);
    std::string const text = ::testing::internal::GetCapturedStderr();
    if (err) *err = text;
    if (!found) {
      EXPECT_EQ(step, -1);
      EXPECT_EQ(meta, (std::map<std::string, std::string>{{"untouched", "yes"}}));
      return -1;
    }
    EXPECT_EQ(meta, meta_of(step));
    return step;
  }
};

}  // namespace

TEST(CheckpointSha256, KnownVectors) {
  using moe::io::sha256_hex;
  EXPECT_EQ(sha256_hex("", 0), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc", 3),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  std::string const two_blocks = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  EXPECT_EQ(sha256_hex(two_blocks.data(), two_blocks.size()),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  std::string const million(1000000, 'a');
  EXPECT_EQ(sha256_hex(million.data(), million.size()),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // Fed in uneven pieces, the digest is the same.
  moe::io::Sha256 h;
  for (std::size_t at = 0, k = 1; at < million.size(); at += k, k = k * 3 % 1031 + 1)
    h.update(million.data() + at, std::min(k, million.size() - at));
  EXPECT_EQ(h.hex_digest(), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_F(Checkpoint, RoundTripF32F64AndMetadata) {
  Model saved(1.5);
  save(7, saved);
  EXPECT_EQ(entries(tmp.ckpt()), (std::set<std::string>{"step_00000007"}));
  EXPECT_TRUE(fs::is_regular_file(tmp.ckpt() + "/LOCK"));
  EXPECT_EQ(fs::file_size(tmp.ckpt() + "/LOCK"), 0u) << "released (emptied) after the save";
  EXPECT_EQ(entries(step_dir(tmp, 7)), (std::set<std::string>{"index.json", "model.safetensors"}));

  Model loaded(0);
  ASSERT_NE(loaded, saved);
  std::string err;
  EXPECT_EQ(load(loaded, &err), 7);
  EXPECT_EQ(err, "");
  EXPECT_EQ(loaded, saved);

  // The model file is a plain safetensors file; the index records its size and SHA-256.
  std::string const model = step_dir(tmp, 7) + "/model.safetensors";
  moe::io::File const f = moe::io::File::read(model);
  EXPECT_EQ(f.metadata, meta_of(7));
  EXPECT_EQ(f.get<float>("layer.w"), saved.w);
  EXPECT_EQ(f.at("scale").shape, std::vector<std::int64_t>{});
  EXPECT_EQ(f.at("empty").shape, (std::vector<std::int64_t>{0, 4}));
  std::uint64_t size = 0;
  std::string const sha = moe::io::file_sha256(model, size);
  std::string const index = slurp(step_dir(tmp, 7) + "/index.json");
  EXPECT_NE(index.find("\"sha256\": \"" + sha + "\""), std::string::npos) << index;
  EXPECT_NE(index.find("\"bytes\": " + std::to_string(size)), std::string::npos) << index;
  EXPECT_NE(index.find("\"step\": 7"), std::string::npos) << index;
}

TEST_F(Checkpoint, NoDirectoryOrEmptyDirectoryIsNotFound) {
  Model m(0);
  std::string err;
  EXPECT_EQ(load(m, &err), -1);
  EXPECT_EQ(err, "");
  fs::create_directories(tmp.ckpt());
  EXPECT_EQ(load(m, &err), -1);
  EXPECT_EQ(err, "");
}

TEST_F(Checkpoint, KeepsTheLastN) {
  for (int step = 1; step <= 5; ++step) {
    Model m(step);
    save(step * 10, m, 2);
  }
  EXPECT_EQ(entries(tmp.ckpt()), (std::set<std::string>{"step_00000040", "step_00000050"}));
  Model m(6);
  save(60, m, 1);
  EXPECT_EQ(entries(tmp.ckpt()), (std::set<std::string>{"step_00000060"}));
  Model loaded(0);
  EXPECT_EQ(load(loaded), 60);
  EXPECT_EQ(loaded, m);
}

TEST_F(Checkpoint, SavingAStepAgainReplacesIt) {
  Model a(1), b(2);
  save(3, a);
  save(3, b);
  EXPECT_EQ(entries(tmp.ckpt()), (std::set<std::string>{"step_00000003"}));
  Model loaded(0);
  EXPECT_EQ(load(loaded), 3);
  EXPECT_EQ(loaded, b);
}

TEST_F(Checkpoint, NewerCheckpointsOfAnAbandonedRunAreNotDeleted) {
  Model a(1), b(2);
  save(20, a, 1);
  save(10, b, 1);  // a rolled-back run saving an older step keeps step 20 (and does not delete 10)
  EXPECT_EQ(entries(tmp.ckpt()), (std::set<std::string>{"step_00000010", "step_00000020"}));
}

// Every way a newest checkpoint can be broken: it is skipped with a message naming it and the
// reason, and the previous one is loaded.
TEST_F(Checkpoint, BrokenNewestCheckpointIsSkipped) {
  struct Case {
    char const* what;
    std::function<void(std::string const& dir)> damage;
    char const* reason;
  };
  auto const rewrite_index = [](std::string const& dir, std::string const& from,
                                std::string const& to) {
    std::string text = slurp(dir + "/index.json");
    std::size_t const at = text.find(from);
    ASSERT_NE(at, std::string::npos);
    text.replace(at, from.size(), to);
    spit(dir + "/index.json", text);
  };
  std::vector<Case> const cases = {
      {"truncated model file",
       [](std::string const& d) {
         fs::resize_file(d + "/model.safetensors", fs::file_size(d + "/model.safetensors") - 9);
       },
       "truncated"},
      {"flipped byte",
       [](std::string const& d) {
         std::fstream f(d + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
         f.seekg(-3, std::ios::end);
         char c = 0;
         f.read(&c, 1);
         f.seekp(-3, std::ios::end);
         c = static_cast<char>(c ^ 0x10);
         f.write(&c, 1);
       },
       "checksum mismatch"},
      {"missing index", [](std::string const& d) { fs::remove(d + "/index.json"); },
       "the checkpoint is incomplete"},
      {"missing model", [](std::string const& d) { fs::remove(d + "/model.safetensors"); },
       "cannot stat model.safetensors"},
      {"index of another step",
       [this](std::string const& d) {
         fs::copy_file(step_dir(tmp, 1) + "/index.json", d + "/index.json",
                       fs::copy_options::overwrite_existing);
       },
       "index.json is for step 1 but the directory is for step 2"},
      {"garbage index", [](std::string const& d) { spit(d + "/index.json", "{\"format\": "); },
       "not valid JSON"},
      {"index of another format",
       [&](std::string const& d) { rewrite_index(d, "moe-checkpoint", "something-else"); },
       "not a version 1 moe-checkpoint index"},
      {"checksum of a broken model file recorded",
       [](std::string const& d) {
         // A structurally invalid file whose size and checksum the index matches.
         std::string bad(16, '\0');
         bad[0] = 100;  // a 100-byte header in a 16-byte file
         spit(d + "/model.safetensors", bad);
         std::string text = slurp(d + "/index.json");
         auto const set_field = [&](std::string const& key, std::string const& value) {
           std::size_t const at = text.find("\"" + key + "\": ");
           std::size_t const from = at + key.size() + 4;
           std::size_t const to = text.find(',', from);
           text.replace(from, to - from, value);
         };
         set_field("bytes", "16");
         set_field("sha256", "\"" + moe::io::sha256_hex(bad.data(), 16) + "\"");
         spit(d + "/index.json", text);
       },
       "truncated file?"},
      {"index and model list different tensors",
       [&](std::string const& d) { rewrite_index(d, "\"bias\"", "\"bias2\""); },
       "list different tensors"},
  };
  for (Case const& c : cases) {
    SCOPED_TRACE(c.what);
    fs::remove_all(tmp.ckpt());
    Model one(1), two(2);
    save(1, one);
    save(2, two);
    c.damage(step_dir(tmp, 2));
    Model loaded(0);
    std::string err;
    EXPECT_EQ(load(loaded, &err), 1);
    EXPECT_EQ(loaded, one);
    std::string const prefix = "checkpoint: skipping " + step_dir(tmp, 2) + ": ";
    EXPECT_EQ(err.rfind(prefix, 0), 0u) << err;
    EXPECT_NE(err.find(c.reason), std::string::npos) << err;
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  }
}

TEST_F(Checkpoint, NoValidCheckpointReturnsFalse) {
  Model a(1), b(2);
  save(1, a);
  save(2, b);
  fs::remove(step_dir(tmp, 1) + "/index.json");
  fs::resize_file(step_dir(tmp, 2) + "/model.safetensors", 100);
  Model loaded(0);
  std::string err;
  EXPECT_EQ(load(loaded, &err), -1);
  EXPECT_EQ(loaded, Model(0));
  EXPECT_NE(err.find("checkpoint: skipping " + step_dir(tmp, 2) + ": "), std::string::npos) << err;
  EXPECT_NE(err.find("checkpoint: skipping " + step_dir(tmp, 1) + ": "), std::string::npos) << err;
  EXPECT_LT(err.find(step_dir(tmp, 2)), err.find(step_dir(tmp, 1))) << "newest first";
}

TEST_F(Checkpoint, CheckpointWithOtherTensorsIsSkipped) {
  Model a(1);
  save(1, a);
  std::vector<float> w(35);
  std::map<std::string, std::string> meta;
  std::int64_t step = -1;
  for (auto const& [block, dtype, reason] :
       {std::make_tuple(whole({7, 5}), "F32", "tensor 'layer.w' is F32 [5, 7] but F32 [7, 5]"),
        std::make_tuple(whole({5, 7}), "F64", "tensor 'layer.w' is F32 [5, 7] but F64 [5, 7]"),
        std::make_tuple(whole({35}), "F32", "was requested")}) {
    std::vector<double> big(35);
    void* data = std::string(dtype) == "F64" ? static_cast<void*>(big.data()) : w.data();
    ::testing::internal::CaptureStderr();
    EXPECT_FALSE(moe::io::load_latest_checkpoint(comm, tmp.ckpt(),
                                                 {{"layer.w", block, dtype, data}}, meta, step));
    std::string const err = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find(reason), std::string::npos) << err;
  }
  ::testing::internal::CaptureStderr();
  EXPECT_FALSE(moe::io::load_latest_checkpoint(
      comm, tmp.ckpt(), {{"other", whole({2}), "F32", w.data()}}, meta, step));
  std::string const err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("it has no tensor 'other' (requested by rank 0)"), std::string::npos) << err;
  // A subset of the tensors is fine.
  EXPECT_TRUE(moe::io::load_latest_checkpoint(
      comm, tmp.ckpt(), {{"layer.w", whole({5, 7}), "F32", w.data()}}, meta, step));
  EXPECT_EQ(w, a.w);
}

// One rank may hold several blocks of a tensor: save from two halves, load as four quadrants.
TEST_F(Checkpoint, BlocksOfOneRankAndResharding) {
  std::vector<double> top(3 * 8), bottom(3 * 8);
  for (int i = 0; i < 24; ++i) top[i] = i, bottom[i] = 24 + i;
  std::vector<BlockRef> const halves = {
      {"g", {{6, 8}, {3, 8}, {0, 0}}, "F64", top.data()},
      {"g", {{6, 8}, {3, 8}, {3, 0}}, "F64", bottom.data()},
      {"g", {{6, 8}, {3, 8}, {3, 0}}, "F64", bottom.data()}};  // a copy of a block is fine
  moe::io::save_checkpoint(comm, tmp.ckpt(), 1, halves, {}, 1);
  std::vector<std::vector<double>> q(4, std::vector<double>(9 + 3));
  std::vector<BlockRef> quads;
  for (int k = 0; k < 4; ++k) {
    std::int64_t const r0 = k / 2 * 3, c0 = k % 2 * 4;
    quads.push_back({"g", {{6, 8}, {3, 4}, {r0, c0}}, "F64", q[k].data()});
  }
  std::map<std::string, std::string> meta{{"x", "y"}};
  std::int64_t step = 0;
  ASSERT_TRUE(moe::io::load_latest_checkpoint(comm, tmp.ckpt(), quads, meta, step));
  EXPECT_TRUE(meta.empty());
  for (int k = 0; k < 4; ++k) {
    for (int i = 0; i < 3; ++i) {
      for (int j = 0; j < 4; ++j) {
        EXPECT_EQ(q[k][i * 4 + j], (k / 2 * 3 + i) * 8 + k % 2 * 4 + j)
            << k << " " << i << " " << j;
      }
    }
  }
}

TEST_F(Checkpoint, BadArgumentsAndBlocksAreConfigErrors) {
  std::vector<float> v(16, 1.f), other(16, 2.f);
  auto const bad = [&](std::vector<BlockRef> const& blocks, char const* what, std::int64_t step = 1,
                       int keep = 2) {
    try {
      moe::io::save_checkpoint(comm, tmp.ckpt(), step, blocks, {}, keep);
      ADD_FAILURE() << "no ConfigError for " << what;
    } catch (moe::ConfigError const& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  bad({{"a", {{4, 4}, {2, 4}, {0, 0}}, "F32", v.data()}}, "cover 8 of its 16 elements");
  bad({{"a", {{4, 4}, {3, 4}, {0, 0}}, "F32", v.data()},
       {"a", {{4, 4}, {2, 4}, {2, 0}}, "F32", v.data()}},
      "overlap partially");
  bad({{"a", whole({4, 4}), "F32", v.data()}, {"a", whole({4, 4}), "F32", other.data()}},
      "differ; copies of a block must be identical");
  bad({{"a", whole({4, 4}), "F32", v.data()}, {"a", whole({16}), "F32", v.data()}},
      "every block of a tensor must give the same dtype and global shape");
  bad({{"a", whole({4, 2}), "F16", v.data()}}, "dtype 'F16' is not supported");
  bad({{"a", {{4, 4}, {2, 4}, {3, 0}}, "F32", v.data()}}, "does not lie within the global shape");
  bad({{"a", {{4, 4}, {4}, {0, 0}}, "F32", v.data()}}, "the same number of dimensions");
  bad({{"a", whole({4}), "F32", nullptr}}, "data is null");
  bad({{"", whole({4}), "F32", v.data()}}, "the tensor name is empty");
  bad({{"__metadata__", whole({4}), "F32", v.data()}}, "reserved");
  bad({}, "keep = 0", 1, 0);
  bad({}, "step -1 is negative", -1, 1);
  EXPECT_THROW(moe::io::save_checkpoint(comm, tmp.ckpt(), 1, {}, {{"k", "\xff"}}, 1),
               moe::ConfigError);
  EXPECT_FALSE(fs::exists(tmp.ckpt())) << "nothing is written on an error";
}

TEST_F(Checkpoint, UnwritableDirectoryIsAnIoError) {
  spit(tmp.path() + "/file", "x");
  Model m(1);
  EXPECT_THROW(moe::io::save_checkpoint(comm, tmp.path() + "/file/ckpt", 1, m.refs(), {}, 1),
               moe::IoError);
  std::map<std::string, std::string> meta;
  std::int64_t step = 0;
  EXPECT_THROW(moe::io::load_latest_checkpoint(comm, tmp.path() + "/file", m.refs(), meta, step),
               moe::IoError);
}

namespace {

/// Runs \p body in a child process; returns its wait status.
template <class F>
int in_child(F&& body, pid_t* pid_out = nullptr, bool wait = true) {
  std::fflush(nullptr);
  pid_t const pid = ::fork();
  if (pid == 0) {
    try {
      body();
    } catch (...) {
      ::_exit(3);
    }
    ::_exit(0);
  }
  if (pid_out) *pid_out = pid;
  int status = 0;
  if (wait) ::waitpid(pid, &status, 0);
  return status;
}

}  // namespace

// The writer dies (_exit) at each named point of the save: the checkpoint is either absent
// (previous one loaded) or complete, never partial; the next save cleans up.
TEST_F(Checkpoint, CrashAtEachPointOfTheSave) {
  struct Point {
    char const* name;
    bool new_one_complete;
  };
  for (Point const p : {Point{"model_written", false}, Point{"index_written", false},
                        Point{"installed", true}, Point{"retention", true}}) {
    SCOPED_TRACE(p.name);
    fs::remove_all(tmp.ckpt());
    Model one(1), two(2), three(3), four(4);
    save(1, one, 2);
    save(2, two, 2);
    int const status = in_child([&] {
      ::setenv("MOE_CHECKPOINT_TEST_CRASH", p.name, 1);
      save(3, three, 2);
    });
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 86) << "the crash point was not reached";
    Model loaded(0);
    std::string err;
    EXPECT_EQ(load(loaded, &err), p.new_one_complete ? 3 : 2);
    EXPECT_EQ(loaded, p.new_one_complete ? three : two);
    EXPECT_EQ(err, "");
    save(4, four, 2);
    EXPECT_EQ(entries(tmp.ckpt()),
              (std::set<std::string>{p.new_one_complete ? "step_00000003" : "step_00000002",
                                     "step_00000004"}));
  }
}

// A write fails at each point of the save (as a full disk or a file-size limit would): the save
// throws IoError naming the point, the directory holds exactly the checkpoints before it (no
// temporary directory or file left behind, nothing to clean up by the next save), and those load
// bitwise (#32: temporary files are removed on every error path).
TEST_F(Checkpoint, AWriteFailingAtEachPointLeavesNoTemporary) {
  for (char const* point : {"tmp_made", "gathered", "model_written", "index_written"}) {
    SCOPED_TRACE(point);
    fs::remove_all(tmp.ckpt());
    Model one(1), two(2), three(3);
    save(1, one, 2);
    save(2, two, 2);
    ::setenv("MOE_CHECKPOINT_TEST_FAIL", point, 1);
    try {
      save(3, three, 2);
      ADD_FAILURE() << "the save did not fail";
    } catch (moe::IoError const& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("a write failed at ") + point),
                std::string::npos)
          << e.what();
    }
    ::unsetenv("MOE_CHECKPOINT_TEST_FAIL");
    EXPECT_EQ(entries(tmp.ckpt()), (std::set<std::string>{"step_00000001", "step_00000002"}));
    Model loaded(0);
    EXPECT_EQ(load(loaded), 2);
    EXPECT_EQ(loaded, two);
  }
}

// SIGKILL at random moments of saves of a large tensor (fixed seed).
TEST_F(Checkpoint, KilledAtRandomMomentsNeverLeavesAPartialCheckpoint) {
  std::size_t const n = std::size_t{6} << 20;  // 24 MiB of F32
  std::vector<float> data(n), back(n);
  auto fill = [&](std::int64_t step) {
    for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<float>(step * 4096 + i % 4093);
  };
  auto refs = [](std::vector<float>& v) {
    return std::vector<BlockRef>{
        {"big", whole({static_cast<std::int64_t>(n / 1024), 1024}), "F32", v.data()}};
  };
  fill(1);
  auto const t0 = std::chrono::steady_clock::now();
  moe::io::save_checkpoint(comm, tmp.ckpt(), 1, refs(data), {{"step", "1"}}, 2);
  double const full_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

  std::mt19937 rng(20240611);
  std::uniform_real_distribution<double> when(0.0, 1.3 * full_ms);
  std::int64_t latest = 1;
  int completed = 0, interrupted = 0;
  for (std::int64_t step = 2; step <= 11; ++step) {
    fill(step);
    pid_t pid = 0;
    in_child(
        [&] {
          moe::io::save_checkpoint(comm, tmp.ckpt(), step, refs(data),
                                   {{"step", std::to_string(step)}}, 2);
        },
        &pid, false);
    std::this_thread::sleep_for(std::chrono::microseconds(static_cast<long>(when(rng) * 1000)));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);

    std::map<std::string, std::string> meta;
    std::int64_t got = -1;
    ::testing::internal::CaptureStderr();
    ASSERT_TRUE(moe::io::load_latest_checkpoint(comm, tmp.ckpt(), refs(back), meta, got));
    std::string const err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(err, "") << "step " << step;
    ASSERT_TRUE(got == step || got == latest) << "loaded " << got << " while saving " << step;
    EXPECT_EQ(meta.at("step"), std::to_string(got));
    bool ok = true;
    for (std::size_t i = 0; i < n && ok; ++i)
      ok = back[i] == static_cast<float>(got * 4096 + i % 4093);
    EXPECT_TRUE(ok) << "values of step " << got;
    (got == step ? completed : interrupted) += 1;
    latest = got;
  }
  std::printf("[          ] full save %.1f ms; %d saves completed, %d interrupted\n", full_ms,
              completed, interrupted);
  // Whatever was left behind, the next save works and leaves only complete checkpoints.
  fill(99);
  moe::io::save_checkpoint(comm, tmp.ckpt(), 99, refs(data), {}, 1);
  EXPECT_EQ(entries(tmp.ckpt()), (std::set<std::string>{"step_00000099"}));
}

namespace {

/// Sets moe::io::detail::lock_wait_seconds() for a scope.
struct LockWait {
  double old = moe::io::detail::lock_wait_seconds();
  explicit LockWait(double seconds) { moe::io::detail::lock_wait_seconds() = seconds; }
  ~LockWait() { moe::io::detail::lock_wait_seconds() = old; }
  LockWait(LockWait const&) = delete;
  LockWait& operator=(LockWait const&) = delete;
};

/// Another process holding the lock of a directory (a forked child with a DirLock), until it is
/// killed or, with \p exit_after >= 0, until it exits (_exit: the lock is not released by hand)
/// that many seconds after taking it.
class LockHolder {
 public:
  explicit LockHolder(std::string const& dir, double exit_after = -1) {
    int ready[2];
    if (::pipe(ready) != 0) throw std::runtime_error("pipe failed");
    std::fflush(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(ready[0]);
      char answer = 'n';
      try {
        moe::io::detail::make_dir(dir);
        moe::io::detail::DirLock const lock(dir);
        answer = 'y';
        if (::write(ready[1], &answer, 1) != 1) ::_exit(4);
        if (exit_after >= 0) {
          std::this_thread::sleep_for(std::chrono::duration<double>(exit_after));
          ::_exit(0);
        }
        for (;;) ::pause();
      } catch (...) {
      }
      if (::write(ready[1], &answer, 1) != 1) ::_exit(4);
      ::_exit(3);
    }
    ::close(ready[1]);
    char answer = 0;
    locked_ = ::read(ready[0], &answer, 1) == 1 && answer == 'y';
    ::close(ready[0]);
  }
  ~LockHolder() { kill(); }
  LockHolder(LockHolder const&) = delete;
  LockHolder& operator=(LockHolder const&) = delete;

  bool locked() const { return locked_; }
  pid_t pid() const { return pid_; }
  /// SIGKILL, and waits for the end of the process.
  void kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  bool locked_ = false;
};

std::string host_name() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return host;
}

}  // namespace

// A second job (another process) cannot lock, save into or prune a directory another job holds;
// the error names the holder; a killed holder leaves no stale lock.
TEST_F(Checkpoint, DirectoryLockedByAnotherProcess) {
  LockWait const wait(0.2);
  Model one(1), two(2);
  save(1, one);
  LockHolder holder(tmp.ckpt());
  ASSERT_TRUE(holder.locked());
  std::string const pid = std::to_string(holder.pid());
  std::string const text = slurp(tmp.ckpt() + "/LOCK");
  EXPECT_EQ(text.rfind("hostname=" + host_name() + "\npid=" + pid + "\nsince=", 0), 0u) << text;
  EXPECT_NE(text.find("\ncommand="), std::string::npos) << text;

  auto const t0 = std::chrono::steady_clock::now();
  try {
    moe::io::CheckpointDirLock const lock(comm, tmp.ckpt());
    ADD_FAILURE() << "a directory locked by another process was locked again";
  } catch (moe::IoError const& e) {
    std::string const msg = e.what();
    EXPECT_EQ(msg.rfind("checkpoint_dir '" + tmp.ckpt() + "' is in use by another job (hostname=" +
                            host_name() + ", pid=" + pid + ", since=",
                        0),
              0u)
        << msg;
    EXPECT_NE(msg.find("); two jobs must not share a checkpoint directory: wait for it to finish, "
                       "or set checkpoint_dir to another directory"),
              std::string::npos)
        << msg;
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  // Saving (which would prune step 1 with keep = 1) is refused too, and writes nothing.
  try {
    save(2, two, 1);
    ADD_FAILURE() << "saved into a directory locked by another process";
  } catch (moe::IoError const& e) {
    EXPECT_NE(std::string(e.what()).find("pid=" + pid + ","), std::string::npos) << e.what();
  }
  EXPECT_EQ(entries(tmp.ckpt()), (std::set<std::string>{"step_00000001"}));
  EXPECT_EQ(slurp(tmp.ckpt() + "/LOCK"), text) << "the holder's LOCK is left alone";
  // Reading takes no lock.
  Model loaded(0);
  EXPECT_EQ(load(loaded), 1);
  EXPECT_EQ(loaded, one);

  // SIGKILL: the kernel drops the lock, and the next job takes it at once.
  holder.kill();
  {
    moe::io::CheckpointDirLock const lock(comm, tmp.ckpt());
    EXPECT_TRUE(lock.held());
    EXPECT_EQ(lock.dir(), tmp.ckpt());
    EXPECT_EQ(
        slurp(tmp.ckpt() + "/LOCK")
            .rfind("hostname=" + host_name() + "\npid=" + std::to_string(::getpid()) + "\n", 0),
        0u);
    save(2, two, 1);  // under the job's lock
    EXPECT_EQ(entries(tmp.ckpt()), (std::set<std::string>{"step_00000002"}));
  }
  EXPECT_EQ(slurp(tmp.ckpt() + "/LOCK"), "") << "a released LOCK names nobody";
}

// A job killed a moment ago may still hold the lock: it is waited for (lock_wait_seconds).
TEST_F(Checkpoint, LockOfAnEndingProcessIsWaitedFor) {
  LockWait const wait(30);
  LockHolder holder(tmp.ckpt(), 0.3);
  ASSERT_TRUE(holder.locked());
  auto const t0 = std::chrono::steady_clock::now();
  moe::io::CheckpointDirLock const lock(comm, tmp.ckpt());
  EXPECT_TRUE(lock.held());
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
}

// One process locking one directory twice (by any path) is an error, not a silent success (fcntl
// locks belong to the process); its saves use the lock it holds; moving the lock keeps it.
TEST_F(Checkpoint, DirectoryLockedTwiceByOneProcess) {
  LockWait const wait(0.2);
  moe::io::CheckpointDirLock first(comm, tmp.ckpt());
  ASSERT_TRUE(first.held());
  fs::create_directory_symlink(tmp.ckpt(), tmp.path() + "/alias");
  for (std::string const& path : {tmp.ckpt(), tmp.ckpt() + "/.", tmp.path() + "/alias"}) {
    SCOPED_TRACE(path);
    try {
      moe::io::CheckpointDirLock const again(comm, path);
      ADD_FAILURE() << "locked twice";
    } catch (moe::ConfigError const& e) {
      EXPECT_EQ(std::string(e.what()).rfind(
                    "checkpoint_dir '" + path + "' is already locked by this process (pid=" +
                        std::to_string(::getpid()) + ", as '" + tmp.ckpt() + "')",
                    0),
                0u)
          << e.what();
    }
  }
  Model m(1);
  save(1, m);
  save(2, m);
  // Neither the failed attempts nor the saves released it: another process still cannot lock.
  auto const child_locks = [&] {
    return in_child([&] {
      moe::io::detail::DirLock const lock(tmp.ckpt());
      ::_exit(0);
    });
  };
  int status = child_locks();
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 3) << "the child took the lock this process holds";
  moe::io::CheckpointDirLock moved = std::move(first);
  EXPECT_TRUE(moved.held());
  EXPECT_FALSE(first.held());  // NOLINT(bugprone-use-after-move): moved from holds nothing
  status = child_locks();
  EXPECT_EQ(WEXITSTATUS(status), 3) << "moving the lock released it";
  moved.release();
  EXPECT_FALSE(moved.held());
  status = child_locks();
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "released, yet another process cannot lock";
  moe::io::CheckpointDirLock const again(comm, tmp.path() + "/alias");
  EXPECT_TRUE(again.held());
}

// The job's LOCK deleted (or replaced) while it runs: a second job could lock the directory, so
// the holder's next save is refused, naming the file, and writes nothing (#32).
TEST_F(Checkpoint, SaveRefusedWhenTheLockFileWasDeleted) {
  moe::io::CheckpointDirLock lock(comm, tmp.ckpt());
  ASSERT_TRUE(lock.held());
  Model m(1);
  save(1, m);
  fs::remove(tmp.ckpt() + "/LOCK");
  try {
    save(2, m);
    ADD_FAILURE() << "saved without its lock file";
  } catch (moe::IoError const& e) {
    EXPECT_NE(std::string(e.what()).find("LOCK', the lock this job holds on checkpoint_dir"),
              std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(fs::exists(step_dir(tmp, 2)));
  EXPECT_TRUE(fs::exists(step_dir(tmp, 1)));
  // Replaced by another file of the same name: refused too.
  std::ofstream(tmp.ckpt() + "/LOCK") << "hostname=elsewhere\n";
  EXPECT_THROW(save(2, m), moe::IoError);
  EXPECT_FALSE(fs::exists(step_dir(tmp, 2)));
}

TEST_F(Checkpoint, LockArgumentErrors) {
  EXPECT_THROW(moe::io::CheckpointDirLock(comm, ""), moe::ConfigError);
  spit(tmp.path() + "/file", "x");
  try {
    moe::io::CheckpointDirLock const lock(comm, tmp.path() + "/file/ckpt");
    ADD_FAILURE() << "locked a directory that cannot exist";
  } catch (moe::IoError const& e) {
    EXPECT_NE(std::string(e.what()).find("cannot create the checkpoint directory"),
              std::string::npos)
        << e.what();
  }
  moe::io::CheckpointDirLock const none;
  EXPECT_FALSE(none.held());
  EXPECT_EQ(none.dir(), "");
}
