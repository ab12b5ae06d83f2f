"""Attention over keys held as dask arrays, chunked along the keys axis, on a ``LocalCluster``:
``multiattn.dot_product_attention(q, k, v, lengths)`` as a user calls it.

    python benchmarks/dask_keys.py                       # 262,144 keys in 16 chunks of 16,384
    python benchmarks/dask_keys.py --keys 32768 --chunk 4096 --kill

Reports the graph (tasks, tasks per key chunk, build time), the computation on 2 single-threaded
workers of 600 MiB (wall time of building and computing the graph, the inputs made and held by
the workers beforehand; peak worker memory), the same call in this one process on numpy
arrays (the in-memory block path), and the largest difference from a float64 reference computed
here row block by row block with numpy alone.  ``--before``: also the graph the Array API block
loop builds for the same call (specialisations off; it may take minutes at large sizes).
``--kill``: again, with a worker killed once a key chunk's partial is held.

This process and the workers run with glibc's ``MALLOC_TOP_PAD_`` of 64 MiB (``--allocator
default``: as they come): each block's new arrays, where the heap is trimmed between blocks
(as dask's workers do by default, ``MALLOC_TRIM_THRESHOLD_`` 64 KiB), have their pages faulted
in anew each time, which under this VM costs a large part of the block's arithmetic; a
process's own heap history decides it otherwise (benchmarks/RESULTS.md, 2026-12-07 second).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import multiattn  # noqa: E402


def reference(q, k, v, lens, rows=64):
    """(output, lse) in float64, numpy alone, a few query rows at a time over the visible keys."""
    B, Q, d = q.shape
    out, lse = np.zeros((B, Q, v.shape[-1])), np.full((B, Q), -np.inf)
    for b in range(B):
        n = int(lens[b])
        for i0 in range(0, Q, rows):
            s = q[b, i0 : i0 + rows] @ k[b, :n].T / np.sqrt(d)
            top = s.max(-1, keepdims=True)
            p = np.exp(s - top)
            total = p.sum(-1, keepdims=True)
            out[b, i0 : i0 + rows] = p @ v[b, :n] / total
            lse[b, i0 : i0 + rows] = (top + np.log(total))[:, 0]
    return out, lse


def inputs(args):
    import dask.array as da

    rng = da.random.default_rng(0)
    q = rng.standard_normal((args.batch, args.queries, args.d), chunks=(args.batch, args.queries, args.d))
    k, v = (
        rng.standard_normal((args.batch, args.keys, args.d), chunks=(args.batch, args.chunk, args.d))
        for _ in range(2)
    )
    lens = np.array([args.keys - 1234] + [args.keys // 3] * (args.batch - 1))[: args.batch]
    return q, k, v, lens


def graph(q, k, v, lens):
    import dask.array as da

    start = time.perf_counter()
    out, lse = multiattn.dot_product_attention(q, k, v, da.from_array(lens), return_lse=True)
    built = time.perf_counter() - start
    tasks = len(dict(out.__dask_graph__()) | dict(lse.__dask_graph__()))
    return (out, lse), tasks, built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=262_144)
    parser.add_argument("--chunk", type=int, default=16_384)
    parser.add_argument("--queries", type=int, default=1024)
    parser.add_argument("--d", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--memory", default="600MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", action="store_true")
    parser.add_argument("--kill", action="store_true")
    parser.add_argument("--allocator", choices=("padded", "default"), default="padded")
    args = parser.parse_args()
    env = {"MALLOC_TOP_PAD_": str(64 << 20)} if args.allocator == "padded" else {}
    if env and os.environ.get("MALLOC_TOP_PAD_") != env["MALLOC_TOP_PAD_"]:  # glibc reads it at start
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})
    import dask
    from distributed import Client, LocalCluster

    from multiattn import specialise

    q, k, v, lens = inputs(args)
    chunks = len(k.chunks[1])
    print(
        f"B={args.batch} Q={args.queries} K={args.keys} in {chunks} chunks of {args.chunk}, "
        f"d={args.d}, float64; allocator {args.allocator}"
    )
    (out, lse), tasks, built = graph(q, k, v, lens)
    print(
        f"graph: {tasks} tasks ({tasks / chunks:.1f} per key chunk, inputs included), built in {built:.3f} s"
    )
    if args.before:
        with specialise.primitives_only():
            _, before, before_built = graph(q, k, v, lens)
        print(f"before (the block loop over dask arrays): {before} tasks, built in {before_built:.1f} s")
    local = dask.compute(q, k, v, scheduler="synchronous")
    want, want_lse = reference(*local, lens)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        got, got_lse = multiattn.dot_product_attention(*local, lens, return_lse=True)
        times.append(time.perf_counter() - start)
    error = max(np.abs(got - want).max(), np.abs(got_lse - want_lse).max())
    print(
        f"one process, numpy block path: median {statistics.median(times):.2f} s of {args.repeats}; "
        f"error {error:.1e}"
    )
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, memory_limit=args.memory,
        env=env,
    ) as cluster, Client(cluster) as client:  # fmt: skip
        q, k, v = client.persist([q, k, v])  # the inputs made on the workers, not timed
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            (out, lse), _, _ = graph(q, k, v, lens)
            got, got_lse = client.compute([out, lse], sync=True)
            times.append(time.perf_counter() - start)
        error = max(np.abs(got - want).max(), np.abs(got_lse - want_lse).max())
        peaks = client.run(lambda dask_worker: max(dask_worker.monitor.quantities["memory"]))
        print(
            f"cluster, 2 workers x 1 thread, {args.memory} each: median {statistics.median(times):.2f} s of "
            f"{args.repeats} (graph and attention, the inputs held by the workers); peak worker memory "
            f"{max(peaks.values()) / 2**20:.0f} MiB; error {error:.1e}"
        )
        if args.kill:
            pids = client.run(os.getpid)
            (out, lse), _, _ = graph(q, k, v, lens)
            futures = client.compute([out, lse])
            victim = None
            while victim is None:
                for address, keys in client.has_what().items():
                    if any("attention-of-a-key-chunk" in str(key) for key in keys):
                        victim = address
                time.sleep(0.01)
            os.kill(pids[victim], signal.SIGKILL)
            got, got_lse = (f.result() for f in futures)
            error = max(np.abs(got - want).max(), np.abs(got_lse - want_lse).max())
            print(f"a worker killed mid-run: error {error:.1e}")


if __name__ == "__main__":
    main()
