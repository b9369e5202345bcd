// The tools' shared input checks (examples/common/moe_cli.hpp) and the library's text helpers
// behind their messages: paths checked up front, duplicate keys, near-miss suggestions, one
// parallelism validation for every tool, and the first difference of two rank fingerprints.
#include <moe/comm/communicator.hpp>
#include <moe/config.hpp>
#include <moe/distributed/parallel_config.hpp>

#include <moe_cli.hpp>
#include <train_moe/config.hpp>

#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace {

namespace fs = std::filesystem;

/// A fresh scratch directory, removed at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() /
           ("moe_cli_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path / "ro", fs::perms::owner_all, ec);
    fs::remove_all(path, ec);
  }
  std::string file(std::string const& name, std::string const& text) const {
    std::ofstream(path / name) << text;
    return (path / name).string();
  }
  std::string operator/(std::string const& name) const { return (path / name).string(); }
};

/// The ConfigError message of f(), or "" when f does not throw one.
template <class F>
std::string config_error(F&& f) {
  try {
    f();
  } catch (moe::ConfigError const& e) {
    return e.what();
  }
  return "";
}

bool has(std::string const& text, std::string const& part) {
  return text.find(part) != std::string::npos;
}

bool running_as_root() { return ::geteuid() == 0; }

}  // namespace

TEST(CliPaths, InputFileMustExistAndNotBeADirectory) {
  TempDir d;
  std::string const f = d.file("a.yml", "num_experts: 4\n");
  EXPECT_NO_THROW(moe::cli::require_input_file("--config", f));
  auto m = config_error([&] { moe::cli::require_input_file("--config", d / "missing.yml"); });
  EXPECT_TRUE(has(m, "--config '" + d / "missing.yml" + "' does not exist")) << m;
  m = config_error([&] { moe::cli::require_input_file("dataset_path", d.path.string()); });
  EXPECT_TRUE(has(m, "dataset_path '" + d.path.string() + "' is a directory")) << m;
  m = config_error([&] { moe::cli::require_input_file("--in", ""); });
  EXPECT_TRUE(has(m, "--in is empty")) << m;
  if (!running_as_root()) {  // root reads anything
    fs::permissions(f, fs::perms::none);
    m = config_error([&] { moe::cli::require_input_file("--config", f); });
    EXPECT_TRUE(has(m, "cannot be opened for reading")) << m;
  }
}

TEST(CliPaths, OutputFileIsNotAnInputNorADirectory) {
  TempDir d;
  std::string const in = d.file("case.safetensors", "x");
  EXPECT_NO_THROW(moe::cli::require_output_file("--out", d / "out.safetensors", {{"--in", in}}));
  auto m = config_error([&] { moe::cli::require_output_file("--out", in, {{"--in", in}}); });
  EXPECT_TRUE(has(m, "is the same file as --in")) << m;
  // Through a link, and through a relative spelling of the same path.
  fs::create_symlink(in, d / "link.safetensors");
  m = config_error([&] {
    moe::cli::require_output_file("--out", d / "link.safetensors", {{"--in", in}});
  });
  EXPECT_TRUE(has(m, "is the same file as --in")) << m;
  m = config_error([&] {
    moe::cli::require_output_file("--out", (d.path / "sub" / ".." / "case.safetensors").string(),
                                  {{"--in", in}});
  });
  EXPECT_FALSE(m.empty());  // sub/ does not exist: refused either way
  m = config_error([&] {
    moe::cli::require_output_file("--out", (d.path / "." / "case.safetensors").string(),
                                  {{"--in", in}});
  });
  EXPECT_TRUE(has(m, "is the same file as --in")) << m;
  m = config_error([&] { moe::cli::require_output_file("--out", d.path.string(), {}); });
  EXPECT_TRUE(has(m, "is a directory")) << m;
  m = config_error([&] { moe::cli::require_output_file("--out", d / "no/such/out.st", {}); });
  EXPECT_TRUE(has(m, "does not exist")) << m;
  // A not-yet-existing output that an input will not become is fine; nothing was created.
  EXPECT_FALSE(fs::exists(d / "out.safetensors"));
}

TEST(CliPaths, OutputDirectory) {
  TempDir d;
  EXPECT_NO_THROW(moe::cli::require_output_dir("checkpoint_dir", d.path.string()));
  EXPECT_NO_THROW(moe::cli::require_output_dir("checkpoint_dir", d / "new/deeper"));
  EXPECT_FALSE(fs::exists(d / "new"));  // checked, not created
  std::string const f = d.file("file", "");
  auto m = config_error([&] { moe::cli::require_output_dir("checkpoint_dir", f); });
  EXPECT_TRUE(has(m, "checkpoint_dir '" + f + "' is a file; expected a directory")) << m;
  m = config_error([&] { moe::cli::require_output_dir("checkpoint_dir", f + "/below"); });
  EXPECT_TRUE(has(m, "is not a directory")) << m;
  if (!running_as_root()) {
    fs::create_directory(d / "ro");
    fs::permissions(d / "ro", fs::perms::owner_read | fs::perms::owner_exec);
    m = config_error([&] { moe::cli::require_output_dir("checkpoint_dir", d / "ro"); });
    EXPECT_TRUE(has(m, "is not writable")) << m;
  }
}

