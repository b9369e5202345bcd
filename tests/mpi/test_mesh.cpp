// Multi-rank tests of moe::comm::MeshComm: the one cache of axis-group communicators laid over a
// sharding::Mesh, and errors that every rank raises together (run at 1, 2 and 4 ranks).
#include <moe/comm/mesh_comm.hpp>
#include <moe/sharding/mesh.hpp>

#include <gtest/gtest.h>
#include <moe/comm/mpi.hpp>

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

void check_group(sh::Mesh const& mesh, moe::comm::AxisGroup const& g,
                 std::vector<std::string> const& axes) {
  EXPECT_EQ(g.axes, axes);
  EXPECT_EQ(g.size(), mesh.group_size(axes)) << mesh.to_string();
  EXPECT_EQ(g.rank(), mesh.rank_in_group(world_rank(), axes)) << mesh.to_string();
  check_comm(mesh, g.comm.get(), axes);
}

}  // namespace

TEST(MeshComm, Coordinates) {
  for (auto const& mesh : meshes_for(world_size())) {
    moe::comm::MeshComm mc(MPI_COMM_WORLD, mesh);
    EXPECT_EQ(mc.mesh(), mesh);
    EXPECT_EQ(mc.rank(), world_rank());
    EXPECT_EQ(mc.coords(), mesh.coords(world_rank()));
    for (int i = 0; i < mesh.num_axes(); ++i)
      EXPECT_EQ(mc.coord(mesh.name(i)), mesh.coord(world_rank(), mesh.name(i)));
    EXPECT_EQ(mc.coord("tensor"), 0);
    int cmp = MPI_UNEQUAL;
    MPI_Comm_compare(mc.comm().get(), MPI_COMM_WORLD, &cmp);
    EXPECT_EQ(cmp, MPI_CONGRUENT);  // a duplicate, not the user's communicator
  }
}

TEST(MeshComm, SharesAGivenCommunicator) {
  moe::comm::Communicator const world(MPI_COMM_WORLD);
  moe::comm::MeshComm mc(world, sh::Mesh({{"data", world_size()}}));
  EXPECT_EQ(mc.comm().get(), world.get());
}

TEST(MeshComm, OneAxisGroups) {
  for (auto const& mesh : meshes_for(world_size())) {
    moe::comm::MeshComm mc(MPI_COMM_WORLD, mesh);
    for (int i = 0; i < mesh.num_axes(); ++i) {
      auto const& axis = mesh.name(i);
      auto const& g = mc.group({axis});
      check_group(mesh, g, {axis});
      EXPECT_EQ(g.rank(), mc.coord(axis));
    }
    // An axis the mesh does not have has size 1: a group of this rank alone.
    check_group(mesh, mc.group({"tensor"}), {"tensor"});
    EXPECT_EQ(mc.group({"tensor"}).size(), 1);
  }
}

TEST(MeshComm, Groups) {
  std::vector<std::vector<std::string>> const groups{{"fsdp", "fsdp_transpose"},
                                                     {"data", "fsdp", "expert"},
                                                     {"expert", "fsdp_transpose"},
                                                     {"fsdp_transpose", "expert"},
                                                     {"data", "fsdp", "fsdp_transpose", "expert"},
                                                     {}};
  for (auto const& mesh : meshes_for(world_size())) {
    moe::comm::MeshComm mc(MPI_COMM_WORLD, mesh);
    for (auto const& g : groups) check_group(mesh, mc.group(g), g);
  }
}

TEST(MeshComm, EmptyAxisListIsThisRankAlone) {
  moe::comm::MeshComm mc(MPI_COMM_WORLD, meshes_for(world_size()).back());
  auto const& g = mc.group({});
  EXPECT_EQ(g.size(), 1);
  EXPECT_EQ(g.rank(), 0);
  EXPECT_TRUE(g.axes.empty());
  int cmp = MPI_UNEQUAL;
  MPI_Comm_compare(g.comm.get(), MPI_COMM_SELF, &cmp);
  EXPECT_EQ(cmp, MPI_CONGRUENT);
}

