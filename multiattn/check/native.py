"""``multiattn check --native``: each framework's own attention (``native_wrappers``) through
check's battery, a subprocess per framework (``worker --native``), judged against the reference:
check's rows per implementation (``build_native_rows``) and the cells of the "where frameworks
disagree" summary (``classify``, ``summarize``).  Their text tables and the page
docs/native-attention.md are ``native_report``'s."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import numpy as np

from .. import reference
from .._registry import get_backend
from .against import cases_for, run_function
from .cases import GROUPED_HEADS, GROUPED_KV_HEADS, MASKS, MOD_MASKS, NUM_HEADS, Case, tolerance
from .native_wrappers import (
    TENSORS,
    Implementation,
    absent,
    backend_of,
    implementation_version,
    implementations,
)
from .results import Results, framework_version
from .table import build_rows

# ---------------------------------------------------------------- running


def run_implementation(impl: Implementation, seed: int = 0) -> dict:
    """``run_function``'s results for one implementation, with its label, kind and version;
    a case the native API cannot express is ``unsupported: <why>``."""
    module = get_backend(backend_of(impl.framework))
    meta = {"backend": impl.framework, "kind": impl.kind, "framework_version": "?"}
    try:
        fn = impl.make()
        results = run_function(fn, impl.kind, backend_of(impl.framework), seed, mods=True)
        meta["framework_version"] = (
            implementation_version(impl) if impl.framework in TENSORS else framework_version(impl.framework)
        )
        results["version"] = implementation_version(impl)
    except Exception as err:
        return {"version": "?", "status": f"failed: {type(err).__name__}: {err}", "cases": {}, **meta}
    notes = getattr(module, "DTYPE_NOTES", {})
    for name, result in results["cases"].items():
        status = result["status"]
        if status.startswith("error: Unsupported: "):
            result["status"] = "unsupported: " + status[len("error: Unsupported: ") :]
        elif status.startswith("unsupported: ") and status.endswith(" has no " + name.split("/")[-1]):
            why = notes.get(name.split("/")[-1])  # multiattn's backend does not run this dtype
            if isinstance(why, dict):
                why = why.get(impl.kind)
            if why:
                result["status"] = f"unsupported: {why}"
    return {**results, **meta}


def run_framework(framework: str, seed: int = 0) -> Results:
    """Every implementation of one framework, in this process: {label: results}."""
    module = get_backend(backend_of(framework))
    if hasattr(module, "enable_float64"):
        module.enable_float64()
    skip = absent(framework)
    out = {}
    for impl in implementations(framework):
        if impl.label in skip:  # kept, so that the page can say why it has no rows
            out[impl.label] = {"version": "?", "status": f"absent: {skip[impl.label]}", "cases": {},
                               "backend": framework, "kind": impl.kind}  # fmt: skip
        else:
            out[impl.label] = run_implementation(impl, seed)
    return out


# ---------------------------------------------------------------- judging


def cases_of(kind: str, seed: int = 0) -> List[Case]:
    return cases_for(kind, seed, mods=True)


def build_native_rows(results: Results, seed: int = 0, overrides: Optional[Dict[str, float]] = None) -> list:
    """check's rows (``table.build_rows``), one implementation at a time (never compared
    with each other: each is judged against the reference)."""
    rows = []
    for label, res in results.items():
        kind = res.get("kind")
        if kind is None:  # a framework whose worker died: its status, one row
            kind = "dot_product"
        rows += build_rows({label: res}, cases_of(kind, seed), overrides, functions=(kind,))
    return rows


def _dead_rows(case: Case) -> np.ndarray:
    """(batch, queries): where the reference sees no key."""
    weights = case.expected["weights"]
    dead = weights.sum(-1) == 0
    return dead.all(1) if case.function in ("multi_head", "grouped") else dead


def _uniform_alternative(case: Case) -> np.ndarray:
    """The output of a row that weighs every key alike (a fully masked row where the mask is a
    large negative number rather than nothing): the mean of the (projected) values."""
    args = case.inputs
    B, Q = _dead_rows(case).shape
    if case.function == "dot_product":
        mean = args["values"].mean(1)
    else:
        zero = np.zeros(args["W_v"].shape[0])
        mean = (args["values"] @ args["W_v"].T + args.get("b_v", zero)).mean(1)  # per key/value head
        if case.function == "grouped":  # each query head takes its group's shared head
            mean = np.repeat(mean.reshape(B, GROUPED_KV_HEADS, -1), GROUPED_HEADS // GROUPED_KV_HEADS, 1)
            mean = mean.reshape(B, -1)
        mean = mean @ args["W_o"].T + args.get("b_o", np.zeros(args["W_o"].shape[0]))
    return np.broadcast_to(mean[:, None, :], (B, Q, mean.shape[-1]))


UNMASKED = (
    "fully masked rows: the weights of the unmasked scores (a finite additive mask cancels in the softmax)"
)


def _unmasked(case: Case) -> dict:
    """The reference without any mask: what a row gets where its mask, a constant added to every
    score of the row, cancels in the softmax."""
    args = case.inputs
    if case.function == "dot_product":
        return reference.dot_product_attention(args["queries"], args["keys"], args["values"], None)
    weights = {n: v for n, v in args.items() if n not in ("queries", "keys", "values")}
    heads = dict(num_heads=NUM_HEADS)
    if case.function == "grouped":
        heads = dict(num_heads=GROUPED_HEADS, num_kv_heads=GROUPED_KV_HEADS)
    return reference.multi_head_attention(
        args["queries"], args["keys"], args["values"], None, weights, **heads
    )


def _max_err(got: Any, want: np.ndarray, rows: np.ndarray) -> float:
    got = np.asarray(got, dtype=np.float64)
    if got.shape != want.shape:
        return float("inf")
    if got.ndim == rows.ndim + 2:  # per-head weights
        rows = np.broadcast_to(rows[:, None], got.shape[:-1])
    diff = np.abs(got - want)[rows]
    return float("inf") if np.isnan(diff).any() else float(diff.max(initial=0.0))


SEPARATOR = "; "
FLOAT32_ACCURACY = "float64 at float32 accuracy"  # within float32's tolerance, not float64's


def classify(case: Case, result: dict, backend: str, overrides: Optional[Dict[str, float]] = None) -> str:
    """'' where the case agrees with the reference, else why not, in a few words (the
    summary's cell): a status, NaN or non-zero weights in fully masked rows, a difference in
    the rows that see keys, or the gradients."""
    status = result["status"]
    if status != "ok":
        return status
    if result.get("modified"):
        return "writes into its inputs: " + ", ".join(result["modified"])
    want = case.expected
    scale = max([1.0] + [float(np.abs(a).max(initial=0.0)) for a in (want["out"], want["weights"])])
    tol = tolerance(backend, case.dtype, overrides) * scale
    dead = _dead_rows(case)
    live = ~dead
    got = {k: result[k] for k in ("out", "weights") if k in result}
    for key, value in got.items():
        if np.shape(value) != want[key].shape:
            name = "output" if key == "out" else "weights"
            return f"{name} of shape {np.shape(value)}, reference {want[key].shape}"
    reasons = []
    live_errors = {k: _max_err(v, want[k], live) for k, v in got.items()}
    if any(not err <= tol for err in live_errors.values()):
        key = max(live_errors, key=lambda k: live_errors[k])
        err, name = live_errors[key], "output" if key == "out" else "weights"
        if case.dtype == "float64" and err <= tolerance(backend, "float32") * scale:
            reasons.append(FLOAT32_ACCURACY)
        else:
            what = "NaN" if math.isinf(err) else f"{err:.2g} from the reference"
            reasons.append(f"{name} {what} where keys are visible")
    if dead.any():  # what the rows that see nothing get, recognised at a float32 tolerance
        reasons += _fully_masked(case, got, dead, max(tol, tolerance(backend, "float32") * scale))
    if reasons:
        return SEPARATOR.join(reasons)
    for arg, grad in result.get("grads", {}).items():
        g_want = want["grads"][arg]
        g_err = _max_err(grad, g_want, np.ones(np.shape(g_want)[:-1], bool))
        if not g_err <= 10 * tolerance(backend, case.dtype, overrides) * max(
            1.0, float(np.abs(g_want).max())
        ):
            if math.isinf(g_err):
                return f"gradient of {arg}: NaN"
            if case.dtype == "float64" and g_err <= 10 * tolerance(backend, "float32") * max(
                1.0, float(np.abs(g_want).max())
            ):
                return FLOAT32_ACCURACY
            return f"gradient of {arg}: {g_err:.2g} from the reference"
    return ""


def _fully_masked(case: Case, got: dict, dead: np.ndarray, tol: float) -> List[str]:
    """What the implementation gives in the rows that see no key, where it is not the reference's."""
    want = case.expected
    out_dead = np.asarray(got["out"], dtype=np.float64)[dead]
    weights_dead = None
    if "weights" in got:
        weights = np.asarray(got["weights"], dtype=np.float64)
        weights_dead = (weights.transpose(0, 2, 1, 3) if weights.ndim == 4 else weights)[dead]
    nan = [
        n for n, a in (("output", out_dead), ("weights", weights_dead)) if a is not None and np.isnan(a).any()
    ]
    if nan:
        return [f"fully masked rows: NaN {' and '.join(nan)}"]
    unmasked = _unmasked(case)
    if weights_dead is not None and np.abs(weights_dead).max() > tol:
        if np.ptp(weights_dead, axis=-1).max() <= tol:
            return [f"fully masked rows: uniform weights {weights_dead.flat[0]:.2g}, reference 0"]
        if _max_err(got["weights"], unmasked["weights"], dead) <= tol:
            return [UNMASKED]
        return ["fully masked rows: non-zero weights, reference 0"]
    if not _max_err(got["out"], want["out"], dead) > tol:
        return []
    if _max_err(got["out"], _uniform_alternative(case), dead) <= tol:
        want_what = "0" if case.function == "dot_product" else "b_o"
        return [
            f"fully masked rows: uniform weights (an output of the mean of the values), reference {want_what}"
        ]
    if _max_err(got["out"], unmasked["out"], dead) <= tol:
        return [UNMASKED]
    if np.abs(out_dead).max() <= tol:
        return ["fully masked rows: output 0, reference b_o"]
    return [f"fully masked rows: output {_max_err(got['out'], want['out'], dead):.2g} from the reference"]


def summarize(results: Results, seed: int = 0, overrides: Optional[Dict[str, float]] = None) -> List[tuple]:
    """[(label, {mask: cell})]: 'agree', 'n/a', 'not run' or the reasons, each with the dtypes
    that show it where not every dtype that ran does."""
    out = []
    for label, res in results.items():
        cells = {}
        kind = res.get("kind", "dot_product")
        for mask in MASKS + MOD_MASKS:
            if res["status"] != "ok":
                cells[mask] = res["status"]
                continue
            reasons: Dict[str, List[str]] = {}
            ran, statuses = [], set()
            for case in (c for c in cases_of(kind, seed) if c.mask == mask):
                result = res["cases"].get(case.name, {"status": "error: missing"})
                if result["status"].startswith(("unsupported", "skipped")):
                    statuses.add("not run" if result["status"].startswith("skipped") else "n/a")
                    continue
                ran.append(case.dtype)
                why = classify(case, result, res.get("backend", label), overrides)
                for reason in why.split(SEPARATOR) if why else ():
                    reasons.setdefault(reason, []).append(case.dtype)
            cells[mask] = _cell(reasons, ran, statuses)
        out.append((label, cells))
    return out


def _cell(reasons: Dict[str, List[str]], ran: List[str], statuses: set) -> str:
    if not ran:
        return "not run" if "not run" in statuses else "n/a"
    if not reasons:
        return "agree"
    return SEPARATOR.join(
        why if set(dtypes) >= set(ran) or why == FLOAT32_ACCURACY else f"{why} ({', '.join(dtypes)})"
        for why, dtypes in reasons.items()
    )


AGREE = ("agree", "n/a", "not run")


def disagreements(summary: List[tuple]) -> int:
    """How many implementation x mask cells disagree with the reference."""
    return sum(cell not in AGREE for _, cells in summary for cell in cells.values())
