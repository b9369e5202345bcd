// moe-layer-run: runs one MoE layer on a case file over MPI ranks and writes the result
// (DESIGN.md §7).
//
//   mpirun -np N moe-layer-run --config CFG.yml --in CASE.safetensors --out RESULT.safetensors
//                              [--gmm auto|onednn|vendor|tiled|dense] [key=value ...]
//   mpirun -np N moe-layer-run --example [key=value ...]   (built-in case, readable summary)
//
// CASE holds global tensors x[B,S,D], gate[D,E], optional gate_bias[E], wi_0/wi_1[E,D,F],
// wo[E,F,D], optional shared_wi_0/shared_wi_1[D,Fs], shared_wo[Fs,D], optional dy[B,S,D], all
// float32 or all float64; the layer computes in that dtype. Dimensions the config leaves unset are
// taken from CASE. The config (YAML + key=value overrides) holds LayerConfig keys and
// ParallelConfig keys (ici_*_parallelism, use_ring_of_experts, custom_mesh_and_rule, ...).
//
// Every rank reads CASE and CFG, builds the DistributedMoeLayer for the global batch [B,S] and
// loads its blocks; forward (+ backward with dy) runs over all ranks; rank 0 gathers the blocks
// (one rank per distinct block) and writes RESULT atomically. Errors on any rank become the same
// one-line message and exit code 2 on every rank.
#include <moe/distributed/layer.hpp>
#include <moe/io/safetensors.hpp>
#include <moe/moe.hpp>

#include <moe_blocks.hpp>
#include <moe_cli.hpp>

#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>

namespace {

struct Args {
  std::string config, in, out, gmm = "auto";
  bool example = false;
  moe::cli::KeyValues overrides;
};

char const* const kUsage =
    "usage: mpirun -np N moe-layer-run --config CFG.yml --in CASE.safetensors\n"
    "                    --out RESULT.safetensors [--gmm auto|onednn|vendor|tiled|dense] "
    "[key=value ...]\n"
    "       mpirun -np N moe-layer-run --example [key=value ...]\n"
    "keys: LayerConfig keys (num_experts, ...) and ParallelConfig keys (ici_data_parallelism,\n"
    "      ici_fsdp_parallelism, ici_fsdp_transpose_parallelism, ici_expert_parallelism,\n"
    "      ici_tensor_parallelism, ici_context_parallelism, use_ring_of_experts,\n"
    "      ragged_buffer_factor, moe_fsdp_use_two_stage_all_gather, custom_mesh_and_rule)\n";

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string const s = argv[i];
    auto value = [&](char const* flag) {
      if (i + 1 >= argc) throw moe::ConfigError(moe::detail::cat(flag, " needs a value"));
      return std::string(argv[++i]);
    };
    if (s == "--config")
      a.config = value("--config");
    else if (s == "--in")
      a.in = value("--in");
    else if (s == "--out")
      a.out = value("--out");
    else if (s == "--gmm")
      a.gmm = value("--gmm");
    else if (s == "--example")
      a.example = true;
    else if (s.rfind("--", 0) == 0)
      throw moe::ConfigError(moe::detail::cat("unknown flag '", s, "'"));
    else
      a.overrides.push_back(moe::cli::parse_override(s));
  }
  if (a.gmm != "auto" && a.gmm != "onednn" && a.gmm != "vendor" && a.gmm != "tiled" &&
      a.gmm != "dense")
    throw moe::ConfigError(
        moe::detail::cat("--gmm ", a.gmm, " is not one of auto|onednn|vendor|tiled|dense"));
  if (!a.example && (a.config.empty() || a.in.empty() || a.out.empty()))
    throw moe::ConfigError("--config, --in and --out are required (or --example)");
  return a;
}

using Mem = Kokkos::DefaultExecutionSpace::memory_space;

template <class T, class V>
void fill_view(V const& v, std::vector<T> const& vals) {
  auto h = Kokkos::create_mirror_view(v);
  auto* p = h.data();
  for (std::size_t i = 0; i < vals.size(); ++i) p[i] = vals[i];
  Kokkos::deep_copy(v, h);
}

template <class T, class V>
std::vector<T> read_view(V const& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<T>(h.data(), h.data() + h.span());
}

