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
