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

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

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

// ---- config field tables (moe/config_table.hpp) ------------------------------------------------

namespace {

/// Values of each field type that set() accepts (Choice: every choice).
std::vector<std::string> samples(moe::FieldType type, std::vector<std::string> const& choices) {
  switch (type) {
    case moe::FieldType::Int:
      return {"3", "-1", "70"};
    case moe::FieldType::Int64:
      return {"3", "-1", "12345678901"};
    case moe::FieldType::UInt64:
      return {"7", "12345678901234"};
    case moe::FieldType::Double:
      return {"0.375", "2.5", "-1"};
    case moe::FieldType::Bool:
      return {"true", "false"};
    case moe::FieldType::String:
      return {"abc", "float64"};
    case moe::FieldType::Choice:
      return choices;
  }
  return {};
}

/// Every field of table `t`: its default's text sets the default; each sample value set from text
/// reads back (text) and sets the same again; a value other than the default changes describe()
/// (every field is in the text the ranks compare); every alias sets the same as the key.
template <class C, class Describe>
void expect_round_trips(moe::ConfigTable<C> const& t, Describe describe) {
  C const defaults{};
  for (auto const& f : t.fields()) {
    SCOPED_TRACE(f.key);
    EXPECT_FALSE(f.doc.empty());
    C d{};
    t.set(d, f.key, f.text(defaults));
    EXPECT_EQ(describe(d), describe(defaults));
    for (auto const& v : samples(f.type, f.choices)) {
      C c{};
      t.set(c, f.key, v);
      C back{};
      t.set(back, f.key, f.text(c));
      EXPECT_EQ(f.text(back), f.text(c)) << v;
      EXPECT_EQ(describe(back), describe(c)) << v;
      if (f.text(c) != f.text(defaults)) {
        EXPECT_NE(describe(c), describe(defaults)) << f.key << "=" << v << " is not in describe()";
      }
      for (auto const& a : f.aliases) {
        C via_alias{};
        t.set(via_alias, a, v);
        EXPECT_EQ(describe(via_alias), describe(c)) << a;
      }
    }
  }
}

}  // namespace

// Outside the anonymous namespace: nvcc's front end warns (#177-D "declared but never
// referenced") about an internal-linkage operator T() that is only named in unevaluated operands
// (std::optional<T>'s constructor constraints, via member_count<ParallelConfig>).
namespace test_cli_detail {
/// Converts to anything: counts the members of an aggregate (the largest N with T{any x N}).
struct AnyMember {
  template <class T>
  operator T() const;
};
}  // namespace test_cli_detail

namespace {
using test_cli_detail::AnyMember;
template <class T, std::size_t... I>
constexpr auto brace_initializable(std::index_sequence<I...>)
    -> decltype(T{(void(I), AnyMember{})...}, true) {
  return true;
}
template <class T>
constexpr bool brace_initializable(...) {
  return false;
}
template <class T, std::size_t N = 0>
constexpr std::size_t member_count() {
  if constexpr (!brace_initializable<T>(std::make_index_sequence<N + 1>{}))
    return N;
  else
    return member_count<T, N + 1>();
}

std::string layer_text(moe::LayerConfig const& c) { return moe::describe(c); }
std::string par_text(moe::ParallelConfig const& c) { return c.describe(); }
std::string train_text(train::TrainConfig const& c) { return c.describe(); }

}  // namespace

TEST(ConfigTable, EveryFieldRoundTripsThroughSetAndDescribe) {
  expect_round_trips(moe::LayerConfig::table(), layer_text);
  expect_round_trips(moe::ParallelConfig::table(), par_text);
  expect_round_trips(train::TrainConfig::table(), train_text);
}

