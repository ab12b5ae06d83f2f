"""`multiattn check --against` and `multiattn.testing.assert_matches_reference`: someone
else's attention through the battery of `check`, judged against the float64 reference."""

from __future__ import annotations

import json

import numpy as np
import pytest

import multiattn
from multiattn.testing import assert_matches_reference

from . import user_attention
from .test_cli_errors import one_line, run_cli

SPEC = "tests.user_attention:"


def against(function, kind, *extra, backend="numpy"):
    return run_cli("check", "--against", SPEC + function, "--kind", kind, "--backend", backend, *extra)


@pytest.mark.parametrize(
    "function, kind",
    [("ours_masked_softmax", "masked_softmax"), ("ours_dot_product", "dot_product"),
     ("ours_additive", "additive"), ("ours_multi_head", "multi_head")],
)  # fmt: skip
@pytest.mark.backend("numpy")
def test_multiattns_own_functions_agree(function, kind):
    result = against(function, kind)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all agree within tolerance" in result.stdout
    assert "not run" not in result.stdout  # they take the masks: every case ran
    assert result.stdout.count(f"{kind} float") == 3  # float32, float64, float16 (numpy has no bfloat16)


@pytest.mark.backend("numpy")
def test_d2ls_masked_softmax_fails_on_fully_masked_rows_and_says_so():
    result = against("d2l_masked_softmax", "masked_softmax")
    assert result.returncode == 1
    rows = {line.split()[3]: line for line in result.stdout.splitlines() if "masked_softmax float" in line}
    assert "1d, 2d: fully masked row: got uniform weights 0.2, reference 0" in rows["float32"]
    assert "NaN in the output in fully masked rows only" in rows["float16"]  # -1e6 is -inf there
    # it takes no masks: those cases are named, not silently passed
    assert (
        "not run: mask, causal, all (the function takes no attention_mask/causal keyword)" in rows["float32"]
    )
    # and judged on the rows d2l defines, it agrees
    skipped = against("d2l_masked_softmax", "masked_softmax", "--skip-fully-masked")
    assert skipped.returncode == 0, skipped.stdout
    assert "rows where nothing is visible were not judged" in skipped.stdout


@pytest.mark.backend("numpy")
def test_a_function_that_writes_into_its_input_fails():
    result = against("writes_its_input", "masked_softmax")
    assert result.returncode == 1
    assert "none, 1d, 2d, mask, causal, all: input modified in place: X" in result.stdout


@pytest.mark.backend("numpy")
def test_a_forgotten_scale_fails_with_the_error_size(tmp_path):
    path = tmp_path / "out.json"
    result = against("forgets_the_scale", "dot_product", "--json", str(path))
    assert result.returncode == 1
    line = next(line for line in result.stdout.splitlines() if "dot_product float64" in line)
    assert "FAIL: none" in line and "output 0.34 from the reference > 1.2e-10" in line
    assert json.loads(path.read_text())["rows"][0]["verdict"] == "FAIL"
    assert against("scaled_right", "dot_product").returncode == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--against", "tests.nowhere:f", "--kind", "dot_product", "--backend", "numpy"],
         "cannot import 'tests.nowhere': ModuleNotFoundError"),
        (["--against", SPEC + "missing", "--kind", "dot_product", "--backend", "numpy"],
         "module 'tests.user_attention' has no attribute 'missing'"),
        (["--against", SPEC + "not_a_function", "--kind", "dot_product", "--backend", "numpy"],
         "is a int, not a function"),
        (["--against", SPEC + "d2l_masked_softmax", "--kind", "dot_product", "--backend", "numpy"],
         "does not take the arguments of --kind dot_product, fn(queries, keys, values, valid_lens)"),
        (["--against", SPEC + "ours_dot_product", "--backend", "numpy"], "--against needs --kind"),
        (["--against", "no_colon", "--kind", "dot_product", "--backend", "numpy"],
         "--against needs MODULE:FUNCTION"),
        (["--kind", "dot_product"], "go with --against MODULE:FUNCTION"),
    ],
)  # fmt: skip
@pytest.mark.backend("numpy")
def test_usage_errors_are_one_line_and_exit_2(args, message):
    assert message in one_line(run_cli("check", *args))


KINDS = {
    "masked_softmax": user_attention.ours_masked_softmax,
    "dot_product": user_attention.ours_dot_product,
    "additive": user_attention.ours_additive,
    "multi_head": user_attention.ours_multi_head,
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_assert_matches_reference_passes_for_a_correct_function(bk, kind):
    rows = assert_matches_reference(KINDS[kind], kind=kind, backend=bk.name)
    assert {r.dtype for r in rows if r.verdict == "ok"} == set(bk.dtypes)
    if bk.module.vjp is not None:  # gradients were judged too
        assert all(r.grad_error is not None for r in rows if r.dtype == "float32")


@pytest.mark.backend("numpy")
def test_assert_matches_reference_fails_with_the_table():
    with pytest.raises(AssertionError) as info:
        assert_matches_reference(user_attention.d2l_masked_softmax, kind="masked_softmax", backend="numpy",
                                 dtypes=["float32"])  # fmt: skip
    message = str(info.value)
    assert message.startswith("tests.user_attention:d2l_masked_softmax does not match the reference")
    assert "masked_softmax float32" in message and "fully masked row: got uniform weights 0.2" in message
    rows = assert_matches_reference(
        user_attention.d2l_masked_softmax, kind="masked_softmax", backend="numpy", skip_fully_masked=True
    )
    assert {r.verdict for r in rows} == {"ok", "n/a"}  # numpy has no bfloat16
    with pytest.raises(AssertionError, match="no case could run"):
        assert_matches_reference(user_attention.ours_dot_product, kind="dot_product", backend="numpy",
                                 dtypes=["bfloat16"])  # fmt: skip


@pytest.mark.backend("torch")
def test_a_torch_function_gets_its_gradients_judged():
    import torch

    def wrong_gradient(queries, keys, values, valid_lens, **masks):
        out = multiattn.dot_product_attention(queries, keys, values, valid_lens, **masks)
        return out.detach() + (out - out.detach()) * 2  # right values, twice the gradient

    with pytest.raises(AssertionError) as info:
        assert_matches_reference(wrong_gradient, kind="dot_product", backend="torch", dtypes=["float64"])
    assert "gradient of queries" in str(info.value) and "from the reference" in str(info.value)
    assert torch.is_grad_enabled()
    assert np.isfinite(1.0)


@pytest.mark.backend("numpy")
def test_the_docs_example_runs():
    import re
    import subprocess
    import sys
    from pathlib import Path

    page = Path(__file__).resolve().parent.parent / "docs" / "check-your-code.md"
    (code,) = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "none: output 0.34 from the reference > 1.2e-10" in result.stdout
    assert "does not match the reference (dot_product on numpy)" in result.stdout
