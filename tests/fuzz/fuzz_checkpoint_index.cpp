// Fuzz target: the checkpoint index reader (moe/io/checkpoint_index.hpp):
// moe::io::read_checkpoint_index, and moe::io::verify_checkpoint, which checks a checkpoint
// directory against its index before a run resumes from it.
//
// The input is the text of index.json. A scratch step directory holds it next to a fixed, valid
// model.safetensors (written once; the seed corpus's indexes record its size and SHA-256, so
// mutations reach the comparisons behind the checksum). read_index parses the index; when it
// succeeds, verify checks the directory for the step it names, with tensors requested as
// train_moe requests them. A refusal must be a moe::Error.

#include "fuzz_common.hpp"

#include <moe/io/checkpoint_index.hpp>
#include <moe/io/safetensors.hpp>

#include <cstdint>
#include <map>
#include <string>

namespace {

namespace io = moe::io;
using moe_fuzz::expect_moe_errors;
using moe_fuzz::require;

/// The scratch step directory, with the fixed model.safetensors in it.
std::string const& step_dir() {
  static std::string const dir = [] {
    io::File model;
    model.metadata["step"] = "7";
    model.set("w", io::Tensor::from<float>({2, 3}, {0, 1, 2, 3, 4, 5}));
    model.set("b", io::Tensor::from<std::int64_t>({3}, {-1, 0, 1}));
    model.set("empty", io::Tensor::from<double>({0, 4}, {}));
    model.write(moe_fuzz::scratch_dir() + "/" + io::kCheckpointModelFile);
    return moe_fuzz::scratch_dir();
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  std::string const& dir = step_dir();
  moe_fuzz::write_file(dir + "/" + io::kCheckpointIndexFile, data, size);
  io::CheckpointIndex ix;
  if (!expect_moe_errors("read_index", [&] { ix = io::read_checkpoint_index(dir); })) return 0;
  require(ix.step >= 0 && ix.bytes >= 0, "read_index accepted a negative step or size");
  for (io::CheckpointIndexEntry const& e : ix.tensors)
    for (std::int64_t d : e.shape) require(d >= 0, "read_index accepted a negative dimension");

  // The tensors train_moe would request: the model's own, and one it does not have.
  std::map<std::string, io::TensorSpec> requested;
  requested["w"] = io::TensorSpec{io::DType::F32, {2, 3}, 0};
  requested["b"] = io::TensorSpec{io::DType::I64, {3}, 1};
  expect_moe_errors("verify", [&] {
    io::File const f = io::verify_checkpoint(dir, ix.step, requested);
    require(f.has("w") && f.has("b"), "verify accepted a file without the requested tensors");
  });
  requested["missing"] = io::TensorSpec{io::DType::F64, {1}, 0};
  bool const ok =
      expect_moe_errors("verify", [&] { io::verify_checkpoint(dir, ix.step, requested); });
  require(!ok, "verify accepted a checkpoint without a requested tensor");
  return 0;
}
