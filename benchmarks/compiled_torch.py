"""torch.compile (inductor, fullgraph=True) of a 4-D causal ``multiattn.dot_product_attention``
against the same call eagerly, and SDPA itself for scale: the median over rounds of the mean
time per call, eager and compiled interleaved round by round (a busy machine slows both alike).

    python benchmarks/compiled_torch.py                       # (2, 8, 128, 64), (2, 8, 1024, 64)
    python benchmarks/compiled_torch.py --shapes 2,8,128,64 --rounds 15
    python benchmarks/compiled_torch.py --shapes "" --decode 1,8,2,64,1024,1000  # a decoding step only

q, k, v (B, H, N, d) float32 on the CPU, causal, no weights.  Prints one JSON line per shape
(milliseconds) with compiled / eager, the CPU model and the torch version.

--decode B,H,H_kv,d,capacity,length: one ``multiattn.cached_attention`` step (one new position,
causal) on a contiguous ``KVCache(capacity=)`` holding length positions, eagerly and compiled;
each call appends at the same position (the length set back before it), so every call does
the same work.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    return next(
        (line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line), "unknown"
    )


def interleaved(runs: dict, rounds: int, budget_s: float, torch) -> dict:
    """Medians over rounds of each run's mean ms per call, the runs interleaved round by round
    (a busy machine slows them alike); the calls per round fill budget_s."""
    start = time.perf_counter()
    for fn in runs.values():
        fn()
    per_round = max(1, int(budget_s / rounds / max(time.perf_counter() - start, 1e-6)))
    times: dict = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            for _ in range(per_round):
                fn()
            times[name].append((time.perf_counter() - start) / per_round * 1e3)
    found = {name: round(statistics.median(t), 4) for name, t in times.items()}
    return {
        "ms": found,
        "compiled/eager": round(found["compiled"] / found["eager"], 2),
        "calls_per_round": per_round,
        "rounds": rounds,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu_model(),
    }


def measure(shape: tuple, rounds: int, budget_s: float) -> dict:
    sys.path.insert(0, str(HERE.parent))
    import torch
    from torch.nn import functional as F

    import multiattn
    import multiattn.backends.torch  # noqa: F401  (loaded before tracing: docs/performance.md)

    def call(q, k, v):
        return multiattn.dot_product_attention(q, k, v, causal=True)

    torch.manual_seed(0)
    q, k, v = (torch.randn(shape) for _ in range(3))
    compiled = torch.compile(call, fullgraph=True)
    start = time.perf_counter()
    compiled(q, k, v)
    compile_s = time.perf_counter() - start
    torch.testing.assert_close(compiled(q, k, v), call(q, k, v))
    runs = {
        "eager": lambda: call(q, k, v),
        "compiled": lambda: compiled(q, k, v),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    found = interleaved(runs, rounds, budget_s, torch)
    return {"shape": list(shape), **found, "compile_s": round(compile_s, 1)}


def measure_decode(sizes: tuple, rounds: int, budget_s: float) -> dict:
    sys.path.insert(0, str(HERE.parent))
    import torch

    import multiattn
    import multiattn.backends.torch  # noqa: F401

    batch, heads, kv_heads, dim, capacity, length = sizes
    if length >= capacity:
        raise ValueError(f"--decode length must be below the capacity {capacity}, got {length}")

    def step(q, k, v, cache):
        return multiattn.cached_attention(q, k, v, cache)

    torch.manual_seed(0)
    q = torch.randn(batch, heads, 1, dim)
    k, v = (torch.randn(batch, kv_heads, 1, dim) for _ in range(2))
    cache = multiattn.KVCache(batch, kv_heads, dim, like=q, capacity=capacity)
    with torch.no_grad():
        cache.append(*(torch.randn(batch, kv_heads, length, dim) for _ in range(2)))
    compiled = torch.compile(step, fullgraph=True)

    def from_length(fn):
        def run():
            cache.length = length  # the same position written by every call
            return fn(q, k, v, cache)[0]

        return run

    runs = {"eager": from_length(step), "compiled": from_length(compiled)}
    with torch.no_grad():
        start = time.perf_counter()
        runs["compiled"]()
        compile_s = time.perf_counter() - start
        torch.testing.assert_close(runs["compiled"](), runs["eager"]())
        found = interleaved(runs, rounds, budget_s, torch)
    sizes = dict(zip(("batch", "heads", "kv_heads", "dim", "capacity", "length"), sizes))
    return {"decode": sizes, **found, "compile_s": round(compile_s, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="2,8,128,64;2,8,1024,64", help="B,H,N,d;...")
    parser.add_argument("--decode", default="", help="B,H,H_kv,d,capacity,length;... (none by default)")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--seconds", type=float, default=20.0, help="time measured per shape")
    args = parser.parse_args(argv)
    for text in filter(None, args.shapes.split(";")):
        shape = tuple(int(x) for x in text.split(","))
        print(json.dumps(measure(shape, args.rounds, args.seconds)), flush=True)
    for text in filter(None, args.decode.split(";")):
        sizes = tuple(int(x) for x in text.split(","))
        print(json.dumps(measure_decode(sizes, args.rounds, args.seconds)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
