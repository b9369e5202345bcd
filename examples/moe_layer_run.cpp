// moe-layer-run: runs one MoE layer on a case file over MPI ranks and writes the result
// (DESIGN.md §7).
//
//   mpirun -np N moe-layer-run --config CFG.yml --in CASE.safetensors --out RESULT.safetensors
//                              [--gmm auto|onednn|vendor|tiled|dense] [key=value ...]
//   mpirun -np N moe-layer-run --example [key=value ...]   (built-in case, readable summary)
//   moe-layer-run --keys   (every key: type, default, meaning, rules; from the config tables)
//
// CASE holds global tensors x[B,S,D], gate[D,E], optional gate_bias[E], wi_0/wi_1[E,D,F],
// wo[E,F,D], optional shared_wi_0/shared_wi_1[D,Fs], shared_wo[Fs,D], optional dy[B,S,D], all
// float32 or all float64; the layer computes in that dtype. Dimensions the config leaves unset are
// taken from CASE. The config (YAML + key=value overrides) holds LayerConfig keys and
// ParallelConfig keys (ici_*_parallelism, use_ring_of_experts, custom_mesh_and_rule, ...).
// --config may be given several times: the files are read in order, then the overrides, later
// wins, as MaxText reads them (moe_maxtext_config.hpp: MaxText's base.yml and model files as they
// are, model_name=NAME, the files' mesh_axes / logical_axis_rules as the layout's rules; MaxText's
// other keys are summarised in one line on rank 0).
//
// Every rank reads CASE and CFG, builds the DistributedMoeLayer for the global batch [B,S] and
// loads its blocks; forward (+ backward with dy) runs over all ranks; rank 0 gathers the blocks
// (one rank per distinct block) and writes RESULT atomically. Errors on any rank become the same
// one-line message and exit code 2 on every rank.
#include <moe/distributed/layer.hpp>
#include <moe/distributed/memory.hpp>
#include <moe/io/safetensors.hpp>
#include <moe/moe.hpp>

#include <moe_blocks.hpp>
#include <moe_cli.hpp>
#include <moe_maxtext_config.hpp>

#include <moe/comm/mpi.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>

