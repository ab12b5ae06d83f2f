"""Benchmark suite: multiattn against the textbook implementation and the bare floor.

    python benchmarks/run.py                                  # every installed backend but array_api
    python benchmarks/run.py --backends torch --out /tmp/torch.md   # the report in a file
    python benchmarks/run.py --python mxnet=.tox/mxnet/bin/python   # mxnet from its own env
    python benchmarks/run.py --backends torch --contended --runs 4 --min-time 3   # under load
    python benchmarks/run.py --sizes longseq --out /tmp/longseq.md   # N to 65536 in blocks (longseq.py)

Per backend (each in its own subprocess) and size, in the same run: median
time of the textbook implementation (d2l's way, benchmarks/textbook.py),
multiattn (weights materialised, as d2l; and, for dot-product and multi-head,
the no-weights fast path), and the floor (matmul, softmax, matmul, no mask).
For multi-head attention (d2l 11.5) on torch also torch.nn.MultiheadAttention,
with and without its weights, in a second table.  Peak memory: the growth of
the process's peak RSS during one call, each measured in a fresh subprocess.
Ratios are to the textbook and to the floor of the same run; with --runs N the table has
the median times of N fresh workers, and each worker's multiattn / textbook follows it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import longseq  # noqa: E402  (benchmarks/longseq.py: --sizes longseq)

# name: (kind, B, Q, K, d or query width, key width, value width, hiddens)
SIZES = {
    "toy": ("dot", 2, 1, 10, 2, 2, 4, 0),
    "medium": ("dot", 8, 512, 512, 64, 64, 64, 0),
    "long": ("dot", 4, 2048, 2048, 64, 64, 64, 0),
    "additive": ("additive", 4, 256, 256, 32, 16, 64, 64),
    "multihead": ("multihead", 8, 512, 512, 512, 512, 512, 512),  # num_hiddens 512 in NUM_HEADS heads
}
# --sizes longseq: N = 4096, 16384, 65536 (--longseq-n), B=1, one head, in blocks (longseq.py)
LONGSEQ = "longseq"
NUM_HEADS = 8
MEMORY_SIZES = ("long", "additive")
IMPLS = ("textbook", "multiattn", "multiattn-fast", "floor")
# the framework's own multi-head layer (torch only), with and without its weights
LAYER_IMPLS = ("torch-mha", "torch-mha-fast")


def _inputs(backend: str, size: str, module):
    import numpy as np

    kind, B, Q, K, d, k_width, v_width, h = SIZES[size]
    rng = np.random.default_rng(0)
    arrays = [
        rng.normal(size=(B, Q, d)),
        rng.normal(size=(B, K, d if kind == "dot" else k_width)),
        rng.normal(size=(B, K, v_width)),
    ]
    tensors = [module.from_numpy(a, "float32") for a in arrays]
    lens = rng.integers(K // 2, K + 1, size=B)
    tensors.append(module.from_numpy(lens.astype("float32" if backend == "mxnet" else "int64")))
    if kind == "additive":
        for shape in ((h, d), (h, k_width), (h,)):
            tensors.append(module.from_numpy(rng.normal(size=shape) * 0.3, "float32"))
    if kind == "multihead":  # W_q, W_k, W_v, W_o, canonical (out, in), scaled to keep unit variance
        for shape in ((h, d), (h, k_width), (h, v_width), (h, h)):
            tensors.append(module.from_numpy(rng.normal(size=shape) / shape[1] ** 0.5, "float32"))
    return kind, tensors


def _functions(backend: str, module, kind: str, args: list) -> dict:
    from textbook import implementations

    impls = implementations(backend)
    if kind == "dot":
        fns = {
            "textbook": impls["textbook"][0],
            "multiattn": lambda q, k, v, lens: module.dot_product_attention(
                q, k, v, lens, return_weights=True
            )[0],
            "multiattn-fast": lambda q, k, v, lens: module.dot_product_attention(q, k, v, lens),
            "floor": impls["floor"][0],
        }
    elif kind == "multihead":

        def multiattn(q, k, v, lens, W_q, W_k, W_v, W_o, **kwargs):
            weights = {"W_q": W_q, "W_k": W_k, "W_v": W_v, "W_o": W_o}
            return module.multi_head_attention(q, k, v, lens, weights=weights, num_heads=NUM_HEADS, **kwargs)

        fns = {
            "textbook": partial(impls["textbook_mha"], num_heads=NUM_HEADS),
            "multiattn": lambda *a: multiattn(*a, return_weights=True)[0],
            "multiattn-fast": multiattn,
            "floor": partial(impls["floor_mha"], num_heads=NUM_HEADS),
        }
        if backend == "torch":
            fns.update(_torch_layer(*args))
    else:
        fns = {
            "textbook": impls["textbook"][1],
            "multiattn": lambda q, k, v, lens, W_q, W_k, w_v: module.additive_attention(
                q, k, v, lens, W_q=W_q, W_k=W_k, w_v=w_v
            ),
            "floor": impls["floor"][1],
        }
    if backend == "jax":
        import jax

        fns = {name: jax.jit(f) for name, f in fns.items()}
    return fns


def _torch_layer(q, k, v, lens, W_q, W_k, W_v, W_o) -> dict:
    """torch.nn.MultiheadAttention holding the same canonical weights, padding from the lengths."""
    import torch

    layer = torch.nn.MultiheadAttention(W_q.shape[0], NUM_HEADS, bias=False, batch_first=True).eval()
    with torch.no_grad():
        layer.in_proj_weight.copy_(torch.cat([W_q, W_k, W_v], 0))
        layer.out_proj.weight.copy_(W_o)

    def call(q, k, v, lens, *weights, need_weights):
        padding = torch.arange(k.shape[1], device=k.device) >= lens[:, None]  # True = padding
        return layer(
            q, k, v, key_padding_mask=padding, need_weights=need_weights, average_attn_weights=False
        )[0]

    return {
        "torch-mha": partial(call, need_weights=True),
        "torch-mha-fast": partial(call, need_weights=False),
    }


def _sync(backend: str, out) -> None:
    """Wait for asynchronous frameworks to finish the call."""
    if backend == "jax":
        out.block_until_ready()
    elif backend == "mlx":
        import mlx.core as mx

        mx.eval(out)
    elif backend == "mxnet":
        out.wait_to_read()


def _context(backend: str):
    if backend == "torch":
        import torch

        return torch.no_grad()
    import contextlib

    return contextlib.nullcontext()


def _setup(backend: str):
    import multiattn

    return multiattn.get_backend(backend)


def time_backend(backend: str, sizes: list, min_time: float) -> dict:
    module = _setup(backend)
    results = {"version": _version(backend), "times": {}}
    with _context(backend):
        for size in sizes:
            kind, args = _inputs(backend, size, module)
            fns = _functions(backend, module, kind, args)
            for fn in fns.values():
                for _ in range(2):  # warm-up (and jit compilation)
                    _sync(backend, fn(*args))
            # Round robin, one call of each implementation per round: a slow spell of the
            # machine (a noisy neighbour on a shared VM) hits all of them alike, not just one.
            # The order rotates each round: the first call of a round can be the fastest (mlx's
            # toy calls: 26 us first, 64 us after another call), so each takes every place.
            samples: dict = {name: [] for name in fns}
            names = list(fns)
            start = time.perf_counter()
            while len(samples["textbook"]) < 5 or (
                time.perf_counter() - start < min_time * len(fns) and len(samples["textbook"]) < 200
            ):
                shift = len(samples["textbook"]) % len(names)
                for name in names[shift:] + names[:shift]:
                    fn = fns[name]
                    t0 = time.perf_counter()
                    _sync(backend, fn(*args))
                    samples[name].append(time.perf_counter() - t0)
            for name, times in samples.items():
                results["times"][f"{size}/{name}"] = statistics.median(times)
    return results


def memory_once(backend: str, size: str, impl: str) -> float:
    """MiB by which one call raises the process's peak RSS (run in a fresh process)."""
    module = _setup(backend)
    with _context(backend):
        kind, args = _inputs(backend, size, module)
        fn = _functions(backend, module, kind, args)[impl]
        if backend == "jax":  # compile first: the compiler's memory is not the call's
            fn.lower(*args).compile()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        _sync(backend, fn(*args))
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (after - before) / 1024.0


