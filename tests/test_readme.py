"""The README's per-framework quick starts run, and print the books' output."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from multiattn import BACKENDS

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = {
    m.group(1): m.group(0)[len("```python\n") : -3]
    for m in re.finditer(r"```python\n# backend: (\w+).*?```", README.read_text(), re.S)
}


def test_every_backend_has_a_quick_start():
    assert sorted(BLOCKS) == sorted(BACKENDS)


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