std::vector<std::int64_t> shape_of(moe::io::File const& f, std::string const& name,
                                   std::size_t rank) {
  auto const& t = f.at(name);
  if (t.shape.size() != rank)
    throw moe::ShapeError(
        moe::detail::cat("CASE tensor ", name, " has rank ", t.shape.size(), ", expected ", rank));
  return t.shape;
}

/// Loads this rank's block of CASE tensor `name` into `v` (ShapeError when the CASE tensor does
/// not have the global shape the config needs).
template <class T, class V>
void load_block(moe::io::File const& f, std::string const& name, moe::TensorBlock const& b,
                V const& v) {
  auto const& t = f.at(name);
  if (t.shape != b.global_shape)
    throw moe::ShapeError(
        moe::detail::cat("CASE tensor ", name, " has shape ", moe::io::detail::shape_str(t.shape),
                         " but the config needs ", moe::io::detail::shape_str(b.global_shape)));
  fill_view(v, moe::cli::take_block(f.get<T>(name), b));
}

/// What every rank knows after reading the arguments, the config and CASE (no collectives).
struct Setup {
  Args args;
  moe::LayerConfig cfg;
  moe::ParallelConfig par;
  moe::io::File in;
  moe::io::DType dtype = moe::io::DType::F32;
  std::int64_t B = 0, S = 0;
};

/// The built-in example: a small Mixtral-style layer with random weights, float32.
moe::io::File example_case(moe::LayerConfig& cfg) {
  cfg.num_experts = 8;
  cfg.num_experts_per_tok = 2;
  cfg.base_emb_dim = 64;
  cfg.base_moe_mlp_dim = 128;
  cfg.load_balance_loss_weight = 0.01;
  std::int64_t const B = 8, S = 16, D = 64, E = 8, F = 128;
  std::mt19937_64 rng(1234);
  std::normal_distribution<double> n01(0.0, 1.0);
  auto rnd = [&](std::vector<std::int64_t> shape, double scale) {
    std::vector<float> v(static_cast<std::size_t>(moe::cli::numel(shape)));
    for (auto& e : v) e = float(scale * n01(rng));
    return moe::io::Tensor::from<float>(shape, v);
  };
  moe::io::File f;
  f.set("x", rnd({B, S, D}, 1.0));
  f.set("gate", rnd({D, E}, 1.0 / std::sqrt(double(D))));
  f.set("wi_0", rnd({E, D, F}, 1.0 / std::sqrt(double(D))));
  f.set("wi_1", rnd({E, D, F}, 1.0 / std::sqrt(double(D))));
  f.set("wo", rnd({E, F, D}, 1.0 / std::sqrt(double(F))));
  f.set("dy", rnd({B, S, D}, 1.0));
  return f;
}

