"""``run.py --sizes longseq``: attention past the scores budget, in blocks, per backend.

    python benchmarks/run.py --sizes longseq --out /tmp/longseq.md
    python benchmarks/run.py --sizes longseq --longseq-n 1024,2048 --backends numpy,torch --out /tmp/ls.md
    python benchmarks/run.py --sizes longseq --python mxnet=/work/venv-mx/bin/python --backends mxnet \\
        --out /tmp/ls-mxnet.md

B = 1, one head, 3-D inputs (1, N, 64), float32, no weights; for each N (``--longseq-n``,
default 4096, 16384, 65536) five cases: ``plain``; ``causal`` (causal=True); ``lengths``
(valid_lens = [N // 4]: 3/4 of the keys hidden); ``window`` (mask_mod=mods.sliding_window(512));
``documents`` (mask_mod=mods.document of 16 equal documents).  Implementations (``IMPLS``):

* ``blocks``: ``dot_product_attention(q, k, v, lens, causal=..., block_size=BLOCK)``, the core's
  blocks forced on every backend, BLOCK the automatic choice
  (``blockwise.block_size_for`` of ``tuning.Tuning.block_area``);
* ``default``: the same call with block_size=None, measured where it takes another path:
  the scores whole where they fit the budget (N^2 * 4 B <= ``SCORES_BUDGET_BYTES``), on
  torch past it SDPA's flash kernel (the specialisation ``attend_by_flash_kernel``), and for the
  mask functions always (their block side: ``MaskFunction.block_side``); a mask function's
  ratio is its default call to the unmasked default call (``plain/default``, else the blocks);
* ``floor``: matmul, softmax, matmul, no mask (benchmarks/textbook.py), plain only, where the
  scores fit (N^2 * 4 B * 3 <= ``--floor-max-gib``);
* ``sdpa`` (torch): F.scaled_dot_product_attention on (1, 1, N, 64) views (4-D: the flash
  kernel on CPU), plain, is_causal=True, and for ``lengths`` on the first N // 4 keys;
* case ``fwd+bwd``: the backend's ``vjp`` of ``blocks`` (plain): the output and the gradients of
  q, k and v, at ``--longseq-grad-n`` (default 16384, mlx 4096); on torch also of SDPA.

``--longseq-max BACKEND=N``: no N above it for that backend ("not run (cap)" in its table;
default mlx=16384).

jax runs the blocks eagerly, op by op (as a user calls it outside jit): under jit the Python
block loop would be traced whole and the lengths would be tracers, so the plan could not
skip the blocks they hide.  The floor is jit-compiled (compiled before any call is timed).

Time: in one worker per (backend, N), per measurement a warm-up call at N = min(2 * BLOCK, N / 4) (thread
pools, jax's per-op compilation), one full-size warm-up call where N < ``--longseq-no-warmup-from``
(default 65536: a call there takes tens of seconds), then up to ``--longseq-calls`` (3) timed
calls, no further one once the time taken plus the last call would pass ``--longseq-budget``
seconds; the median.  Memory: the growth of peak RSS during one call in a fresh process
(after the same small warm-up, the peak reset to the RSS just before the call with Linux's
/proc/self/clear_refs), ``--memory-runs`` (default 3) processes, median and worst.
"""

from __future__ import annotations

import json
import math
import resource
import statistics
import sys
import time

# mask functions (multiattn.mods): a causal band of WINDOW keys; DOCUMENTS equal documents
MOD_CASES = ("window", "documents")
CASES = ("plain", "causal", "lengths") + MOD_CASES
WINDOW, DOCUMENTS = 512, 16
GRAD = "fwd+bwd"
IMPLS = ("blocks", "default", "floor", "sdpa")
D = 64
DEFAULT_N = "4096,16384,65536"
DEFAULT_GRAD_N = "16384,mlx=4096"
# mlx's CPU build is some 30x slower than numpy here: one call at 65536 would take over ten minutes
DEFAULT_CAPS = "mlx=16384"
NO_AUTODIFF = ("numpy", "array_api")  # their backend modules' vjp is None
FLOOR_COPIES = 3  # the floor holds about three (N, N) float32 arrays at once: scores, exp, weights


