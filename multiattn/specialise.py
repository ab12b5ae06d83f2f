"""Which specialisation of a core step runs: the order they are tried in, written once, and
the record of why the others declined.

A specialisation is a method of the adapter (``multiattn.specialisations.Specialisations``)
that takes a step's inputs and returns either a function of no arguments that does the
step, or a short string saying why it declines.  ``run`` asks them in ``ORDER``; the core
runs its own formula where every one declines, or where the scores are too few for any
(``asks``: the backend's ``tuning.Tuning.specialised_from``).  ``primitives_only()`` switches them all off
(the tests run the matrix so); ``explained()`` records each decision.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Iterator, List, Tuple

from . import tuning

# step -> its specialisations, tried in this order
ORDER = {
    "dot_product_attend": ("attend_over_visible_keys", "attend_fused"),
    "attend_past_memory": ("attend_by_flash_kernel",),
    "attend_in_chunks": ("attend_over_chunks",),
    "masked_softmax": ("masked_softmax_writing_padding", "masked_softmax_in_scores_memory"),
    "additive_scores": ("additive_scores_over_visible_keys", "additive_scores_in_blocks"),
}
# step -> the names asked, each looked up with getattr at each call (torch.compile traces it)
_ASK = {step: tuple(names) for step, names in ORDER.items()}
OFF = "all specialisations are off (MULTIATTN_SPECIALISATIONS=off or primitives_only())"

_state = {"on": os.environ.get("MULTIATTN_SPECIALISATIONS", "on").lower() != "off", "log": None}
Decision = Tuple[str, str, str, str]  # (backend, step, specialisation, "ran" or why it declined)


def run(ops: Any, step: str, *inputs: Any) -> Any:
    """The result of the first specialisation of ``step`` that takes these inputs, or None
    where every one declines (the core then runs its formula)."""
    log = _state["log"]
    if not _state["on"]:
        if log is not None:
            log.append((ops.name, step, "*", OFF))
        return None
    for name in _ASK[step]:
        offer = getattr(type(ops), name)(ops, *inputs)  # the adapter's override, or the base's decline
        if type(offer) is str:
            if log is not None:
                log.append((ops.name, step, name, offer))
            continue
        if log is not None:
            log.append((ops.name, step, name, "ran"))
        return offer()
    return None


def asks(ops: Any, scores_shape: tuple) -> bool:
    """Whether scores of this shape reach the backend's ``tuning.Tuning.specialised_from``, below which every
    offer of ``dot_product_attend`` and ``masked_softmax`` declines (so the core asks none)."""
    least = tuning.of(ops).specialised_from
    if not least or not _state["on"] or math.prod(scores_shape) >= least:  # off: ``run`` records it
        return True
    if _state["log"] is not None:
        _state["log"].append((ops.name, "*", "*", f"fewer than {least} scores: no offer asked"))
    return False


@contextlib.contextmanager
def primitives_only(off: bool = True) -> Iterator[None]:
    """Within the block, every step runs the core's formula over the required primitives."""
    before = _state["on"]
    _state["on"] = not off
    try:
        yield
    finally:
        _state["on"] = before


@contextlib.contextmanager
def explained() -> Iterator[List[Decision]]:
    """Within the block, each decision is appended to the list it gives: (backend, step,
    specialisation, "ran" or the reason it declined)."""
    before, log = _state["log"], []
    _state["log"] = log
    try:
        yield log
    finally:
        _state["log"] = before


def describe(decisions: List[Decision]) -> str:
    """The decisions as lines: ``step: specialisation: outcome``."""
    return "\n".join(f"{backend} {step}: {name}: {outcome}" for backend, step, name, outcome in decisions)