TEST(ConfigTable, TablesListEveryMemberOnce) {
  // No key twice (building a table throws on that), and as many fields as the struct has
  // members: a member missing from the table, or one listed twice, fails here.
  auto unique = [](std::vector<std::string> k) {
    std::sort(k.begin(), k.end());
    return std::adjacent_find(k.begin(), k.end()) == k.end();
  };
  EXPECT_TRUE(unique(moe::LayerConfig::keys()));
  EXPECT_TRUE(unique(moe::ParallelConfig::keys()));
  EXPECT_TRUE(unique(train::TrainConfig::all_keys()));
  EXPECT_EQ(member_count<moe::LayerConfig>(), moe::LayerConfig::table().fields().size());
  // ParallelConfig: its table, plus `sharding` (the files' rules; not a key).
  EXPECT_EQ(member_count<moe::ParallelConfig>(), moe::ParallelConfig::table().fields().size() + 1);
  // TrainConfig's own table, plus its members layer, par and given.
  EXPECT_EQ(member_count<train::TrainConfig>(), train::TrainConfig::table().fields().size() + 3);
  EXPECT_EQ(moe::LayerConfig::keys().size(), 23u);
  EXPECT_EQ(moe::ParallelConfig::keys().size(), 15u);
  // train_moe: its own keys (two aliases; with MaxText's precision keys weight_dtype, grad_dtype
  // and mu_dtype), then the layer's and the parallelism's (seed and dtype are its).
  EXPECT_EQ(train::TrainConfig::own_keys().size(), 38u);
  EXPECT_EQ(train::TrainConfig::all_keys().size(), 38u + 23u - 2u + 15u);
  // ParallelConfig::ici() comes from the table: the ici_* keys in order.
  moe::ParallelConfig p;
  p.ici_tensor_parallelism = 4;
  auto const ici = p.ici();
  ASSERT_EQ(ici.size(), 6u);
  EXPECT_EQ(ici[0].first, "ici_data_parallelism");
  EXPECT_EQ(ici[4], (std::pair<std::string, int>("ici_tensor_parallelism", 4)));
}

TEST(ConfigTable, BuildingRejectsAKeyOrMemberTwice) {
  struct Toy {
    int a = 1;
    int b = 2;
    double c = 0.5;
  };
  moe::ConfigTable<Toy> t;
  t.field("a", &Toy::a, "a", "first");
  EXPECT_THROW(t.field("a", &Toy::b, "b", "the key again"), std::logic_error);
  EXPECT_THROW(t.field("a2", &Toy::a, "a2", "the member again"), std::logic_error);
  EXPECT_THROW(t.field("b", &Toy::b, "a", "the describe() name again"), std::logic_error);
  t.field("b", &Toy::b, "b", "second").alias("bee");
  EXPECT_THROW(t.alias("a"), std::logic_error);
  EXPECT_THROW(t.at_least(&Toy::c, 0.0), std::logic_error);  // c is no field of the table
  t.field("c", &Toy::c, "c", "third").greater_than(&Toy::c, 0.0);
  EXPECT_EQ(t.keys(), (std::vector<std::string>{"a", "b", "bee", "c"}));
  Toy x;
  t.set(x, "bee", "7");
  EXPECT_EQ(x.b, 7);
  EXPECT_EQ(t.describe(x), "a=1;b=7;c=0.500000");
  x.c = 0;
  EXPECT_EQ(config_error([&] { t.validate(x); }), "c=0 must be > 0");
  EXPECT_EQ(t.listing(Toy{}),
            "a: int, default 1 -- first\nb (alias bee): int, default 2 -- second\n"
            "c: float, default 0.5 -- third; must be > 0\n");
}

