"""``multiattn check``: every backend against a float64 reference and against each other.

Its modules, each importing only modules named before it (no import cycle, function-local
imports included: tests/test_package_layout.py):
``results`` (the result files and framework versions, a leaf), ``cases`` (the battery and its
reference), ``table`` (check's rows), ``against`` (a user's function through the battery),
``native_wrappers`` (each framework's own attention as such a function), ``native`` (running and
judging those), ``native_report`` (their tables and docs/native-attention.md), ``worker`` (one
backend in a subprocess), and this package: the subprocesses, and `check --json`'s files."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
from typing import Callable, Dict, List, Optional

from .._registry import BACKENDS
from . import worker
from .cases import make_cases
from .results import load_json, load_native, load_results, write_json
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


def _run_isolated(
    name: str,
    seed: int,
    timeout: float,
    against: Optional[List[str]] = None,
    progress: Optional[Callable[[int, int], None]] = None,
) -> dict:
    """One worker subprocess; ``against``: [SPEC, KIND, DTYPES or "-", flags...] for `--against`;
    progress(cases done, cases) as the worker reports them."""
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile("w+") as errors:
        out = os.path.join(tmp, f"{name}.npz")
        if against:
            cmd = [*WORKER_COMMAND, "--against", against[0], against[1], name, str(seed), out, *against[2:]]
        else:
            cmd = [*WORKER_COMMAND, name, str(seed), out]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:  # the worker's "progress DONE TOTAL" lines
                words = line.split()
                if progress and len(words) == 3 and words[0] == "progress":
                    progress(int(words[1]), int(words[2]))
            proc.wait()
        finally:
            timed_out = not timer.is_alive()
            timer.cancel()
        if timed_out and proc.returncode != 0:
            return {"version": "?", "status": f"failed: no result within {timeout:.0f} s", "cases": {}}
        if proc.returncode != 0 or not os.path.exists(out):
            errors.seek(0)
            tail = (errors.read().strip().splitlines() or ["no output"])[-1]
            how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
            if proc.returncode == -11:
                how += " (segmentation fault)"
            return {"version": "?", "status": f"failed: worker {how}: {tail}", "cases": {}}
        return load_results(out)


def run_check(
    backends: List[str],
    seed: int = 0,
    in_process: bool = False,
    progress: Optional[Callable[..., None]] = None,
    timeout: float = 600.0,
) -> Dict[str, dict]:
    """Results of every backend: each in its own subprocess unless in_process.  progress(message,
    in_place=False): a line to show; in_place, one that the next replaces (the rows done)."""
    results = {}
    n_rows = len(rows_of(make_cases(seed)))
    for i, name in enumerate(backends, 1):
        prefix = f"[{i}/{len(backends)}] {name}"

        shown = [-1]

        def rows_done(done: int, total: int, prefix: str = prefix, shown: list = shown) -> None:
            rows = done * n_rows // total
            if progress and rows != shown[0]:
                shown[0] = rows
                progress(f"{prefix}: {rows}/{n_rows} rows", in_place=True)

        if progress:
            progress(f"{prefix}: importing and running its {n_rows} rows ...")
        if in_process:
            try:
                results[name] = worker.run_backend(name, seed, rows_done)
            except Exception as err:
                results[name] = {
                    "version": "?",
                    "status": f"failed: {type(err).__name__}: {err}",
                    "cases": {},
                }
        else:
            results[name] = _run_isolated(name, seed, timeout, progress=rows_done)
        if progress:
            progress(f"{prefix}: {results[name]['status']}")
    return results


def rows_of(cases: list) -> set:
    """The table's rows a battery fills, one per function and dtype."""
    return {(case.function, case.dtype) for case in cases}


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
    from .native_wrappers import FRAMEWORKS

    frameworks = [name for name in backends if name in FRAMEWORKS]
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
                got = load_native(out)
            else:  # a crash (a segfault) is that framework's one failed row, never a dead command
                got = {name: {"version": "?", "status": failed, "cases": {}, "backend": name}}
        results.update(got)
        if progress:
            statuses = sorted({r["status"] for r in got.values()})
            progress(f"[{i}/{len(frameworks)}] {name}: {len(got)} implementations, {', '.join(statuses)}")
    return results


def save_json(
    path: str, results: Dict[str, dict], rows: List[Row], seed: int, native: bool = False,
    not_importable: Optional[Dict[str, str]] = None,
) -> None:  # fmt: skip
    """The results and rows of `check --json` (native: of `check --native --json`, with the
    implementations that could not be imported, {label: why}); ``load_json`` reads them back."""
    from .. import __version__

    write_json(path, __version__, results, rows_as_json(rows), seed, native, not_importable)