/// Purely local: parses the arguments, reads CFG and CASE, routes every key to LayerConfig or
/// ParallelConfig and checks CASE against the config.
Setup prepare(int argc, char** argv) {
  Setup s;
  s.args = parse_args(argc, argv);
  auto& cfg = s.cfg;
  auto& in = s.in;
  if (s.args.example) {
    in = example_case(cfg);
    // Default layout of the example: the batch split over all ranks, unless a degree is given.
    bool any_ici = false;
    for (auto const& kv : s.args.overrides) any_ici = any_ici || kv.first.rfind("ici_", 0) == 0;
    if (!any_ici) s.par.ici_data_parallelism = -1;
  } else {
    in = moe::io::File::read(s.args.in);
    // Dimensions default to the CASE's; the config may restate them (and must agree).
    auto const g = shape_of(in, "gate", 2);
    auto const w = shape_of(in, "wi_0", 3);
    cfg.base_emb_dim = int(g[0]);
    cfg.num_experts = int(g[1]);
    cfg.base_moe_mlp_dim = int(w[2]);
    if (in.has("shared_wi_0"))
      cfg.shared_experts = int(shape_of(in, "shared_wi_0", 2)[1] / std::max<std::int64_t>(1, w[2]));
    cfg.routed_bias = in.has("gate_bias");
    moe::cli::apply(cfg, s.par, moe::cli::read_yaml(s.args.config));
  }
  moe::cli::apply(cfg, s.par, s.args.overrides);
  cfg.validate();

  auto const xs = shape_of(in, "x", 3);
  s.B = xs[0];
  s.S = xs[1];
  if (xs[2] != cfg.base_emb_dim)
    throw moe::ShapeError(moe::detail::cat("CASE tensor x has shape ",
                                           moe::io::detail::shape_str(xs),
                                           " but base_emb_dim=", cfg.base_emb_dim));
  if (in.has("dy") && in.at("dy").shape != xs)
    throw moe::ShapeError(
        moe::detail::cat("CASE tensor dy has shape ", moe::io::detail::shape_str(in.at("dy").shape),
                         " but x has shape ", moe::io::detail::shape_str(xs), ": they must agree"));
  s.dtype = in.at("x").dtype;
  for (auto const& name : in.names())
    if (in.at(name).dtype != s.dtype)
      throw moe::IoError(moe::detail::cat(
          "CASE tensor ", name, " is ", moe::io::dtype_name(in.at(name).dtype), " but x is ",
          moe::io::dtype_name(s.dtype), ": all tensors share one dtype"));
  if (s.dtype != moe::io::DType::F64 && s.dtype != moe::io::DType::F32)
    throw moe::IoError(moe::detail::cat("CASE x has dtype ", moe::io::dtype_name(s.dtype),
                                        ": only F32 and F64 are supported"));
  if (cfg.routed_bias && !in.has("gate_bias"))
    throw moe::ConfigError("routed_bias=true but CASE has no gate_bias tensor");
  if (!cfg.routed_bias && in.has("gate_bias"))
    throw moe::ConfigError("CASE has gate_bias but routed_bias=false: set routed_bias=true");
  if (cfg.shared_experts > 0) {
    for (char const* n : {"shared_wi_0", "shared_wi_1", "shared_wo"})
      if (!in.has(n))
        throw moe::ConfigError(moe::detail::cat("shared_experts=", cfg.shared_experts,
                                                " but CASE has no ", n, " tensor"));
  } else if (in.has("shared_wi_0") || in.has("shared_wi_1") || in.has("shared_wo")) {
    throw moe::ConfigError("CASE has shared expert tensors but shared_experts=0");
  }
  return s;
}

char const* route_name(moe::ExpertRoute r) {
  switch (r) {
    case moe::ExpertRoute::Local:
      return "local";
    case moe::ExpertRoute::RaggedA2A:
      return "ragged-all-to-all";
    case moe::ExpertRoute::Ring:
      return "ring";
    case moe::ExpertRoute::Replicated:
      return "replicated";
  }
  return "?";
}

struct Summary {
  std::string mesh, route;
};

/// Collective: runs the layer on this rank's blocks and gathers RESULT on rank 0 (empty File on
/// the other ranks).
template <class T, class Gmm>
moe::io::File run_case(moe::comm::Communicator const& world, Setup const& s, Summary& sum) {
  using Layer = moe::DistributedMoeLayer<T, moe::Policies<moe::routing::Auto, Gmm>>;
  auto const& cfg = s.cfg;
  auto const& in = s.in;
  bool const root = world.rank() == 0, has_dy = in.has("dy");
  Layer layer(world.get(), cfg, s.par, s.B, s.S);
  for (auto const& [axis, size] : layer.mesh().axes())
    if (size > 1) sum.mesh += (sum.mesh.empty() ? "" : " x ") + axis + "=" + std::to_string(size);
  if (sum.mesh.empty()) sum.mesh = "(one rank)";
  sum.route = route_name(layer.expert_route());

  auto const xb = layer.block("x");
  std::int64_t const b = xb.local_shape[0], S = s.S, D = cfg.base_emb_dim;
  std::int64_t const K = cfg.num_experts_per_tok;
  moe::View3<T, Mem> x("x", b, S, D), y("y", b, S, D), dy("dy", has_dy ? b : 0, S, D),
      dx("dx", has_dy ? b : 0, S, D);
  moe::comm::collective_guard(world, [&] {
    layer.parameters().for_each(
        [&](char const* name, auto const& v) { load_block<T>(in, name, layer.block(name), v); });
    load_block<T>(in, "x", xb, x);
    if (has_dy) load_block<T>(in, "dy", layer.block("dy"), dy);
  });
  layer.forward(x, y);
  typename Layer::params_type g;
  if (has_dy) layer.backward(dy, dx, g);

  // Gather: every tensor from the ranks' blocks; one rank per distinct block sends.
  moe::io::File out;
  auto gather = [&](std::string const& name, moe::TensorBlock const& blk, auto const& local) {
    using V = typename std::decay_t<decltype(local)>::value_type;
    auto global = moe::cli::gather_blocks<V>(world, blk, local, name);
    if (root) out.set(name, moe::io::Tensor::from<V>(blk.global_shape, global));
  };
  moe::TensorBlock const rb{{s.B, S, K}, {b, S, K}, {xb.offset[0], 0, 0}};
  gather("y", layer.block("y"), read_view<T>(y));
  gather("expert_ids", rb, read_view<std::int32_t>(layer.expert_ids()));
  gather("weights", rb, read_view<T>(layer.weights()));
  if (root) {
    out.set("lb_loss", moe::io::Tensor::from<T>({}, {T(layer.lb_loss())}));
    if (cfg.routed_bias_update_rate > 0) {
      std::vector<T> up(layer.bias_update().begin(), layer.bias_update().end());
      out.set("bias_update", moe::io::Tensor::from<T>({std::int64_t(up.size())}, up));
    }
  }
  if (has_dy) {
    gather("dx", layer.block("dx"), read_view<T>(dx));
    g.for_each([&](char const* name, auto const& v) {
      gather(std::string("d_") + name, layer.block(name), read_view<T>(v));
    });
  }
  return out;
}

