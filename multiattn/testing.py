"""Check your own attention code in your own test suite, against multiattn's float64 reference.

    from multiattn.testing import assert_matches_reference

    def test_my_attention():
        assert_matches_reference(my_attention, kind="dot_product", backend="torch")

The function runs through the battery of ``multiattn check`` for its kind (lengths, masks,
every dtype the framework runs, gradients where it has autodiff), in this process.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional

from .check.against import cases_for, run_function
from .check.table import Row, build_rows, render

__all__ = ["assert_matches_reference"]


def assert_matches_reference(
    fn: Callable,
    *,
    kind: str,
    backend: str,
    dtypes: Optional[Iterable[str]] = None,
    skip_fully_masked: bool = False,
    seed: int = 0,
    tolerance: Optional[Dict[str, float]] = None,
) -> List[Row]:
    """AssertionError, with the failing rows of the table as its message, unless ``fn`` agrees
    with the reference on every case it takes; returns the rows otherwise.

    kind: ``masked_softmax``, ``dot_product``, ``additive`` or ``multi_head``; fn takes the
    arguments of multiattn's functional form of that kind (``fn(X, valid_lens)``,
    ``fn(queries, keys, values, valid_lens)``, ``..., *, W_q, W_k, w_v``, ``..., *, weights,
    num_heads``) and ``attention_mask=``/``causal=`` if it can (else those cases are left out,
    and the rows say so).  dtypes: a subset of the framework's (default: all it runs).
    skip_fully_masked: do not judge rows where nothing is visible (d2l leaves them uniform).
    tolerance: dtype -> max abs error, overriding the defaults."""
    dtypes = None if dtypes is None else list(dtypes)
    label = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    result = run_function(fn, kind, backend, seed, dtypes, skip_fully_masked)
    rows = build_rows(
        {label: {**result, "backend": backend}}, cases_for(kind, seed, skip_fully_masked), tolerance, (kind,)
    )
    rows = [r for r in rows if dtypes is None or r.dtype in dtypes]
    failed = [r for r in rows if r.verdict == "FAIL"]
    if failed:
        raise AssertionError(f"{label} does not match the reference ({kind} on {backend}):\n{render(failed)}")
    if not any(r.verdict == "ok" for r in rows):
        raise AssertionError(f"{label}: no case could run ({kind} on {backend}):\n{render(rows)}")
    return rows