namespace {

struct Args {
  std::vector<std::string> configs;  ///< --config files, in order
  std::string in, out, gmm = "auto";
  bool example = false;
  moe::cli::KeyValues overrides;
};

char const* const kUsage =
    "usage: mpirun -np N moe-layer-run --config CFG.yml --in CASE.safetensors\n"
    "                    --out RESULT.safetensors [--gmm auto|onednn|vendor|tiled|dense] "
    "[key=value ...]\n"
    "       mpirun -np N moe-layer-run --example [key=value ...]\n"
    "       moe-layer-run --keys\n"
    "--config may repeat (files read in order, then the overrides; MaxText files as they are)\n"
    "keys: LayerConfig keys (num_experts, ...) and ParallelConfig keys (ici_*_parallelism,\n"
    "      use_ring_of_experts, ...); --keys lists each with its type, default and meaning\n";

/// --keys: every key moe-layer-run takes, from the config tables.
std::string key_listing() {
  return "layer keys (LayerConfig):\n" + moe::LayerConfig::table().listing(moe::LayerConfig()) +
         "parallelism keys (ParallelConfig):\n" +
         moe::ParallelConfig::table().listing(moe::ParallelConfig());
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string const s = argv[i];
    auto value = [&](char const* flag) {
      if (i + 1 >= argc) throw moe::ConfigError(moe::detail::cat(flag, " needs a value"));
      return std::string(argv[++i]);
    };
    if (s == "--config")
      a.configs.push_back(value("--config"));
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
  if (!a.example && (a.configs.empty() || a.in.empty() || a.out.empty()))
    throw moe::ConfigError("--config, --in and --out are required (or --example)");
  moe::cli::require_unique_keys(a.overrides, "the command line");
  // Every path up front: nothing is read into the layer or written before they pass.
  for (auto const& c : a.configs) moe::cli::require_input_file("--config", c);
  if (!a.example) {
    moe::cli::require_input_file("--in", a.in);
  }
  if (!a.out.empty()) {
    std::vector<std::pair<std::string, std::string>> inputs = {{"--in", a.in}};
    for (auto const& c : a.configs) inputs.emplace_back("--config", c);
    moe::cli::require_output_file("--out", a.out, inputs);
  }
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

/// Loads this rank's block of CASE tensor `name` into `v` (ShapeError when the CASE tensor does
/// not have the global shape the config needs).
template <class T, class V>
void load_block(moe::io::File const& f, std::string const& name, moe::TensorBlock const& b,
                V const& v) {
  auto const& t = f.at(name);
  if (t.shape != b.global_shape)
    throw moe::ShapeError(
        moe::detail::cat("CASE tensor ", name, " has shape ", moe::detail::shape_text(t.shape),
                         " but the config needs ", moe::detail::shape_text(b.global_shape)));
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
  moe::cli::maxtext::Loaded loaded;  ///< what the config files and overrides said
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

/// The CASE tensor names moe-layer-run reads (the README's list); every other name is an error.
std::vector<std::string> const& case_names() {
  static std::vector<std::string> const names = {"x",         "gate", "gate_bias",   "wi_0",
                                                 "wi_1",      "wo",   "shared_wi_0", "shared_wi_1",
                                                 "shared_wo", "dy"};
  return names;
}

/// Dimensions read off CASE: D from x, E and F from wi_0, Fs from shared_wi_0 (0 without).
struct CaseDims {
  std::int64_t B = 0, S = 0, D = 0, E = 0, F = 0, Fs = 0;
};

/// Checks CASE's names, dtypes and shapes against each other before any value is used; every
/// error names the tensor, the file and the rule. Returns the dimensions.
CaseDims check_case_layout(moe::io::File const& in, std::string const& file) {
  using moe::detail::cat;
  using moe::detail::shape_text;
  std::string const where = "CASE '" + file + "': ";
  for (auto const& name : in.names()) {
    auto const& known = case_names();
    if (std::find(known.begin(), known.end(), name) == known.end())
      throw moe::IoError(cat(where, "unknown tensor '", name, "'",
                             moe::detail::did_you_mean(name, known),
                             "; a CASE holds x, gate, wi_0, wi_1, wo, optional gate_bias, "
                             "shared_wi_0, shared_wi_1, shared_wo and dy"));
  }
  for (char const* name : {"x", "gate", "wi_0", "wi_1", "wo"})
    if (!in.has(name)) throw moe::IoError(cat(where, "has no tensor '", name, "' (required)"));
  auto const dtype = in.at("x").dtype;
  if (dtype != moe::io::DType::F64 && dtype != moe::io::DType::F32 && dtype != moe::io::DType::BF16)
    throw moe::IoError(cat(where, "tensor x is ", moe::io::dtype_name(dtype),
                           ": only F32, F64 and BF16 are supported"));
  for (auto const& name : in.names())
    if (in.at(name).dtype != dtype)
      throw moe::IoError(cat(where, "tensor ", name, " is ", moe::io::dtype_name(in.at(name).dtype),
                             " but x is ", moe::io::dtype_name(dtype),
                             ": all tensors share one dtype"));
  auto rank_of = [&](char const* name, std::size_t rank, char const* dims) {
    auto const& sh = in.at(name).shape;
    if (sh.size() != rank)
      throw moe::ShapeError(cat(where, "tensor ", name, " has shape ", shape_text(sh), " (rank ",
                                sh.size(), "); expected ", dims));
    for (auto d : sh)
      if (d < 1)
        throw moe::ShapeError(cat(where, "tensor ", name, " has shape ", shape_text(sh),
                                  "; every dimension of ", dims, " must be >= 1"));
    return sh;
  };
  CaseDims c;
  auto const x = rank_of("x", 3, "[B,S,D]");
  auto const w = rank_of("wi_0", 3, "[E,D,F]");
  c.B = x[0], c.S = x[1], c.D = x[2], c.E = w[0], c.F = w[2];
  auto expect = [&](char const* name, std::vector<std::int64_t> const& want, char const* dims) {
    if (!in.has(name)) return;
    auto const& sh = in.at(name).shape;
    if (sh != want)
      throw moe::ShapeError(cat(where, "tensor ", name, " has shape ", shape_text(sh),
                                " but must be ", dims, " = ", shape_text(want), " (D=", c.D,
                                " from x ", shape_text(x), ", E=", c.E, " and F=", c.F,
                                " from wi_0 ", shape_text(w), ")"));
  };
  expect("wi_0", {c.E, c.D, c.F}, "[E,D,F]");
  expect("gate", {c.D, c.E}, "[D,E]");
  expect("gate_bias", {c.E}, "[E]");
  expect("wi_1", {c.E, c.D, c.F}, "[E,D,F]");
  expect("wo", {c.E, c.F, c.D}, "[E,F,D]");
  expect("dy", x, "[B,S,D] (the shape of x)");
  bool const any_shared = in.has("shared_wi_0") || in.has("shared_wi_1") || in.has("shared_wo");
  if (any_shared) {
    for (char const* n : {"shared_wi_0", "shared_wi_1", "shared_wo"})
      if (!in.has(n))
        throw moe::IoError(cat(where, "has shared expert tensors but no '", n,
                               "': give shared_wi_0, shared_wi_1 and shared_wo together"));
    c.Fs = rank_of("shared_wi_0", 2, "[D,Fs]")[1];
    expect("shared_wi_0", {c.D, c.Fs}, "[D,Fs]");
    expect("shared_wi_1", {c.D, c.Fs}, "[D,Fs]");
    expect("shared_wo", {c.Fs, c.D}, "[Fs,D]");
    if (c.Fs % c.F != 0)
      throw moe::ShapeError(cat(where, "shared_wi_0 has Fs=", c.Fs,
                                " columns, not a multiple of F=", c.F,
                                " (the shared expert is shared_experts x F wide)"));
  }
  return c;
}

/// Checks that every CASE tensor is finite; names the tensor, the file and the first bad index.
void check_case_finite(moe::io::File const& in, std::string const& file) {
  for (auto const& name : in.names()) {
    auto const v = in.at(name).to_vector<double>();
    for (std::size_t i = 0; i < v.size(); ++i)
      if (!std::isfinite(v[i])) {
        auto const& sh = in.at(name).shape;
        std::vector<std::size_t> coord(sh.size());
        std::size_t rest = i;
        for (std::size_t d = sh.size(); d-- > 0;) {
          coord[d] = rest % std::size_t(sh[d]);
          rest /= std::size_t(sh[d]);
        }
        std::string idx;
        for (std::size_t d = 0; d < coord.size(); ++d) {
          if (d) idx += ',';
          idx += std::to_string(coord[d]);
        }
        throw moe::InputError(moe::detail::cat("CASE '", file, "': tensor ", name, " holds ",
                                               std::isnan(v[i]) ? "NaN" : "Inf", " at [", idx,
                                               "] (element ", i,
                                               "): inputs and weights must be finite (or set "
                                               "check_finite=false)"));
      }
  }
}

/// Purely local: parses the arguments, reads CFG and CASE, routes every key to LayerConfig or
/// ParallelConfig and checks CASE (names, dtypes, shapes, finiteness) against the config.
Setup prepare(int argc, char** argv) {
  using moe::detail::cat;
  Setup s;
  s.args = parse_args(argc, argv);
  auto& cfg = s.cfg;
  auto& in = s.in;
  std::string const file = s.args.example ? std::string("--example") : s.args.in;
  if (s.args.example) {
    in = example_case(cfg);
    // Default layout of the example: the batch split over all ranks, unless a degree is given.
    bool any_ici = false;
    for (auto const& kv : s.args.overrides) any_ici = any_ici || kv.first.rfind("ici_", 0) == 0;
    if (!any_ici) s.par.ici_data_parallelism = -1;
  }
  if (!s.args.example) in = moe::io::File::read(s.args.in);
  CaseDims const dims = check_case_layout(in, file);
  if (!s.args.example) {
    // Dimensions default to the CASE's; the config may restate them (and must agree).
    cfg.base_emb_dim = int(dims.D);
    cfg.num_experts = int(dims.E);
    cfg.base_moe_mlp_dim = int(dims.F);
    cfg.shared_experts = int(dims.Fs / dims.F);
    cfg.routed_bias = in.has("gate_bias");
    // A BF16 CASE computes in bf16 (a float layer, docs/precision.md) unless the config says
    // dtype=float32.
    if (in.at("x").dtype == moe::io::DType::BF16) cfg.dtype = moe::ComputeDtype::BFloat16;
  }
  // The --config files in order, then the overrides, read as MaxText reads them.
  s.loaded = moe::cli::maxtext::load(
      s.args.configs, s.args.overrides,
      [](std::string const& k) {
        return moe::LayerConfig::has_key(k) || moe::ParallelConfig::has_key(k);
      },
      moe::cli::known_keys(), "--config");
  moe::cli::apply(cfg, s.par, s.loaded.apply);
  s.loaded.apply_sharding(s.par);
  cfg.validate();
  s.par.validate();
  auto agree = [&](char const* key, std::int64_t value, std::int64_t from_case, char const* src) {
    if (value != from_case)
      throw moe::ConfigError(cat(key, "=", value, " but CASE '", file, "' has ", from_case, " (",
                                 src, "): remove the key or give a matching CASE"));
  };
  agree("base_emb_dim", cfg.base_emb_dim, dims.D, "D of x [B,S,D]");
  agree("num_experts", cfg.num_experts, dims.E, "E of wi_0 [E,D,F]");
  agree("base_moe_mlp_dim", cfg.base_moe_mlp_dim, dims.F, "F of wi_0 [E,D,F]");
  agree("shared_experts", cfg.shared_experts, dims.Fs / dims.F, "Fs/F of shared_wi_0 [D,Fs]");
  if (cfg.routed_bias && !in.has("gate_bias"))
    throw moe::ConfigError(cat("routed_bias=true but CASE '", file, "' has no gate_bias tensor"));
  if (!cfg.routed_bias && in.has("gate_bias"))
    throw moe::ConfigError(
        cat("CASE '", file, "' has gate_bias but routed_bias=false: set routed_bias=true"));
  if (cfg.check_finite) check_case_finite(in, file);
  s.B = dims.B;
  s.S = dims.S;
  s.dtype = in.at("x").dtype;
  return s;
}

/// A canonical text of what every rank must have read the same: the config, and per CASE tensor
/// its dtype, shape and a hash of its bytes (every rank reads the whole CASE).
std::string case_fingerprint(Setup const& s) {
  std::string t = "gmm=" + s.args.gmm + "|" + moe::describe(s.cfg) + "|" + s.par.describe();
  for (auto const& name : s.in.names()) {
    auto const& ten = s.in.at(name);
    t += "|" + name + "=" + moe::io::dtype_name(ten.dtype) + moe::detail::shape_text(ten.shape) +
         " content hash " + std::to_string(moe::detail::fnv1a(ten.bytes.data(), ten.bytes.size()));
  }
  return t;
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
  sum.route = moe::to_string(layer.expert_route());  // as train_moe prints it

  auto const xb = layer.block("x");
  // D columns of this rank's tokens: base_emb_dim, or base_emb_dim / ep with EP-TP.
  std::int64_t const b = xb.local_shape[0], S = s.S, D = xb.local_shape[2];
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
  // Auto as the backend it resolves to: the same layer type as that backend's case, compiled once.
  return run_case<T, moe::gmm::resolve_t<moe::gmm::Auto, Kokkos::DefaultExecutionSpace, T>>(world,
                                                                                            s, sum);
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

/// Refuses a layer whose tensors exceed the kernels' index limits, or whose estimate (the
/// layer's buffers, this rank's x / y / dy / dx blocks, rank 0's gathered RESULT) exceeds this
/// rank's share of the node's available memory (host memory spaces only; MOE_SKIP_MEMORY_CHECK=1
/// skips that comparison). CASE itself is read by then (every rank holds it).
void check_memory(moe::comm::Communicator const& world, Setup const& s) {
  using Exec = Kokkos::DefaultExecutionSpace;
  std::size_t const sb = s.dtype == moe::io::DType::F64 ? 8 : 4;
  moe::LayerConfig cfg = s.cfg;
  if (s.args.gmm == "dense") cfg.sparse_matmul = false;  // gmm::Dense runs as the dense path
  auto const plan = moe::make_plan(cfg, s.par, world.size(), world.rank(), s.B, s.S, sb);
  moe::check_index_limits(plan, moe::IndexLimits::of<Exec>());
  if (!moe::detail::runs_on_host<Exec>()) return;
  bool const has_dy = s.in.has("dy");
  bool const packed =
      (s.args.gmm == "auto" || s.args.gmm == "onednn") && moe::default_packed_weights(plan);
  auto est = moe::estimate_layer_memory(plan, cfg, has_dy, packed);
  std::string const keys = "the batch or sequence length of CASE x, base_emb_dim";
  std::int64_t const x = moe::checked_product(plan.tensor("x").local_shape, "the x block");
  est.add("x, y, dy, dx blocks",
          moe::checked_mul(x, std::int64_t(sb) * (has_dy ? 4 : 2), "the x, y, dy, dx blocks"),
          keys);
  if (world.rank() == 0) {
    // RESULT: y (with dy also dx and every gradient) gathered whole, as a vector and a tensor.
    std::int64_t g = moe::checked_product(plan.tensor("y").global_shape, "the global y");
    if (has_dy) {
      g = moe::checked_mul(g, 2, "the global y and dx");
      for (auto const& t : plan.tensors)
        if (t.name != "x" && t.name != "y")
          g = moe::checked_add(g, moe::checked_product(t.global_shape, "global d_" + t.name),
                               "the RESULT elements");
    }
    est.add("RESULT (rank 0)", moe::checked_mul(g, 2 * std::int64_t(sb), "the RESULT bytes"),
            keys + ", num_experts, base_moe_mlp_dim");
  }
  // The batch and sequence come from CASE x, not from config keys: say so.
  std::string hint;
  auto const ks = est.keys_to_reduce();
  for (std::size_t i = 0; i < ks.size(); ++i) {
    std::string k = ks[i];
    if (k == "per_device_batch_size") k = "the batch of CASE x";
    if (k == "max_target_length") k = "the sequence length of CASE x";
    hint += (i == 0 ? "" : i + 1 == ks.size() ? " or " : ", ") + k;
  }
  moe::require_fits("moe-layer-run", est, moe::available_memory_bytes(),
                    moe::applied_host_threads().local_ranks, hint);
}

int run(int argc, char** argv) {
  moe::comm::Communicator world(MPI_COMM_WORLD);
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--keys") {
      if (world.rank() == 0) std::fputs(key_listing().c_str(), stdout);
      return 0;
    }
  Setup s;
  moe::comm::collective_guard(world, [&] { s = prepare(argc, argv); });
  // Before any collective depends on them: every rank read the same config and the same CASE.
  moe::comm::check_agreement(world, "configuration and CASE (--config, key=value, --in)",
                             case_fingerprint(s));
  moe::comm::collective_guard(world, [&] { check_memory(world, s); });
  moe::cli::maxtext::print_ignored(s.loaded, "moe-layer-run", world.rank() == 0);
  Summary sum;
  moe::io::File out = s.dtype == moe::io::DType::F64 ? run_dtype<double>(world, s, sum)
                                                     : run_dtype<float>(world, s, sum);
  // dtype=bfloat16: y and dx are bf16 values, written as BF16; weight gradients stay F32.
  if (s.cfg.bf16() && s.dtype != moe::io::DType::F64)
    for (char const* n : {"y", "dx"})
      if (out.has(n)) out.set(n, out.at(n).as(moe::io::DType::BF16));
  // Only rank 0 writes; a failure there is reported by every rank.
  moe::comm::collective_guard(world, [&] {
    if (world.rank() == 0 && !s.args.out.empty()) out.write(s.args.out);
  });
  // What oneDNN ran; a rank that ran a reference implementation names it on stderr.
  auto const kernels = moe::gmm::onednn_stats();
  if (kernels.reference_runs > 0)
    std::fprintf(stderr, "moe-layer-run: rank %d: %s\n", world.rank(), kernels.warning().c_str());
  if (world.rank() == 0) {
    print_summary(s, sum, out, world.size());
    std::printf("  gemm kernels (rank 0) %s\n", kernels.summary().c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return moe::cli::tool_main("moe-layer-run", kUsage, argc, argv, [&] { return run(argc, argv); });
}
