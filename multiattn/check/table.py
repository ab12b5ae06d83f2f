"""Compare every backend's results with the reference and with each other; one table.

A row is one backend x function x dtype (its three mask kinds together):
max abs error of outputs and weights against the float64 reference, max abs
difference against every other backend, gradient error, verdict.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import numpy as np

from .cases import DECODING_MASKS, DTYPES, FUNCTIONS, MASKS, MOD_MASKS, Case, tolerance


@dataclass
class Row:
    backend: str
    version: str
    function: str
    dtype: str
    ref_error: Optional[float] = None  # max abs error vs the reference
    cross: Dict[str, float] = field(default_factory=dict)  # other backend -> max abs difference
    grad_error: Optional[float] = None
    verdict: str = "ok"
    reason: str = ""
    not_run: Dict[str, List[str]] = field(default_factory=dict)  # why -> cases the function could not take
    failures: Dict[str, List[str]] = field(default_factory=dict)  # why -> the masks it failed in

    @property
    def worst_cross(self) -> str:
        if not self.cross:
            return "-"
        other = max(self.cross, key=lambda name: self.cross[name])
        return f"{self.cross[other]:.1e} ({other})"


def _name(results: Dict[str, dict], label: str) -> str:
    """The backend behind a row label (`report` labels a backend found in two files)."""
    return results[label].get("backend", label)


def _err(got: np.ndarray, want: np.ndarray) -> float:
    got = np.asarray(got, dtype=np.float64)
    if got.shape != want.shape:
        return float("inf")
    diff = np.abs(got - want)
    return float("inf") if np.isnan(diff).any() else float(diff.max(initial=0.0))


def _scale(*arrays: np.ndarray) -> float:
    return max([1.0] + [float(np.abs(a).max(initial=0.0)) for a in arrays])


def _fail(row: Row, reason: str) -> None:
    """Mark the row failed; distinct reasons are kept, each with the masks it happened in
    ("1d, 2d: NaN in the output; 1d: input modified in place: X")."""
    row.verdict = "FAIL"
    mask, sep, why = reason.partition(": ")
    if not sep or mask not in MASKS + MOD_MASKS + DECODING_MASKS:
        mask, why = "", reason
    row.failures.setdefault(why, [])
    if mask and mask not in row.failures[why]:
        row.failures[why].append(mask)
    row.reason = "; ".join(
        f"{', '.join(masks)}: {why}" if masks else why for why, masks in list(row.failures.items())[:3]
    )


def build_rows(
    results: Dict[str, dict],
    cases: List[Case],
    overrides: Optional[Dict[str, float]] = None,
    functions: tuple = FUNCTIONS,
) -> List[Row]:
    rows = []
    for backend, res in results.items():
        for function in functions:
            for dtype in DTYPES:
                row = Row(backend, res["version"], function, dtype)
                rows.append(row)
                if res["status"] != "ok":
                    _fail(row, res["status"])
                    continue
                tol = tolerance(_name(results, backend), dtype, overrides)
                for case in (c for c in cases if c.function == function and c.dtype == dtype):
                    _compare_case(row, case, backend, results, tol, overrides)
    return rows


def _compare_case(row, case, backend, results, tol, overrides) -> None:
    mine = results[backend]["cases"].get(case.name, {"status": "error: missing"})
    if mine["status"].startswith("unsupported"):
        row.verdict, row.reason = "n/a", mine["status"].split(": ", 1)[1]
        return
    if mine["status"].startswith("skipped"):  # `check --against`: a case the function cannot take
        row.not_run.setdefault(mine["status"].split(": ", 1)[1], []).append(case.mask)
        return
    if mine["status"] != "ok":
        _fail(row, f"{case.mask}: {mine['status']}")
        return
    if mine.get("modified"):
        _fail(row, f"{case.mask}: input modified in place: {', '.join(mine['modified'])}")
    want = case.expected
    mine = _without_skipped_rows(mine, want)
    scale = _scale(want["out"], want["weights"])
    errors = {"output": _err(mine["out"], want["out"])}
    if "weights" in mine:
        errors["weights"] = _err(mine["weights"], want["weights"])
    if "fast" in mine:  # the no-weights path (fused kernels), compared with the same reference
        errors["output without weights"] = _err(mine["fast"], want["out"])
    if "blocks" in mine:  # the block path forced
        errors["output in blocks"] = _err(mine["blocks"], want["out"])
    err = max(errors.values())
    row.ref_error = max(row.ref_error or 0.0, err)
    if not err <= tol * scale:
        _fail(row, f"{case.mask}: {explain(case, mine, errors, tol * scale)}")
    for key, path in (("grads", ""), ("block_grads", " in blocks")):
        for arg, grad in mine.get(key, {}).items():
            g_err = _err(grad, want["grads"][arg])
            row.grad_error = max(row.grad_error or 0.0, g_err)
            g_tol = 10 * tol * _scale(want["grads"][arg])
            if not g_err <= g_tol:
                what = "NaN" if np.isnan(grad).any() else f"{g_err:.2g} from the reference > {g_tol:.2g}"
                _fail(row, f"{case.mask}: gradient{path} of {arg} {what}")
    for other, res in results.items():
        theirs = res["cases"].get(case.name, {}) if res["status"] == "ok" else {}
        if other == backend or theirs.get("status") != "ok":
            continue
        diff = _err(mine["out"], theirs["out"])
        row.cross[other] = max(row.cross.get(other, 0.0), diff)
        both = (tol + tolerance(_name(results, other), case.dtype, overrides)) * scale
        if not diff <= both:
            _fail(row, f"{case.mask}: differs from {other} by {diff:.2g} > {both:.2g}")


def _without_skipped_rows(mine: dict, want: dict) -> dict:
    """The result with the rows the reference leaves out (``--skip-fully-masked``) set to the
    reference's, so that they cannot fail."""
    skip = want.get("skip_rows")
    if skip is None or not skip.any():
        return mine
    mine = dict(mine)
    for key, reference in (("out", want["out"]), ("weights", want["weights"])):
        if key in mine and np.shape(mine[key]) == reference.shape:
            rows = skip if reference.ndim == skip.ndim + 1 else skip[:, None]  # multi-head weights: per head
            mine[key] = np.where(np.broadcast_to(rows[..., None], reference.shape), reference, mine[key])
    return mine