def _version(backend: str) -> str:
    from multiattn._registry import BACKENDS

    module = sys.modules.get(BACKENDS[backend][0])
    return str(getattr(module, "__version__", "?"))


def _worker(argv: list) -> int:
    mode, backend = argv[0], argv[1]
    if mode.startswith(LONGSEQ):
        return longseq.worker(argv, setup=_setup, sync=_sync, context=_context, version=_version)
    if mode == "time":
        print(json.dumps(time_backend(backend, argv[2].split(","), float(argv[3]))))
    else:
        print(json.dumps(memory_once(backend, argv[2], argv[3])))
    return 0


# glibc hands large freed blocks back to the OS, so on a small VM every (B, Q, K) allocation
# page-faults afresh and times measure the kernel, not the attention (seen: 3x swings between
# identical runs).  Workers keep freed memory instead; the same for every implementation.
STEADY_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}
ENV = dict(os.environ)


# For memory the opposite: every block over 64 KiB is its own mapping, unmapped when freed, so
# the growth of peak RSS is the peak of live memory (with glibc's defaults it varied 3x).
EXACT_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(1 << 16)}


MEMORY_ENV = {**os.environ, **EXACT_ALLOCATOR}


WORKER_TIMEOUT = [None]  # seconds a worker may take (--worker-timeout), None: no limit