TEST(ConfigTable, UnknownKeysNameTheNearest) {
  moe::LayerConfig cfg;
  EXPECT_EQ(config_error([&] { cfg.set("num_experts_per_tk", "2"); }),
            "unknown config key 'num_experts_per_tk' (value 2) (did you mean "
            "'num_experts_per_tok'?)");
  EXPECT_EQ(config_error([&] { cfg.set("bogus", "1"); }), "unknown config key 'bogus' (value 1)");
  moe::ParallelConfig par;
  EXPECT_EQ(config_error([&] { par.set("use_ring_of_expert", "true"); }),
            "unknown config key 'use_ring_of_expert' (value true) (did you mean "
            "'use_ring_of_experts'?)");
  train::TrainConfig tc;
  auto m = config_error([&] { tc.set("grad_clp", "0.5"); });
  EXPECT_TRUE(has(m, "unknown config key 'grad_clp' (value '0.5')")) << m;
  EXPECT_TRUE(has(m, "(did you mean 'grad_clip'?)")) << m;  // aliases are suggested too
  m = config_error([&] { tc.set("topk_routing_grup", "2"); });
  EXPECT_TRUE(has(m, "(did you mean 'topk_routing_group'?)")) << m;  // and the layer's keys
}

TEST(ConfigTable, WrongValuesNameTheKeyAndTheValue) {
  // Every typed field of every table: the message starts with key=value as given.
  auto every_field = [](auto const& table, auto make) {
    for (auto const& f : table.fields()) {
      if (f.type == moe::FieldType::String) continue;  // any text is a string
      for (auto const& key : [&] {
             auto k = f.aliases;
             k.insert(k.begin(), f.key);
             return k;
           }()) {
        auto c = make();
        auto const m = config_error([&] { table.set(c, key, "@bad"); });
        EXPECT_EQ(m.rfind(key + "=@bad", 0), 0u) << key << ": " << m;
      }
    }
  };
  every_field(moe::LayerConfig::table(), [] { return moe::LayerConfig(); });
  every_field(moe::ParallelConfig::table(), [] { return moe::ParallelConfig(); });
  every_field(train::TrainConfig::table(), [] { return train::TrainConfig(); });

  moe::LayerConfig c;
  auto error = [&](char const* key, char const* value) {
    return config_error([&] { c.set(key, value); });
  };
  EXPECT_EQ(error("num_experts", "abc"), "num_experts=abc is not an integer");
  EXPECT_EQ(error("num_experts", "99999999999"), "num_experts=99999999999 does not fit in 32 bits");
  EXPECT_EQ(error("capacity_factor", "x"), "capacity_factor=x is not a finite number");
  EXPECT_EQ(error("capacity_factor", "1e400"), "capacity_factor=1e400 is not a finite number");
  EXPECT_EQ(error("routed_bias", "maybe"), "routed_bias=maybe is not a boolean (true or false)");
  EXPECT_EQ(error("seed", "-1"), "seed=-1 must be >= 0");
  EXPECT_EQ(error("decoder_block", "gpt"),
            "decoder_block=gpt is not supported (mixtral | deepseek)");
  EXPECT_EQ(error("routed_score_func", "relu"),
            "routed_score_func=relu is not supported (\"\" | softmax | sigmoid | sqrtsoftplus)");
  EXPECT_EQ(error("mlp_activations", "relu"),
            "mlp_activations=relu: activation 'relu' is not supported (silu | gelu)");
  EXPECT_EQ(error("mlp_activations", "silu,gelu"),
            "mlp_activations=silu,gelu is not supported ([silu, linear] | [gelu, linear])");
  moe::ParallelConfig p;
  EXPECT_EQ(config_error([&] { p.set("ici_data_parallelism", "0"); }),
            "ici_data_parallelism=0 must be -1 (fill) or a positive degree");
  train::TrainConfig t;
  EXPECT_EQ(config_error([&] { t.set("dtype", "float16"); }),
            "dtype=float16 is not supported (float32 | float64 | bfloat16)");
  EXPECT_EQ(config_error([&] { t.set("grad_clip", "x"); }), "grad_clip=x is not a finite number");
  EXPECT_EQ(config_error([&] { t.set("steps", "1.5"); }), "steps=1.5 is not an integer");
  // A rejected value leaves the field as it was.
  EXPECT_EQ(t.dtype, "float32");
  EXPECT_EQ(c.num_experts, 8);
}

