"""Ratios of long-sequence calls on one backend, measured in interleaved rounds.

    python benchmarks/rounds.py tensorflow --n 16384 --rounds 9
    /work/venv-mx/bin/python benchmarks/rounds.py mxnet --rounds 7

Each round makes one call of every case (``longseq.prepare``'s "case/implementation" keys, the
same calls as ``run.py --sizes longseq``) one after the other, and each ratio is taken within a
round: a drift of the machine's speed (a virtual machine's neighbours, another process) slows
both sides of a ratio alike, where ratios of medians from separate workers mix different
minutes.  Printed: the median time of each case, then per ratio its median over the rounds and
its range.  One process, warmed up first (a call at a small size, then one at full size).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import longseq  # noqa: E402
import run  # noqa: E402

RATIOS = (
    ("plain/blocks", "plain/floor"),  # blocks against the materialised floor
    ("causal/blocks", "plain/blocks"),
    ("lengths/blocks", "plain/blocks"),  # 3/4 of the keys hidden
    ("window/default", "plain/default"),  # mask functions with their own blocks, to the unmasked call
    ("documents/default", "plain/default"),
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("backend")
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--ratios",
        default=",".join(f"{a}:{b}" for a, b in RATIOS),
        help="comma-separated A:B pairs of case/implementation keys (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    ratios = [tuple(pair.split(":")) for pair in args.ratios.split(",")]
    keys = list(dict.fromkeys(key for pair in ratios for key in pair))
    module = run._setup(args.backend)
    block = longseq.block_size(module)
    calls = {}
    for key in keys:
        with longseq._context(args.backend, key, run._context):
            longseq.prepare(args.backend, module, longseq._warm_n(args.n, block), key, block, run._sync)()
            calls[key] = longseq.prepare(args.backend, module, args.n, key, block, run._sync)
            calls[key]()
    times = {key: [] for key in keys}
    for _ in range(args.rounds):
        for key in keys:
            with longseq._context(args.backend, key, run._context):
                start = time.perf_counter()
                calls[key]()
                times[key].append(time.perf_counter() - start)
    print(
        f"{args.backend} {run._version(args.backend)}, N = {args.n}, blocks of {block}, {args.rounds} rounds"
    )
    report(times, ratios)
    return 0


def report(times: dict, ratios) -> None:
    """Each case's median time, then per ratio A / B its median over the rounds and its range."""
    for key, found in times.items():
        print(f"  {key:20} median {statistics.median(found) * 1e3:9.1f} ms")
    for a, b in ratios:
        found = [x / y for x, y in zip(times[a], times[b])]
        print(f"  {a} / {b}: median {statistics.median(found):.3f} (range {min(found):.3f}-{max(found):.3f})")


if __name__ == "__main__":
    sys.exit(main())
