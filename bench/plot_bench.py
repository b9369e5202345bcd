#!/usr/bin/python3
"""Plots moe_bench results (Google Benchmark JSON) and prints a Markdown table.

usage: plot_bench.py RESULTS.json [-o bench.png] [--table table.md]

The plot shows dense_ratio (GFLOP/s of the benchmark / GFLOP/s of one dense GEMM of equal FLOPs
measured in the same process) per benchmark, grouped by family (gmm/, layer_fwd/, layer_bwd/,
permute/), with the issue's targets drawn as lines. The table adds peak_ratio (GFLOP/s / the
process's measured FMA peak), bw_ratio (decode rows: weight bytes read per second / the measured
triad bandwidth) and the backend that ran (the benchmark's label), and is preceded by the machine
yardsticks of the run's context (fma_peak, triad_bandwidth, dense_yardstick, onednn, blas_core and
any warning).
"""
import argparse
import json
import re
import sys

TARGETS = {"gmm": 0.90, "layer_fwd": 0.85}


def load(path):
    with open(path) as f:
        data = json.load(f)
    rows = []
    for b in data.get("benchmarks", []):
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        b["name"] = re.sub(r"/iterations:\d+(/manual_time)?", "", b["name"])
        b["name"] = re.sub(r"/manual_time$", "", b["name"])
        rows.append(b)
    return data.get("context", {}), rows


CONTEXT_KEYS = ["fma_peak", "triad_bandwidth", "gemm_threads", "dense_yardstick", "onednn",
                "blas_core", "warning_blas_core"]


def context_lines(ctx):
    return ["- {}: {}".format(k, ctx[k]) for k in CONTEXT_KEYS if k in ctx]


def table(rows, ctx=None):
    out = context_lines(ctx or {})
    if out:
        out.append("")
    out += ["| benchmark | backend | time (ms) | GFLOP/s | dense_ratio | peak_ratio | bw_ratio "
            "| its GEMMs alone: dense_ratio |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]

    def fmt(v, spec):
        return "" if v is None else spec.format(v)

    for b in rows:
        t = b.get("real_time", 0.0)
        unit = b.get("time_unit", "ns")
        ms = t * {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
        out.append("| {} | {} | {:.2f} | {} | {} | {} | {} | {} |".format(
            b["name"], b.get("label", ""), ms, fmt(b.get("gflops"), "{:.1f}"),
            fmt(b.get("dense_ratio"), "{:.3f}"), fmt(b.get("peak_ratio"), "{:.3f}"),
            fmt(b.get("bw_ratio"), "{:.3f}"), fmt(b.get("gemms_ratio"), "{:.3f}")))
    return "\n".join(out)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [b for b in rows if "dense_ratio" in b]
    if not rows:
        print("no dense_ratio counters to plot", file=sys.stderr)
        return
    names = [b["name"] for b in rows]
    vals = [b["dense_ratio"] for b in rows]
    colors = []
    palette = {"gmm": "tab:blue", "layer_fwd": "tab:green", "layer_bwd": "tab:orange",
               "permute": "tab:gray"}
    for n in names:
        colors.append(palette.get(n.split("/")[0], "tab:purple"))
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(names) + 1.5))
    ax.barh(range(len(names)), vals, color=colors)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=7)
    ax.invert_yaxis()
    for fam, t in TARGETS.items():
        ax.axvline(t, linestyle="--", linewidth=0.8, color=palette[fam],
                   label="{} target {:.2f}".format(fam, t))
    ax.set_xlabel("dense_ratio (GFLOP/s vs one dense GEMM of equal FLOPs)")
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("-o", "--output", default="bench.png")
    ap.add_argument("--table")
    a = ap.parse_args()
    ctx, rows = load(a.json)
    md = table(rows, ctx)
    if a.table:
        with open(a.table, "w") as f:
            f.write(md + "\n")
    print(md)
    plot(rows, a.output)


if __name__ == "__main__":
    main()
