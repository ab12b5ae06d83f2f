"""The protocol as a base class: every adapter subclasses protocol.Ops, defines each required
primitive, and nothing the base does not declare (a misspelled override would be dead code)."""

from __future__ import annotations

import pytest

from multiattn import protocol
from multiattn.protocol import Ops, adapter_problems


def test_each_adapter_is_a_complete_ops_subclass(bk):
    cls = type(bk.module.ops)
    assert issubclass(cls, Ops)
    assert adapter_problems(cls) == []
    public = {name for name in vars(bk.module.ops) if not name.startswith("_")}
    assert public <= set(dir(Ops)), f"undeclared instance attributes {public - set(dir(Ops))}"


def test_the_check_finds_a_misspelled_hook_and_a_missing_primitive(bk):
    adapter = type(bk.module.ops)

    class Misspelled(adapter):
        def softmax_own(self, x):  # softmax_owned, misspelled: it would never run
            return x

    class Incomplete(Ops):
        name = "incomplete"

        def shape(self, x):
            return x.shape

    assert adapter_problems(Misspelled) == [
        "Misspelled.softmax_own is not a member of protocol.Ops (misspelled?)"
    ]
    problems = adapter_problems(Incomplete)
    assert "Incomplete lacks the required primitive softmax" in problems
    assert not any("shape" in p for p in problems)
    assert len(problems) == len(protocol.REQUIRED) - 1


def test_a_required_primitive_left_undefined_says_which():
    with pytest.raises(NotImplementedError):
        Ops().softmax(None)
