// A checkpoint written by the code before the format moved into include/moe/io/ (commit 86ee19f;
// tests/data/checkpoint_v1/README.md says how) still reads: index, SHA-256, every tensor's shape
// and values, and a load through moe::io::load_latest_checkpoint, whole and in blocks.
#include "mpi_on_demand.hpp"

#include <moe/io/checkpoint.hpp>
#include <moe/io/checkpoint_index.hpp>
#include <moe/io/safetensors.hpp>
#include <moe/io/sha256.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::string const kDir = std::string(MOE_TEST_DATA_DIR) + "/checkpoint_v1";
std::string const kStep = kDir + "/step_00000002";

/// What the checkpoint holds, read from the file when it was checked in: each tensor's name,
/// shape, first and last element (exact as floats) and the sum of its elements (in order, in
/// double).
char const* const kTable = R"(
opt_state.mu.final_norm.scale        8     0.00500681205   0.0644633919    0.097640679101459682
opt_state.mu.layers_0.moe.gate       8x4   -0.00133081165  -0.00263346918  2.5193003239110112e-10
opt_state.mu.layers_0.moe.wi_0       4x8x8 -0.000841469911 0.000502809591  0.0042041313706704386
opt_state.mu.layers_0.moe.wi_1       4x8x8 -0.00256024045  -0.000203447315 0.023420522809075806
opt_state.mu.layers_0.moe.wo         4x8x8 0.00200208486   0.000524707662  0.0063583108227476259
opt_state.mu.layers_0.pre_norm.scale 8     -0.00787044037  -0.00601484999  -0.018270582178956829
opt_state.mu.output_projection       8x16  0.00406564632   -0.0198377296   -1.7636921256780624e-08
opt_state.mu.token_embedding         16x8  0               0.000786028628  0.011939726726268418
opt_state.mu.token_mixing            4x8   -0.00048293604  0.00463968748   0.025775954829441616
opt_state.nu.final_norm.scale        8     0.000182147982  0.0179480966    0.02130632259286358
opt_state.nu.layers_0.moe.gate       8x4   7.54487019e-06  6.30666982e-05  0.0006108995343083734
opt_state.nu.layers_0.moe.wi_0       4x8x8 2.72070474e-06  1.46721732e-06  0.0015173966475847678
opt_state.nu.layers_0.moe.wi_1       4x8x8 1.97917961e-05  2.7099648e-07   0.0026111556508990191
opt_state.nu.layers_0.moe.wo         4x8x8 2.43890754e-05  7.91359525e-07  0.0015906942061282292
opt_state.nu.layers_0.pre_norm.scale 8     0.000167424208  9.79390898e-05  0.00074054234028153587
opt_state.nu.output_projection       8x16  8.83249741e-05  0.00142700924   0.052968777407073731
opt_state.nu.token_embedding         16x8  0               3.08920426e-06  0.003234872748574702
opt_state.nu.token_mixing            4x8   1.24371745e-05  6.48235655e-05  0.010972621419568895
params.final_norm.scale              8     1.00141203      0.994940341     7.9860880970954895
params.layers_0.moe.gate             8x4   -0.00875383988  0.0822210908    -2.7803202044451609
params.layers_0.moe.wi_0             4x8x8 -0.56755209     0.225499183     -2.1991568681551144
params.layers_0.moe.wi_1             4x8x8 -0.172268063    0.649749339     -1.2831428403151222
params.layers_0.moe.wo               4x8x8 0.188932002     0.223631009     0.13816117442911491
params.layers_0.pre_norm.scale       8     1.00560367      1.00560164      7.9957413077354431
params.output_projection             8x16  0.164772749     -0.697311342    -5.451990601606667
params.token_embedding               16x8  -0.528142154    -1.48192036     0.37554151564836502
params.token_mixing                  4x8   1.00353003      -0.507881045    6.8789314031600952
)";

struct Expected {
  std::string name;
  std::vector<std::int64_t> shape;
  float first = 0, last = 0;
  double sum = 0;
};

std::vector<Expected> const& expected() {
  static std::vector<Expected> const table = [] {
    std::vector<Expected> out;
    std::istringstream in(kTable);
    Expected e;
    std::string shape;
    while (in >> e.name >> shape >> e.first >> e.last >> e.sum) {
      e.shape.clear();
      std::istringstream dims(shape);
      for (std::string d; std::getline(dims, d, 'x');) e.shape.push_back(std::stoll(d));
      out.push_back(e);
    }
    return out;
  }();
  return table;
}

std::int64_t numel(std::vector<std::int64_t> const& shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

void expect_values(Expected const& e, std::vector<float> const& v) {
  ASSERT_EQ(static_cast<std::int64_t>(v.size()), numel(e.shape)) << e.name;
  EXPECT_EQ(v.front(), e.first) << e.name;
  EXPECT_EQ(v.back(), e.last) << e.name;
  double sum = 0;
  for (float x : v) sum += x;
  EXPECT_DOUBLE_EQ(sum, e.sum) << e.name;
}

}  // namespace

