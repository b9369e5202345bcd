#!/usr/bin/env python3
"""Plots loss vs step from train_moe's metrics_file (JSON lines) with the entropy-rate line.

    python3 scripts/plot_loss.py METRICS.jsonl [-o loss.png] [--title TEXT]

Draws the loss (cross-entropy + load-balance), the cross-entropy alone, and the dataset's
entropy rate (the best achievable cross-entropy) when the metrics carry one. A step that appears
more than once (a resumed run) keeps its last line.
"""
import argparse
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(path):
    by_step = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"plot_loss: {path}:{n}: not JSON: {e}")
            if "step" not in rec or "loss" not in rec:
                sys.exit(f"plot_loss: {path}:{n}: a metrics line needs 'step' and 'loss'")
            by_step[int(rec["step"])] = rec
    if not by_step:
        sys.exit(f"plot_loss: {path} holds no metrics")
    return [by_step[s] for s in sorted(by_step)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", help="metrics_file written by train_moe (JSON lines)")
    ap.add_argument("-o", "--output", default="loss.png", help="PNG to write (default loss.png)")
    ap.add_argument("--title", default=None, help="plot title")
    args = ap.parse_args()

    recs = read_metrics(args.metrics)
    steps = [r["step"] for r in recs]
    loss = [r["loss"] for r in recs]
    ce = [r.get("ce_loss") for r in recs]
    rates = [r.get("entropy_rate") for r in recs if r.get("entropy_rate") is not None]
    rate = rates[-1] if rates and math.isfinite(rates[-1]) else None

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(steps, loss, label="loss (cross-entropy + load balance)", lw=1.4)
    if all(v is not None for v in ce):
        ax.plot(steps, ce, label="cross-entropy", lw=1.0, alpha=0.8)
    if rate is not None:
        ax.axhline(rate, color="k", ls="--", lw=1.0, label=f"entropy rate {rate:.4f} nats/token")
        ax.set_ylim(bottom=0.0)
        ax.set_ylim(top=max(min(max(loss), 4 * rate), rate * 1.5))
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.set_title(args.title or f"train_moe: loss vs step ({args.metrics})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    last = recs[-1]
    ce_last = last.get("ce_loss", last["loss"])
    gap = f", ce_loss {ce_last:.4f} is {100 * (ce_last - rate) / rate:.1f}% above the entropy rate" \
        if rate is not None else ""
    print(f"plot_loss: {args.output}: {len(recs)} steps, final loss {last['loss']:.4f}{gap}")


if __name__ == "__main__":
    main()
