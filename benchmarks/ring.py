"""Ring attention (torch over gloo) against one process doing the whole call: per-rank peak
memory growth, time, the causal balance of the layouts and the time spent waiting on the
exchanges.  B = 1, 8 query heads over 2 key/value heads, d = 64, float32, forward.

    python benchmarks/ring.py --n 32768 --world 2 --causal            # both layouts and one process
    python benchmarks/ring.py --n 131072 --world 2 --causal --layouts contiguous

Each measurement runs in fresh processes (memory: the peak RSS growth of the call); the ranks
share this machine's cores (each rank cores / world threads; the single process all of them).
Prints one JSON line per measurement."""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

H, KV, D = 8, 2, 64


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _inputs(torch, n: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, n, D, generator=generator) for h in (H, KV, KV)]


def single(n: int, causal: bool) -> dict:
    import torch

    import multiattn

    q, k, v = _inputs(torch, n, 0)
    multiattn.dot_product_attention(q[..., :256, :], k[..., :256, :], v[..., :256, :], causal=causal)  # warm
    before, start = _rss_mb(), time.perf_counter()
    with torch.no_grad():
        multiattn.dot_product_attention(q, k, v, causal=causal)
    seconds = time.perf_counter() - start
    return {"what": "one process", "n": n, "threads": torch.get_num_threads(), "seconds": seconds,
            "peak_growth_mb": _peak_mb() - before}  # fmt: skip


def rank_main(rank: int, world: int, port: int, n: int, causal: bool, layout: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    import multiattn
    from multiattn.distributed import ring_attention
    from multiattn.backends import torch_ring as ring_torch

    torch.set_num_threads(max(1, os.cpu_count() // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    waited = [0.0]
    wait = ring_torch.Exchange.wait

    def timed_wait(self, works, what):  # the time blocked on an exchange, this rank's
        start = time.perf_counter()
        wait(self, works, what)
        waited[0] += time.perf_counter() - start

    ring_torch.Exchange.wait = timed_wait
    q, k, v = _inputs(torch, n // world, rank)
    small = [x[..., :256, :] for x in (q, k, v)]
    multiattn.dot_product_attention(*small, causal=causal)  # warm, as the single process
    dist.barrier()
    before, start = _rss_mb(), time.perf_counter()
    with torch.no_grad():
        ring_attention(q, k, v, causal=causal, layout=layout)
    seconds = time.perf_counter() - start
    found = {"what": f"rank {rank} of {world}", "layout": layout, "n": n, "threads": torch.get_num_threads(),
             "seconds": seconds, "waiting": waited[0], "compute": seconds - waited[0],
             "peak_growth_mb": _peak_mb() - before}  # fmt: skip
    Path(out, f"{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--layouts", default="contiguous,zigzag")
    parser.add_argument("--no-single", action="store_true", help="the rings alone")
    parser.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:  # one measurement in this fresh process
        kind = args.child[0]
        if kind == "single":
            print(json.dumps(single(args.n, args.causal)))
            return
        import tempfile

        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as out:
            spawn_args = (args.world, _free_port(), args.n, args.causal, kind, out)
            mp.spawn(rank_main, args=spawn_args, nprocs=args.world)
            ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("*.json"))]
        compute = [r["compute"] for r in ranks]
        summary = {"what": "ring", "layout": kind, "n": args.n, "world": args.world, "causal": args.causal,
                   "seconds": max(r["seconds"] for r in ranks),
                   "slowest_compute_over_mean": max(compute) / (sum(compute) / len(compute)),
                   "peak_growth_mb": max(r["peak_growth_mb"] for r in ranks)}  # fmt: skip
        for line in ranks + [summary]:
            print(json.dumps(line))
        return
    common = ["--n", str(args.n), "--world", str(args.world)] + (["--causal"] if args.causal else [])
    kinds = ([] if args.no_single else ["single"]) + args.layouts.split(",")
    for kind in kinds:
        done = subprocess.run(
            [sys.executable, __file__, *common, "--child", kind], capture_output=True, text=True
        )
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        print(done.stdout, end="", flush=True)


if __name__ == "__main__":
    main()