def explain(case: Case, mine: dict, errors: Dict[str, float], tol: float) -> str:
    """Why a case failed, in words: NaN, the fully masked rows' weights, or the largest error."""
    want_weights = case.expected["weights"]
    dead = want_weights.sum(-1) == 0  # rows where the reference sees no key
    for key in ("out", "weights", "fast", "blocks"):
        got = mine.get(key)
        if got is None:
            continue
        got = np.asarray(got, dtype=np.float64)
        name = {
            "out": "output",
            "weights": "weights",
            "fast": "output without weights",
            "blocks": "output in blocks",
        }[key]
        if got.shape != (want_weights if key == "weights" else case.expected["out"]).shape:
            want_shape = (want_weights if key == "weights" else case.expected["out"]).shape
            return f"{name} has shape {got.shape}, reference {want_shape}"
        if np.isnan(got).any():
            rows = np.isnan(got).any(-1)
            only_dead = rows.shape == dead.shape and dead.any() and not rows[~dead].any()
            return f"NaN in the {name}" + (" in fully masked rows only" if only_dead else "")
    got_weights = mine.get("weights")
    if got_weights is not None and dead.any():
        rows = np.asarray(got_weights, dtype=np.float64)[dead]
        if np.abs(rows).max() > tol:
            if np.ptp(rows, axis=-1).max() <= tol:
                return f"fully masked row: got uniform weights {rows.flat[0]:.3g}, reference 0"
            return f"fully masked row: got weights summing to {rows.sum(-1).max():.3g}, reference 0"
    name = max(errors, key=lambda k: errors[k])
    return f"{name} {errors[name]:.2g} from the reference > {tol:.2g}"


def _not_run(row: Row) -> str:
    if not row.not_run:
        return ""
    return "; not run: " + "; ".join(f"{', '.join(masks)} ({why})" for why, masks in row.not_run.items())


def render(rows: List[Row]) -> str:
    header = ["backend", "version", "case", "vs reference", "vs others (worst)", "gradients", "verdict"]

    def num(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.1e}"

    lines = [
        [
            r.backend,
            r.version,
            f"{r.function} {r.dtype}",
            num(r.ref_error),
            r.worst_cross,
            num(r.grad_error),
            r.verdict + (f": {r.reason}" if r.reason else "") + _not_run(r),
        ]
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    widths[-1] = len(header[-1])  # the verdict column runs free

    def fmt(cells):
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    out = [fmt(header), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines]
    failed = sum(r.verdict == "FAIL" for r in rows)
    backends = sorted({r.backend for r in rows})
    out.append("")
    out.append(
        f"{len(rows)} rows, {len(backends)} backend{'' if len(backends) == 1 else 's'} "
        f"({', '.join(backends)}): " + (f"{failed} FAILED" if failed else "all agree within tolerance")
    )
    return "\n".join(out)


def rows_as_json(rows: List[Row]) -> list:
    return [asdict(r) for r in rows]
