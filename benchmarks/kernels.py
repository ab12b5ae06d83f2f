"""4-D calls against the framework's own fused attention: q (1, 8, N, 64), keys and values
(1, H_kv, N, 64), float32; causal, no mask, and lengths (each sequence's first 3N/4 keys,
given to the kernel as a boolean mask); multiattn's ``dot_product_attention`` against torch's
``scaled_dot_product_attention(enable_gqa=True)``, paddle's
``nn.functional.scaled_dot_product_attention`` and mlx's ``mx.fast.scaled_dot_product_attention``.

    python benchmarks/kernels.py --backend torch [--grad] [--sizes 256,1024,2048,4096]

Each cell: the median of --calls timed calls of each, interleaved (multiattn, kernel, kernel,
multiattn, ...),
after two warm-up calls; the ratio multiattn / kernel; the largest difference of the two
outputs (and of the gradients with --grad) from each other, and of multiattn's output from a
float64 reference (numpy, the formula) up to --reference-to, printed after every timing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

H, D = 8, 64


def _torch(rng, n, kv, mask, grad):
    import torch
    import torch.nn.functional as F

    import multiattn

    q, k, v = (torch.tensor(rng.normal(size=(1, h, n, D)), dtype=torch.float32) for h in (H, kv, kv))
    lens = torch.tensor([3 * n // 4])
    sdpa_mask = (torch.arange(n) < lens[:, None])[:, None, None, :] if mask == "lengths" else None
    ours_kw = {"causal": mask == "causal", "valid_lens": lens if mask == "lengths" else None}
    d_out = torch.tensor(rng.normal(size=(1, H, n, D)), dtype=torch.float32)

    def call(f):
        tensors = [x.detach().requires_grad_(grad) for x in (q, k, v)]
        out = f(*tensors)
        if not grad:
            return out.detach(), ()
        grads = torch.autograd.grad(out, tensors, d_out)
        return out.detach(), grads

    def ours(a, b, c):
        return multiattn.dot_product_attention(a, b, c, **ours_kw)

    def kernel(a, b, c):
        return F.scaled_dot_product_attention(
            a, b, c, attn_mask=sdpa_mask, is_causal=mask == "causal", enable_gqa=kv != H
        )

    def run(f):
        with torch.set_grad_enabled(grad):
            return call(f)

    return (lambda: run(ours)), (lambda: run(kernel)), (lambda x: x.numpy())


def _paddle(rng, n, kv, mask, grad):
    import paddle
    import paddle.nn.functional as F

    import multiattn

    def tensor(shape):
        return paddle.to_tensor(rng.normal(size=shape).astype("float32"))

    q, k, v = tensor((1, H, n, D)), tensor((1, kv, n, D)), tensor((1, kv, n, D))
    lens = paddle.to_tensor([3 * n // 4])
    ours_kw = {"causal": mask == "causal", "valid_lens": lens if mask == "lengths" else None}
    # paddle's layout is (batch, seq, heads, dim); its kernel takes no grouped heads: repeated
    g = H // kv
    qt, kt, vt = (paddle.transpose(x, [0, 2, 1, 3]) for x in (q, k, v))
    kt, vt = (paddle.repeat_interleave(x, g, axis=2) for x in (kt, vt))
    kmask = None
    if mask == "lengths":
        kmask = (paddle.arange(n) < lens[:, None])[:, None, None, :]

    def ours():
        return multiattn.dot_product_attention(q, k, v, **ours_kw), ()

    def kernel():
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=kmask, is_causal=mask == "causal")
        return paddle.transpose(out, [0, 2, 1, 3]), ()

    return ours, kernel, (lambda x: x.numpy())


def _mlx(rng, n, kv, mask, grad):
    import mlx.core as mx

    import multiattn

    q, k, v = (mx.array(rng.normal(size=(1, h, n, D)).astype("float32")) for h in (H, kv, kv))
    lens = mx.array([3 * n // 4])
    ours_kw = {"causal": mask == "causal", "valid_lens": lens if mask == "lengths" else None}
    kmask = {"causal": "causal", "none": None}.get(mask)
    if mask == "lengths":
        kmask = (mx.arange(n) < lens[:, None])[:, None, None, :]

    def ours():
        out = multiattn.dot_product_attention(q, k, v, **ours_kw)
        mx.eval(out)
        return out, ()

    def kernel():
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=kmask)
        mx.eval(out)
        return out, ()

    return ours, kernel, np.asarray


SETUPS = {"torch": _torch, "paddle": _paddle, "mlx": _mlx}


def reference(n, kv, mask, seed=0):
    """The float64 output from the formula, numpy alone, for the inputs the setups draw first
    (the same generator state): query head h reads key head h // (H / kv)."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(1, h, n, D)) for h in (H, kv, kv))
    k, v = (np.repeat(x, H // kv, axis=1) for x in (k, v))
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(D)
    visible = np.ones((n, n), bool)
    if mask == "causal":
        visible = np.tril(visible)
    elif mask == "lengths":
        visible[:, 3 * n // 4 :] = False
    scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=sorted(SETUPS), default="torch")
    parser.add_argument("--sizes", default="256,1024,2048,4096")
    parser.add_argument("--kv-heads", default="8,2")
    parser.add_argument("--masks", default="causal,none,lengths")
    parser.add_argument("--calls", type=int, default=7)
    parser.add_argument("--grad", action="store_true", help="forward and backward (torch)")
    parser.add_argument("--reference-to", type=int, default=2048, help="the float64 reference up to this N")
    args = parser.parse_args()
    print(f"{args.backend}{' forward+backward' if args.grad else ''}: N, H_kv, mask, multiattn / kernel ms")
    outputs = []
    for n in map(int, args.sizes.split(",")):
        for kv in map(int, args.kv_heads.split(",")):
            for mask in args.masks.split(","):
                ours, kernel, host = SETUPS[args.backend](np.random.default_rng(0), n, kv, mask, args.grad)
                times = {ours: [], kernel: []}
                results = {}
                for f in (ours, kernel, ours, kernel):  # warm-up
                    results[f] = f()
                for i in range(args.calls):
                    for f in (ours, kernel) if i % 2 == 0 else (kernel, ours):  # neither always first
                        start = time.perf_counter()
                        f()
                        times[f].append(time.perf_counter() - start)
                a, b = (statistics.median(times[f]) * 1e3 for f in (ours, kernel))
                pairs = zip((results[ours][0], *results[ours][1]), (results[kernel][0], *results[kernel][1]))
                diff = max(float(np.max(np.abs(host(x) - host(y)))) for x, y in pairs)
                print(
                    f"{n:5d} {kv} {mask:8s} {a:9.2f} / {b:9.2f} ms = {a / b:5.2f}x",
                    f" (outputs differ by {diff:.1e})",
                    flush=True,
                )
                if n <= args.reference_to:
                    outputs.append((n, kv, mask, host(results[ours][0])))
    # after every timing: numpy's BLAS threads spin after a product, beside the next cell's
    for n, kv, mask, out in outputs:
        far = np.max(np.abs(out - reference(n, kv, mask)))
        print(f"{n:5d} {kv} {mask:8s} multiattn from the float64 reference: {far:.1e}")


if __name__ == "__main__":
    main()
