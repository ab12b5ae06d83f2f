"""``multiattn check --against MODULE:FUNCTION``: someone else's attention through the battery.

The user's function takes the arguments of multiattn's functional form of its kind:

* ``masked_softmax``: ``fn(X, valid_lens)`` -> weights;
* ``dot_product``: ``fn(queries, keys, values, valid_lens)`` -> output or (output, weights);
* ``additive``: ``fn(queries, keys, values, valid_lens, *, W_q, W_k, w_v)`` -> the same;
* ``multi_head``: ``fn(queries, keys, values, valid_lens, *, weights, num_heads)`` -> the same,

and ``attention_mask=`` / ``causal=`` where it accepts them (else the mask cases are not run,
and the table says so).  Each case's inputs are checked for writes, and the results go into
the same table as ``multiattn check``'s, judged against the same float64 reference.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable, Dict, Iterable, Optional

import numpy as np

from .._registry import get_backend
from .cases import (
    FUNCTIONS,
    GROUPED_HEADS,
    GROUPED_KV_HEADS,
    MOD_KEYWORDS,
    NUM_HEADS,
    Case,
    expected,
    make_cases,
    mod_arguments,
)  # fmt: skip
from .native_wrappers import Unsupported
from .results import framework_version

KINDS = FUNCTIONS[:4]  # a function of the user's is checked as d2l's four (no grouped heads)
MASK_KEYWORDS = ("attention_mask", "causal")
# the mod cases' keywords (``cases.mod_arguments``): only ``check --native`` runs those cases
OPTIONAL_KEYWORDS = MASK_KEYWORDS + tuple(MOD_KEYWORDS.values())


class UsageError(ValueError):
    """The function cannot be checked as asked (unimportable, not callable, wrong signature)."""


def load_function(spec: str) -> Callable:
    """MODULE:FUNCTION (an importable module, or a path to a .py file) -> the function."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"--against needs MODULE:FUNCTION (e.g. mycode:attention), got {spec!r}")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            loader = importlib.util.spec_from_file_location("_checked_module", module_name)
            if loader is None or not os.path.exists(module_name):
                raise UsageError(f"cannot import {module_name!r}: no such file")
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())  # as `python -m` would: the current directory
            module = importlib.import_module(module_name)
    except UsageError:
        raise
    except Exception as err:
        raise UsageError(f"cannot import {module_name!r}: {type(err).__name__}: {err}") from err
    fn = getattr(module, attr, None)
    if fn is None:
        raise UsageError(f"module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise UsageError(f"{spec} is a {type(fn).__name__}, not a function")
    return fn


SIGNATURES = {
    "masked_softmax": "fn(X, valid_lens)",
    "dot_product": "fn(queries, keys, values, valid_lens)",
    "additive": "fn(queries, keys, values, valid_lens, *, W_q, W_k, w_v)",
    "multi_head": "fn(queries, keys, values, valid_lens, *, weights, num_heads)",
    "grouped": "fn(queries, keys, values, valid_lens, *, weights, num_heads, num_kv_heads)",
}


def mask_keywords(fn: Callable, kind: str) -> tuple:
    """Which of attention_mask/causal (and the mods' keywords) fn accepts; UsageError if it
    cannot take its kind's arguments."""
    if kind not in FUNCTIONS:
        raise UsageError(f"--kind must be one of {', '.join(KINDS)}, got {kind!r}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: assume the plain form
        return ()
    positional = ("X", None) if kind == "masked_softmax" else (None, None, None, None)
    keywords = {
        "additive": ("W_q", "W_k", "w_v"), "multi_head": ("weights", "num_heads"),
        "grouped": ("weights", "num_heads", "num_kv_heads"),
    }.get(kind, ())  # fmt: skip
    try:
        signature.bind(*positional, **dict.fromkeys(keywords))
    except TypeError as err:
        raise UsageError(
            f"the function does not take the arguments of --kind {kind}, {SIGNATURES[kind]} "
            f"(and optionally attention_mask=, causal=): {err}"
        ) from None
    params = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return OPTIONAL_KEYWORDS
    return tuple(k for k in OPTIONAL_KEYWORDS if k in signature.parameters)


def fully_masked_rows(case: Case) -> np.ndarray:
    """True for the (batch, [heads,] queries) rows of the reference's weights with nothing visible."""
    return case.expected["weights"].sum(-1) == 0


def cases_for(kind: str, seed: int = 0, skip_fully_masked: bool = False, mods: bool = False) -> list:
    """The battery of one kind, judged without the fully masked rows where asked; mods: with
    the mod cases (``cases.MOD_MASKS``)."""
    cases = [c for c in make_cases(seed, mods=mods) if c.function == kind]
    if skip_fully_masked:
        for case in cases:
            _ignore_fully_masked_rows(case)
    return cases


def run_function(
    fn: Callable,
    kind: str,
    backend: str,
    seed: int = 0,
    dtypes: Optional[Iterable[str]] = None,
    skip_fully_masked: bool = False,
    mods: bool = False,
) -> Dict[str, Any]:
    """The results of fn over the battery of its kind (mods: and the mod cases, each given by
    its keyword, ``cases.mod_arguments``), in the form of ``worker.run_backend``; each case's
    result also carries ``modified`` (inputs written into) where it happened."""
    accepted = mask_keywords(fn, kind)
    module = get_backend(backend)
    if hasattr(module, "enable_float64"):
        module.enable_float64()
    results: Dict[str, Any] = {"version": framework_version(backend), "status": "ok", "cases": {}}
    for case in cases_for(kind, seed, skip_fully_masked, mods):
        if dtypes is not None and case.dtype not in dtypes:
            continue
        if case.dtype not in module.SUPPORTED_DTYPES:
            results["cases"][case.name] = {"status": f"unsupported: {backend} has no {case.dtype}"}
            continue
        needs = [
            k for k, given in zip(MASK_KEYWORDS, (case.attention_mask is not None, case.causal)) if given
        ]
        if any(k not in accepted for k in needs):
            absent = "/".join(k for k in MASK_KEYWORDS if k not in accepted)
            results["cases"][case.name] = {"status": f"skipped: the function takes no {absent} keyword"}
            continue
        absent = [k for k in mod_arguments(case) if k not in accepted]
        if absent:
            results["cases"][case.name] = {"status": f"skipped: the function takes no {absent[0]} keyword"}
            continue
        try:
            results["cases"][case.name] = {"status": "ok", **_run_user_case(module, fn, case)}
        except Exception as err:  # the user's code failing is a failed row, not a dead command
            results["cases"][case.name] = {"status": f"error: {type(err).__name__}: {err}"}
    return results


def _ignore_fully_masked_rows(case: Case) -> None:
    """Judge the case on the other rows only: no cotangent there (so no gradient from them),
    and the reference's rows replaced by the function's later (``skip`` in the result)."""
    dead = fully_masked_rows(case)
    if case.function in ("multi_head", "grouped"):
        dead = dead.all(1)  # an output row is undefined only where every head sees nothing
    case.cotangent = np.where(dead[..., None], 0.0, case.cotangent)
    case.expected = expected(case)
    case.expected["skip_rows"] = dead


def _call(module: Any, fn: Callable, case: Case, tensors: Dict[str, Any], lens: Any, masks: dict):
    q_names = ("queries", "keys", "values")
    if case.function == "masked_softmax":
        return fn(tensors["X"], lens, **masks)
    args = [tensors[n] for n in q_names] + [lens]
    if case.function == "dot_product":
        return fn(*args, **masks)
    if case.function == "additive":
        return fn(*args, W_q=tensors["W_q"], W_k=tensors["W_k"], w_v=tensors["w_v"], **masks)
    weights = {n: t for n, t in tensors.items() if n not in q_names}
    if case.function == "grouped":
        return fn(*args, weights=weights, num_heads=GROUPED_HEADS, num_kv_heads=GROUPED_KV_HEADS, **masks)
    return fn(*args, weights=weights, num_heads=NUM_HEADS, **masks)


def _run_user_case(module: Any, fn: Callable, case: Case) -> Dict[str, Any]:
    tensors = {arg: module.from_numpy(value, case.dtype) for arg, value in case.inputs.items()}
    lens = None if case.valid_lens is None else module.from_numpy(case.valid_lens)
    masks: Dict[str, Any] = {}
    if case.attention_mask is not None:
        masks["attention_mask"] = module.from_numpy(case.attention_mask)
    if case.causal:
        masks["causal"] = True
    masks.update(mod_arguments(case))
    before = {arg: np.array(module.to_numpy(t)) for arg, t in tensors.items()}  # copies: numpy is itself
    if lens is not None:
        before["valid_lens"] = np.array(module.to_numpy(lens))
    returned = _call(module, fn, case, tensors, lens, masks)
    out, weights = returned if isinstance(returned, tuple) and len(returned) == 2 else (returned, None)
    result: Dict[str, Any] = {"out": module.to_numpy(out)}
    if case.function == "masked_softmax":
        weights = out
    if weights is not None:
        result["weights"] = module.to_numpy(weights)
    after = dict(tensors, **({"valid_lens": lens} if lens is not None else {}))
    modified = [arg for arg, value in before.items() if not _same(module.to_numpy(after[arg]), value)]
    if modified:
        result["modified"] = modified
    if case.wants_grads and module.vjp is not None and not modified:
        order = list(case.inputs)

        def first_output(*xs):
            got = _call(module, fn, case, dict(zip(order, xs)), lens, masks)
            return got[0] if isinstance(got, tuple) and len(got) == 2 else got

        cotangent = module.from_numpy(case.cotangent, case.dtype)
        try:
            _, grads = module.vjp(first_output, [tensors[a] for a in order], cotangent)
        except Unsupported as err:  # a native kernel without a backward here: its values alone
            result["grads_unsupported"] = str(err)
        else:
            result["grads"] = {a: module.to_numpy(g) for a, g in zip(order, grads)}
    return result


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))