template <class T>
moe::io::File run_dtype(moe::comm::Communicator const& world, Setup const& s, Summary& sum) {
  if (s.args.gmm == "tiled") return run_case<T, moe::gmm::Tiled<32, 32, 32>>(world, s, sum);
  if (s.args.gmm == "dense") return run_case<T, moe::gmm::Dense>(world, s, sum);
  if (s.args.gmm == "vendor") return run_case<T, moe::gmm::Vendor>(world, s, sum);
  if (s.args.gmm == "onednn") return run_case<T, moe::gmm::OneDnn>(world, s, sum);
  return run_case<T, moe::gmm::Auto>(world, s, sum);
}

double norm(moe::io::Tensor const& t) {
  double s = 0;
  for (double v : t.to_vector<double>()) s += v * v;
  return std::sqrt(s);
}

void print_summary(Setup const& s, Summary const& sum, moe::io::File const& out, int ranks) {
  auto const& cfg = s.cfg;
  std::printf("moe-layer-run: B=%lld S=%lld D=%d E=%d K=%d F=%d dtype=%s gmm=%s path=%s\n",
              (long long)s.B, (long long)s.S, cfg.base_emb_dim, cfg.num_experts,
              cfg.num_experts_per_tok, cfg.base_moe_mlp_dim, moe::io::dtype_name(s.dtype),
              s.args.gmm.c_str(), cfg.sparse_matmul ? "sparse" : "dense");
  std::printf("  ranks=%d mesh %s experts=%s\n", ranks, sum.mesh.c_str(), sum.route.c_str());
  std::printf("  %s\n", moe::describe_gemm().c_str());
  std::printf("  |y| = %.6g   lb_loss = %.6g\n  tokens per expert:", norm(out.at("y")),
              out.at("lb_loss").to_vector<double>()[0]);
  std::vector<std::int64_t> load(std::size_t(cfg.num_experts), 0);
  for (auto e : out.at("expert_ids").to_vector<std::int64_t>())
    if (e >= 0 && e < cfg.num_experts) load[std::size_t(e)] += 1;
  for (auto c : load) std::printf(" %lld", (long long)c);
  std::printf("\n");
  if (out.has("dx")) {
    std::printf("  gradients:");
    for (auto const& n : out.names())
      if (n.rfind("d_", 0) == 0 || n == "dx") std::printf(" |%s|=%.4g", n.c_str(), norm(out.at(n)));
    std::printf("\n");
  }
  if (!s.args.out.empty()) std::printf("  wrote %s\n", s.args.out.c_str());
}

int run(int argc, char** argv) {
  moe::comm::Communicator world(MPI_COMM_WORLD);
  Setup s;
  moe::comm::collective_guard(world, [&] { s = prepare(argc, argv); });
  Summary sum;
  moe::io::File out = s.dtype == moe::io::DType::F64 ? run_dtype<double>(world, s, sum)
                                                     : run_dtype<float>(world, s, sum);
  // Only rank 0 writes; a failure there is reported by every rank.
  moe::comm::collective_guard(world, [&] {
    if (world.rank() == 0 && !s.args.out.empty()) out.write(s.args.out);
  });
  if (world.rank() == 0) {
    print_summary(s, sum, out, world.size());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return moe::cli::tool_main("moe-layer-run", kUsage, argc, argv, [&] { return run(argc, argv); });
}