TEST(MeshComm, GroupCacheReturnsTheSameCommunicator) {
  moe::comm::MeshComm mc(MPI_COMM_WORLD, meshes_for(world_size()).back());
  std::vector<std::string> const axes{"fsdp", "expert"};
  EXPECT_FALSE(mc.has_group(axes));
  auto const& first = mc.group(axes);
  EXPECT_TRUE(mc.has_group(axes));
  auto const& again = mc.group(axes);  // cached: no communication (only rank 0 could ask)
  EXPECT_EQ(&again, &first);
  EXPECT_EQ(again.comm.get(), first.comm.get());
  auto const& looked_up = static_cast<moe::comm::MeshComm const&>(mc).group(axes);
  EXPECT_EQ(&looked_up, &first);
  // The order of the axes is part of the key: {expert, fsdp} is another group.
  auto const& reversed = mc.group({"expert", "fsdp"});
  EXPECT_NE(reversed.comm.get(), first.comm.get());
  if (world_rank() == 0) {
    // Only rank 0 asks again: a cached group never communicates, so this cannot hang.
    EXPECT_EQ(mc.group(axes).comm.get(), first.comm.get());
  }
  EXPECT_TRUE(all_ranks(true));
}

TEST(MeshComm, ConstLookupOfAnUnmadeGroupThrowsNamingTheAxes) {
  moe::comm::MeshComm mc(MPI_COMM_WORLD, meshes_for(world_size()).back());
  mc.group({"expert"});
  auto const& cmc = mc;
  EXPECT_EQ(cmc.group({"expert"}).axes, std::vector<std::string>{"expert"});
  std::string msg;
  try {
    cmc.group({"fsdp", "expert"});
  } catch (moe::Error const& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("[fsdp, expert]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("never made"), std::string::npos) << msg;
  EXPECT_THROW(cmc.group({}), moe::Error);
  EXPECT_FALSE(cmc.has_group({"fsdp", "expert"}));
}

TEST(MeshComm, DisagreeingGroupRequestsThrowOnEveryRank) {
  int const n = world_size();
  moe::comm::MeshComm mc(MPI_COMM_WORLD, meshes_for(n).back());
  std::vector<std::string> const mine =
      world_rank() == 0 ? std::vector<std::string>{"expert"} : std::vector<std::string>{"fsdp"};
  std::string msg;
  try {
    mc.group(mine);
  } catch (moe::ConfigError const& e) {
    msg = e.what();
  }
  if (n == 1) {
    EXPECT_EQ(msg, "");  // one rank agrees with itself
  } else {
    EXPECT_TRUE(all_ranks(!msg.empty()));
    EXPECT_NE(msg.find("MeshComm::group"), std::string::npos) << msg;
    EXPECT_FALSE(mc.has_group(mine));  // nothing was cached
  }
}

TEST(MeshComm, RepeatedAxisThrowsOnEveryRank) {
  moe::comm::MeshComm mc(MPI_COMM_WORLD, meshes_for(world_size()).back());
  EXPECT_THROW(mc.group({"expert", "expert"}), moe::ConfigError);
  EXPECT_TRUE(all_ranks(true));  // nobody is left inside a split
}

TEST(MeshComm, CopiesShareCommunicators) {
  auto const mesh = meshes_for(world_size()).back();
  moe::comm::MeshComm a(MPI_COMM_WORLD, mesh);
  MPI_Comm const expert = a.group({"expert"}).comm.get();
  {
    moe::comm::MeshComm b = a;
    EXPECT_EQ(static_cast<moe::comm::MeshComm const&>(b).group({"expert"}).comm.get(), expert);
  }
  // Still valid after the copy is gone.
  check_comm(mesh, a.group({"expert"}).comm.get(), {"expert"});
}

TEST(MeshComm, ProductMismatchThrowsOnEveryRank) {
  int const n = world_size();
  std::string msg;
  try {
    moe::comm::MeshComm mc(MPI_COMM_WORLD, sh::Mesh({{"data", 2}, {"expert", n + 1}}));
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
  // proceed into the splits (which would hang), everyone must throw the same error.
  sh::Mesh const mesh = world_rank() == 0 ? sh::Mesh({{"data", n}}) : sh::Mesh({{"data", n + 1}});
  std::string msg;
  try {
    moe::comm::MeshComm mc(MPI_COMM_WORLD, mesh);
  } catch (moe::ConfigError const& e) {
    msg = e.what();
  }
  if (n == 1) {
    EXPECT_EQ(msg, "");  // one rank agrees with itself and its mesh fits
  } else {
    std::string const expected =
        "moe::comm::check_agreement: the mesh differs across ranks: rank "
        "1 has \"data=" +
        std::to_string(n + 1) + "\" but rank 0 has \"data=" + std::to_string(n) +
        "\"; every rank must be given the same mesh";
    EXPECT_EQ(msg, expected);
    EXPECT_TRUE(all_ranks(msg == expected));
  }
}
