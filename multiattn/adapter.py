"""What an adapter subclasses: ``Ops``, the primitives of ``protocol.Primitives`` (the contract,
which imports nothing) and the optional specialisations of ``specialisations.Specialisations``,
with the check that an adapter is complete and declares nothing the two halves do not."""

from __future__ import annotations

from typing import List, Tuple

from . import _registry, state
from .protocol import REQUIRED, Primitives, Tensor
from .specialisations import Specialisations


class Ops(Primitives, Specialisations):
    """The primitives (``protocol.Primitives``) and the optional specialisations."""

    def check_tensors(self, **tensors: Tensor) -> None:
        _registry.check_framework(self.name, **tensors)

    def softmax_with_lse(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """``protocol``'s optional softmax_with_lse from the required ops: the state's lse."""
        lse = state.log_sum_exp(self, x)
        return self.exp(x - lse), lse


def adapter_problems(cls: type) -> List[str]:
    """What is wrong with an Ops subclass: a public member Ops does not declare (a misspelled
    override would never be called), a required primitive left undefined."""
    declared = set(dir(Ops)) - {"mro"}
    declared.update(*(vars(klass).get("_declares", ()) for klass in cls.__mro__))  # a shared base's own
    problems = [
        f"{klass.__name__}.{member} is not a member of adapter.Ops (misspelled?)"
        for klass in cls.__mro__
        if issubclass(klass, Ops) and klass is not Ops
        for member in vars(klass)
        if not member.startswith("_") and member not in declared
    ]
    problems += [
        f"{cls.__name__} lacks the required primitive {member}"
        for member in REQUIRED
        if getattr(cls, member) is getattr(Ops, member)
    ]
    if not cls.name:
        problems.append(f"{cls.__name__} has no name")
    return problems
