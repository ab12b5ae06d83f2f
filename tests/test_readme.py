"""The README's per-framework quick starts run, and print the books' output."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from multiattn import BACKENDS

README = Path(__file__).resolve().parent.parent / "README.md"
MULTI_HEAD = README.parent / "docs" / "multihead.md"


def _blocks(path: Path) -> dict:
    return {
        m.group(1): m.group(0)[len("```python\n") : -3]
        for m in re.finditer(r"```python\n# backend: (\w+).*?```", path.read_text(), re.S)
    }


BLOCKS, MULTI_HEAD_BLOCKS = _blocks(README), _blocks(MULTI_HEAD)


def test_every_backend_has_a_quick_start():
    assert sorted(BLOCKS) == sorted(BACKENDS)
    assert sorted(MULTI_HEAD_BLOCKS) == sorted(BACKENDS)


def _numbers(text: str) -> list:
    return [round(float(x), 3) for x in re.findall(r"-?\d+(?:\.\d*)?(?:e[-+]?\d+)?", text)]


def test_multi_head_quick_start_runs(bk):
    """Each framework's multi-head quick start prints the book's output, twice (lengths, then
    the same as a boolean mask; array_api: then causal), and the weights' shape."""
    result = subprocess.run(
        [sys.executable, "-c", MULTI_HEAD_BLOCKS[bk.name]], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout.split("[[[")
    assert _numbers(printed[1])[:8] == [2, 3, 4, 5, 10, 11, 12, 13], result.stdout
    if bk.name == "array_api":
        assert _numbers(printed[2])[:8] == [0, 1, 2, 3, 0, 1, 2, 3], result.stdout
        return
    assert "(2, 2, 1, 10)" in result.stdout or "[2, 2, 1, 10]" in result.stdout, result.stdout
    assert _numbers(printed[2])[:8] == [2, 3, 4, 5, 10, 11, 12, 13], result.stdout


def test_quick_start_runs(bk):
    result = subprocess.run(
        [sys.executable, "-c", BLOCKS[bk.name]], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout[result.stdout.index("[[[") :]
    numbers = re.findall(r"-?\d+(?:\.\d*)?(?:e[-+]?\d+)?", printed)
    first = [round(float(x), 3) for x in numbers[:8]]
    assert first == [2, 3, 4, 5, 10, 11, 12, 13], result.stdout


def test_readme_is_short_and_its_links_exist():
    text = README.read_text()
    assert len(text) <= 12_000, f"README.md has {len(text)} characters; move detail to docs/"
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links, "README.md links no docs"
    missing = [link for link in links if "://" not in link and not (README.parent / link).exists()]
    assert missing == []


def test_doc_pages_link_to_pages_that_exist():
    for page in (README.parent / "docs").glob("*.md"):
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in link:
                assert (page.parent / link).exists(), f"{page.name} links {link}, which does not exist"


SAMPLE = re.search(r"```text\n(backend .*?)```", README.read_text(), re.S).group(1).strip().splitlines()


def _cells(line: str) -> list:
    return re.split(r"\s{2,}", line.strip(), maxsplit=6)


def _close(sample: str, real: str) -> bool:
    """The same cell: equal, or numbers within a factor 10 (other CPUs round differently)."""
    if sample == real:
        return True
    numbers = [re.match(r"\d[0-9.]*e[+-]\d+", text) for text in (sample, real)]
    if not all(numbers):
        return False
    a, b = (float(n.group(0)) for n in numbers)
    return (a == b == 0) or (a > 0 and b > 0 and 0.1 <= a / b <= 10)


@pytest.mark.shared
def test_the_readme_sample_is_what_check_prints(bk):
    """Each sample row of a backend under test against a real run of its cases; the summary line
    against the run of every backend it names, where all of them are under test (in `tox`'s
    `all` env the run of `multiattn check --json` just before, MULTIATTN_CHECK_JSON: not twice)."""
    from multiattn.check import build_rows, load_json, render, run_check
    from multiattn.check.cases import make_cases

    from .conftest import backends_under_test

    named = re.search(r"backends \((.*)\)", SAMPLE[-1]).group(1).split(", ")
    everyone = sorted(named) == sorted(backends_under_test())
    if bk.name != backends_under_test()[0]:
        return  # one run: of its own backend, or of every one where all are under test
    names = named if everyone else [bk.name]
    ran = os.environ.get("MULTIATTN_CHECK_JSON") if everyone else None
    results, seed, _ = load_json([ran]) if ran else (run_check(names, in_process=True), 0, None)
    assert sorted(results) == sorted(names)
    table = render(build_rows(results, make_cases(seed))).splitlines()
    assert _cells(table[0]) == _cells(SAMPLE[0])  # column widths follow the backends' names
    real = {tuple(_cells(line)[:3]): _cells(line) for line in table[2:] if line.strip()}
    for line in SAMPLE[2:-1]:
        if line == "..." or _cells(line)[0] not in names:
            continue
        want = _cells(line)
        got = real[tuple(want[:3])]
        if not everyone:  # alone in its environment, a backend has no others to compare with
            want, got = want[:4] + want[5:], got[:4] + got[5:]
        assert len(got) == len(want) and all(_close(w, g) for w, g in zip(want, got)), (want, got)
    if everyone:
        assert table[:2] == SAMPLE[:2] and table[-1] == SAMPLE[-1]


LONG_SEQUENCES = README.parent / "docs" / "long-sequences.md"


def test_the_long_sequences_examples_print_what_their_comments_say():
    """docs/long-sequences.md's examples (numpy) run; each print's comment is its output."""
    blocks = re.findall(r"```python\n(.*?)```", LONG_SEQUENCES.read_text(), re.S)
    assert len(blocks) == 3
    for block in blocks:
        result = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        said = [line.split("# ", 1)[1] for line in block.splitlines() if line.startswith("print(")]
        assert result.stdout.splitlines() == said


DECODING = README.parent / "docs" / "decoding.md"


def test_the_decoding_examples_print_what_their_comments_say():
    """docs/decoding.md's examples run; each print's comment is its output (each framework's
    where it is installed: every one is in some CI environment)."""
    blocks = re.findall(r"```python\n(.*?)```", DECODING.read_text(), re.S)
    assert len(blocks) == 10
    for block in blocks:
        needs = re.findall(r"^(?:import|from) (\w+)", block, re.M)
        if any(importlib.util.find_spec(name) is None for name in needs):
            continue  # an environment without it runs the others
        result = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        said = [line.split("# ", 1)[1] for line in block.splitlines() if line.startswith("print(")]
        assert result.stdout.splitlines() == said
