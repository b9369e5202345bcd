// Test helper of the moe-layer-run tests (tests/tools/layer_run_test.sh):
//
//   moe_case_tool write CASE.safetensors --dtype f32|f64|bf16 [--B n] [--S n] [--D n] [--E n] [--F
//   n]
//                 [--shared n] [--bias] [--no-dy] [--seed n]
//       writes a random CASE (x, gate, [gate_bias], wi_0, wi_1, wo, [shared_*], [dy])
//   moe_case_tool mix-dtype IN OUT      copies IN with `gate` converted to the other float dtype
//   moe_case_tool poison IN OUT T I nan|inf   copies IN with element I (flat) of tensor T bad
//   moe_case_tool rename IN OUT OLD NEW       copies IN with tensor OLD stored as NEW
//   moe_case_tool transpose IN OUT T          copies IN with the 2-D tensor T transposed
//   moe_case_tool compare REF GOT RTOL  compares every tensor of two RESULT files: the same names,
//       shapes and dtypes; integer tensors exactly; float tensors with
//       max|got - ref| <= RTOL * max|ref| (per tensor). Exit 0 when all agree, 1 otherwise.
#include <moe/io/safetensors.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using moe::io::DType;
using moe::io::File;
using moe::io::Tensor;

int usage() {
  std::fputs(
      "usage: moe_case_tool write CASE --dtype f32|f64|bf16 [--B n] [--S n] [--D n] [--E n] [--F "
      "n]\n"
      "                     [--shared n] [--bias] [--no-dy] [--seed n]\n"
      "       moe_case_tool mix-dtype IN OUT\n"
      "       moe_case_tool poison IN OUT TENSOR INDEX nan|inf\n"
      "       moe_case_tool rename IN OUT OLD NEW\n"
      "       moe_case_tool transpose IN OUT TENSOR\n"
      "       moe_case_tool compare REF GOT RTOL\n",
      stderr);
  return 2;
}

template <class T>
Tensor random_tensor(std::vector<std::int64_t> const& shape, double scale, std::mt19937_64& g) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  std::normal_distribution<double> d(0.0, scale);
  std::vector<T> v(static_cast<std::size_t>(n));
  for (auto& e : v) e = T(d(g));
  return Tensor::from<T>(shape, v);
}

template <class T>
void write_case(std::string const& path, std::int64_t B, std::int64_t S, std::int64_t D,
                std::int64_t E, std::int64_t F, std::int64_t shared, bool bias, bool dy,
                unsigned seed) {
  std::mt19937_64 g(seed);
  File f;
  f.set("x", random_tensor<T>({B, S, D}, 1.0, g));
  f.set("gate", random_tensor<T>({D, E}, 0.5, g));
  if (bias) f.set("gate_bias", random_tensor<T>({E}, 0.1, g));
  f.set("wi_0", random_tensor<T>({E, D, F}, 0.3, g));
  f.set("wi_1", random_tensor<T>({E, D, F}, 0.3, g));
  f.set("wo", random_tensor<T>({E, F, D}, 0.3, g));
  if (shared > 0) {
    f.set("shared_wi_0", random_tensor<T>({D, shared * F}, 0.3, g));
    f.set("shared_wi_1", random_tensor<T>({D, shared * F}, 0.3, g));
    f.set("shared_wo", random_tensor<T>({shared * F, D}, 0.3, g));
  }
  if (dy) f.set("dy", random_tensor<T>({B, S, D}, 1.0, g));
  f.write(path);
}

int cmd_write(int argc, char** argv) {
  if (argc < 3) return usage();
  std::string const path = argv[2];
  std::string dtype = "f64";
  std::int64_t B = 8, S = 4, D = 16, E = 8, F = 8, shared = 0;
  bool bias = false, dy = true;
  unsigned seed = 7;
  for (int i = 3; i < argc; ++i) {
    std::string const a = argv[i];
    auto num = [&]() -> std::int64_t {
      if (i + 1 >= argc) throw moe::ConfigError(a + " needs a value");
      return std::stoll(argv[++i]);
    };
    if (a == "--dtype") {
      if (i + 1 >= argc) return usage();
      dtype = argv[++i];
    } else if (a == "--B")
      B = num();
    else if (a == "--S")
      S = num();
    else if (a == "--D")
      D = num();
    else if (a == "--E")
      E = num();
    else if (a == "--F")
      F = num();
    else if (a == "--shared")
      shared = num();
    else if (a == "--seed")
      seed = unsigned(num());
    else if (a == "--bias")
      bias = true;
    else if (a == "--no-dy")
      dy = false;
    else
      return usage();
  }
  if (dtype == "f64")
    write_case<double>(path, B, S, D, E, F, shared, bias, dy, seed);
  else if (dtype == "f32")
    write_case<float>(path, B, S, D, E, F, shared, bias, dy, seed);
  else if (dtype == "bf16") {  // the f32 case with every tensor rounded to BF16
    write_case<float>(path, B, S, D, E, F, shared, bias, dy, seed);
    File f = File::read(path);
    for (auto const& n : f.names()) f.set(n, f.at(n).as(DType::BF16));
    f.write(path);
  } else
    return usage();
  return 0;
}

int cmd_mix(int argc, char** argv) {
  if (argc != 4) return usage();
  File f = File::read(argv[2]);
  Tensor const& gate = f.at("gate");
  if (gate.dtype == DType::F64)
    f.set("gate", Tensor::from<float>(gate.shape, [&] {
            auto v = gate.to_vector<double>();
            return std::vector<float>(v.begin(), v.end());
          }()));
  else
    f.set("gate", Tensor::from<double>(gate.shape, gate.to_vector<double>()));
  f.write(argv[3]);
  return 0;
}

