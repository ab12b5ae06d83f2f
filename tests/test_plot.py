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
def test_demo_prints_the_books_outputs_and_saves_the_heatmap(bk, tmp_path, capsys, monkeypatch):
    from matplotlib.figure import Figure

    saved = []
    real_savefig = Figure.savefig
    monkeypatch.setattr(
        Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), real_savefig(fig, *a, **k))
    )
    path = tmp_path / "weights.png"
    assert cli.main(["demo", "--backend", bk.name, "--out", str(path)]) == 0
    out = capsys.readouterr().out
    assert "matches the books' output [[[2,3,4,5]],[[10,11,12,13]]]: yes" in out
    width, height = png_size(path)
    assert width > 2 * height  # two panels of 2 x 10 cells, side by side, sized to them
    (fig,) = saved
    assert bk.name in fig.get_suptitle()
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["AdditiveAttention", "DotProductAttention"]
    rows = [label.get_text() for label in panels[0].get_yticklabels()]
    assert rows == ["sequence 0 (valid_len 2)", "sequence 1 (valid_len 6)"]
    keys = [label.get_text() for label in panels[0].get_xticklabels()]
    assert keys and all(text.lstrip("\u2212-").isdigit() for text in keys), keys  # integer ticks


def test_show_heatmaps_ticks_are_integers_and_figures_fit_their_panels():
    fig = show_heatmaps(np.random.default_rng(1).uniform(size=(1, 2, 3, 7)), "Keys", "Queries")
    fig.canvas.draw()
    for labels in (fig.axes[0].get_xticklabels(), fig.axes[0].get_yticklabels()):
        texts = [t.get_text() for t in labels if t.get_text()]
        assert texts and all(t.lstrip("\u2212-").isdigit() for t in texts), texts
    width, height = fig.get_size_inches()
    assert 6 < width < 10 and 2 < height < 4
