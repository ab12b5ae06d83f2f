"""The benchmark command runs and writes its table (timings themselves are never asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .conftest import backends_under_test

RUN = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"


def test_benchmark_suite_writes_its_table(tmp_path):
    # array_api has no textbook (d2l has no Array API version): numpy stands in for it
    backend = next((name for name in backends_under_test() if name != "array_api"), "numpy")
    out = tmp_path / "results.md"
    cmd = [
        sys.executable,
        str(RUN),
        "--backends",
        backend,
        "--sizes",
        "toy",
        "--min-time",
        "0.01",
        "--no-memory",
    ]
    result = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    table = out.read_text()
    assert "| textbook | multiattn |" in table and f"| {backend} " in table and "| toy |" in table
    assert "failed" not in table


def test_the_suite_names_the_machine_and_can_run_contended(tmp_path):
    out = tmp_path / "results.md"
    cmd = [sys.executable, str(RUN), "--backends", "numpy", "--sizes", "toy", "--min-time", "0.01"]
    result = subprocess.run(
        [*cmd, "--no-memory", "--contended", "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    header = out.read_text().split("|", 1)[0]
    assert "L2 " in header and "per core" in header and "CPUs" in header
    assert "one CPU-bound busy process beside it (--contended)" in header


def test_memory_in_several_fresh_processes_under_the_default_malloc(tmp_path):
    out = tmp_path / "results.md"
    cmd = [sys.executable, str(RUN), "--backends", "numpy", "--sizes", "additive", "--min-time", "0.01"]
    cmd += ["--memory-runs", "2", "--default-malloc", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    text = out.read_text()
    assert "for memory: glibc's default malloc, 2 fresh process(es), median (worst)" in text
    row = next(line for line in text.splitlines() if line.startswith("| numpy") and "| additive |" in line)
    textbook, multiattn, ratio = (cell.strip() for cell in row.strip("|").split("|")[-3:])
    assert float(textbook.split()[0]) > float(multiattn.split()[0]) > 0 and ratio.endswith("x")
