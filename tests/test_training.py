"""docs/training.md's training loops run, one per framework with layers, and their loss falls."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

TRAINING = Path(__file__).resolve().parent.parent / "docs" / "training.md"
BLOCKS = {
    m.group(1): m.group(0)[len("```python\n") : -3]
    for m in re.finditer(r"```python\n# backend: (\w+).*?```", TRAINING.read_text(), re.S)
}


def test_the_training_loop_learns(bk):
    if bk.name not in BLOCKS:  # numpy has no autodiff, the Array API no layers
        assert bk.module.vjp is None or not bk.has_layers, f"{bk.name} trains: docs/training.md lacks it"
        return
    result = subprocess.run(
        [sys.executable, "-c", BLOCKS[bk.name]], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [(int(s), float(x)) for s, x in re.findall(r"step +(\d+) +loss (\d+\.\d+)", result.stdout)]
    assert [s for s, _ in steps] == [1, 10, 20, 30, 40, 50], result.stdout
    losses = [x for _, x in steps]
    assert losses[0] > 1.9 and losses[-1] < 0.7, result.stdout  # from about ln 8 to well below
    assert losses[-1] < losses[2] < losses[0], result.stdout


DOCS = TRAINING.parent


def test_the_numpy_examples_of_mods_and_usage_run_and_print_what_their_comments_say():
    blocks = [
        block
        for page in ("mods.md", "usage.md")
        for block in re.findall(r"```python\n(# backend: numpy.*?)```", (DOCS / page).read_text(), re.S)
    ]
    assert len(blocks) == 3
    for block in blocks:
        result = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        wanted = re.findall(r"print\(.*\)\s+# (.*)", block)
        assert result.stdout.split("\n")[: len(wanted)] == wanted, result.stdout
