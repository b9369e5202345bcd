#!/usr/bin/python3
"""Markdown report of bench/isa_tiers.sh: the oneDNN backend at each ISA tier of one CPU.

usage: isa_table.py DIR TIER [TIER...]

DIR holds bench_<tier>_r<round>.json (moe_bench --isa=<tier>), threads_<n>.json (the native tier
at n OpenMP threads) and train_<tier>_r<round>.log (train_moe's default run). For each benchmark
row and tier: the median over rounds of GFLOP/s, peak_ratio (the FMA peak measured at that
tier), dense_ratio and, for decode rows, bw_ratio; the first tier's GFLOP/s over each other's
(median over rounds of the per-round ratio, rounds alternate the tiers); the worst ref_runs.
"""
import glob
import json
import os
import re
import statistics
import sys


def rows_of(path):
    with open(path) as f:
        data = json.load(f)
    out = {}
    for b in data.get("benchmarks", []):
        name = re.sub(r"/iterations:\d+", "", b["name"])
        name = re.sub(r"/manual_time$", "", name)
        name = re.sub(r"/isa=[a-z0-9_]+$", "", name)
        out[name] = b
    return data.get("context", {}), out


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(v, spec):
    return "" if v is None else spec.format(v)


def main():
    d, tiers = sys.argv[1], sys.argv[2:]
    runs = {t: [] for t in tiers}  # tier -> [(context, rows)] per round
    for t in tiers:
        for path in sorted(glob.glob(os.path.join(d, "bench_{}_r*.json".format(t)))):
            runs[t].append(rows_of(path))
    out = ["# oneDNN backend per ISA tier (bench/isa_tiers.sh)", ""]
    first = runs[tiers[0]][0][0] if runs[tiers[0]] else {}
    for key in ("cpu", "date", "host_name"):
        if key in first:
            out.append("- {}: {}".format(key, first[key]))
    for t in tiers:
        if runs[t]:
            c = runs[t][0][0]
            out.append("- tier {}: {}; fma_peak {}; triad {}; {} rounds".format(
                t, c.get("onednn", "?"), c.get("fma_peak", "?"), c.get("triad_bandwidth", "?"),
                len(runs[t])))
    out.append("")
    head = "| benchmark |"
    rule = "|---|"
    for t in tiers:
        head += " {0} GFLOP/s | {0} peak_ratio | {0} dense_ratio | {0} bw_ratio |".format(t)
        rule += "---:|---:|---:|---:|"
    for t in tiers[1:]:
        head += " {} / {} |".format(tiers[0], t)
        rule += "---:|"
    head += " ref_runs |"
    rule += "---:|"
    out += [head, rule]
    names = []
    for t in tiers:
        for _, rows in runs[t]:
            for n in rows:
                if n not in names:
                    names.append(n)
    for n in names:
        line = "| {} |".format(n)
        per_round = {}
        refs = []
        for t in tiers:
            got = [rows[n] for _, rows in runs[t] if n in rows]
            per_round[t] = [g.get("gflops") for g in got]
            refs += [g.get("ref_runs", 0) for g in got]
            line += " {} | {} | {} | {} |".format(
                fmt(med(per_round[t]), "{:.1f}"), fmt(med([g.get("peak_ratio") for g in got]), "{:.3f}"),
                fmt(med([g.get("dense_ratio") for g in got]), "{:.3f}"),
                fmt(med([g.get("bw_ratio") for g in got]), "{:.3f}"))
        for t in tiers[1:]:
            pairs = [a / b for a, b in zip(per_round[tiers[0]], per_round[t]) if a and b]
            line += " {} |".format(fmt(med(pairs), "{:.3f}"))
        line += " {} |".format(fmt(max(refs) if refs else None, "{:.0f}"))
        out.append(line)
    decode = [(re.search(r"decode_([a-z0-9_]+)\.json", p).group(1), rows_of(p))
              for p in glob.glob(os.path.join(d, "decode_*.json"))]
    order = ["sse41", "avx", "avx2", "avx512_core", "avx512_core_vnni", "avx512_core_bf16",
             "avx512_core_amx"]
    decode.sort(key=lambda x: order.index(x[0]) if x[0] in order else len(order))
    if decode:
        out += ["", "Decode rows (T=64, K=2, E=64) at every tier of this CPU: bw_ratio (weight bytes "
                "read per second / triad bandwidth), ref_runs", "",
                "| benchmark | " + " | ".join(t for t, _ in decode) + " |",
                "|---|" + "---:|" * len(decode)]
        for n in decode[0][1][1]:
            out.append("| {} | {} |".format(n, " | ".join(
                "{}, {}".format(fmt(r[1][n].get("bw_ratio"), "{:.3f}"),
                                fmt(r[1][n].get("ref_runs"), "{:.0f}")) if n in r[1] else ""
                for _, r in decode)))
    threads = sorted(glob.glob(os.path.join(d, "threads_*.json")),
                     key=lambda p: int(re.search(r"threads_(\d+)", p).group(1)))
    if threads:
        out += ["", "Native tier at other thread counts (OMP_NUM_THREADS; this machine has {} "
                "cores, so more threads oversubscribe it): GFLOP/s, ref_runs".format(os.cpu_count()),
                "", "| benchmark | " + " | ".join(
                    re.search(r"threads_(\d+)", p).group(1) + " threads" for p in threads) + " |",
                "|---|" + "---:|" * len(threads)]
        data = [rows_of(p)[1] for p in threads]
        for n in data[0]:
            out.append("| {} | {} |".format(n, " | ".join(
                "{}, {}".format(fmt(r[n].get("gflops"), "{:.1f}"), fmt(r[n].get("ref_runs"), "{:.0f}"))
                if n in r else "" for r in data)))
    train = {t: sorted(glob.glob(os.path.join(d, "train_{}_r*.log".format(t)))) for t in tiers}
    if any(train.values()):
        out += ["", "train_moe default run (2 ranks): tokens/s/device per round; wall seconds of "
                "the whole run (start-up, 400 steps, the closing GEMM yardstick); the kernels "
                "rank 0 ran", "", "| tier | tokens/s/device | wall s | kernels (last round) |",
                "|---|---|---|---|"]
        tps = {}
        for t in tiers:
            vals, walls, kern = [], [], ""
            for p in train[t]:
                text = open(p).read()
                m = re.search(r"^summary: tokens/s/device ([0-9.]+)", text, re.M)
                vals.append(float(m.group(1)) if m else None)
                m = re.search(r"^wall_seconds: ([0-9.]+)", text, re.M)
                walls.append(m.group(1) if m else "?")
                m = re.search(r"^summary: gemm kernels \(rank 0\) (.*)$", text, re.M)
                kern = m.group(1) if m else "?"
            tps[t] = vals
            out.append("| {} | {} | {} | {} |".format(
                t, ", ".join(fmt(v, "{:.0f}") for v in vals), ", ".join(walls), kern))
        for t in tiers[1:]:
            pairs = [a / b for a, b in zip(tps[tiers[0]], tps[t]) if a and b]
            out.append("")
            out.append("tokens/s/device {} / {}: {} per round, median {}".format(
                tiers[0], t, ", ".join("{:.3f}".format(p) for p in pairs),
                fmt(med(pairs), "{:.3f}")))
    print("\n".join(out))


if __name__ == "__main__":
    main()
