"""Ring attention across processes (multiattn.distributed): torch over gloo in 2 and 3 spawned
processes, jax over 4 CPU devices in shard_map; each against the single-process call and the
float64 reference (tests/ring_worker.py runs them, each rank writing what it found)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("ring_worker.py")
# forward and gradients equal to the single-process call in float64
EXACT = 1e-12


def _run(tmp_path, *args, timeout=300):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, str(WORKER), *args, str(tmp_path)], capture_output=True, text=True, timeout=timeout,
        env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {path.stem: json.loads(path.read_text()) for path in tmp_path.glob("*.json")}


def _check_cases(found, expected_cases):
    for where, rows in found.items():
        assert set(rows) == expected_cases, where
        for case, row in rows.items():
            assert max(row["errors"]) <= EXACT, (where, case, row)
            assert row["finite"], (where, case)
            assert row.get("reference", 0.0) <= 1e-12, (where, case, row)
            assert row.get("zero_rows", 0.0) == 0.0, (where, case, row)


TORCH_CASES = {
    f"{name}/{layout}"
    for name in (
        "none",
        "causal",
        "lengths",
        "nothing_visible",
        "sliding_window",
        "document",
        "alibi",
        "softcap",
    )
    for layout in ("contiguous", "zigzag")
} | {"three_d/contiguous"}


@pytest.mark.backend("torch")
@pytest.mark.parametrize("world", [2, 3])
def test_torch_ring_equals_the_single_process_call(tmp_path, world):
    found = _run(tmp_path, "torch", str(world))
    assert sorted(found) == [f"torch_{world}_{rank}" for rank in range(world)]
    _check_cases(found, TORCH_CASES)


@pytest.mark.backend("jax")
def test_jax_ring_in_shard_map_equals_the_single_process_call(tmp_path):
    found = _run(tmp_path, "jax", timeout=600)
    _check_cases(found, {
        "none/contiguous", "causal/zigzag", "causal+lengths/contiguous", "sliding_window+alibi/zigzag",
        "document+softcap/contiguous",
    })  # fmt: skip


@pytest.mark.backend("torch")
@pytest.mark.parametrize(
    "kind, error, says",
    [
        ("zigzag_unequal", "ValueError", "same even number of positions"),
        ("mismatch", "ValueError", "ranks [1] differ from rank 0"),
        ("alone", "ValueError", "at least 2 ranks"),
        ("dead", "RuntimeError", "failed or timed out"),
        ("absent", "RuntimeError", "failed or timed out"),
    ],
)
def test_torch_misuse_and_faults_raise_on_every_rank_within_the_timeout(tmp_path, kind, error, says):
    found = _run(tmp_path, "fault", kind)
    alive = {"dead": 1, "absent": 1}.get(kind, {"alone": 1}.get(kind, 2))
    assert len(found) == alive, found
    for rank, result in found.items():
        assert result["raised"] and result["raised"].startswith(error) and says in result["raised"], (
            rank,
            result,
        )
        assert result["seconds"] < 3 + 5, (rank, result)  # the timeout (3 s) and some slack, never a hang


@pytest.mark.backend("jax")
def test_jax_ring_misuse_raises():
    import jax.numpy as jnp

    from multiattn.distributed import ring_attention, shard, unshard

    x = jnp.zeros((1, 2, 6, 4))
    with pytest.raises(ValueError, match="axis_name"):
        ring_attention(x, x, x)
    with pytest.raises(ValueError, match="layout must be one of"):
        ring_attention(x, x, x, axis_name="sp", layout="ring")
    with pytest.raises(ValueError, match="a multiple of 4"):
        shard(x, 0, 2, "zigzag")
    parts = [shard(jnp.arange(12.0).reshape(1, 12, 1), r, 3, "zigzag") for r in range(3)]
    assert unshard(parts, "zigzag")[0, :, 0].tolist() == list(range(12))


def _doc_examples():
    """docs/distributed.md's python blocks: (torch's torchrun script, jax's example)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "distributed.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    return [b for b in blocks if "init_process_group" in b][0], [b for b in blocks if "shard_map" in b][0]


@pytest.mark.backend("torch")
def test_the_torchrun_example_runs_as_written(tmp_path):
    script = tmp_path / "ring_step.py"
    script.write_text(_doc_examples()[0])
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    shapes = "(1, 8, 1024, 64) (1, 2, 1024, 64)"  # each rank's line; the two ranks' writes may interleave
    assert done.stdout.count(shapes) == 2, done.stdout
    assert sorted(re.findall(r"[01]", done.stdout.replace(shapes, ""))) == ["0", "1"], done.stdout


@pytest.mark.backend("jax")
def test_the_shard_map_example_prints_what_its_comment_says(tmp_path):
    example = _doc_examples()[1]
    script = tmp_path / "ring_jax.py"
    script.write_text(example)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = example.split("print(")[-1].split("# ")[1].strip()
    assert done.stdout.strip().splitlines()[-1] == said