def _run(python: str, *args: str) -> object:
    env = MEMORY_ENV if "memory" in args[0] else ENV
    cmd = [python, __file__, "--worker", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=WORKER_TIMEOUT[0])
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"worker {' '.join(args)} gave no result within {WORKER_TIMEOUT[0]:g} s") from None
    if proc.returncode != 0:
        why = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        raise RuntimeError(f"worker {' '.join(args)} failed: {why}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def describe_machine() -> str:
    """CPU model, L2 per core and widest vector extension, as the OS reports them (Linux)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    l2 = "?"
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "level").read_text().strip() == "2":
                l2 = (index / "size").read_text().strip()
        except OSError:
            pass
    vector = next((v for v in ("avx512f", "avx2", "avx", "sse4_2", "neon", "asimd") if v in flags), "?")
    return f"{model}, L2 {l2} per core, {vector.upper()}, {os.cpu_count()} CPUs"


# The thread settings that decide how a call fares beside a busy process (docs/performance.md).
THREAD_SETTINGS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS", "KMP_BLOCKTIME")


def describe_threads() -> str:
    """The workers' thread settings from the environment, or the frameworks' defaults."""
    settings = [f"{name}={os.environ[name]}" for name in THREAD_SETTINGS if name in os.environ]
    if settings:
        return ", ".join(settings)
    return "none of " + ", ".join(THREAD_SETTINGS) + " set (OpenMP's defaults: waiting threads spin)"


def _ratio(a, b) -> str:
    return "-" if a is None or b in (None, 0) else f"{a / b:.2f}x"


def _ratios(times: dict, sizes: list) -> dict:
    """multiattn / textbook per size in one run's times."""
    return {size: _ratio(times.get(f"{size}/multiattn"), times.get(f"{size}/textbook")) for size in sizes}


def render_runs(results: dict, sizes: list) -> str:
    """Each run's multiattn / textbook, where there were several (the table has the median
    times): under load the runs spread, and a median of times can hide two modes."""
    lines = []
    for backend, res in results.items():
        runs = res.get("ratios", [])
        if len(runs) > 1:
            cells = (f"{size} {', '.join(run[size] for run in runs)}" for size in sizes)
            lines.append(f"- {backend}: {'; '.join(cells)}")
    return "\n\nmultiattn / textbook in each run:\n\n" + "\n".join(lines) + "\n" if lines else ""


def render(results: dict, sizes: list) -> str:
    lines = [
        "| backend | size | textbook | multiattn | fast path | floor | multiattn / textbook | "
        "multiattn / floor | fast / floor | peak MiB textbook | peak MiB multiattn | memory ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for backend, res in results.items():
        if "error" in res:
            lines.append(f"| {backend} | - | failed: {res['error']} |" + " |" * 9)
            continue
        for size in sizes:
            t = {impl: res["times"].get(f"{size}/{impl}") for impl in IMPLS}
            memory = res.get("memory", {})
            m = {impl: memory.get(f"{size}/{impl}") for impl in ("textbook", "multiattn")}
            worst = {impl: memory.get(f"{size}/{impl}/worst") for impl in ("textbook", "multiattn")}
            ms = {k: "-" if v is None else f"{v * 1e3:.2f} ms" for k, v in t.items()}
            mem = {
                k: "-" if v is None else f"{v:.1f}" + (f" (worst {worst[k]:.1f})" if worst[k] != v else "")
                for k, v in m.items()
            }
            lines.append(
                f"| {backend} {res['version']} | {size} | {ms['textbook']} | {ms['multiattn']} | "
                f"{ms['multiattn-fast']} | {ms['floor']} | {_ratio(t['multiattn'], t['textbook'])} | "
                f"{_ratio(t['multiattn'], t['floor'])} | {_ratio(t['multiattn-fast'], t['floor'])} | "
                f"{mem['textbook']} | {mem['multiattn']} | {_ratio(m['multiattn'], m['textbook'])} |"
            )
    return "\n".join(lines + _render_layers(results, sizes))


def _render_layers(results: dict, sizes: list) -> list:
    """The second table: multiattn against the framework's own multi-head layer, where timed."""
    rows = []
    for backend, res in results.items():
        for size in sizes:
            t = {impl: res.get("times", {}).get(f"{size}/{impl}") for impl in IMPLS + LAYER_IMPLS}
            if t["torch-mha"] is None and t["torch-mha-fast"] is None:
                continue
            ms = {k: "-" if v is None else f"{v * 1e3:.2f} ms" for k, v in t.items()}
            rows.append(
                f"| {backend} {res['version']} | {size} | {ms['multiattn']} | {ms['torch-mha']} | "
                f"{_ratio(t['multiattn'], t['torch-mha'])} | {ms['multiattn-fast']} | "
                f"{ms['torch-mha-fast']} | {_ratio(t['multiattn-fast'], t['torch-mha-fast'])} |"
            )
    if not rows:
        return []
    return [
        "",
        "Against torch.nn.MultiheadAttention (bias=False, batch_first, eval, no_grad) holding the same "
        "weights, key_padding_mask from the lengths; `torch-mha` returns the per-head weights "
        "(need_weights=True, average_attn_weights=False), `torch-mha fast` none (need_weights=False).",
        "",
        "| backend | size | multiattn | torch-mha | multiattn / torch-mha | fast path | torch-mha fast | "
        "fast / torch-mha fast |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return _worker(sys.argv[2:])
    from multiattn.check import installed_backends

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", help="comma-separated (default: every installed backend)")
    parser.add_argument(
        "--sizes",
        default=",".join(SIZES),
        help=f"comma-separated of {', '.join(SIZES)}; or {LONGSEQ} alone (long sequences in blocks)",
    )
    parser.add_argument("--min-time", type=float, default=0.5, help="seconds of samples per measurement")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--python", action="append", default=[], help="BACKEND=PYTHON to run it elsewhere")
    parser.add_argument(
        "--system-allocator", action="store_true", help="leave glibc's allocator thresholds alone (noisier)"
    )
    parser.add_argument(
        "--contended", action="store_true", help="run a CPU-bound busy process beside the measurements"
    )
    parser.add_argument(
        "--runs", type=int, default=1, help="timing runs per backend, each in a fresh worker (median times)"
    )
    parser.add_argument(
        "--memory-runs",
        type=int,
        default=None,
        help="fresh processes per peak memory (median, and worst; default 1, longseq 3)",
    )
    parser.add_argument(
        "--default-malloc",
        action="store_true",
        help="measure memory under glibc's default malloc (as users see it) instead of exact mappings",
    )
    parser.add_argument(
        "--out", help="write the report (header and table) to this file; default: print the table only"
    )
    parser.add_argument(
        "--worker-timeout", type=float, help="seconds one worker process may take (default: no limit)"
    )
    ls = parser.add_argument_group("--sizes longseq (benchmarks/longseq.py)")
    ls.add_argument(
        "--longseq-n", default=longseq.DEFAULT_N, help="N, comma-separated; BACKEND=N entries for one backend"
    )
    ls.add_argument(
        "--longseq-max",
        default=longseq.DEFAULT_CAPS,
        help=f"caps, BACKEND=N comma-separated: larger N not run (default {longseq.DEFAULT_CAPS}; '' none)",
    )
    ls.add_argument(
        "--longseq-grad-n",
        default=longseq.DEFAULT_GRAD_N,
        help=f"N of the forward+backward (default {longseq.DEFAULT_GRAD_N}; 0: none)",
    )
    ls.add_argument("--longseq-calls", type=int, default=3, help="timed calls per measurement, at most")
    ls.add_argument(
        "--longseq-budget", type=float, default=30.0, help="seconds of timed calls, no further call past it"
    )
    ls.add_argument(
        "--longseq-no-warmup-from", type=int, default=65536, help="N from which no full-size warm-up call"
    )
    ls.add_argument(
        "--floor-max-gib", type=float, default=12.0, help="the floor only where its scores x3 fit in this"
    )
    ls.add_argument("--json", help="also write the raw results here (JSON)")
    args = parser.parse_args()
    WORKER_TIMEOUT[0] = args.worker_timeout
    pythons = dict(p.split("=", 1) for p in args.python)
    if not args.system_allocator:
        ENV.update(STEADY_ALLOCATOR)
    if args.default_malloc:
        MEMORY_ENV.clear()
        MEMORY_ENV.update({k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")})
    sizes = args.sizes.split(",")
    if LONGSEQ in sizes:
        if sizes != [LONGSEQ]:
            parser.error(f"--sizes {LONGSEQ} runs alone")
        args.memory_runs = args.memory_runs or 3
        return _longseq(args, pythons, installed_backends)
    args.memory_runs = args.memory_runs or 1
    # array_api has no textbook to compare with (d2l has no Array API version)
    backends = (
        args.backends.split(",")
        if args.backends
        else [name for name in installed_backends() if name != "array_api"]
    )
    results = {}
    busy = None
    if args.contended:  # a competing process, as data-loader workers or other requests are
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        _measure(args, backends, sizes, pythons, results)
    finally:
        if busy is not None:
            busy.kill()
    machine = f"{describe_machine()}, {platform.system()}, Python {platform.python_version()}"
    table = render(results, sizes) + render_runs(results, sizes)
    load = "with one CPU-bound busy process beside it (--contended)" if args.contended else "quiet"
    header = (
        f"# multiattn benchmarks\n\nMeasured {time.strftime('%Y-%m-%d')} on {machine};\n"
        f"float32, {'one run' if args.runs == 1 else f'the median of {args.runs} runs'}, {load}.\n"
        "Times are medians of round-robin samples (one call of each implementation per round);\n"
        "memory is the growth of peak RSS during one call in a fresh process.\n"
        "Allocator for the times: "
        f"{'glibc defaults' if args.system_allocator else 'glibc thresholds raised (see run.py)'}; "
        + (
            f"for memory: glibc's default malloc, {args.memory_runs} fresh process(es), median (worst).\n"
            if args.default_malloc
            else f"for memory: every block its own mapping (see run.py), {args.memory_runs} run(s), median.\n"
        )
        + f"Thread settings: {describe_threads()}.\n"
        + "`multiattn` keeps the attention weights (d2l behaviour); `fast path` is the dot-product or\n"
        "multi-head call without weights (the framework's fused kernel where the adapter uses one on this\n"
        f"machine).  `multihead` is d2l 11.5 multi-head attention, {NUM_HEADS} heads, no biases.\n\n"
    )
    return _report(args.out, header + table + "\n", table)


def _longseq(args: argparse.Namespace, pythons: dict, installed_backends) -> int:
    """--sizes longseq: every installed backend (array_api too, and those given --python), each
    measurement in its own worker (benchmarks/longseq.py)."""
    from multiattn._registry import BACKENDS

    if args.backends:
        backends = args.backends.split(",")
    else:
        found = set(installed_backends()) | set(pythons)
        backends = [name for name in BACKENDS if name in found]
    busy = None
    if args.contended:
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        results = longseq.measure(args, backends, pythons, _run)
    finally:
        if busy is not None:
            busy.kill()
    machine = f"{describe_machine()}, {platform.system()}, Python {platform.python_version()}"
    if args.contended:
        machine += ", with one CPU-bound busy process beside it (--contended)"
    memory = "glibc's default malloc" if args.default_malloc else "every block over 64 KiB its own mapping"
    table = longseq.render(results, args.floor_max_gib)
    text = longseq.header(args, machine, describe_threads(), results, memory) + table + "\n"
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    return _report(args.out, text, table)


def _report(out: str | None, text: str, table: str) -> int:
    """The table printed; the whole report written to out, where given (benchmarks/RESULTS.md
    keeps each session's dated section, written by hand from these)."""
    print(table)
    if out:
        Path(out).write_text(text)
        print(f"\nwritten to {out}", file=sys.stderr)
    return 0


def _measure(args: argparse.Namespace, backends: list, sizes: list, pythons: dict, results: dict) -> None:
    for backend in backends:
        python = pythons.get(backend, sys.executable)
        try:
            # several timing runs, each in a fresh worker: under load identical runs spread
            # widely, so each implementation's time is the median over the runs
            runs = []
            for run in range(args.runs):
                of = f" (run {run + 1} of {args.runs})" if args.runs > 1 else ""
                print(f"{backend}: timing {', '.join(sizes)}{of} ...", file=sys.stderr, flush=True)
                runs.append(_run(python, "time", backend, ",".join(sizes), str(args.min_time)))
            results[backend] = runs[0]
            results[backend]["ratios"] = [_ratios(run["times"], sizes) for run in runs]
            results[backend]["times"] = {
                key: statistics.median(run["times"][key] for run in runs) for key in runs[0]["times"]
            }
            if not args.no_memory:
                results[backend]["memory"] = {}
                for size in (s for s in sizes if s in MEMORY_SIZES):
                    for impl in ("textbook", "multiattn"):
                        print(f"{backend}: peak memory {size} {impl} ...", file=sys.stderr, flush=True)
                        runs = [_run(python, "memory", backend, size, impl) for _ in range(args.memory_runs)]
                        results[backend]["memory"][f"{size}/{impl}"] = statistics.median(runs)
                        results[backend]["memory"][f"{size}/{impl}/worst"] = max(runs)
        except RuntimeError as err:
            results[backend] = {"error": str(err)}


if __name__ == "__main__":
    sys.exit(main())
