"""multiattn: the attention scoring functions of d2l 11.3, once, for every framework.

Importing this package imports no framework.  Two ways in:

* functions that follow the tensors: ``masked_softmax``, ``dot_product_attention``
  run on whichever framework made their arguments;
* layer classes of the backend named by ``MULTIATTN_BACKEND`` (default numpy):
  ``multiattn.AdditiveAttention``, ``multiattn.DotProductAttention``, or of any
  backend via ``multiattn.get_backend(name)``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ._registry import BACKENDS, ENV_VAR, BackendImportError, framework_of_call, get_backend
from ._registry import selected_backend as _selected_backend
from .checks import InputDtypeError

__version__ = "0.1.0"

__all__ = [
    "AdditiveAttention",
    "BACKENDS",
    "BackendImportError",
    "DotProductAttention",
    "ENV_VAR",
    "InputDtypeError",
    "additive_attention",
    "backend",
    "dot_product_attention",
    "get_backend",
    "masked_softmax",
]


def backend() -> str:
    """The name of the selected backend: MULTIATTN_BACKEND, or 'numpy' when unset."""
    return _selected_backend()


def masked_softmax(X: Any, valid_lens: Any = None) -> Any:
    """Softmax over X's last axis, positions >= valid_lens exactly 0, on X's framework."""
    name = framework_of_call(X=X, valid_lens=valid_lens)
    return get_backend(name).masked_softmax(X, valid_lens)


def dot_product_attention(
    queries: Any, keys: Any, values: Any, valid_lens: Any = None, *, return_weights: bool = False
) -> Any:
    """softmax(Q K^T / sqrt(d)) V with masking, on the framework of the arguments.

    With ``return_weights=True`` returns ``(output, attention_weights)``.
    """
    name = framework_of_call(queries=queries, keys=keys, values=values, valid_lens=valid_lens)
    return get_backend(name).dot_product_attention(
        queries, keys, values, valid_lens, return_weights=return_weights
    )


def additive_attention(
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any = None,
    *,
    W_q: Any,
    W_k: Any,
    w_v: Any,
    return_weights: bool = False,
) -> Any:
    """Additive attention with weight tensors in the canonical layout, on their framework:
    W_q (num_hiddens, query_size), W_k (num_hiddens, key_size), w_v (num_hiddens,)."""
    name = framework_of_call(
        queries=queries, keys=keys, values=values, valid_lens=valid_lens, W_q=W_q, W_k=W_k, w_v=w_v
    )
    return get_backend(name).additive_attention(
        queries, keys, values, valid_lens, W_q=W_q, W_k=W_k, w_v=w_v, return_weights=return_weights
    )


def _selected_module() -> ModuleType:
    return get_backend(_selected_backend())


def __getattr__(attr: str) -> Any:
    # The layer classes resolve at use, so MULTIATTN_BACKEND is read then, not at import.
    if attr in ("AdditiveAttention", "DotProductAttention"):
        module = _selected_module()
        if not hasattr(module, attr):
            raise AttributeError(
                f"the {module.ops.name} backend has no layer classes (functions only: "
                "multiattn.masked_softmax, dot_product_attention, additive_attention); "
                f"choose a framework's backend with {ENV_VAR}"
            )
        return getattr(module, attr)
    raise AttributeError(f"module 'multiattn' has no attribute {attr!r}")
