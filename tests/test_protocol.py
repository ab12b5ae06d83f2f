"""The protocol as a base class: every adapter subclasses adapter.Ops, defines each required
primitive, and nothing the base does not declare (a misspelled override would be dead code)."""

from __future__ import annotations

import numpy as np
import pytest

from multiattn import protocol
from multiattn.adapter import Ops, adapter_problems


def test_each_adapter_is_a_complete_ops_subclass(bk):
    cls = type(bk.module.ops)
    assert issubclass(cls, Ops)
    assert adapter_problems(cls) == []
    public = {name for name in vars(bk.module.ops) if not name.startswith("_")}
    assert public <= set(dir(Ops)), f"undeclared instance attributes {public - set(dir(Ops))}"


def test_the_check_finds_a_misspelled_hook_and_a_missing_primitive(bk):
    adapter = type(bk.module.ops)

    class Misspelled(adapter):
        def attend_fuse(self, *inputs):  # attend_fused, misspelled: it would never be offered
            return "declined"

    class Incomplete(Ops):
        name = "incomplete"

        def shape(self, x):
            return x.shape

    assert adapter_problems(Misspelled) == [
        "Misspelled.attend_fuse is not a member of adapter.Ops (misspelled?)"
    ]
    problems = adapter_problems(Incomplete)
    assert "Incomplete lacks the required primitive softmax" in problems
    assert "Incomplete lacks the required primitive shape" not in problems
    assert len(problems) == len(protocol.REQUIRED) - 1


def test_row_windows_are_the_slices_stacked_and_joined_rows_undo_a_tiling(bk):
    x = np.arange(2 * 10 * 3, dtype=np.float32).reshape(2, 10, 3)
    ops, t = bk.module.ops, bk.tensor(x, "float32")
    windows = bk.numpy(ops.row_windows(t, 1, 3, 2, 4))  # rows 1-3, 3-5, 5-7, 7-9
    np.testing.assert_array_equal(windows, np.stack([x[:, at : at + 3] for at in (1, 3, 5, 7)]))
    np.testing.assert_array_equal(bk.numpy(ops.joined_rows(ops.row_windows(t, 0, 5, 5, 2))), x)


def test_a_required_primitive_left_undefined_says_which():
    with pytest.raises(NotImplementedError):
        Ops().softmax(None)


@pytest.mark.parametrize("size, expected", [("1024K", 1 << 20), ("2M", 2 << 20), ("524288", 1 << 19)])
def test_the_l2_size_is_read_from_sysfs(tmp_path, size, expected):
    from multiattn._machine import l2_cache_bytes

    for index, (level, text) in enumerate((("1", "48K"), ("1", "32K"), ("2", size), ("3", "32768K"))):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        (folder / "level").write_text(level + "\n")
        (folder / "size").write_text(text + "\n")
    assert l2_cache_bytes(cache_dir=str(tmp_path)) == expected
    fallback = l2_cache_bytes(default=123, cache_dir=str(tmp_path / "missing"))  # sysconf, else default
    assert fallback == 123 or fallback >= 1 << 16


def test_measured_faster_measures_once_per_key():
    import time

    from multiattn._machine import measured_faster

    calls, inputs = [], []
    slow, fast = (lambda x: (calls.append("slow"), time.sleep(0.002))), (lambda x: calls.append("fast"))

    def make_input():
        inputs.append(1)
        return 0

    assert measured_faster(("test", 1), fast, slow, make_input) is True
    assert measured_faster(("test", 2), slow, fast, make_input) is False
    count = len(calls)
    assert measured_faster(("test", 1), slow, fast, make_input) is True and len(calls) == count  # cached
    assert len(inputs) == 2  # the input is built only to measure


def test_the_protocol_imports_no_other_multiattn_module():
    """The contract a backend author reads depends on nothing of the implementation."""
    import ast

    tree = ast.parse(open(protocol.__file__, encoding="utf-8").read())
    imported = [
        node.module or "." if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
        if isinstance(node, ast.Import) or alias is node.names[0]
    ]
    relative = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]
    assert not relative and not [name for name in imported if name.startswith("multiattn")], imported
    # nor dynamically: no importlib, no __import__
    assert imported == [name for name in imported if name in ("__future__", "math", "typing")], imported
    assert "import_module" not in ast.unparse(tree) and "__import__" not in ast.unparse(tree)


def test_the_optional_primitives_defaults_compute_what_the_adapters_do():
    """A numpy adapter with every optional primitive at the protocol's default (written from
    the required ones): masked softmax, attention with lengths (one per sequence, per query),
    a boolean mask and causality, materialised and in blocks, against the float64 reference;
    ``softmax_with_lse`` against the formula."""
    from multiattn.backends.numpy import NumpyOps
    from multiattn.functional import bind

    from . import reference as ref

    optional = [
        name
        for name, value in vars(protocol.Primitives).items()
        if callable(value) and not name.startswith("_") and name not in protocol.REQUIRED
    ]
    assert {"matmul_t", "where", "logical_and", "length_mask", "causal_mask"} <= set(optional)
    defaults = type("DefaultsOps", (NumpyOps,), {name: vars(protocol.Primitives)[name] for name in optional})
    masked_softmax, attention, *_ = bind(defaults())
    rng = np.random.default_rng(3)
    q, k, v = rng.normal(size=(2, 9, 4)), rng.normal(size=(2, 11, 4)), rng.normal(size=(2, 11, 3))
    mask = rng.random((2, 9, 11)) < 0.7
    for lens in (np.array([11, 4]), rng.integers(0, 12, size=(2, 9)).astype(np.float64)):
        want = ref.dot_product_attention(q, k, v, lens, attention_mask=mask, causal=True)[0]
        for block_size in (None, 4):
            got = attention(q, k, v, lens, attention_mask=mask, causal=True, block_size=block_size)
            np.testing.assert_allclose(got, want, atol=1e-12)
        scores = rng.normal(size=(2, 9, 11)) * 30
        assert "softmax_with_lse" not in vars(NumpyOps)  # adapter.Ops' default
        weights, lse = defaults().softmax_with_lse(scores)
        np.testing.assert_allclose(lse[..., 0], np.log(np.exp(scores).sum(-1)), rtol=1e-13)
        np.testing.assert_allclose(weights, np.exp(scores - lse), rtol=1e-12)
        got = masked_softmax(scores, lens, attention_mask=mask, causal=True)
        np.testing.assert_allclose(
            got, ref.masked_softmax(scores, lens, attention_mask=mask, causal=True), atol=1e-12
        )