TEST(CliConfig, DuplicateKeysAreErrors) {
  TempDir d;
  std::string const f = d.file("dup.yml", "num_experts: 4\nbase_emb_dim: 8\nnum_experts: 6\n");
  auto m = config_error([&] { moe::cli::read_yaml(f); });
  EXPECT_TRUE(has(m, "sets key 'num_experts' twice (lines 1 and 3)")) << m;
  EXPECT_EQ(moe::cli::read_yaml(d.file("ok.yml", "num_experts: 4\nbase_emb_dim: 8\n")).size(), 2u);
  m = config_error([&] {
    moe::cli::require_unique_keys({{"steps", "5"}, {"seed", "1"}, {"steps", "6"}},
                                  "the command line");
  });
  EXPECT_TRUE(has(m, "the command line sets key 'steps' twice ('5', then '6')")) << m;
  m = config_error([&] { moe::cli::read_yaml(d.path.string(), "--config"); });
  EXPECT_TRUE(has(m, "--config '" + d.path.string() + "' is a directory")) << m;
}

TEST(CliConfig, NearMissKeysAreSuggested) {
  EXPECT_EQ(moe::detail::nearest("num_expert", moe::LayerConfig::keys()), "num_experts");
  EXPECT_EQ(moe::detail::nearest("dY", {"x", "dy", "gate"}), "dy");
  EXPECT_EQ(moe::detail::nearest("bogus_key", moe::LayerConfig::keys()), "");
  moe::LayerConfig cfg;
  auto m = config_error([&] { cfg.set("capacity_factr", "2"); });
  EXPECT_TRUE(has(m, "did you mean 'capacity_factor'?")) << m;
  moe::ParallelConfig par;
  m = config_error([&] { moe::cli::apply(cfg, par, {{"ici_expert_paralelism", "2"}}); });
  EXPECT_TRUE(has(m, "did you mean 'ici_expert_parallelism'?")) << m;
  train::TrainConfig tc;
  m = config_error([&] { tc.set("stepz", "3"); });
  EXPECT_TRUE(has(m, "did you mean 'steps'?")) << m;
}

TEST(CliConfig, OneParallelismValidationForEveryTool) {
  // Two fill degrees: rejected by ParallelConfig::validate, so by moe-layer-run, moe-shard
  // (compute_layout) and train_moe alike.
  moe::ParallelConfig par;
  par.set("ici_fsdp_parallelism", "-1");
  par.set("ici_data_parallelism", "-1");
  auto m = config_error([&] { par.validate(); });
  EXPECT_TRUE(has(m, "ici_data_parallelism=-1 and ici_fsdp_parallelism=-1")) << m;
  train::TrainConfig tc;
  tc.given.clear();
  tc.set("ici_fsdp_parallelism", "-1");
  tc.set("ici_data_parallelism", "-1");
  m = config_error([&] { tc.validate(); });
  EXPECT_TRUE(has(m, "at most one ici_*_parallelism degree may be -1")) << m;
  // The default's -1 (ici_expert_parallelism) still yields to one the user gives.
  train::TrainConfig t2;
  t2.given.clear();
  t2.set("ici_fsdp_parallelism", "-1");
  EXPECT_NO_THROW(t2.validate());
  EXPECT_EQ(t2.par.ici_expert_parallelism, 1);
  EXPECT_EQ(t2.par.ici_fsdp_parallelism, -1);
  moe::ParallelConfig rb;
  rb.set("ragged_buffer_factor", "0");
  m = config_error([&] { rb.validate(); });
  EXPECT_TRUE(has(m, "ragged_buffer_factor=0 must be > 0")) << m;
}

TEST(CliConfig, AgreementNamesTheFirstDifferingField) {
  using moe::comm::detail::first_difference;
  auto d = first_difference("E=8;K=2|steps=5|dtype=float32", "E=8;K=2|steps=10|dtype=float32");
  EXPECT_EQ(d.first, "steps=5");
  EXPECT_EQ(d.second, "steps=10");
  // Beyond the first 300 characters too (the old message cut both texts there).
  std::string pad(400, 'a');
  d = first_difference("p=" + pad + "|dtype=float32", "p=" + pad + "|dtype=float64");
  EXPECT_EQ(d.first, "dtype=float32");
  EXPECT_EQ(d.second, "dtype=float64");
  // Unstructured texts: the neighbourhood of the first differing character.
  d = first_difference(pad + "XYZ", pad + "XQZ");
  EXPECT_TRUE(has(d.first, "XYZ")) << d.first;
  EXPECT_TRUE(has(d.second, "XQZ")) << d.second;
  EXPECT_LT(d.first.size(), 200u);
}