/// poison IN OUT TENSOR INDEX nan|inf: element INDEX (flat, row-major) of TENSOR becomes NaN/Inf.
int cmd_poison(int argc, char** argv) {
  if (argc != 7) return usage();
  File f = File::read(argv[2]);
  std::string const name = argv[4];
  std::size_t const index = std::stoul(argv[5]);
  double const bad = std::string(argv[6]) == "inf" ? HUGE_VAL : std::nan("");
  Tensor const t = f.at(name);
  auto v = t.to_vector<double>();
  if (index >= v.size()) throw std::runtime_error("poison: index beyond the tensor");
  v[index] = bad;
  if (t.dtype == DType::F64)
    f.set(name, Tensor::from<double>(t.shape, v));
  else
    f.set(name, Tensor::from<float>(t.shape, std::vector<float>(v.begin(), v.end())));
  f.write(argv[3]);
  return 0;
}

/// rename IN OUT OLD NEW: tensor OLD is stored as NEW.
int cmd_rename(int argc, char** argv) {
  if (argc != 6) return usage();
  File const in = File::read(argv[2]);
  File out;
  for (auto const& n : in.names()) out.set(n == argv[4] ? std::string(argv[5]) : n, in.at(n));
  out.write(argv[3]);
  return 0;
}

/// transpose IN OUT TENSOR: a 2-D tensor [a,b] becomes its transpose [b,a].
int cmd_transpose(int argc, char** argv) {
  if (argc != 5) return usage();
  File f = File::read(argv[2]);
  Tensor const t = f.at(argv[4]);
  if (t.shape.size() != 2) throw std::runtime_error("transpose: the tensor is not 2-D");
  auto const v = t.to_vector<double>();
  std::int64_t const a = t.shape[0], b = t.shape[1];
  std::vector<double> w(v.size());
  for (std::int64_t i = 0; i < a; ++i)
    for (std::int64_t j = 0; j < b; ++j) w[std::size_t(j * a + i)] = v[std::size_t(i * b + j)];
  if (t.dtype == DType::F64)
    f.set(argv[4], Tensor::from<double>({b, a}, w));
  else
    f.set(argv[4], Tensor::from<float>({b, a}, std::vector<float>(w.begin(), w.end())));
  f.write(argv[3]);
  return 0;
}

int cmd_compare(int argc, char** argv) {
  if (argc != 5) return usage();
  File const ref = File::read(argv[2]);
  File const got = File::read(argv[3]);
  double const rtol = std::stod(argv[4]);
  bool ok = ref.names() == got.names();
  if (!ok) {
    std::string a, b;
    for (auto const& n : ref.names()) a += " " + n;
    for (auto const& n : got.names()) b += " " + n;
    std::printf("tensor names differ:\n  ref:%s\n  got:%s\n", a.c_str(), b.c_str());
  }
  for (auto const& name : ref.names()) {
    if (!got.has(name)) continue;
    Tensor const& r = ref.at(name);
    Tensor const& g = got.at(name);
    if (r.dtype != g.dtype || r.shape != g.shape) {
      std::printf("%-14s dtype/shape differ: %s%s vs %s%s\n", name.c_str(),
                  moe::io::dtype_name(r.dtype), moe::io::detail::shape_text(r.shape).c_str(),
                  moe::io::dtype_name(g.dtype), moe::io::detail::shape_text(g.shape).c_str());
      ok = false;
      continue;
    }
    if (!moe::io::is_floating(r.dtype)) {
      auto const a = r.to_vector<std::int64_t>(), b = g.to_vector<std::int64_t>();
      std::size_t diff = 0;
      for (std::size_t i = 0; i < a.size(); ++i) diff += a[i] != b[i];
      std::printf("%-14s %zu of %zu elements differ (exact)\n", name.c_str(), diff, a.size());
      ok = ok && diff == 0;
      continue;
    }
    auto const a = r.to_vector<double>(), b = g.to_vector<double>();
    double scale = 0, err = 0;
    bool finite = true;
    for (std::size_t i = 0; i < a.size(); ++i) {
      finite = finite && std::isfinite(a[i]) && std::isfinite(b[i]);
      scale = std::max(scale, std::abs(a[i]));
      err = std::max(err, std::abs(a[i] - b[i]));
    }
    double const rel = scale > 0 ? err / scale : err;
    bool const good = finite && (err <= rtol * scale || err == 0);
    std::printf("%-14s rel error %.3g (max |ref| %.3g)%s\n", name.c_str(), rel, scale,
                good ? "" : "  <-- FAIL");
    ok = ok && good;
  }
  std::printf("%s\n", ok ? "MATCH" : "MISMATCH");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage();
  std::string const cmd = argv[1];
  try {
    if (cmd == "write") return cmd_write(argc, argv);
    if (cmd == "mix-dtype") return cmd_mix(argc, argv);
    if (cmd == "poison") return cmd_poison(argc, argv);
    if (cmd == "rename") return cmd_rename(argc, argv);
    if (cmd == "transpose") return cmd_transpose(argc, argv);
    if (cmd == "compare") return cmd_compare(argc, argv);
  } catch (std::exception const& e) {
    std::fprintf(stderr, "moe_case_tool: %s\n", e.what());
    return 2;
  }
  return usage();
}