def block_size(module=None) -> int:
    """The block the automatic choice takes for one (1, N, d) float32 call on the backend
    ``module`` (some take larger ones: ``tuning.Tuning.block_area``)."""
    from multiattn import blockwise, tuning

    area = 1 if module is None else tuning.of(module.ops).block_area
    return blockwise.block_size_for(1, 4, area=area)


def scores_fit_budget(n: int) -> bool:
    """Whether the automatic call at N keeps the scores whole (they fit the budget)."""
    from multiattn import blockwise

    return n * n * 4 <= blockwise.SCORES_BUDGET_BYTES


# -- the worker: one process per measurement kind -------------------------------------------------


def _inputs(backend: str, module, n: int):
    import numpy as np

    rng = np.random.default_rng(0)  # float32 from the start: no float64 copies raise the peak
    q, k, v, cotangent = (
        module.from_numpy(rng.standard_normal((1, n, D), dtype=np.float32), "float32") for _ in range(4)
    )
    lens = module.from_numpy(np.array([n // 4], dtype="float32" if backend == "mxnet" else "int64"))
    return q, k, v, lens, cotangent


def _floor(backend: str):
    """The floor (q, k, v, lens) of the framework: textbook.py's, or the Array API's own."""
    if backend != "array_api":
        from textbook import implementations

        return implementations(backend)["floor"][0]
    from array_api_compat import array_namespace

    def floor(q, k, v, lens):
        xp = array_namespace(q, k, v)
        scores = xp.matmul(q, xp.matrix_transpose(k)) / math.sqrt(q.shape[-1])
        e = xp.exp(scores - xp.max(scores, axis=-1, keepdims=True))
        return xp.matmul(e / xp.sum(e, axis=-1, keepdims=True), v)

    return floor


def prepare(backend: str, module, n: int, key: str, block: int, sync):
    """A function of no arguments that makes one call of ``key`` ("case/impl") at N and waits
    for it; the inputs made (and jax's floor compiled) beforehand."""
    case, impl = key.split("/")
    q, k, v, lens, cotangent = _inputs(backend, module, n)
    causal, lengths = case == "causal", (lens if case == "lengths" else None)
    mask_mod = _mask_mod(case, n)
    if impl in ("blocks", "default"):
        size = block if impl == "blocks" else None
        if case == GRAD:

            def attend(q, k, v):
                return module.dot_product_attention(q, k, v, block_size=size)

            call = lambda: module.vjp(attend, [q, k, v], cotangent)  # noqa: E731
        else:
            call = lambda: module.dot_product_attention(  # noqa: E731
                q, k, v, lengths, causal=causal, block_size=size, mask_mod=mask_mod
            )
    elif impl == "floor":
        floor, args = _floor(backend), (q, k, v, lens)
        if hasattr(floor, "lower"):  # jax: compiled now, not in a call
            floor = floor.lower(*args).compile()
        call = lambda: floor(*args)  # noqa: E731
    elif impl == "sdpa":
        import torch.nn.functional as F

        q4, k4, v4 = (x.unsqueeze(1) for x in (q, k, v))
        sdpa, ct4 = F.scaled_dot_product_attention, cotangent.unsqueeze(1)
        visible = n // 4
        if case == GRAD:
            call = lambda: module.vjp(sdpa, [q4, k4, v4], ct4)  # noqa: E731
        elif case == "lengths":  # SDPA on the visible keys, as multiattn's flash path does
            call = lambda: sdpa(q4, k4[..., :visible, :], v4[..., :visible, :])  # noqa: E731
        else:
            call = lambda: sdpa(q4, k4, v4, is_causal=causal)  # noqa: E731
    else:
        raise ValueError(f"unknown implementation {impl!r}")

    def once():
        out = call()
        for tensor in _flat(out):
            sync(backend, tensor)
        return out

    return once


def _flat(out):
    if isinstance(out, (list, tuple)):
        return [t for part in out for t in _flat(part)]
    return [out]


def _path(module, backend: str, n: int, key: str, run_once) -> str:
    """What the call of ``key`` ran: "blocks", "materialised", and any specialisation that ran."""
    import multiattn

    with multiattn.explained() as log:
        run_once()
    ran = [name for _, _, name, outcome in log if outcome == "ran"]
    impl = key.split("/")[1]
    if impl not in ("blocks", "default"):
        return impl
    base = "materialised" if impl == "default" and scores_fit_budget(n) else "blocks"
    return " + ".join([base] + ran) if base == "materialised" or not ran else ", ".join(ran)


def _context(backend: str, key: str, context):
    import contextlib

    return contextlib.nullcontext() if key.startswith(GRAD) else context(backend)


def time_worker(backend, n, keys, calls, budget, warmup, *, setup, sync, context, version) -> dict:
    module = setup(backend)
    block = block_size(module)
    results = {"version": version(backend), "block": block, "times": {}, "calls": {}, "paths": {}}
    if key_needs_autodiff(keys) and getattr(module, "vjp", None) is None:
        return dict(results, no_autodiff=True)
    for key in keys:
        with _context(backend, key, context):
            prepare(backend, module, _warm_n(n, block), key, block, sync)()  # one-off costs
            once = prepare(backend, module, n, key, block, sync)
            path = None
            if warmup:
                path = _path(module, backend, n, key, once)
            samples, start = [], time.perf_counter()
            while len(samples) < calls:
                t0 = time.perf_counter()
                if path is None:
                    path = _path(module, backend, n, key, once)  # the log costs nothing measurable
                else:
                    once()
                samples.append(time.perf_counter() - t0)
                if time.perf_counter() - start + samples[-1] > budget:
                    break
        results["times"][key] = statistics.median(samples)
        results["calls"][key] = len(samples)
        results["paths"][key] = path
    return results


def _warm_n(n: int, block: int) -> int:
    """The N of the small warm-up call: two blocks, and well below N (its peak is not the call's)."""
    return max(min(2 * block, n // 4), 1)


def key_needs_autodiff(keys) -> bool:
    return any(key.startswith(GRAD + "/") for key in keys)


def reset_peak() -> bool:
    """Set the process's peak RSS to its RSS now (Linux: /proc/self/clear_refs, which getrusage
    follows), so that the peaks of the warm-up and of making the inputs are not the call's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_worker(backend, n, key, *, setup, sync, context) -> dict:
    """MiB by which one call raises the process's peak RSS (run in a fresh process), and
    whether the peak could be reset before it."""
    module = setup(backend)
    block = block_size(module)
    with _context(backend, key, context):
        prepare(backend, module, _warm_n(n, block), key, block, sync)()  # one-off costs
        once = prepare(backend, module, n, key, block, sync)
        reset = reset_peak()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        once()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mib": (after - before) / 1024.0, "peak_reset": reset}


def worker(argv: list, **helpers) -> int:
    """``run.py --worker longseq-time BACKEND N KEYS CALLS BUDGET WARMUP`` or
    ``--worker longseq-memory BACKEND N KEY``; helpers: run.py's setup, sync, context, version."""
    mode, backend, n = argv[0], argv[1], int(argv[2])
    if mode == "longseq-time":
        calls, budget, warmup = int(argv[4]), float(argv[5]), argv[6] == "1"
        print(json.dumps(time_worker(backend, n, argv[3].split(","), calls, budget, warmup, **helpers)))
    else:
        helpers.pop("version", None)
        print(json.dumps(memory_worker(backend, n, argv[3], **helpers)))
    return 0


# -- the parent: which measurements, in which processes -------------------------------------------


def parse_sizes(text: str, option: str) -> tuple:
    """ "16384,mlx=4096" -> ([16384], {"mlx": [4096]}): bare numbers for every backend, BACKEND=N
    entries for one (each replacing the bare list for it); "0" or "" for none."""
    common, per = [], {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.rpartition("=")
        try:
            number = int(value)
        except ValueError:
            raise SystemExit(f"{option}: {item!r} is not N or BACKEND=N") from None
        target = per.setdefault(name, []) if name else common
        if number > 0:
            target.append(number)
    return common, per


def parse_caps(text: str) -> dict:
    caps = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not value.isdigit():
            raise SystemExit(f"--longseq-max: {item!r} is not BACKEND=N")
        caps[name] = int(value)
    return caps


def _mask_mod(case: str, n: int):
    """The mask function of a case of MOD_CASES, else None."""
    if case not in MOD_CASES:
        return None
    import numpy as np

    from multiattn import mods

    if case == "window":
        return mods.sliding_window(WINDOW)
    return mods.document(np.repeat(np.arange(DOCUMENTS), -(-n // DOCUMENTS))[None, :n])


def keys_for(backend: str, n: int, floor_max_bytes: float) -> list:
    keys = [f"{case}/blocks" for case in CASES]
    masks = [case for case in CASES if case not in MOD_CASES]
    if scores_fit_budget(n) or backend == "torch":  # else the automatic call is these blocks
        keys += [f"{case}/default" for case in masks]
    keys += [f"{case}/default" for case in MOD_CASES]  # the blocks the mask function chooses
    if floor_fits(n, floor_max_bytes):
        keys.append("plain/floor")
    if backend == "torch":
        keys += [f"{case}/sdpa" for case in masks]
    return keys


def floor_fits(n: int, floor_max_bytes: float) -> bool:
    return n * n * 4 * FLOOR_COPIES <= floor_max_bytes


def measure(args, backends: list, pythons: dict, run) -> dict:
    """results[backend] = {"version", "block", "n": {N: {"times", "calls", "paths", "memory",
    "memory_worst"} or {"skipped": why} or {"error": why}}}; run(python, *worker args)."""
    common, per = parse_sizes(args.longseq_n, "--longseq-n")
    grad_common, grad_per = parse_sizes(args.longseq_grad_n, "--longseq-grad-n")
    caps = parse_caps(args.longseq_max)
    floor_max = args.floor_max_gib * (1 << 30)
    results = {}
    for backend in backends:
        python = pythons.get(backend, sys.executable)
        res = results[backend] = {"version": "?", "n": {}, "grad": {}}
        cap = caps.get(backend)
        jobs = [("n", n, keys_for(backend, n, floor_max)) for n in per.get(backend, common)]
        grad_keys = [f"{GRAD}/blocks"] + ([f"{GRAD}/sdpa"] if backend == "torch" else [])
        for n in grad_per.get(backend, grad_common):
            if backend in NO_AUTODIFF:
                res["grad"][n] = {"skipped": "no autodiff (the backend's vjp is None)"}
            else:
                jobs.append(("grad", n, grad_keys))
        for table, n, keys in jobs:
            if cap is not None and n > cap:
                res[table][n] = {"skipped": f"not run (cap {backend}={cap})"}
                print(f"{backend}: N={n}: not run (cap {backend}={cap})", file=sys.stderr, flush=True)
                continue
            if table == "n" and not floor_fits(n, floor_max):
                print(
                    f"{backend}: N={n}: floor skipped: its scores, {n * n * 4 / (1 << 30):.0f} GiB x "
                    f"{FLOOR_COPIES}, pass --floor-max-gib {args.floor_max_gib:g}",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
            res[table][n] = _measure_one(args, run, python, backend, n, keys)
            res["version"] = res[table][n].get("version", res["version"])
            res["block"] = res[table][n].get("block", res.get("block"))
    return results


def _measure_one(args, run, python: str, backend: str, n: int, keys: list) -> dict:
    warmup = "1" if n < args.longseq_no_warmup_from else "0"
    what = "forward+backward" if key_needs_autodiff(keys) else "timing"
    try:
        runs = []
        for i in range(args.runs):
            of = f" (run {i + 1} of {args.runs})" if args.runs > 1 else ""
            print(f"{backend}: N={n}: {what} {', '.join(keys)}{of} ...", file=sys.stderr, flush=True)
            runs.append(
                run(python, "longseq-time", backend, str(n), ",".join(keys),
                    str(args.longseq_calls), str(args.longseq_budget), warmup)
            )  # fmt: skip
        if runs[0].get("no_autodiff"):
            return {"skipped": "no autodiff (vjp is None)"}
        found = dict(runs[0])
        found["times"] = {key: statistics.median(r["times"][key] for r in runs) for key in keys}
        found["calls"] = {key: sum(r["calls"][key] for r in runs) for key in keys}
        found["memory"], found["memory_worst"] = {}, {}
        if not args.no_memory:
            for key in keys:
                print(f"{backend}: N={n}: peak memory {key} ...", file=sys.stderr, flush=True)
                runs = [run(python, "longseq-memory", backend, str(n), key) for _ in range(args.memory_runs)]
                mib = [r["mib"] for r in runs]
                found["memory"][key], found["memory_worst"][key] = statistics.median(mib), max(mib)
                found["peak_reset"] = found.get("peak_reset", True) and all(r["peak_reset"] for r in runs)
        return found
    except RuntimeError as err:
        return {"error": str(err)}


# -- the tables ----------------------------------------------------------------------------------


def _time(seconds, calls=None) -> str:
    if seconds is None:
        return "-"
    text = f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"
    return text if calls is None else f"{text} ×{calls}"


def _mib(res: dict, key: str) -> str:
    median, worst = res.get("memory", {}).get(key), res.get("memory_worst", {}).get(key)
    if median is None:
        return "-"
    return f"{median:.1f}" + (f" (worst {worst:.1f})" if worst is not None and worst != median else "")


def _ratio(a, b, of: str) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x {of}"


def render_backend(backend: str, res: dict, floor_max_gib: float) -> str:
    torch = backend == "torch"
    cols = ["N", "case", "blocks", "ratio", "default call", "default / blocks", "floor"]
    if torch:
        cols += ["SDPA", "blocks / SDPA", "default / SDPA"]
    cols += ["peak MiB blocks", "peak MiB default", "peak MiB floor"] + (["peak MiB SDPA"] if torch else [])
    lines = [
        f"### {backend} {res.get('version', '?')}, blocks of {res.get('block', '?')}",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    rows = [(n, case, found) for n, found in sorted(res.get("n", {}).items()) for case in CASES]
    rows += [(n, GRAD, found) for n, found in sorted(res.get("grad", {}).items())]
    seen_skips = set()
    for n, case, found in rows:
        if "skipped" in found or "error" in found:
            if (n, case == GRAD) in seen_skips:
                continue
            seen_skips.add((n, case == GRAD))
            why = found.get("skipped") or f"failed: {found['error']}"
            label = GRAD if case == GRAD else "all"
            lines.append(f"| {n} | {label} | {why} |" + " |" * (len(cols) - 3))
            continue
        t, calls = found["times"], found["calls"]

        def get(impl, c=case, t=t):
            return t.get(f"{c}/{impl}")

        blocks = get("blocks")
        if case == "plain":
            ratio = _ratio(blocks, get("floor"), "floor")
        elif case == GRAD:
            forward = res.get("n", {}).get(n, {}).get("times", {}).get("plain/blocks")
            ratio = _ratio(blocks, forward, "forward")
        elif case in MOD_CASES:  # what a user's call takes, to the same call without the mask
            unmasked = get("default", "plain") or get("blocks", "plain")
            ratio = _ratio(get("default") or blocks, unmasked, "unmasked")
        else:
            ratio = _ratio(blocks, get("blocks", "plain"), "plain")
        if f"{case}/default" in t:
            key = f"{case}/default"
            default = f"{_time(t[key], calls[key])} ({found['paths'][key]})"
        else:
            default = "= blocks" if case != GRAD else "-"
        if case == "plain" and "plain/floor" not in t:
            floor = f"does not fit (N²·4 B ×{FLOOR_COPIES} > {floor_max_gib:g} GiB)"
        else:
            floor = _time(get("floor"), calls.get(f"{case}/floor")) if case == "plain" else "-"
        cells = [
            str(n), case, _time(blocks, calls.get(f"{case}/blocks")), ratio, default,
            _ratio(get("default"), blocks, ""), floor,
        ]  # fmt: skip
        if torch:
            sdpa = get("sdpa")
            cells += [_time(sdpa, calls.get(f"{case}/sdpa")), _ratio(blocks, sdpa, "")]
            cells.append(_ratio(get("default"), sdpa, ""))
        cells += [_mib(found, f"{case}/blocks"), _mib(found, f"{case}/default"), _mib(found, f"{case}/floor")]
        if torch:
            cells.append(_mib(found, f"{case}/sdpa"))
        lines.append("| " + " | ".join(c.strip() for c in cells) + " |")
    return "\n".join(lines)


def render(results: dict, floor_max_gib: float) -> str:
    return "\n\n".join(render_backend(backend, res, floor_max_gib) for backend, res in results.items())


def header(args, machine: str, threads: str, results: dict, allocator: str) -> str:
    from multiattn import blockwise

    block = block_size()
    runs = "" if args.runs == 1 else f", the median over {args.runs} fresh workers"
    found = [f for res in results.values() for table in ("n", "grad") for f in res.get(table, {}).values()]
    if all(f.get("peak_reset", True) for f in found):
        peak = "the peak reset to the RSS just before it (/proc/self/clear_refs)"
    else:
        peak = "the peak NOT reset before it where /proc/self/clear_refs was refused (an underestimate)"
    memory = "not measured (--no-memory)" if args.no_memory else (
        f"growth of peak RSS during one call in a fresh process ({allocator}; after the small warm-up; "
        f"{peak}), median (worst) of {args.memory_runs} process(es)"
    )  # fmt: skip
    lines = [
        "# multiattn long-sequence benchmarks (--sizes longseq)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {machine}.",
        f"Thread settings: {threads}.",
        "",
        f"- B=1, one head, inputs (1, N, {D}), float32, no weights.  Cases: `plain`; `causal` (causal=True);",
        "  `lengths` (valid_lens=[N//4]: 3/4 of the keys hidden); "
        f"`window` (mask_mod=mods.sliding_window({WINDOW}));",
        f"  `documents` (mods.document: {DOCUMENTS} equal ones); `{GRAD}`: the backend's vjp of the blocks, "
        "plain (the output and the gradients of q, k, v).",
        "- `blocks`: dot_product_attention(..., block_size=BLOCK), the core's online softmax forced "
        "(the automatic",
        f"  choice's block, from the L2 per core: {block}, filling the backend's `block_area` L2 caches).",
        "  `default call`: the same with block_size=None, where it takes another",
        f"  path: the scores whole where N²·4 B <= {blockwise.SCORES_BUDGET_BYTES >> 20} MiB, and on torch "
        "past that SDPA's flash kernel",
        "  (attend_by_flash_kernel); `= blocks` where it is these blocks.",
        "- `floor`: matmul, softmax, matmul, no mask (benchmarks/textbook.py), "
        f"where N²·4 B ×{FLOOR_COPIES} <= {args.floor_max_gib:g} GiB.",
        "- `SDPA` (torch): F.scaled_dot_product_attention on (1, 1, N, 64) (4-D: its flash kernel), "
        "is_causal for `causal`,",
        "  the first N//4 keys and values for `lengths`.",
        "- ratio: `plain` blocks / floor; `causal`, `lengths`, `window`, `documents` blocks / plain blocks;",
        f"  `{GRAD}` / plain forward blocks.",
        "- jax runs the blocks eagerly (under jit every block would be traced, the lengths as tracers: no "
        "block skipped);",
        "  its floor is jit-compiled before it is timed.",
        f"- Times: per measurement a warm-up call at N = min(2 × BLOCK, N/4), a full-size one where "
        f"N < {args.longseq_no_warmup_from},",
        f"  then up to {args.longseq_calls} timed calls, no further one past {args.longseq_budget:g} s; "
        f"the median (×n: its calls){runs}.",
        f"- Memory (MiB): {memory}.",
        f"- Caps (--longseq-max): {args.longseq_max or 'none'}.",
        "",
        "",
    ]
    return "\n".join(lines)
