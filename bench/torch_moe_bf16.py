#!/usr/bin/env python3
"""PyTorch's sorted-by-expert MoE layer in bf16 on the CPU, the yardstick of #29's layer targets.

What a user writes in PyTorch for moe's layer_fwd_bf16/ row (E=8, T=4096, K=2, D=1024, F=2816,
softmax top-k, SiLU-gated experts): route in fp32, sort the token copies by expert, one matmul
per expert and projection in bf16 (PyTorch's CPU matmul: oneDNN, AMX where the CPU has it),
weighted sum back to the tokens. Prints the forward and the forward+backward in GFLOP/s of the
expert GEMMs (the counting of moe_bench's layer rows: 3 x 2*T*K*D*F forward, 9 x forward+backward)
as one JSON line, with PyTorch's dense bf16 matmul of one projection's FLOPs (dense_gflops).
Run it with the thread count of the moe_bench run it is compared with:

    OMP_NUM_THREADS=2 python3 bench/torch_moe_bf16.py --threads 2
"""
import argparse
import json
import time

import torch


def layer(x, gate, wi0, wi1, wo, top_k):
    logits = x.float() @ gate.float()
    probs = torch.softmax(logits, dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate.shape[1]).tolist()
    xs = x.repeat_interleave(top_k, dim=0)[order]
    outs = []
    start = 0
    for e, n in enumerate(counts):
        rows = xs[start:start + n]
        h = torch.nn.functional.silu(rows @ wi0[e]) * (rows @ wi1[e])
        outs.append(h @ wo[e])
        start += n
    ys = torch.empty_like(xs)
    ys[order] = torch.cat(outs)
    ys = ys.view(x.shape[0], top_k, -1).float()
    return (ys * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)


def median(v):
    v = sorted(v)
    return v[len(v) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--emb", type=int, default=1024)
    ap.add_argument("--mlp", type=int, default=2816)
    ap.add_argument("--iterations", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    T, E, K, D, F = a.tokens, a.experts, a.top_k, a.emb, a.mlp
    bf = torch.bfloat16
    x = torch.randn(T, D).to(bf)
    gate = (0.02 * torch.randn(D, E)).requires_grad_()
    wi0 = (0.02 * torch.randn(E, D, F)).to(bf).requires_grad_()
    wi1 = (0.02 * torch.randn(E, D, F)).to(bf).requires_grad_()
    wo = (0.02 * torch.randn(E, F, D)).to(bf).requires_grad_()
    flops = 2.0 * T * K * D * F * 3
    fwd, both = [], []
    for it in range(a.iterations + 1):
        with torch.no_grad():
            t0 = time.perf_counter()
            layer(x, gate, wi0, wi1, wo, K)
            t1 = time.perf_counter()
        xg = x.clone().requires_grad_()
        t2 = time.perf_counter()
        y = layer(xg, gate, wi0, wi1, wo, K)
        y.float().sum().backward()
        t3 = time.perf_counter()
        for p in (gate, wi0, wi1, wo):
            p.grad = None
        if it > 0:  # the first is a warm-up
            fwd.append(t1 - t0)
            both.append(t3 - t2)
    # PyTorch's own dense bf16 matmul of the same FLOPs as one projection ([T*K, D] x [D, F]).
    lhs, rhs = torch.randn(T * K, D).to(bf), torch.randn(D, F).to(bf)
    dense = []
    for it in range(a.iterations + 1):
        t0 = time.perf_counter()
        torch.matmul(lhs, rhs)
        if it > 0:
            dense.append(time.perf_counter() - t0)
    print(json.dumps({
        "torch": torch.__version__, "threads": a.threads, "T": T, "E": E, "K": K, "D": D, "F": F,
        "fwd_ms": 1e3 * median(fwd), "fwd_gflops": flops / median(fwd) * 1e-9,
        "fwd_bwd_ms": 1e3 * median(both), "fwd_bwd_gflops": 3 * flops / median(both) * 1e-9,
        "dense_gflops": 2.0 * T * K * D * F / median(dense) * 1e-9,
        "mkldnn_bf16": torch.backends.mkldnn.is_available()}))


if __name__ == "__main__":
    main()
