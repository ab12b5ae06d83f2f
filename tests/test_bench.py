"""The benchmark command runs and writes its table (timings themselves are never asserted)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

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
        [*cmd, "--no-memory", "--contended", "--runs", "3", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=_without_thread_settings(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    header = out.read_text().split("|", 1)[0]
    assert "L2 " in header and "per core" in header and "CPUs" in header
    assert "one CPU-bound busy process beside it (--contended)" in header
    assert "the median of 3 runs" in header
    assert "Thread settings: none of OMP_NUM_THREADS" in header and "waiting threads spin" in header
    assert [f"(run {i} of 3)" in result.stderr for i in (1, 2, 3)] == [True] * 3  # three workers
    per_run = out.read_text().split("multiattn / textbook in each run:", 1)[1]
    assert re.search(r"- numpy: toy \d+\.\d\dx, \d+\.\d\dx, \d+\.\d\dx$", per_run.strip()), per_run


def _without_thread_settings() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "MKL_", "KMP_"))}


def test_the_header_names_the_thread_settings_the_workers_ran_with(tmp_path):
    # beside a busy process OMP_WAIT_POLICY decides the ratios (docs/performance.md)
    out = tmp_path / "results.md"
    cmd = [sys.executable, str(RUN), "--backends", "numpy", "--sizes", "toy", "--min-time", "0.01"]
    env = _without_thread_settings()
    env.update(OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="2")
    result = subprocess.run(
        [*cmd, "--no-memory", "--out", str(out)], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Thread settings: OMP_NUM_THREADS=2, OMP_WAIT_POLICY=PASSIVE.\n" in out.read_text()


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


def _load(name: str):
    """benchmarks/<name>.py as a fresh module, leaving sys.path as it was (run.py extends it)."""
    path = list(sys.path)
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", RUN.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
    return module


def _mha_inputs(seed: int = 0, query_width: int = 5):
    """Small multi-head inputs (float64): key and value widths different, every length >= 1."""
    rng = np.random.default_rng(seed)
    B, Q, K, h, H = 3, 4, 6, 8, 2
    q, k, v = (rng.normal(size=(B, n, w)) for n, w in ((Q, query_width), (K, 7), (K, 3)))
    weights = [rng.normal(size=(h, w)) * 0.5 for w in (query_width, 7, 3, h)]
    lens = np.array([1, K, 3])
    return q, k, v, lens, weights, H


def _per_head_loop(q, k, v, lens, weights, H):
    """d2l 11.5 head by head: head i attends with columns i*d:(i+1)*d of the projections."""
    W_q, W_k, W_v, W_o = weights
    d = W_q.shape[0] // H
    heads = np.zeros((q.shape[0], q.shape[1], W_q.shape[0]))
    for b in range(q.shape[0]):
        for i in range(H):
            cols = slice(i * d, (i + 1) * d)
            qi, ki, vi = (x[b] @ W[cols].T for x, W in ((q, W_q), (k, W_k), (v, W_v)))
            scores = qi @ ki.T / np.sqrt(d)
            scores[:, lens[b] :] = -np.inf
            w = np.exp(scores - scores.max(-1, keepdims=True))
            heads[b][:, cols] = (w / w.sum(-1, keepdims=True)) @ vi
    return heads @ W_o.T


def test_numpy_textbook_multi_head_attention_is_d2l_head_by_head():
    q, k, v, lens, weights, H = _mha_inputs()
    impls = _load("textbook").implementations("numpy")
    out = impls["textbook_mha"](q, k, v, lens, *weights, num_heads=H)
    np.testing.assert_allclose(out, _per_head_loop(q, k, v, lens, weights, H), rtol=1e-6, atol=1e-9)
    # the floor: the same heads, no lengths at all
    floor = impls["floor_mha"](q, k, v, lens, *weights, num_heads=H)
    full = np.full_like(lens, k.shape[1])
    np.testing.assert_allclose(floor, _per_head_loop(q, k, v, full, weights, H), rtol=1e-6, atol=1e-9)
    assert not np.allclose(floor, out)  # the lengths mask something here


@pytest.mark.backend("torch")
def test_textbook_multi_head_attention_equals_torch_multihead_attention():
    import torch

    q, k, v, lens, weights, H = _mha_inputs(1, query_width=8)  # the layer's queries are embed_dim wide
    h = weights[0].shape[0]
    layer = torch.nn.MultiheadAttention(h, H, bias=False, batch_first=True, kdim=7, vdim=3)
    layer = layer.double().eval()
    with torch.no_grad():
        for name, W in zip(("q_proj_weight", "k_proj_weight", "v_proj_weight"), weights):
            getattr(layer, name).copy_(torch.from_numpy(W))
        layer.out_proj.weight.copy_(torch.from_numpy(weights[3]))
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        padding = torch.arange(k.shape[1])[None, :] >= torch.from_numpy(lens)[:, None]
        expected = layer(tq, tk, tv, key_padding_mask=padding, need_weights=False)[0].numpy()
        tw = [torch.from_numpy(W) for W in weights]
        ours = _load("textbook").implementations("torch")["textbook_mha"]
        torch_out = ours(tq, tk, tv, torch.from_numpy(lens), *tw, num_heads=H).numpy()
    numpy_out = _load("textbook").implementations("numpy")["textbook_mha"](
        q, k, v, lens, *weights, num_heads=H
    )
    np.testing.assert_allclose(numpy_out, expected, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(torch_out, expected, rtol=1e-6, atol=1e-9)


@pytest.mark.backend("torch")
def test_the_benchmarked_torch_layer_computes_the_textbook_multi_head_attention():
    import torch

    run = _load("run")
    rng = np.random.default_rng(2)
    h, lens = 16, torch.tensor([1, 6, 3])  # nn.MultiheadAttention's packed in_proj: every width h
    args = [torch.from_numpy(rng.normal(size=(3, n, h))).float() for n in (4, 6, 6)] + [lens]
    args += [torch.from_numpy(rng.normal(size=(h, h)) * 0.5).float() for _ in range(4)]
    layers = run._torch_layer(*args)
    assert set(layers) == {"torch-mha", "torch-mha-fast"}
    textbook = _load("textbook").implementations("torch")["textbook_mha"]
    with torch.no_grad():
        expected = textbook(*args, num_heads=run.NUM_HEADS).numpy()
        for name, fn in layers.items():
            np.testing.assert_allclose(fn(*args).numpy(), expected, rtol=1e-4, atol=1e-5, err_msg=name)


def test_the_table_shows_the_multihead_row_and_the_torch_layer_comparison():
    run = _load("run")
    assert "multihead" in run.SIZES and "multihead" not in run.MEMORY_SIZES
    times = {f"multihead/{impl}": t for impl, t in zip(run.IMPLS, (0.4, 0.2, 0.1, 0.05))}
    both = {
        "version": "1",
        "times": dict(times, **{"multihead/torch-mha": 0.5, "multihead/torch-mha-fast": 0.4}),
    }
    table = run.render({"numpy": {"version": "1", "times": times}, "torch": both}, ["multihead"])
    rows = [line for line in table.splitlines() if "| multihead |" in line]
    assert len(rows) == 3  # numpy and torch in the main table, torch alone against its layer
    assert "| 400.00 ms | 200.00 ms | 100.00 ms | 50.00 ms | 0.50x |" in rows[0]
    assert rows[2].startswith(
        "| torch 1 | multihead | 200.00 ms | 500.00 ms | 0.40x | 100.00 ms | 400.00 ms | 0.25x |"
    )
    assert "| multiattn | torch-mha | multiattn / torch-mha |" in table


def test_longseq_times_the_blocks_against_the_floor_and_reports_caps(tmp_path):
    out, raw = tmp_path / "longseq.md", tmp_path / "longseq.json"
    cmd = [sys.executable, str(RUN), "--backends", "numpy", "--sizes", "longseq", "--longseq-n", "256,512"]
    cmd += ["--longseq-max", "numpy=256", "--longseq-grad-n", "256", "--memory-runs", "1"]
    cmd += ["--longseq-calls", "1", "--out", str(out), "--json", str(raw)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    text = out.read_text()
    header = text.split("|", 1)[0]
    assert "long-sequence" in header and "L2 " in header and "Thread settings: " in header
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line for line in text.splitlines()}
    for case in ("plain", "causal", "lengths"):
        assert re.search(r"\| \d+\.\d ms ×1 \|", rows[("256", case)]), rows[("256", case)]
    assert "x floor |" in rows[("256", "plain")] and "x plain |" in rows[("256", "causal")]
    assert "(materialised" in rows[("256", "plain")]  # 256 x 256 scores fit: the default call keeps them
    assert "not run (cap numpy=256)" in rows[("512", "all")]
    assert "no autodiff" in rows[("256", "fwd+bwd")]
    assert "failed" not in text
    memory = rows[("256", "plain")].strip("|").split("|")[-3:]  # blocks, default, floor
    assert all(float(cell.split()[0]) >= 0 for cell in memory), memory
    assert '"plain/blocks"' in raw.read_text()


def test_longseq_table_ratios_sdpa_and_the_floor_that_does_not_fit():
    run = _load("run")
    longseq = _load("longseq")
    times = {"plain/blocks": 2.0, "causal/blocks": 1.0, "lengths/blocks": 0.5, "plain/default": 1.0}
    times.update({"causal/default": 0.5, "lengths/default": 0.25, "plain/sdpa": 1.0, "causal/sdpa": 0.5})
    times["lengths/sdpa"] = 0.25
    times.update({"window/blocks": 0.4, "window/default": 0.1})  # the mask's own block: default
    found = {
        "times": times,
        "calls": dict.fromkeys(times, 1),
        "paths": dict.fromkeys(times, "attend_by_flash_kernel"),
        "memory": {"plain/blocks": 10.0},
        "memory_worst": {"plain/blocks": 12.0},
    }
    grad_times = {"fwd+bwd/blocks": 6.0, "fwd+bwd/sdpa": 3.0}
    grad = {"times": grad_times, "calls": dict.fromkeys(grad_times, 1)}
    res = {"version": "1", "n": {65536: found, 131072: {"error": "killed"}}, "grad": {65536: grad}}
    table = longseq.render({"torch": res}, 12)
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line for line in table.splitlines()}
    plain = rows[("65536", "plain")]
    assert "| 2.00 s ×1 | - |" in plain and "does not fit" in plain  # no floor, so no ratio to it
    assert "1.00 s ×1 (attend_by_flash_kernel) | 0.50x |" in plain and "| 2.00x | 1.00x |" in plain
    assert "| 10.0 (worst 12.0) |" in plain
    assert "| 0.50x plain |" in rows[("65536", "causal")] and "| 0.25x plain |" in rows[("65536", "lengths")]
    assert "| 6.00 s ×1 | 3.00x forward |" in rows[("65536", "fwd+bwd")]
    assert "| 0.10x unmasked |" in rows[("65536", "window")]  # its default call to the unmasked one
    assert "failed: killed" in rows[("131072", "all")]
    assert "| SDPA | blocks / SDPA |" in table
    assert longseq.parse_sizes("16384,mlx=4096", "x") == ([16384], {"mlx": [4096]})
    assert longseq.parse_sizes("0", "x") == ([], {})
    assert run.LONGSEQ == "longseq"


def test_longseq_runs_alone():
    cmd = [sys.executable, str(RUN), "--sizes", "toy,longseq", "--out", os.devnull]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "runs alone" in result.stderr


def test_rounds_prints_each_ratio_within_rounds():
    backend = "numpy" if "numpy" in backends_under_test() else backends_under_test()[0]
    script = RUN.parent / "rounds.py"
    cmd = [sys.executable, str(script), backend, "--n", "256", "--rounds", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    for key in (
        "plain/blocks / plain/floor",
        "causal/blocks / plain/blocks",
        "window/default / plain/default",
    ):
        assert re.search(
            re.escape(key) + r": median \d+\.\d{3} \(range \d+\.\d{3}-\d+\.\d{3}\)", result.stdout
        )