TEST(CheckpointV1, IndexAndChecksum) {
  moe::io::CheckpointIndex const ix = moe::io::read_checkpoint_index(kStep);
  EXPECT_EQ(ix.step, 2);
  EXPECT_EQ(ix.file, "model.safetensors");
  EXPECT_EQ(ix.bytes, 16280);
  EXPECT_EQ(ix.sha256, "da209b1af1f18e0673fc1d1a045c8149406aceae5ef90ae13a4c4cd5a7ddfea3");
  std::uint64_t size = 0;
  EXPECT_EQ(moe::io::file_sha256(kStep + "/model.safetensors", size), ix.sha256);
  EXPECT_EQ(size, 16280u);
  ASSERT_EQ(ix.tensors.size(), expected().size());
  for (std::size_t i = 0; i < ix.tensors.size(); ++i) {
    EXPECT_EQ(ix.tensors[i].name, expected()[i].name);
    EXPECT_EQ(ix.tensors[i].dtype, moe::io::DType::F32) << ix.tensors[i].name;
    EXPECT_EQ(ix.tensors[i].shape, expected()[i].shape) << ix.tensors[i].name;
  }
}

TEST(CheckpointV1, EveryTensorVerifiesWithItsShapeAndValues) {
  std::map<std::string, moe::io::TensorSpec> requested;
  for (Expected const& e : expected()) requested[e.name] = {moe::io::DType::F32, e.shape, 0};
  moe::io::File const f = moe::io::verify_checkpoint(kStep, 2, requested);
  EXPECT_EQ(f.size(), expected().size());
  for (Expected const& e : expected()) expect_values(e, f.get<float>(e.name));
  EXPECT_EQ(f.metadata.at("format"), "train_moe/1");
  EXPECT_EQ(f.metadata.at("step"), "2");
  EXPECT_EQ(f.metadata.at("model.num_experts"), "4");
  EXPECT_EQ(f.metadata.at("run.schedule_steps"), "4");
  EXPECT_EQ(f.metadata.size(), 25u);
}

// The loader of today on the bytes of yesterday: every tensor whole, and the MoE weights once
// more as blocks (halves along the expert axis, quarters along the last axis), as a run on another
// layout would ask for them. Loading only reads the directory.
TEST(CheckpointV1, LoadsWholeAndInBlocks) {
  moe::comm::Communicator const comm(moe_test::self_comm());
  std::vector<std::vector<float>> whole(expected().size());
  std::vector<moe::io::BlockRef> refs;
  for (std::size_t i = 0; i < expected().size(); ++i) {
    Expected const& e = expected()[i];
    whole[i].assign(static_cast<std::size_t>(numel(e.shape)), -1.0f);
    refs.push_back({e.name,
                    {e.shape, e.shape, std::vector<std::int64_t>(e.shape.size(), 0)},
                    "F32",
                    whole[i].data()});
  }
  struct Part {
    std::string name;
    moe::TensorBlock block;
    std::vector<float> data;
  };
  std::vector<Part> parts;
  for (char const* w : {"params.layers_0.moe.wi_0", "opt_state.nu.layers_0.moe.wo"}) {
    for (std::int64_t e0 : {0, 2}) parts.push_back({w, {{4, 8, 8}, {2, 8, 8}, {e0, 0, 0}}, {}});
    for (std::int64_t f0 : {0, 2, 4, 6})
      parts.push_back({w, {{4, 8, 8}, {4, 8, 2}, {0, 0, f0}}, {}});
  }
  for (Part& p : parts) {
    p.data.assign(static_cast<std::size_t>(numel(p.block.local_shape)), -1.0f);
    refs.push_back({p.name, p.block, "F32", p.data.data()});
  }

  std::map<std::string, std::string> meta;
  std::int64_t step = -1;
  ASSERT_TRUE(moe::io::load_latest_checkpoint(comm, kDir, refs, meta, step));
  EXPECT_EQ(step, 2);
  std::set<std::string> entries;
  for (auto const& e : std::filesystem::directory_iterator(kDir))
    entries.insert(e.path().filename().string());
  EXPECT_EQ(entries, (std::set<std::string>{"README.md", "step_00000002"})) << "a load only reads";
  EXPECT_EQ(meta, moe::io::File::read(kStep + "/model.safetensors").metadata);
  for (std::size_t i = 0; i < expected().size(); ++i) expect_values(expected()[i], whole[i]);

  // Each block is its box of the whole tensor.
  for (Part const& p : parts) {
    std::size_t t = 0;
    while (expected()[t].name != p.name) ++t;
    auto const& b = p.block;
    std::size_t k = 0;
    for (std::int64_t a = 0; a < b.local_shape[0]; ++a)
      for (std::int64_t c = 0; c < b.local_shape[1]; ++c)
        for (std::int64_t d = 0; d < b.local_shape[2]; ++d, ++k) {
          std::int64_t const g = ((b.offset[0] + a) * 8 + (b.offset[1] + c)) * 8 + b.offset[2] + d;
          ASSERT_EQ(p.data[k], whole[t][static_cast<std::size_t>(g)])
              << p.name << " block at " << moe::io::detail::shape_text(b.offset) << ", element "
              << k;
        }
  }
}
