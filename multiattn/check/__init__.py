"""``multiattn check``: every backend against a float64 reference and against each other."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from typing import Callable, Dict, List, Optional

import numpy as np

from .._registry import BACKENDS
from . import worker
from .cases import make_cases
from .table import Row, build_rows, render, rows_as_json

__all__ = [
    "installed_backends", "run_check", "run_against", "run_native", "load_json", "save_json", "build_rows",
    "render", "Row",
]  # fmt: skip


def installed_backends() -> List[str]:
    """Backends whose framework is installed, found without importing any of them."""
    return [
        name
        for name, (framework, _, _) in BACKENDS.items()
        if importlib.util.find_spec(framework.split(".")[0]) is not None
    ]


# The worker process: a fresh interpreter per backend, so frameworks never share a process.
WORKER_COMMAND = [sys.executable, "-m", "multiattn.check.worker"]


def _run_isolated(name: str, seed: int, timeout: float, against: Optional[List[str]] = None) -> dict:
    """One worker subprocess; ``against``: [SPEC, KIND, DTYPES or "-", flags...] for `--against`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"{name}.npz")
        if against:
            cmd = [*WORKER_COMMAND, "--against", against[0], against[1], name, str(seed), out, *against[2:]]
        else:
            cmd = [*WORKER_COMMAND, name, str(seed), out]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"version": "?", "status": f"failed: no result within {timeout:.0f} s", "cases": {}}
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
            if proc.returncode == -11:
                how += " (segmentation fault)"
            return {"version": "?", "status": f"failed: worker {how}: {tail}", "cases": {}}
        return worker.load(out)


def run_check(
    backends: List[str],
    seed: int = 0,
    in_process: bool = False,
    progress: Optional[Callable[[str], None]] = None,
    timeout: float = 600.0,
) -> Dict[str, dict]:
    """Results of every backend: each in its own subprocess unless in_process."""
    results = {}
    for i, name in enumerate(backends, 1):
        if progress:
            progress(f"[{i}/{len(backends)}] {name}: importing and running {len(make_cases(seed))} cases ...")
        if in_process:
            try:
                results[name] = worker.run_backend(name, seed)
            except Exception as err:
                results[name] = {
                    "version": "?",
                    "status": f"failed: {type(err).__name__}: {err}",
                    "cases": {},
                }
        else:
            results[name] = _run_isolated(name, seed, timeout)
        if progress:
            progress(f"[{i}/{len(backends)}] {name}: {results[name]['status']}")
    return results


def run_against(
    spec: str,
    kind: str,
    backend: str,
    seed: int = 0,
    dtypes: Optional[List[str]] = None,
    skip_fully_masked: bool = False,
    timeout: float = 600.0,
) -> dict:
    """The results of the user's function SPEC (MODULE:FUNCTION) on one backend, in a subprocess
    (``check.against``); status ``usage: ...`` where it cannot be checked as asked."""
    flags = [",".join(dtypes) if dtypes else "-"] + (["--skip-fully-masked"] if skip_fully_masked else [])
    return _run_isolated(backend, seed, timeout, against=[spec, kind, *flags])


def run_native(
    backends: List[str],
    seed: int = 0,
    progress: Optional[Callable[[str], None]] = None,
    timeout: float = 600.0,
) -> Dict[str, dict]:
    """Each framework's own attention (``check.native``), a subprocess per framework:
    {implementation label: results}; a backend without native attention (numpy) is left out."""
    from . import native

    frameworks = [name for name in backends if name in native.FRAMEWORKS]
    results: Dict[str, dict] = {}
    for i, name in enumerate(frameworks, 1):
        if progress:
            progress(f"[{i}/{len(frameworks)}] {name}: its own attention through the battery ...")
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "native")
            cmd = [*WORKER_COMMAND, "--native", name, str(seed), out]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                failed = f"failed: no result within {timeout:.0f} s"
            else:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                failed = f"failed: worker exit {proc.returncode}: {tail}"
            if os.path.exists(os.path.join(out, "index.json")):
                got = native.load(out)
            else:  # a crash (a segfault) is that framework's one failed row, never a dead command
                got = {name: {"version": "?", "status": failed, "cases": {}, "backend": name}}
        results.update(got)
        if progress:
            statuses = sorted({r["status"] for r in got.values()})
            progress(f"[{i}/{len(frameworks)}] {name}: {len(got)} implementations, {', '.join(statuses)}")
    return results


def _to_lists(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _to_lists(v) for k, v in value.items()}
    return value


def _to_arrays(case: dict) -> dict:
    out = dict(case)
    for key in ("out", "weights", "fast"):
        if key in out:
            out[key] = np.asarray(out[key], dtype=np.float64)
    if "grads" in out:
        out["grads"] = {k: np.asarray(v, dtype=np.float64) for k, v in out["grads"].items()}
    return out


def save_json(
    path: str, results: Dict[str, dict], rows: List[Row], seed: int, native: bool = False,
    not_importable: Optional[Dict[str, str]] = None,
) -> None:  # fmt: skip
    """The results and rows of `check --json` (native: of `check --native --json`, with the
    implementations that could not be imported, {label: why})."""
    from .. import __version__

    doc = {"multiattn": __version__, "seed": seed, "native": native, "backends": _to_lists(results)}
    if native:
        doc["not_importable"] = dict(not_importable or {})
    doc["rows"] = rows_as_json(rows)
    with open(path, "w") as f:
        json.dump(doc, f)


def load_json(paths: List[str]) -> tuple:
    """(merged results, seed, native) of several `check --json` files, or of several `check
    --native --json` files (native True); their seeds must agree, and the kinds must not mix.

    A backend found in more than one file keeps every one of its results, each labelled with
    its file (``numpy [check-mxnet]``): never a silent choice of one.  A native implementation
    that no file could import is among the results with the status ``absent: why``
    (``native.split_absent``)."""
    loaded: List[tuple] = []
    not_importable: Dict[str, str] = {}
    seed = native = None
    for path in paths:
        with open(path) as f:
            try:
                doc = json.load(f)
                doc_seed, backends = doc["seed"], doc["backends"]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(
                    f"{path} is not a file written by `multiattn check --json` ({err})"
                ) from None
        if seed is not None and doc_seed != seed:
            raise ValueError(f"{path} was made with seed {doc_seed}, the others with seed {seed}")
        doc_native = bool(doc.get("native", False))
        if native is not None and doc_native != native:
            kinds = ("`check --json`", "`check --native --json`")
            raise ValueError(
                f"{path} is from {kinds[doc_native]}, the others from {kinds[native]}: "
                "report merges files of one kind"
            )
        seed, native = doc_seed, doc_native
        for name, res in backends.items():
            res["cases"] = {c: _to_arrays(r) for c, r in res["cases"].items()}
            loaded.append((name, os.path.splitext(os.path.basename(path))[0], res))
        for label, why in (doc.get("not_importable") or {}).items():
            not_importable.setdefault(label, why)
    counts = Counter(name for name, _, _ in loaded)
    merged: Dict[str, dict] = {}
    for name, source, res in loaded:
        merged[f"{name} [{source}]" if counts[name] > 1 else name] = {**res, "backend": name}
    for label, why in not_importable.items():
        if label not in counts:  # imported by none of the files
            merged[label] = {"version": "?", "status": f"absent: {why}", "cases": {}, "backend": label}
    return merged, seed, bool(native)
