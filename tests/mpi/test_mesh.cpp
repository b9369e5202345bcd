// Multi-rank tests of moe::sharding::MeshComm: per-axis and per-group sub-communicators, and
// errors that every rank raises together (run at 1, 2 and 4 ranks).
#include <moe/sharding/mesh.hpp>

#include <gtest/gtest.h>
#include <mpi.h>

#include <string>
#include <utility>
#include <vector>

namespace sh = moe::sharding;

namespace {

int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

/// World ranks of the members of `comm`, in `comm`'s rank order.
std::vector<int> members(MPI_Comm comm) {
  int n = 0;
  MPI_Comm_size(comm, &n);
  std::vector<int> out(static_cast<std::size_t>(n));
  int const me = world_rank();
  MPI_Allgather(&me, 1, MPI_INT, out.data(), 1, MPI_INT, comm);
  return out;
}

/// True on every rank iff `ok` holds on every rank.
bool all_ranks(bool ok) {
  int in = ok ? 1 : 0, out = 0;
  MPI_Allreduce(&in, &out, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return out == 1;
}

/// Meshes whose product is the world size: every axis layout the rank count allows.
std::vector<sh::Mesh> meshes_for(int n) {
  std::vector<sh::Mesh> out;
  out.push_back(sh::Mesh::from_ici({{"ici_fsdp_parallelism", -1}}, n,
                                   {"data", "fsdp", "fsdp_transpose", "expert"}));
  out.push_back(sh::Mesh::from_ici({{"ici_expert_parallelism", -1}}, n,
                                   {"data", "fsdp", "fsdp_transpose", "expert"}));
  if (n % 2 == 0)
    out.push_back(sh::Mesh::from_ici({{"ici_data_parallelism", 2}, {"ici_expert_parallelism", -1}},
                                     n, {"data", "fsdp", "fsdp_transpose", "expert"}));
  if (n % 4 == 0)
    out.push_back(sh::Mesh({{"data", 1}, {"fsdp", 2}, {"fsdp_transpose", 2}, {"expert", n / 4}}));
  return out;
}

void check_comm(sh::Mesh const& mesh, MPI_Comm comm, std::vector<std::string> const& axes) {
  int const me = world_rank();
  int size = 0, rank = 0;
  MPI_Comm_size(comm, &size);
  MPI_Comm_rank(comm, &rank);
  EXPECT_EQ(size, mesh.group_size(axes)) << mesh.to_string();
  EXPECT_EQ(rank, mesh.rank_in_group(me, axes)) << mesh.to_string();
  EXPECT_EQ(members(comm), mesh.group_members(me, axes)) << mesh.to_string();
}

}  // namespace

TEST(MeshComm, AxisCommunicators) {
  for (auto const& mesh : meshes_for(world_size())) {
    sh::MeshComm mc(MPI_COMM_WORLD, mesh);
    EXPECT_EQ(mc.rank(), world_rank());
    EXPECT_EQ(mc.coords(), mesh.coords(world_rank()));
    int cmp = MPI_UNEQUAL;
    MPI_Comm_compare(mc.comm(), MPI_COMM_WORLD, &cmp);
    EXPECT_EQ(cmp, MPI_CONGRUENT);  // a duplicate, not the user's communicator
    for (int i = 0; i < mesh.num_axes(); ++i) {
      auto const& axis = mesh.name(i);
      check_comm(mesh, mc.axis_comm(axis), {axis});
      int r = -1;
      MPI_Comm_rank(mc.axis_comm(axis), &r);
      EXPECT_EQ(r, mc.coord(axis));
    }
    EXPECT_EQ(mc.coord("tensor"), 0);
    EXPECT_THROW(mc.axis_comm("tensor"), moe::ConfigError);
  }
}

TEST(MeshComm, GroupCommunicators) {
  std::vector<std::vector<std::string>> const groups{{"fsdp", "fsdp_transpose"},
                                                     {"data", "fsdp", "expert"},
                                                     {"expert", "fsdp_transpose"},
                                                     {"fsdp_transpose", "expert"},
                                                     {"data", "fsdp", "fsdp_transpose", "expert"},
                                                     {}};
  for (auto const& mesh : meshes_for(world_size())) {
    sh::MeshComm mc(MPI_COMM_WORLD, mesh);
    for (auto const& g : groups) {
      MPI_Comm const c = mc.group_comm(g);
      check_comm(mesh, c, g);
      EXPECT_EQ(mc.group_comm(g), c);  // cached: the second call does not communicate
    }
  }
}

TEST(MeshComm, CopiesShareCommunicators) {
  auto const mesh = meshes_for(world_size()).back();
  sh::MeshComm a(MPI_COMM_WORLD, mesh);
  MPI_Comm const expert = a.axis_comm("expert");
  {
    sh::MeshComm b = a;
    EXPECT_EQ(b.axis_comm("expert"), expert);
  }
  // Still valid after the copy is gone.
  check_comm(mesh, a.axis_comm("expert"), {"expert"});
}

TEST(MeshComm, ProductMismatchThrowsOnEveryRank) {
  int const n = world_size();
  std::string msg;
  try {
    sh::MeshComm mc(MPI_COMM_WORLD, sh::Mesh({{"data", 2}, {"expert", n + 1}}));
  } catch (moe::ConfigError const& e) {
    msg = e.what();
  }
  std::string const expected = "mesh product data=2 x expert=" + std::to_string(n + 1) + " = " +
                               std::to_string(2 * (n + 1)) +
                               " does not equal the communicator size " + std::to_string(n);
  EXPECT_EQ(msg, expected);
  EXPECT_TRUE(all_ranks(msg == expected));
  // The communicator is still usable afterwards (no collective was left half-done).
  EXPECT_TRUE(all_ranks(true));
}

TEST(MeshComm, DisagreeingMeshesThrowOnEveryRank) {
  int const n = world_size();
  // Rank 0 asks for a mesh of the right size, the others for one of the wrong size: nobody may
  // proceed into the splits (which would hang), everyone must throw.
  sh::Mesh const mesh = world_rank() == 0 ? sh::Mesh({{"data", n}}) : sh::Mesh({{"data", n + 1}});
  bool threw = false;
  try {
    sh::MeshComm mc(MPI_COMM_WORLD, mesh);
  } catch (moe::ConfigError const&) {
    threw = true;
  }
  if (n == 1) {
    EXPECT_FALSE(threw);  // one rank agrees with itself and its mesh fits
  } else {
    EXPECT_TRUE(all_ranks(threw));
  }
}
