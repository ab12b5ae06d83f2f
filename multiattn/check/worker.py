"""Run the check cases on one backend; usually in a subprocess of its own.

``python -m multiattn.check.worker BACKEND SEED OUT.npz`` writes every result
array to OUT.npz plus a JSON ``meta`` entry (framework version, per-case
status; ``results.save_results``), so that a crash of one framework never takes
the command down.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any, Callable, Dict

from .._registry import get_backend
from ..cache import KVCache, cached_attention
from .cases import (
    CACHED,
    DECODING_OFFSETS,
    GROUPED_HEADS,
    GROUPED_KV_HEADS,
    NUM_HEADS,
    PAGE_SIZE,
    Case,
    make_cases,
    mod_keywords,
)
from .results import framework_version, save_native, save_results

BLOCK_SIZE = 2  # the cases' 3 queries and 5 keys: partial blocks, a last block shorter


def _run_case(module: Any, case: Case) -> Dict[str, Any]:
    tensors = {arg: module.from_numpy(value, case.dtype) for arg, value in case.inputs.items()}
    lens = None if case.valid_lens is None else module.from_numpy(case.valid_lens)
    mask = None if case.attention_mask is None else module.from_numpy(case.attention_mask)
    masks = dict(attention_mask=mask, causal=case.causal, **mod_keywords(case))

    run: Callable[..., Any]
    fast: Callable[..., Any] = None  # the no-weights path (fused kernels), which must agree too
    blocks: Callable[..., Any] = None  # the no-weights path in blocks forced (multiattn.blockwise)
    order = list(case.inputs)
    if case.function in ("masked_softmax", "masked_softmax_4d"):

        def run(X):
            weights = module.masked_softmax(X, lens, **masks)
            return weights, weights

    elif case.function in ("dot_product", "dot_product_4d"):

        def run(q, k, v):
            return module.dot_product_attention(q, k, v, lens, return_weights=True, **masks)

        def fast(q, k, v):
            return module.dot_product_attention(q, k, v, lens, **masks)

        def blocks(q, k, v):
            return module.dot_product_attention(q, k, v, lens, block_size=BLOCK_SIZE, **masks)

    elif case.function == "decoding" and case.mask == "offset":

        def run(q, k, v):
            offsets = DECODING_OFFSETS
            return module.dot_product_attention(
                q, k, v, causal=True, query_offset=offsets, return_weights=True
            )

        def fast(q, k, v):
            return module.dot_product_attention(q, k, v, causal=True, query_offset=DECODING_OFFSETS)

        def blocks(q, k, v):
            return module.dot_product_attention(
                q, k, v, causal=True, query_offset=DECODING_OFFSETS, block_size=BLOCK_SIZE
            )

    elif case.function == "decoding":  # a cache holding CACHED positions, then a step per query
        page_size = PAGE_SIZE if case.mask == "paged" else None

        def run(q, k, v):
            batch, kv_heads, _, width = module.ops.shape(k)
            cache = KVCache(
                batch, kv_heads, width, like=q, page_size=page_size, value_dim=module.ops.shape(v)[-1]
            )
            cache = cache.append(k[..., :CACHED, :], v[..., :CACHED, :])
            outs = []
            for t in range(module.ops.shape(q)[2]):
                step = slice(CACHED + t, CACHED + t + 1)
                out, cache = cached_attention(q[..., t : t + 1, :], k[..., step, :], v[..., step, :], cache)
                outs.append(out)
            return module.ops.concat(outs, 2), None

    elif case.function in ("multi_head", "grouped"):
        heads = (
            dict(num_heads=NUM_HEADS)
            if case.function == "multi_head"
            else dict(num_heads=GROUPED_HEADS, num_kv_heads=GROUPED_KV_HEADS)
        )

        def run(q, k, v, *weights, return_weights=True, block_size=None):
            return module.multi_head_attention(
                q, k, v, lens, weights=dict(zip(order[3:], weights)), return_weights=return_weights,
                block_size=block_size, **heads, **masks,
            )  # fmt: skip

        def fast(*args):
            return run(*args, return_weights=False)

        def blocks(*args):
            return run(*args, return_weights=False, block_size=BLOCK_SIZE)

    else:

        def run(q, k, v, W_q, W_k, w_v):
            return module.additive_attention(
                q, k, v, lens, W_q=W_q, W_k=W_k, w_v=w_v, return_weights=True, **masks
            )

        def blocks(q, k, v, W_q, W_k, w_v):
            return module.additive_attention(
                q, k, v, lens, W_q=W_q, W_k=W_k, w_v=w_v, block_size=BLOCK_SIZE, **masks
            )

    args = [tensors[a] for a in order]
    out, weights = run(*args)
    result: Dict[str, Any] = {"out": module.to_numpy(out)}
    if weights is not None:  # a cache's steps give none
        result["weights"] = module.to_numpy(weights)
    if fast is not None:
        result["fast"] = module.to_numpy(fast(*args))
    if blocks is not None:
        result["blocks"] = module.to_numpy(blocks(*args))
    if case.wants_grads and module.vjp is not None and (case.function != "decoding" or case.mask == "offset"):
        cotangent = module.from_numpy(case.cotangent, case.dtype)
        _, grads = module.vjp(lambda *xs: run(*xs)[0], args, cotangent)
        result["grads"] = {a: module.to_numpy(g) for a, g in zip(order, grads)}
        if blocks is not None:
            _, grads = module.vjp(blocks, args, cotangent)
            result["block_grads"] = {a: module.to_numpy(g) for a, g in zip(order, grads)}
    return result


def run_backend(name: str, seed: int, progress: Callable[[int, int], None] = None) -> Dict[str, Any]:
    """{"version", "status", "cases": {case name: {"status", "out", "weights", "grads"}}};
    progress(cases done, cases) after each case."""
    module = get_backend(name)
    if hasattr(module, "enable_float64"):  # the float64 cases need it (jax: jax_enable_x64)
        module.enable_float64()
    results: Dict[str, Any] = {"version": framework_version(name), "status": "ok", "cases": {}}
    cases = make_cases(seed)
    for done, case in enumerate(cases):
        if progress:
            progress(done, len(cases))
        if case.dtype not in module.SUPPORTED_DTYPES:
            why = module.DTYPE_NOTES.get(case.dtype, f"{name} has no {case.dtype}")
            if isinstance(why, dict):  # what this case itself needs
                why = why.get(case.function, f"{name} has no {case.dtype}")
            results["cases"][case.name] = {"status": f"unsupported: {why}"}
            continue
        try:
            results["cases"][case.name] = {"status": "ok", **_run_case(module, case)}
        except Exception as err:  # one failing case is a failed row, not a dead command
            results["cases"][case.name] = {"status": f"error: {type(err).__name__}: {err}"}
    return results


def main(argv: list) -> int:
    """``BACKEND SEED OUT``, or ``--against SPEC KIND BACKEND SEED OUT [DTYPES] [--skip-fully-masked]``,
    or ``--native FRAMEWORK SEED OUTDIR`` (the framework's own attention, ``check.native``)."""
    if argv[0] == "--against":
        return _main_against(argv[1:])
    if argv[0] == "--native":
        return _main_native(argv[1:])
    name, seed, out = argv[0], int(argv[1]), argv[2]
    try:
        results = run_backend(name, seed, lambda done, total: print(f"progress {done} {total}", flush=True))
    except BaseException as err:  # report why the backend could not run at all
        message = f"{type(err).__name__}: {err}"
        print(traceback.format_exc(), file=sys.stderr)
        results = {"version": "?", "status": f"failed: {message}", "cases": {}}
    save_results(results, out)
    return 0


def _main_against(argv: list) -> int:
    from .against import UsageError, load_function, run_function

    spec, kind, name, seed, out = argv[0], argv[1], argv[2], int(argv[3]), argv[4]
    dtypes = argv[5].split(",") if len(argv) > 5 and argv[5] != "-" else None
    try:
        fn = load_function(spec)
        results = run_function(fn, kind, name, seed, dtypes, skip_fully_masked="--skip-fully-masked" in argv)
    except UsageError as err:  # the command's mistake, not a failed row: exit status 2
        results = {"version": "?", "status": f"usage: {err}", "cases": {}}
    except BaseException as err:
        print(traceback.format_exc(), file=sys.stderr)
        results = {"version": "?", "status": f"failed: {type(err).__name__}: {err}", "cases": {}}
    save_results(results, out)
    return 0


def _main_native(argv: list) -> int:
    from . import native

    name, seed, out = argv[0], int(argv[1]), argv[2]
    try:
        results = native.run_framework(name, seed)
    except BaseException as err:  # the framework itself failed: one result saying why
        print(traceback.format_exc(), file=sys.stderr)
        results = {name: {"version": "?", "status": f"failed: {type(err).__name__}: {err}", "cases": {},
                          "backend": name}}  # fmt: skip
    save_native(results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
