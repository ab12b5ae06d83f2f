"""The `multiattn` command line: check, report, demo."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import multiattn.check
import multiattn.core
import multiattn.specialise
from multiattn import cli
from multiattn import reference as lib_reference
from multiattn.backends import numpy as numpy_backend

from . import reference as ref
from .conftest import backends_under_test
from .test_gradients import MASKS, _inputs, finite_differences


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "multiattn", *args], capture_output=True, text=True)


def test_check_passes_on_the_backends_under_test(tmp_path):  # all env: its `multiattn check` command
    backends = ",".join(backends_under_test())
    result = run_cli("check", "--backends", backends, "--json", str(tmp_path / "out.json"))
    assert result.returncode == 0, result.stdout + result.stderr
    for name in backends_under_test():
        assert f"\n{name} " in result.stdout
    assert "all agree within tolerance" in result.stdout
    assert "[1/" in result.stderr  # progress while frameworks import
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["seed"] == 0 and set(doc["backends"]) == set(backends_under_test())
    assert all(row["verdict"] in ("ok", "n/a") for row in doc["rows"])


def test_a_disagreeing_backend_fails_the_check(monkeypatch, capsys):
    # a wrong primitive: every additive score is off by 1%
    monkeypatch.setattr(numpy_backend.ops, "tanh", lambda x: np.tanh(x) * 1.01)
    code = cli.main(["check", "--backends", "numpy", "--in-process"])
    out = capsys.readouterr().out
    assert code == 1
    additive = [line for line in out.splitlines() if line.startswith("numpy") and "additive float" in line]
    assert additive and all("FAIL" in line and "from the reference" in line for line in additive)
    softmax = [line for line in out.splitlines() if "masked_softmax float32" in line]
    assert softmax and "FAIL: softcap: output" in softmax[0]  # only its case that soft-caps by tanh
    assert "FAILED" in out


def test_a_crashing_backend_is_a_failed_row_not_a_dead_command(monkeypatch, capsys):
    segfault = [sys.executable, "-c", "import ctypes; ctypes.string_at(0)"]
    monkeypatch.setattr(multiattn.check, "WORKER_COMMAND", segfault)
    code = cli.main(["check", "--backends", "numpy"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL: failed: worker killed by signal 11 (segmentation fault)" in out


def test_report_merges_environments(tmp_path, capsys):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    assert cli.main(["check", "--backends", "numpy", "--in-process", "--json", str(first)]) == 0
    doc = json.loads(first.read_text())
    doc["backends"]["other-env"] = doc["backends"].pop("numpy")  # as if from a second environment
    second.write_text(json.dumps(doc))
    capsys.readouterr()
    assert cli.main(["report", str(first), str(second)]) == 0
    out = capsys.readouterr().out
    assert "(other-env)" in out and "(numpy)" in out and "2 backends" in out


def test_report_refuses_different_seeds(tmp_path, capsys):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    cli.main(["check", "--backends", "numpy", "--in-process", "--json", str(first)])
    cli.main(["check", "--backends", "numpy", "--in-process", "--seed", "3", "--json", str(second)])
    capsys.readouterr()
    assert cli.main(["report", str(first), str(second)]) == 2
    assert "seed 3" in capsys.readouterr().err


def test_tolerance_override_can_fail_a_row(capsys):
    assert cli.main(["check", "--backends", "numpy", "--in-process", "--tolerance", "float16=1e-9"]) == 1
    assert "masked_softmax float16" in capsys.readouterr().out


@pytest.mark.parametrize("command", [[], ["check"], ["report"], ["demo"]])
def test_help(command):
    result = run_cli(*command, "--help")
    assert result.returncode == 0 and "usage: multiattn" in result.stdout


def test_bad_arguments_are_usage_errors():
    result = run_cli("check", "--backends", "caffe")
    assert result.returncode == 2 and "unknown backend 'caffe'" in result.stderr
    result = run_cli("check", "--tolerance", "float32")
    assert result.returncode == 2 and "DTYPE=VALUE" in result.stderr


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("function", ["masked_softmax", "dot_product", "additive"])
def test_the_check_reference_matches_the_test_reference(function, mask):
    """The library's analytic reference (what `check` trusts) against the tests' own."""
    inputs, cotangent = _inputs(function)
    lens = MASKS[mask]
    if function == "masked_softmax":
        got = lib_reference.masked_softmax_case(inputs["X"], lens, cotangent)
        want_out = ref.masked_softmax(inputs["X"], lens)
    elif function == "dot_product":
        got = lib_reference.dot_product_attention(*inputs.values(), lens, cotangent)
        want_out = ref.dot_product_attention(*inputs.values(), lens)[0]
    else:
        q, k, v, W_q, W_k, w_v = inputs.values()
        got = lib_reference.additive_attention(q, k, v, lens, W_q, W_k, w_v, cotangent)
        want_out = ref.additive_attention(q, k, v, lens, W_q, W_k, w_v)[0]
    np.testing.assert_allclose(got["out"], want_out, rtol=1e-12, atol=1e-14)
    for name, grad in finite_differences(function, mask).items():
        np.testing.assert_allclose(got["grads"][name], grad, rtol=1e-6, atol=1e-7)


def test_a_wrong_fast_path_fails_the_check(monkeypatch, capsys):
    # a fused kernel that is 1% off: the no-weights path is compared with the reference too
    def fused(self, queries, keys, values, masks, scale, dropout, need_weights):
        if need_weights or dropout is not None:
            return "the weights are wanted"
        with multiattn.specialise.primitives_only():
            out, _ = multiattn.core.dot_product_attention(self, queries, keys, values, masks, scale=scale)
        return lambda: (out * 1.01, None)

    monkeypatch.setattr(numpy_backend.NumpyOps, "attend_fused", fused)
    assert cli.main(["check", "--backends", "numpy", "--in-process"]) == 1
    out = capsys.readouterr().out
    assert all(
        "FAIL" in line
        for line in out.splitlines()
        if line.startswith("numpy") and "dot_product float" in line
    )


@pytest.mark.backend("paddle")
def test_paddle_half_reasons_name_what_each_case_needs(capsys):
    from multiattn.backends import paddle as m

    cli.main(["check", "--backends", "paddle", "--in-process"])
    rows = capsys.readouterr().out.splitlines()
    reasons = {
        f: next(r for r in rows if f"{f} float16" in r) for f in ("masked_softmax", "dot_product", "additive")
    }
    assert reasons["masked_softmax"].endswith("kernels for where (the masking)")
    assert reasons["dot_product"].endswith("kernels for matmul and where")
    assert reasons["additive"].endswith("kernels for matmul, tanh and where")
    # float16 lengths need no half kernel: they are only compared
    weights = m.masked_softmax(
        m.from_numpy(np.ones((2, 3, 4)), "float32"), m.from_numpy(np.array([1.5, 3.0]), "float16")
    )
    np.testing.assert_array_equal(m.to_numpy(weights)[0, :, 2:], 0.0)


def test_a_check_of_what_is_installed_names_what_is_not(monkeypatch, capsys):
    monkeypatch.setattr(multiattn.check, "installed_backends", lambda: ["numpy"])
    assert cli.main(["check", "--in-process"]) == 0
    note = capsys.readouterr().err.splitlines()[-1]
    absent = "torch, tensorflow, jax, mxnet, paddle, mlx, array_api"
    assert note.startswith(f"(not installed here, so not checked: {absent};")
    assert (
        """pip install ".[torch,tensorflow,jax,paddle,mlx,array-api]" in multiattn's clone adds them"""
        in note
    )
    assert "mxnet joins from an environment of its own" in note
    assert cli._not_installed_note(["numpy", "torch", "tensorflow", "jax", "paddle", "mlx", "array_api"]) == (
        "(not installed here, so not checked: mxnet; mxnet joins from an environment of its own "
        "(numpy<1.24; `multiattn report`: docs/check.md))"
    )
    but_torch = ["numpy", "tensorflow", "jax", "paddle", "mlx", "array_api"]
    assert cli._not_installed_note(but_torch).startswith(
        "(not installed here, so not checked: torch, mxnet; "
        """pip install ".[torch]" in multiattn's clone adds it; mxnet"""
    )
    assert cli._not_installed_note(["numpy", "mxnet"]).endswith(
        "with mxnet's numpy<1.24 they join from another environment (`multiattn report`: docs/check.md))"
    )
    assert cli._not_installed_note(list(multiattn.check.BACKENDS)) == ""
    assert cli.main(["check", "--backends", "numpy", "--in-process"]) == 0  # asked for: nothing to name
    assert "not installed" not in capsys.readouterr().err
