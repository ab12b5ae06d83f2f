"""Masks together against the single mask they amount to, and ``block_mask=`` against the masks
given directly, measured in interleaved rounds (as ``rounds.py``) on one backend.

    python benchmarks/combinations.py torch --n 16384 --rounds 3
    /work/venv-mx/bin/python benchmarks/combinations.py mxnet
    python benchmarks/combinations.py mlx --n 4096

q, k, v (1, N, 64) float32, no weights, eager; lengths [N] hide nothing, causality within a
sliding window of 512 changes nothing.  Printed: each case's median time, then per ratio its
median over the rounds and its range.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import rounds  # noqa: E402
import run  # noqa: E402

RATIOS = (
    ("window+causal", "window"),
    ("window+lengths", "window"),
    ("causal+lengths", "causal"),
    ("causal block_mask", "causal"),
    ("window block_mask", "window"),
)


def cases(backend: str, n: int) -> dict:
    """Each case's call, of no arguments, waiting for its result."""
    import numpy as np

    import multiattn
    from multiattn import mods

    module = multiattn.get_backend(backend)
    rng = np.random.default_rng(0)
    q, k, v = (module.from_numpy(rng.standard_normal((1, n, 64)), "float32") for _ in range(3))
    lens = module.from_numpy(np.array([n], dtype="float32" if backend == "mxnet" else "int64"), None)
    window = mods.sliding_window(512)
    causal_bm = multiattn.create_block_mask(batch=1, q_len=n, kv_len=n, causal=True, like=q)
    window_bm = multiattn.create_block_mask(window, batch=1, q_len=n, kv_len=n, like=q)
    kwargs = {
        "window": dict(mask_mod=window),
        "window+causal": dict(mask_mod=window, causal=True),
        "window+lengths": dict(mask_mod=window, valid_lens=lens),
        "causal": dict(causal=True),
        "causal+lengths": dict(causal=True, valid_lens=lens),
        "causal block_mask": dict(block_mask=causal_bm),
        "window block_mask": dict(block_mask=window_bm),
    }

    def call(options):
        return lambda: run._sync(backend, multiattn.dot_product_attention(q, k, v, **options))

    return {name: call(options) for name, options in kwargs.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("backend")
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    calls = cases(args.backend, args.n)
    for fn in calls.values():
        fn()  # warm-up
    times: dict = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    print(f"{args.backend}, N = {args.n}, {args.rounds} rounds")
    rounds.report(times, RATIOS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
