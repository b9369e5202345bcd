// moe-layer-run: runs one MoE layer on a case file and writes the result (DESIGN.md §7).
//
//   moe-layer-run --config CFG.yml --in CASE.safetensors --out RESULT.safetensors
//                 [--gmm vendor|tiled|dense] [key=value ...]
//   moe-layer-run --example        (built-in small case, prints a readable summary)
//
// CASE holds x[B,S,D], gate[D,E], optional gate_bias[E], wi_0/wi_1[E,D,F], wo[E,F,D], optional
// shared_wi_0/shared_wi_1[D,Fs], shared_wo[Fs,D], optional dy[B,S,D], all float32 or all float64;
// the layer computes in that dtype. Dimensions the config leaves unset are taken from CASE.
#include <moe/io/safetensors.hpp>
#include <moe/moe.hpp>

#include <moe_cli.hpp>

#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <iostream>
#include <random>
#include <string>

namespace {

struct Args {
  std::string config, in, out, gmm = "vendor";
  bool example = false;
  moe::cli::KeyValues overrides;
};

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
    else if (s == "-h" || s == "--help") {
      std::puts(
          "usage: moe-layer-run --config CFG.yml --in CASE.safetensors --out RESULT.safetensors\n"
          "                     [--gmm vendor|tiled|dense] [key=value ...]\n"
          "       moe-layer-run --example [key=value ...]");
      std::exit(0);
    } else if (s.rfind("--", 0) == 0)
      throw moe::ConfigError(moe::detail::cat("unknown flag '", s, "'"));
    else
      a.overrides.push_back(moe::cli::parse_override(s));
  }
  if (a.gmm != "vendor" && a.gmm != "tiled" && a.gmm != "dense")
    throw moe::ConfigError(moe::detail::cat("--gmm ", a.gmm, " is not one of vendor|tiled|dense"));
  if (!a.example && (a.config.empty() || a.in.empty() || a.out.empty()))
    throw moe::ConfigError("--config, --in and --out are required (or --example)");
  return a;
}

using Host = Kokkos::DefaultHostExecutionSpace;
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

/// Loads a CASE tensor into a view of the layer's shape (ShapeError when they differ).
template <class T, class V>
void load(moe::io::File const& f, std::string const& name, V const& v) {
  auto const& t = f.at(name);
  bool ok = t.shape.size() == V::rank;
  for (std::size_t r = 0; ok && r < V::rank; ++r) ok = t.shape[r] == std::int64_t(v.extent(r));
  if (!ok) {
    std::string want;
    for (std::size_t r = 0; r < V::rank; ++r) want += (r ? "," : "") + std::to_string(v.extent(r));
    throw moe::ShapeError(moe::detail::cat("CASE tensor ", name, " has shape ",
                                           moe::io::detail::shape_str(t.shape),
                                           " but the config needs [", want, "]"));
  }
  fill_view(v, t.to_vector<T>());
}

struct Summary {
  double y_norm = 0, lb = 0;
  std::vector<std::int64_t> load;
};

template <class T, class Gmm>
moe::io::File run_case(moe::LayerConfig const& cfg, moe::io::File const& in, Summary& sum) {
  using Layer = moe::MoeLayer<T, moe::Policies<moe::routing::Auto, Gmm>>;
  Layer layer(cfg);
  auto& p = layer.parameters();
  load<T>(in, "gate", p.gate);
  if (cfg.routed_bias) {
    if (!in.has("gate_bias"))
      throw moe::ConfigError("routed_bias=true but CASE has no gate_bias tensor");
    load<T>(in, "gate_bias", p.gate_bias);
  } else if (in.has("gate_bias")) {
    throw moe::ConfigError("CASE has gate_bias but routed_bias=false: set routed_bias=true");
  }
  load<T>(in, "wi_0", p.wi_0);
  load<T>(in, "wi_1", p.wi_1);
  load<T>(in, "wo", p.wo);
  if (cfg.shared_experts > 0) {
    for (char const* n : {"shared_wi_0", "shared_wi_1", "shared_wo"})
      if (!in.has(n))
        throw moe::ConfigError(moe::detail::cat("shared_experts=", cfg.shared_experts,
                                                " but CASE has no ", n, " tensor"));
    load<T>(in, "shared_wi_0", p.shared_wi_0);
    load<T>(in, "shared_wi_1", p.shared_wi_1);
    load<T>(in, "shared_wo", p.shared_wo);
  } else if (in.has("shared_wo")) {
    throw moe::ConfigError("CASE has shared expert tensors but shared_experts=0");
  }
  auto xs = shape_of(in, "x", 3);
  std::int64_t const B = xs[0], S = xs[1], D = cfg.base_emb_dim, K = cfg.num_experts_per_tok;
  moe::View3<T, Mem> x("x", B, S, D), y("y", B, S, D);
  load<T>(in, "x", x);
  layer.forward(x, y);

  moe::io::File out;
  auto yv = read_view<T>(y);
  out.set("y", moe::io::Tensor::from<T>({B, S, D}, yv));
  out.set("expert_ids", moe::io::Tensor::from<std::int32_t>(
                            {B, S, K}, read_view<std::int32_t>(layer.expert_ids())));
  out.set("weights", moe::io::Tensor::from<T>({B, S, K}, read_view<T>(layer.weights())));
  out.set("lb_loss", moe::io::Tensor::from<T>({}, {T(layer.lb_loss())}));
  if (cfg.routed_bias_update_rate > 0) {
    std::vector<T> up(layer.bias_update().begin(), layer.bias_update().end());
    out.set("bias_update", moe::io::Tensor::from<T>({std::int64_t(up.size())}, up));
  }
  for (T v : yv) sum.y_norm += double(v) * double(v);
  sum.y_norm = std::sqrt(sum.y_norm);
  sum.lb = layer.lb_loss();
  sum.load.assign(cfg.num_experts, 0);
  for (auto e : read_view<int>(layer.expert_ids())) sum.load[e] += 1;

  if (in.has("dy")) {
    moe::View3<T, Mem> dy("dy", B, S, D), dx("dx", B, S, D);
    load<T>(in, "dy", dy);
    typename Layer::params_type g;
    layer.backward(dy, dx, g);
    out.set("dx", moe::io::Tensor::from<T>({B, S, D}, read_view<T>(dx)));
    g.for_each([&](char const* name, auto const& v) {
      std::vector<std::int64_t> shape;
      for (std::size_t r = 0; r < std::decay_t<decltype(v)>::rank; ++r)
        shape.push_back(std::int64_t(v.extent(r)));
      out.set(std::string("d_") + name, moe::io::Tensor::from<T>(shape, read_view<T>(v)));
    });
  }
  return out;
}

