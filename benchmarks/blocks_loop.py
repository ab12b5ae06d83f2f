"""The block loop's calls, one backend per process, for before/after comparisons of the loop:

    python benchmarks/blocks_loop.py REPO BACKEND N GRAD_N

REPO: the checkout to import multiattn from (a second worktree for "before"); q, k, v (1, N, 64)
float32, blocks forced at the backend's automatic side, the cases plain, causal, lengths (N/4),
causal+lengths (3N/4), window (``mods.sliding_window(512)``) and documents (16 equal ones, both
at their own block side), and where the backend has a vjp, the gradients of the plain and the
causal call at GRAD_N (0: none).  Prints one JSON line: the median of 3 calls each, ms.  Run it
in fresh processes, before and after alternated (benchmarks/RESULTS.md, 2026-12-07 fifth)."""

from __future__ import annotations

import json
import statistics
import sys
import time


def main(repo: str, backend: str, n: int, grad_n: int) -> dict:
    sys.path.insert(0, repo)
    if backend == "paddle":
        import paddle  # noqa: F401  (before tensorflow, which another import may bring)
    import numpy as np

    import multiattn
    from multiattn import blockwise, mods, tuning

    m = multiattn.get_backend(backend)
    ops, rng = m.ops, np.random.default_rng(0)

    def tensor(x):
        return m.from_numpy(x.astype(np.float32), "float32")

    def timed(fn) -> float:
        def once():
            out = fn()
            out = out[0] if isinstance(out, (tuple, list)) else out
            ops.settle(out)
            if backend == "jax":
                out.block_until_ready()
            elif backend == "mlx":
                import mlx.core as mx

                mx.eval(out)

        once()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            once()
            times.append(time.perf_counter() - start)
        return round(statistics.median(times) * 1e3, 1)

    q, k, v = (tensor(rng.standard_normal((1, n, 64))) for _ in range(3))
    block = blockwise.block_size_for(1, 4, area=tuning.of(ops).block_area)
    cases = {
        "plain": {}, "causal": dict(causal=True),
        "lengths": dict(valid_lens=m.from_numpy(np.array([n // 4]))),
        "causal+lengths": dict(causal=True, valid_lens=m.from_numpy(np.array([3 * n // 4]))),
        "window": dict(mask_mod=mods.sliding_window(512)),
        "documents": dict(mask_mod=mods.document(np.repeat(np.arange(16), n // 16)[None])),
    }  # fmt: skip
    found, call = {"backend": backend, "block": block}, multiattn.dot_product_attention
    for name, kw in cases.items():
        size = None if "mask_mod" in kw else block
        found[name] = timed(lambda kw=kw, size=size: call(q, k, v, block_size=size, **kw))
    if m.vjp is not None and grad_n:
        q, k, v, cotangent = (tensor(rng.standard_normal((1, grad_n, 64))) for _ in range(4))
        for name, kw in (("grad plain", {}), ("grad causal", dict(causal=True))):

            def attend(q, k, v, kw=kw):
                return multiattn.dot_product_attention(q, k, v, block_size=block, **kw)

            found[name] = timed(lambda attend=attend: m.vjp(attend, [q, k, v], cotangent)[1][0])
    return found


if __name__ == "__main__":
    repo, backend, n, grad_n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(main(repo, backend, n, grad_n)))
