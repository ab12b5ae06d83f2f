"""Heatmaps: show_heatmaps and `multiattn demo` write valid PNGs of the expected size."""

from __future__ import annotations

import struct

import matplotlib
import numpy as np
import pytest

from multiattn import cli

matplotlib.use("Agg")  # no display: render to files only

from multiattn.plot import show_heatmaps  # noqa: E402


def png_size(path) -> tuple:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_show_heatmaps_renders_a_png_of_the_requested_size(bk, tmp_path):
    weights = bk.tensor(np.random.default_rng(0).uniform(size=(2, 3, 4, 10)), "float32")
    fig = show_heatmaps(weights, xlabel="Keys", ylabel="Queries", titles=["a", "b", "c"], figsize=(6, 4))
    path = tmp_path / "w.png"
    fig.savefig(path, dpi=50)
    assert png_size(path) == (300, 200)
    assert path.stat().st_size > 1000


def test_show_heatmaps_checks_its_input():
    with pytest.raises(
        ValueError, match=r"matrices must be 4-D \(rows, cols, queries, keys\), got shape \(2, 10\)"
    ):
        show_heatmaps(np.zeros((2, 10)), "Keys", "Queries")
    with pytest.raises(ValueError, match="titles must have one entry per column"):
        show_heatmaps(np.zeros((1, 2, 2, 10)), "Keys", "Queries", titles=["only one"])


@pytest.mark.layers
def test_demo_prints_the_books_outputs_and_saves_the_heatmap(bk, tmp_path, capsys):
    path = tmp_path / "weights.png"
    assert cli.main(["demo", "--backend", bk.name, "--out", str(path)]) == 0
    out = capsys.readouterr().out
    assert "matches the books' output [[[2,3,4,5]],[[10,11,12,13]]]: yes" in out
    assert png_size(path) == (600, 250)
