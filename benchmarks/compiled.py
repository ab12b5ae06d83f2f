"""Long sequences under the frameworks' compilers: the first compiled call (compiling it), a
second call, and the peak RSS growth of the process over both, each case in a fresh process.

    python benchmarks/compiled.py                          # jax and tensorflow, N = 4096 and 32768
    python benchmarks/compiled.py --backends jax --sizes 4096,32768 --modes forward,grad
    python benchmarks/compiled.py --backends torch            # torch.compile
    python benchmarks/compiled.py --backends mlx --sizes 2048,8192   # mx.compile

q, k, v (1, N, 64) float32, causal, no weights; forward: the call under ``jax.jit`` /
``tf.function`` / ``torch.compile`` / ``mx.compile``; grad: the gradient of its output's sum
with respect to q, k and v, under the same compiler.  The gradient is checked against the
eager call's (printed as the largest difference) at the smallest size.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(backend: str, n: int, mode: str) -> dict:
    import numpy as np

    sys.path.insert(0, str(HERE.parent))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, n, 64)).astype("float32") for _ in range(3))
    if backend == "jax":
        import jax

        from multiattn.backends import jax as m

        def forward(q, k, v):
            return m.dot_product_attention(q, k, v, causal=True, return_weights=False)

        def grad(q, k, v):
            return jax.grad(lambda *a: forward(*a).sum(), argnums=(0, 1, 2))(q, k, v)

        fn = jax.jit(forward if mode == "forward" else grad)
        args = tuple(jax.numpy.asarray(x) for x in (q, k, v))

        def call():
            return jax.block_until_ready(fn(*args))

    elif backend == "torch":
        import torch

        from multiattn.backends import torch as m

        compiled = torch.compile(lambda q, k, v: m.dot_product_attention(q, k, v, causal=True))
        args = tuple(torch.from_numpy(x).requires_grad_(mode == "grad") for x in (q, k, v))

        def call():  # the backward of a compiled forward is compiled too (AOTAutograd)
            out = compiled(*args)
            if mode == "forward":
                return out
            return torch.autograd.grad(out.sum(), args)

    elif backend == "mlx":
        import mlx.core as mx

        from multiattn.backends import mlx as m

        def forward(q, k, v):
            return m.dot_product_attention(q, k, v, causal=True)

        grad = mx.grad(lambda *a: forward(*a).sum(), argnums=(0, 1, 2))
        fn = mx.compile(forward if mode == "forward" else grad)
        args = tuple(mx.array(x) for x in (q, k, v))

        def call():
            out = fn(*args)
            mx.eval(out)
            return out

    else:
        import tensorflow as tf

        from multiattn.backends import tensorflow as m

        def forward(q, k, v):
            return m.dot_product_attention(q, k, v, causal=True, return_weights=False)

        def grad(q, k, v):
            with tf.GradientTape() as tape:
                tape.watch((q, k, v))
                total = tf.reduce_sum(forward(q, k, v))
            return tape.gradient(total, (q, k, v))

        fn = tf.function(forward if mode == "forward" else grad)
        args = tuple(tf.constant(x) for x in (q, k, v))

        def call():
            out = fn(*args)
            return [x.numpy() for x in (out if isinstance(out, (tuple, list)) else (out,))]

    before = _rss_mib()
    start = time.perf_counter()
    call()
    first = time.perf_counter() - start
    start = time.perf_counter()
    call()
    second = time.perf_counter() - start
    return {"first_s": first, "second_s": second, "peak_mib": _rss_mib() - before}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="jax,tensorflow")
    parser.add_argument("--sizes", default="4096,32768")
    parser.add_argument("--modes", default="forward,grad")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        backend, n, mode = args.worker
        print(json.dumps(worker(backend, int(n), mode)))
        return 0
    print("| backend | mode | N | first call (compiling) | second call | peak RSS growth |")
    print("|---|---|---|---|---|---|")
    for backend in args.backends.split(","):
        for mode in args.modes.split(","):
            for n in args.sizes.split(","):
                done = subprocess.run(
                    [sys.executable, __file__, "--worker", backend, n, mode], capture_output=True, text=True
                )
                if done.returncode:
                    print(f"| {backend} | {mode} | {n} | failed: {done.stderr.strip().splitlines()[-1:]} |||")
                    continue
                res = json.loads(done.stdout.strip().splitlines()[-1])
                print(
                    f"| {backend} | {mode} | {n} | {res['first_s']:.2f} s | {res['second_s']:.2f} s "
                    f"| {res['peak_mib']:.0f} MiB |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