template <class T>
moe::io::File run_dtype(moe::LayerConfig const& cfg, moe::io::File const& in,
                        std::string const& gmm, Summary& sum) {
  if (gmm == "tiled") return run_case<T, moe::gmm::Tiled<32, 32, 32>>(cfg, in, sum);
  if (gmm == "dense") return run_case<T, moe::gmm::Dense>(cfg, in, sum);
  return run_case<T, moe::gmm::Vendor>(cfg, in, sum);
}

/// The built-in example: a small Mixtral-style layer with random weights.
moe::io::File example_case(moe::LayerConfig& cfg) {
  cfg.num_experts = 8;
  cfg.num_experts_per_tok = 2;
  cfg.base_emb_dim = 64;
  cfg.base_moe_mlp_dim = 128;
  cfg.load_balance_loss_weight = 0.01;
  std::int64_t const B = 4, S = 32, D = 64, E = 8, F = 128;
  std::mt19937_64 rng(1234);
  std::normal_distribution<double> n01(0.0, 1.0);
  auto rnd = [&](std::vector<std::int64_t> shape, double scale) {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    std::vector<float> v(n);
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

int run(int argc, char** argv) {
  Args args = parse_args(argc, argv);
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size != 1)
    throw moe::ConfigError(
        moe::detail::cat("moe-layer-run was launched on ", size,
                         " ranks; this build runs the single-rank layer only (use mpirun -np 1)"));

  moe::LayerConfig cfg;
  moe::io::File in;
  if (args.example) {
    in = example_case(cfg);
  } else {
    in = moe::io::File::read(args.in);
    // Dimensions default to the CASE's; the config may restate them (and must agree).
    auto const g = shape_of(in, "gate", 2);
    auto const w = shape_of(in, "wi_0", 3);
    cfg.base_emb_dim = int(g[0]);
    cfg.num_experts = int(g[1]);
    cfg.base_moe_mlp_dim = int(w[2]);
    if (in.has("shared_wi_0"))
      cfg.shared_experts = int(shape_of(in, "shared_wi_0", 2)[1] / std::max<std::int64_t>(1, w[2]));
    cfg.routed_bias = in.has("gate_bias");
    moe::cli::apply(cfg, moe::cli::read_yaml(args.config));
  }
  moe::cli::apply(cfg, args.overrides);
  cfg.validate();

  auto const dt = in.at("x").dtype;
  for (auto const& name : in.names())
    if (in.at(name).dtype != dt)
      throw moe::IoError(
          moe::detail::cat("CASE tensor ", name, " is ", moe::io::dtype_name(in.at(name).dtype),
                           " but x is ", moe::io::dtype_name(dt), ": all tensors share one dtype"));
  Summary sum;
  moe::io::File out;
  if (dt == moe::io::DType::F64)
    out = run_dtype<double>(cfg, in, args.gmm, sum);
  else if (dt == moe::io::DType::F32)
    out = run_dtype<float>(cfg, in, args.gmm, sum);
  else
    throw moe::IoError(moe::detail::cat("CASE x has dtype ", moe::io::dtype_name(dt),
                                        ": only F32 and F64 are supported"));
  if (!args.out.empty()) out.write(args.out);

  auto const xs = in.at("x").shape;
  std::printf("moe-layer-run: B=%lld S=%lld D=%d E=%d K=%d F=%d dtype=%s gmm=%s path=%s\n",
              (long long)xs[0], (long long)xs[1], cfg.base_emb_dim, cfg.num_experts,
              cfg.num_experts_per_tok, cfg.base_moe_mlp_dim, moe::io::dtype_name(dt),
              args.gmm.c_str(), cfg.sparse_matmul ? "sparse" : "dense");
  std::printf("  |y| = %.6g   lb_loss = %.6g\n  tokens per expert:", sum.y_norm, sum.lb);
  for (auto c : sum.load) std::printf(" %lld", (long long)c);
  std::printf("\n");
  if (in.has("dy")) {
    std::printf("  gradients:");
    for (auto const& n : out.names())
      if (n.rfind("d_", 0) == 0 || n == "dx") {
        double s = 0;
        for (double v : out.at(n).to_vector<double>()) s += v * v;
        std::printf(" |%s|=%.4g", n.c_str(), std::sqrt(s));
      }
    std::printf("\n");
  }
  if (!args.out.empty()) std::printf("  wrote %s\n", args.out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    try {
      rc = run(argc, argv);
    } catch (moe::Error const& e) {
      std::fprintf(stderr, "moe-layer-run: error: %s\n", e.what());
      rc = 2;
    } catch (std::exception const& e) {
      std::fprintf(stderr, "moe-layer-run: internal error: %s\n", e.what());
      rc = 3;
    }
  }
  MPI_Finalize();
  return rc;
}
