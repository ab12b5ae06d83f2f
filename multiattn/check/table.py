"""Compare every backend's results with the reference and with each other; one table.

A row is one backend x function x dtype (its three mask kinds together):
max abs error of outputs and weights against the float64 reference, max abs
difference against every other backend, gradient error, verdict.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import numpy as np

from .cases import DTYPES, FUNCTIONS, Case, tolerance


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
    row.verdict = "FAIL"
    row.reason = row.reason or reason


def build_rows(
    results: Dict[str, dict], cases: List[Case], overrides: Optional[Dict[str, float]] = None
) -> List[Row]:
    rows = []
    for backend, res in results.items():
        for function in FUNCTIONS:
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
    if mine["status"] != "ok":
        _fail(row, f"{case.mask}: {mine['status']}")
        return
    want = case.expected
    scale = _scale(want["out"], want["weights"])
    err = max(_err(mine["out"], want["out"]), _err(mine["weights"], want["weights"]))
    if "fast" in mine:  # the dot-product fast path, compared with the same reference
        err = max(err, _err(mine["fast"], want["out"]))
    row.ref_error = max(row.ref_error or 0.0, err)
    if not err <= tol * scale:
        _fail(row, f"{case.mask}: {err:.2g} from the reference > {tol * scale:.2g}")
    if "grads" in mine:
        for arg, grad in mine["grads"].items():
            g_err = _err(grad, want["grads"][arg])
            row.grad_error = max(row.grad_error or 0.0, g_err)
            g_tol = 10 * tol * _scale(want["grads"][arg])
            if not g_err <= g_tol:
                _fail(row, f"{case.mask}: gradient of {arg} {g_err:.2g} from the reference > {g_tol:.2g}")
    for other, res in results.items():
        theirs = res["cases"].get(case.name, {}) if res["status"] == "ok" else {}
        if other == backend or theirs.get("status") != "ok":
            continue
        diff = _err(mine["out"], theirs["out"])
        row.cross[other] = max(row.cross.get(other, 0.0), diff)
        both = (tol + tolerance(_name(results, other), case.dtype, overrides)) * scale
        if not diff <= both:
            _fail(row, f"{case.mask}: differs from {other} by {diff:.2g} > {both:.2g}")


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
            r.verdict + (f": {r.reason}" if r.reason else ""),
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
        f"{len(rows)} rows, {len(backends)} backends ({', '.join(backends)}): "
        + (f"{failed} FAILED" if failed else "all agree within tolerance")
    )
    return "\n".join(out)


def rows_as_json(rows: List[Row]) -> list:
    return [asdict(r) for r in rows]
