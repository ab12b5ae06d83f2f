"""One decoding step over a cache: multiattn's ``cached_attention`` against what Hugging Face's
``DynamicCache`` does (``torch.cat`` of the new position onto the cache, then
``scaled_dot_product_attention(enable_gqa=True)``) and against recomputing the full causal
attention; B = 1, 8 query heads, 2 key/value heads, d = 64, float32, no autograd.  The paged
cache is filled by one append (its pages one array) and, "page by page", by appends of 256
positions (each page its own array, as pages added by decoding steps).

    python benchmarks/decoding.py --backend torch --lengths 1024,8192,32768
    python benchmarks/decoding.py --backend jax                  # multiattn alone, every backend

Per cache length, interleaved rounds (each implementation once per round, the order rotated
from round to round), medians; and the
storage bytes per cached position of a contiguous and a paged (256) cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import _sync  # noqa: E402  (benchmarks/run.py: waiting for lazy frameworks)

import multiattn  # noqa: E402

B, H, KV, D = 1, 8, 2, 64


def implementations(backend: str, length: int) -> dict:
    """name -> a function of no arguments that runs one step (and is reset by its own state)."""
    m = multiattn.get_backend(backend)
    rng = np.random.default_rng(0)
    dtype = "float32"
    k_all = m.from_numpy(rng.normal(size=(B, KV, length, D)), dtype)
    v_all = m.from_numpy(rng.normal(size=(B, KV, length, D)), dtype)
    q = m.from_numpy(rng.normal(size=(B, H, 1, D)), dtype)
    k_new = m.from_numpy(rng.normal(size=(B, KV, 1, D)), dtype)
    v_new = m.from_numpy(rng.normal(size=(B, KV, 1, D)), dtype)
    like = m.from_numpy(np.zeros(1), dtype)
    fns = {}
    layouts = (("multiattn contiguous", None, length), ("multiattn paged 256", 256, length),
               ("multiattn paged 256, page by page", 256, 256))  # fmt: skip
    for name, page_size, chunk in layouts:
        cache = multiattn.KVCache(B, KV, D, like=like, page_size=page_size, capacity=0)
        for at in range(0, length, chunk):  # one append: its pages one array; 256 at a time: one each
            cache = cache.append(k_all[:, :, at : at + chunk], v_all[:, :, at : at + chunk])
        filled = cache.length

        def step(cache=cache, filled=filled):
            cache.length = filled  # the same step each time: the new position overwritten
            out, _ = multiattn.cached_attention(q, k_new, v_new, cache)
            return out

        if backend == "jax":  # a value: the step rebuilds from the same cache each time
            import jax

            jitted = jax.jit(multiattn.cached_attention, donate_argnums=3)  # the storage updated in place
            grown = multiattn.KVCache(B, KV, D, like=like, capacity=length + 1024).append(k_all, v_all)
            state = {"cache": grown, "length": grown.length}

            def step(state=state, jitted=jitted):  # noqa: F811
                state["cache"].length = state["length"]  # the same step each time
                out, state["cache"] = jitted(q, k_new, v_new, state["cache"])
                return out

            if page_size is not None:
                continue
        fns[name] = step
    if backend == "torch":
        import torch
        import torch.nn.functional as F

        def dynamic_cache():  # transformers' DynamicCache.update, then SDPA
            keys, values = torch.cat([k_all, k_new], -2), torch.cat([v_all, v_new], -2)
            return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)

        q_full = torch.from_numpy(rng.normal(size=(B, H, length + 1, D)).astype("float32"))
        keys, values = torch.cat([k_all, k_new], -2), torch.cat([v_all, v_new], -2)

        def recompute():  # the full causal attention again, as without a cache
            return F.scaled_dot_product_attention(q_full, keys, values, is_causal=True, enable_gqa=True)

        fns["torch.cat + SDPA"] = dynamic_cache
        if length <= 8192:
            fns["recompute (SDPA causal)"] = recompute
    return fns


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--lengths", default="1024,8192,32768")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if args.backend == "torch":
        import torch

        torch.set_grad_enabled(False)
    print("| backend | cache length | implementation | step (median) | / torch.cat + SDPA |")
    print("|---|---|---|---|---|")
    for length in (int(n) for n in args.lengths.split(",")):
        fns = implementations(args.backend, length)
        for fn in fns.values():
            for _ in range(3):
                _sync(args.backend, fn())
        times = {name: [] for name in fns}
        names = list(fns)
        for round_ in range(args.rounds):  # the order rotated: none always follows the largest
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                fn = fns[name]
                start = time.perf_counter()
                _sync(args.backend, fn())
                times[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(t) for name, t in times.items()}
        base = medians.get("torch.cat + SDPA")
        for name, t in medians.items():
            ratio = f"{t / base:.2f}x" if base else "-"
            print(f"| {args.backend} | {length} | {name} | {t * 1e3:.3f} ms | {ratio} |")
    m = multiattn.get_backend(args.backend)
    like = m.from_numpy(np.zeros(1), "float32")
    for page_size in (None, 256):
        cache = multiattn.KVCache(B, KV, D, like=like, page_size=page_size)
        ones = m.from_numpy(np.ones((B, KV, 1000, D)), "float32")
        cache = cache.append(ones, ones)
        print(f"bytes per position, {cache!r}: {cache.nbytes / cache.length:.0f}")


if __name__ == "__main__":
    main()
