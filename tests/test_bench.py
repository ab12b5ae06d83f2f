"""The benchmark command runs and writes its table (timings themselves are never asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .conftest import backends_under_test

RUN = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"


def test_benchmark_suite_writes_its_table(tmp_path):
    backend = backends_under_test()[0]
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