TEST(ConfigTable, DescribeTextsStayTheSame) {
  // The ranks compare these texts, and messages quote their fields (K=1, ring=0, cf=1.5): the
  // form must not change by accident.
  EXPECT_EQ(moe::describe(moe::LayerConfig()),
            "E=8;K=2;D=64;F=128;block=0;score=0;bias=0;scale=1.000000;groups=-1/-1;norm=0;"
            "random=0;seed=0;cf=-1.000000;lb=0.000000;rate=0.000000;act=0;shared=0;sparse=1;"
            "finite=1;dtype=0;f32sum=1;f32gate=0");
  moe::LayerConfig c;
  c.set("decoder_block", "deepseek");
  c.set("n_routing_groups", "4");
  c.set("topk_routing_group", "2");
  c.set("capacity_factor", "1.5");
  c.set("mlp_activations", "[gelu, linear]");
  c.set("routed_score_func", "sigmoid");
  EXPECT_EQ(moe::describe(c),
            "E=8;K=2;D=64;F=128;block=1;score=2;bias=0;scale=1.000000;groups=4/2;norm=0;"
            "random=0;seed=0;cf=1.500000;lb=0.000000;rate=0.000000;act=1;shared=0;sparse=1;"
            "finite=1;dtype=0;f32sum=1;f32gate=0");
  EXPECT_EQ(moe::ParallelConfig().describe(),
            "ici_data_parallelism=1;ici_fsdp_parallelism=1;ici_fsdp_transpose_parallelism=1;"
            "ici_expert_parallelism=1;ici_tensor_parallelism=1;ici_context_parallelism=1;ring=0;"
            "rbf=-1.000000;two_stage=0;preset=;no_exp_batch=0;exp_on_fsdp=0;fsdp2d=0;"
            "exp_attn=fsdp;emb_chunks=0");
  train::TrainConfig const t;
  std::string const own =
      "|steps=400|pdbs=8|S=64|V=16|C=4|L=2|dtype=float32|wdtype=float32|gdtype=float32|"
      "mudtype=|eps=1.0000000000000001e-05|seed=0|lr=0.0030000000000000001|warmup=-1|warmup_f=0."
      "10000000000000001|sched=-1|"
      "final=0.10000000000000001|b1=0.90000000000000002|b2=0.94999999999999996|aeps=1e-08|"
      "wd=0.01|clip=1|data=markov|path=|order=2|branch=3|ckpt=0|period=100|dir=checkpoints|"
      "keep=3|export=|log=10|metrics=|sig=SIGTERM,SIGINT,SIGHUP,SIGUSR1|allow=|timeout=600";
  EXPECT_EQ(t.describe(), moe::describe(t.layer) + "|" + t.par.describe() + own);
}

TEST(ConfigTable, ListingAndReadmeCoverEveryKey) {
  std::string const layer = moe::LayerConfig::table().listing(moe::LayerConfig());
  EXPECT_TRUE(has(layer, "num_experts: int, default 8 -- E, routed experts; must be >= 1\n"))
      << layer;
  EXPECT_TRUE(has(layer,
                  "routed_score_func: choice (\"\" | softmax | sigmoid | sqrtsoftplus), "
                  "default \"\" -- "))
      << layer;
  EXPECT_TRUE(has(layer,
                  "mlp_activations: choice ([silu, linear] | [gelu, linear]), default "
                  "[silu, linear] -- "))
      << layer;
  std::string const own = train::TrainConfig::table().listing(train::TrainConfig());
  EXPECT_TRUE(has(own, "adam_weight_decay (alias weight_decay): float, default 0.01 -- ")) << own;
  // README.md documents every key (in backquotes) of every tool.
  std::ifstream in(std::string(MOE_SOURCE_DIR) + "/README.md");
  std::string const readme((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(readme.empty());
  for (auto const& k : train::TrainConfig::all_keys())
    EXPECT_TRUE(has(readme, "`" + k + "`")) << "README.md does not name key " << k;
}
