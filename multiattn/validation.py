"""Argument checks of the attention functions: each error names the argument, the
expected and the actual value.  Framework-free, through ``adapter.Ops``."""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
import re
import types
from typing import Any, Optional

import numpy as np

from . import mods
from ._registry import framework_of
from .adapter import Ops
from .masks import NO_MASKS, Masks
from .mods import as_mask_function
from .protocol import Shape, Tensor


class InputDtypeError(TypeError, ValueError):
    """An argument has a dtype the math cannot use (both a TypeError and a ValueError)."""


def same(a: Any, b: Any) -> bool:
    """Equal, or at least one unknown (a traced dimension)."""
    return a is None or b is None or a == b


def fmt(shape: Shape) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + (",)" if len(shape) == 1 else ")")


def dtype_name(x: Tensor) -> str:
    """'float32' for torch.float32, tf's <dtype: 'float32'>, mxnet's <class 'numpy.float32'>, ..."""
    text = re.sub(r"^<(?:dtype:|class) '(.*)'>$", r"\1", str(getattr(x, "dtype", type(x).__name__)))
    return text.rsplit(".", 1)[-1]


def check_float(ops: Ops, arg: str, x: Tensor) -> None:
    if ops.dtype_kind(x) != "f":
        raise InputDtypeError(f"{arg} must have a floating dtype, got {getattr(x, 'dtype', type(x))}")


def check_valid_lens(ops: Ops, valid_lens: Tensor, batch: Any, queries: Any) -> Shape:
    shape = ops.shape(valid_lens)
    ok = (len(shape) == 1 and same(shape[0], batch)) or (
        len(shape) == 2 and same(shape[0], batch) and same(shape[1], queries)
    )
    if not ok:
        raise ValueError(
            f"valid_lens must have shape {fmt((batch,))} (batch,) or {fmt((batch, queries))} "
            f"(batch, queries), got {fmt(shape)}"
        )
    if ops.dtype_kind(valid_lens) not in "iuf":
        raise InputDtypeError(
            f"valid_lens must have an integer or float dtype, got {getattr(valid_lens, 'dtype', '?')}"
        )
    return shape


def check_scores(
    ops: Ops, X: Tensor, valid_lens: Tensor, attention_mask: Tensor = None, causal: bool = False
) -> tuple[Shape, Tensor]:
    """The arguments of masked_softmax; returns (X's shape, the mask as booleans or None)."""
    check_float(ops, "X", X)
    shape = ops.shape(X)
    if valid_lens is not None:
        if len(shape) not in (3, 4):
            raise ValueError(
                "X must be 3-D (batch, queries, keys) or 4-D (batch, heads, queries, keys) when "
                f"valid_lens is given, got shape {fmt(shape)}"
            )
        check_valid_lens(ops, valid_lens, shape[0], shape[-2])
    check_causal(causal)
    if (causal or attention_mask is not None) and len(shape) < 2:
        raise ValueError(
            f"X must have a queries and a keys axis (..., queries, keys), got shape {fmt(shape)}"
        )
    return shape, check_attention_mask(ops, attention_mask, shape)


def check_causal(causal: Any) -> None:
    check_flag("causal", causal)


def check_attention_mask(ops: Ops, mask: Tensor, scores_shape: Shape) -> Tensor:
    """A boolean (or integer 0/1) mask, True: may attend, broadcastable to the scores
    (B, [H,] Q, K) (a 3-D mask against 4-D scores is (B, Q, K)); as booleans, or None."""
    if mask is None:
        return None
    kind = ops.dtype_kind(mask)
    if kind not in "biu":
        raise InputDtypeError(
            "attention_mask must be boolean (True: may attend) or integer 0/1, got dtype "
            f"{dtype_name(mask)}; a float mask is ambiguous (torch and mlx add float masks to the scores)"
        )
    shape = ops.shape(mask)
    target = tuple(scores_shape)
    if len(target) == 4 and len(shape) == 3:
        target = target[:1] + target[2:]  # (B, Q, K), shared by the heads
    if len(shape) > len(target) or not all(
        m == 1 or same(m, t) for m, t in zip(reversed(shape), reversed(target))
    ):
        raise ValueError(
            f"attention_mask of shape {fmt(shape)} does not broadcast to the scores' shape {fmt(target)} "
            + ("(batch, heads, queries, keys)" if len(target) == 4 else "(batch, queries, keys)")
        )
    return mask if kind == "b" else mask != 0


def check_attention_inputs(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor = None,
    *,
    query_size: Any = None,
    key_size: Any = None,
    value_size: Any = None,
    same_width: bool = False,
    heads: bool = False,
) -> tuple[Shape, Shape, Shape]:
    """The three shapes; ValueError naming the argument, the expected and the actual shape.
    heads: 4-D inputs are taken too, queries (B, H, Q, q), keys and values (B, H_kv, K, .)
    with H_kv dividing H."""
    q_shape, k_shape, v_shape = ops.shape(queries), ops.shape(keys), ops.shape(values)
    # The common case in a few comparisons (toy sizes are dispatch bound); anything
    # unusual (a mismatch, an unknown dimension, a size argument) takes the full check.
    if (
        len(q_shape) == len(k_shape) == len(v_shape) == 3
        and q_shape[0] == k_shape[0] == v_shape[0] is not None
        and k_shape[1] == v_shape[1] is not None
        and (q_shape[2] == k_shape[2] != 0 if same_width else query_size is key_size is value_size is None)
        and queries.dtype == keys.dtype == values.dtype
        and ops.dtype_kind(queries) == "f"
    ):
        if valid_lens is not None:
            check_valid_lens(ops, valid_lens, q_shape[0], q_shape[1])
        return q_shape, k_shape, v_shape
    sizes = (query_size, key_size, value_size)
    _full_check(ops, (queries, keys, values), valid_lens, sizes, same_width, heads)
    return q_shape, k_shape, v_shape


def _full_check(
    ops: Ops, tensors: tuple, valid_lens: Tensor, sizes: tuple, same_width: bool, heads: bool = False
) -> None:
    names = ("queries", "keys", "values")
    shapes = [ops.shape(t) for t in tensors]
    four = heads and len(shapes[0]) == 4
    for arg, shape, rows in zip(names, shapes, ("queries", "keys", "keys")):
        if four and len(shape) != 4:
            head = "heads" if arg == "queries" else "kv_heads"
            raise ValueError(
                f"{arg} must be 4-D (batch, {head}, {rows}, features) like queries, got shape {fmt(shape)}"
            )
        if not four and len(shape) != 3:
            layouts = f"3-D (batch, {rows}, features)"
            if heads:
                layouts += f" or 4-D (batch, {'heads' if arg == 'queries' else 'kv_heads'}, {rows}, features)"
            raise ValueError(f"{arg} must be {layouts}, got shape {fmt(shape)}")
    for arg, x in zip(names, tensors):
        check_float(ops, arg, x)
    if not tensors[0].dtype == tensors[1].dtype == tensors[2].dtype:
        raise InputDtypeError(
            "queries, keys and values must share one dtype, got "
            + ", ".join(f"{arg} {dtype_name(x)}" for arg, x in zip(names, tensors))
        )
    batch, n_queries, q_width = shapes[0][0], shapes[0][-2], shapes[0][-1]
    n_keys, k_width = shapes[1][-2], shapes[1][-1]
    for arg, shape in zip(names[1:], shapes[1:]):
        if not same(shape[0], batch):
            raise ValueError(f"{arg} must have batch size {batch} like queries, got shape {fmt(shape)}")
    if four:
        n_heads, kv_heads = shapes[0][1], shapes[1][1]
        if not same(shapes[2][1], kv_heads):
            raise ValueError(
                f"values must have {kv_heads} heads like keys (batch, kv_heads, keys, features), "
                f"got shape {fmt(shapes[2])}"
            )
        if kv_heads == 0 or (n_heads is not None and kv_heads is not None and n_heads % kv_heads):
            raise ValueError(
                f"keys must have a number of heads dividing the queries' {n_heads} (query head i uses "
                f"key/value head i // (heads / kv_heads)), got shape {fmt(shapes[1])}"
            )
    if not same(shapes[2][-2], n_keys):
        raise ValueError(
            f"values must have {n_keys} rows like keys (one value per key), got shape {fmt(shapes[2])}"
        )
    if same_width and not same(k_width, q_width):
        raise ValueError(
            f"keys must have width {q_width} like queries (dot-product attention), got shape {fmt(shapes[1])}"
        )
    if same_width and q_width == 0:
        raise ValueError("queries must have a non-zero width (the scores are divided by sqrt(width))")
    for arg, label, size, shape in zip(names, ("query_size", "key_size", "value_size"), sizes, shapes):
        width = shape[-1]
        if size is not None and not same(width, size):
            raise ValueError(f"{arg} must have width {label}={size}, got shape {fmt(shape)}")
    if valid_lens is not None:
        check_valid_lens(ops, valid_lens, batch, n_queries)


def check_scale(scale: Any) -> Any:
    """None (1 / sqrt(d)) or a finite real number, as a Python float."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(
            f"scale must be a finite number (the factor of q k^T; None: 1 / sqrt(d)), got {scale!r}"
        )
    return float(scale)


def check_known_width(q_shape: Shape) -> int:
    """The query width, which the scores are divided by the square root of."""
    if q_shape[-1] is None:  # a graph traced with an unknown feature axis
        raise ValueError(
            "queries must have a known width (the scores are divided by sqrt(width)), "
            f"got shape {fmt(q_shape)}"
        )
    return q_shape[-1]


def check_additive_weights(
    ops: Ops, W_q: Tensor, W_k: Tensor, w_v: Tensor, queries: Tensor
) -> tuple[int, int]:
    """Canonical additive weights W_q (h, query_size), W_k (h, key_size), w_v (h,) in the
    queries' dtype; returns (query_size, key_size)."""
    shapes = []
    for arg, x, rank, layout in (
        ("W_q", W_q, 2, "(num_hiddens, query_size)"),
        ("W_k", W_k, 2, "(num_hiddens, key_size)"),
        ("w_v", w_v, 1, "(num_hiddens,)"),
    ):
        shape = ops.shape(x)
        if len(shape) != rank:
            raise ValueError(f"{arg} must have shape {layout}, got {fmt(shape)}")
        check_float(ops, arg, x)
        if getattr(queries, "dtype", None) is not None and not x.dtype == queries.dtype:
            raise InputDtypeError(
                f"{arg} must have the dtype of queries ({dtype_name(queries)}), got {dtype_name(x)}"
            )
        shapes.append(shape)
    (h, query_size), (h_k, key_size), (h_v,) = shapes
    if not (same(h, h_k) and same(h, h_v)):
        raise ValueError(
            "W_q, W_k and w_v must share num_hiddens (their first dimension), got shapes "
            f"{fmt(shapes[0])}, {fmt(shapes[1])}, {fmt(shapes[2])}"
        )
    return query_size, key_size


def check_num_heads(num_heads: Any, num_hiddens: Any) -> int:
    if isinstance(num_heads, bool) or not hasattr(num_heads, "__index__") or num_heads <= 0:
        raise ValueError(f"num_heads must be a positive integer, got {num_heads!r}")
    num_heads = num_heads.__index__()
    if num_hiddens is not None and num_hiddens % num_heads:
        raise ValueError(
            f"num_hiddens ({num_hiddens}) must be divisible by num_heads ({num_heads}): each head "
            "takes num_hiddens / num_heads columns"
        )
    return num_heads


def check_num_kv_heads(num_kv_heads: Any, num_heads: int) -> int:
    """The key/value heads of grouped-query attention (None: num_heads, one per query head)."""
    if num_kv_heads is None:
        return num_heads
    if isinstance(num_kv_heads, bool) or not hasattr(num_kv_heads, "__index__") or num_kv_heads <= 0:
        raise ValueError(f"num_kv_heads must be a positive integer or None, got {num_kv_heads!r}")
    num_kv_heads = num_kv_heads.__index__()
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads}): each key/value head "
            "serves num_heads / num_kv_heads query heads"
        )
    return num_kv_heads


def kv_hiddens(num_hiddens: int, num_heads: int, num_kv_heads: Optional[int]) -> int:
    """The width of the projected keys and values: num_kv_heads heads of num_hiddens / num_heads."""
    return num_hiddens if num_kv_heads is None else num_hiddens // num_heads * num_kv_heads


MULTI_HEAD_WEIGHTS = ("W_q", "W_k", "W_v", "W_o")
MULTI_HEAD_BIASES = ("b_q", "b_k", "b_v", "b_o")


def multi_head_weight_shapes(
    num_hiddens: Any, query_size: Any, key_size: Any, value_size: Any, bias: bool, kv_width: Any = None
) -> dict:
    """The canonical multi-head weights' shapes, by name; kv_width: the rows of W_k and W_v
    (``kv_hiddens``; default num_hiddens)."""
    kv = num_hiddens if kv_width is None else kv_width
    shapes = {
        "W_q": (num_hiddens, query_size),
        "W_k": (kv, key_size),
        "W_v": (kv, value_size),
        "W_o": (num_hiddens, num_hiddens),
    }
    biases = {"b_q": (num_hiddens,), "b_k": (kv,), "b_v": (kv,), "b_o": (num_hiddens,)}
    return {**shapes, **(biases if bias else {})}


def check_weight_names(weights: Any, bias: Any = None) -> bool:
    """That weights is a dict of exactly the multi-head names (the biases all or none, or as
    ``bias`` says); returns whether it has the biases."""
    if not hasattr(weights, "keys") or not hasattr(weights, "__getitem__"):
        raise TypeError(
            f"weights must be a dict with keys {', '.join(MULTI_HEAD_WEIGHTS)} (and "
            f"{', '.join(MULTI_HEAD_BIASES)} with biases), got {type(weights).__name__}"
        )
    has_bias = any(name in weights for name in MULTI_HEAD_BIASES) if bias is None else bias
    names = MULTI_HEAD_WEIGHTS + (MULTI_HEAD_BIASES if has_bias else ())
    unknown = sorted(set(weights) - set(names))
    missing = [name for name in names if name not in weights]
    if unknown or missing:
        raise ValueError(
            f"weights must have exactly the keys {', '.join(names)}; missing {missing or 'none'}, "
            f"unknown {unknown or 'none'}"
        )
    return has_bias


def check_multi_head_weights(
    ops: Ops,
    weights: Any,
    num_heads: Any,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    num_kv_heads: Any = None,
) -> int:
    """Canonical multi-head weights for these inputs, in the queries' dtype; ValueError naming
    the key, the expected and the actual shape.  Returns num_kv_heads checked."""
    has_bias = check_weight_names(weights)
    W_q = weights["W_q"]
    if len(ops.shape(W_q)) != 2:
        raise ValueError(
            f"weights['W_q'] must have shape (num_hiddens, query_size), got {fmt(ops.shape(W_q))}"
        )
    num_hiddens = ops.shape(W_q)[0]
    num_heads = check_num_heads(num_heads, num_hiddens)
    num_kv_heads = check_num_kv_heads(num_kv_heads, num_heads)
    widths = (ops.shape(x)[-1] for x in (queries, keys, values))
    kv_width = kv_hiddens(num_hiddens, num_heads, num_kv_heads)
    for name, expected in multi_head_weight_shapes(num_hiddens, *widths, has_bias, kv_width).items():
        tensor = weights[name]
        shape = ops.shape(tensor)
        if len(shape) != len(expected) or not all(same(a, b) for a, b in zip(shape, expected)):
            heads = (
                f" (num_kv_heads={num_kv_heads} heads of {num_hiddens // num_heads})"
                if name[2] in "kv" and num_kv_heads != num_heads
                else ""
            )
            raise ValueError(f"weights[{name!r}] must have shape {fmt(expected)}{heads}, got {fmt(shape)}")
        check_float(ops, f"weights[{name!r}]", tensor)
        if not tensor.dtype == queries.dtype:
            raise InputDtypeError(
                f"weights[{name!r}] must have the dtype of queries ({dtype_name(queries)}), "
                f"got {dtype_name(tensor)}"
            )
    return num_kv_heads


def check_flag(arg: str, value: Any) -> None:
    if value is not True and value is not False:
        raise TypeError(f"{arg} must be True or False, got {value!r}")


MOD_ARGUMENTS = {"score_mod": "score, b, h, q_idx, kv_idx", "mask_mod": "b, h, q_idx, kv_idx"}


def with_mods(score_mod: Any, mask_mod: Any, masks: Masks, sizes: Optional[tuple] = None) -> tuple:
    """(score_mod, the masks with mask_mod), each checked: a function of its arguments, or None;
    sizes (batch, queries, keys): what a mask function holding arrays must cover."""
    for arg, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is None:
            continue
        if not callable(fn):
            raise TypeError(f"{arg} must be a function ({arg}(...) as in multiattn.mods) or None, got {fn!r}")
        check_arity(arg, fn)
    if mask_mod is None:
        return score_mod, masks
    mask_mod = as_mask_function(mask_mod)
    if sizes is not None:
        mask_mod.check_sizes(*sizes)
    causal = masks.causal and not mask_mod.implies_causal()  # a window is causal already
    return score_mod, Masks(masks.valid_lens, masks.attention_mask, causal, mask_mod)


def check_query_offset(ops: Ops, query_offset: Any, batch: Any) -> Any:
    """An int, or one per sequence: (B,) ints (numpy, or the backend's array; read on the host
    where the framework allows, kept as an array where traced).  A negative offset puts the
    first queries before the first key (they see nothing, causally)."""
    expected = f"an int or {fmt((batch,))} ints (one per sequence)"
    if isinstance(query_offset, bool) or isinstance(query_offset, float):
        raise TypeError(f"query_offset must be {expected}, got {query_offset!r}")
    if framework_of(query_offset) == ops.name and framework_of(query_offset) != "numpy":
        if ops.dtype_kind(query_offset) not in "iu":
            raise InputDtypeError(f"query_offset must have an integer dtype, got {query_offset.dtype}")
        shape = tuple(ops.shape(query_offset))
        host = ops.host_values(query_offset)
        if host is None:  # traced: used as it is
            if len(shape) > 1 or (len(shape) == 1 and not same(shape[0], batch)):
                raise ValueError(f"query_offset must be {expected}, got shape {fmt(shape)}")
            return query_offset
        query_offset = host
    values = np.asarray(query_offset)
    if values.dtype.kind not in "iu" or values.ndim > 1:
        raise TypeError(f"query_offset must be {expected}, got {query_offset!r}")
    if values.ndim == 1 and not same(values.shape[0], batch):
        raise ValueError(f"query_offset must be {expected}, got {values.shape[0]} offsets")
    return int(values) if values.ndim == 0 else values.astype(np.int64)


def check_not_both(block_mask: Any, query_offset: Any) -> None:
    if block_mask is not None:
        raise ValueError(
            "query_offset= and block_mask= together are not supported: give the masks themselves "
            "(causal=, mask_mod=, valid_lens=) with query_offset"
        )


def with_query_offset(ops: Ops, query_offset: Any, masks: Masks, score_mod: Any, sizes: tuple) -> tuple:
    """(score_mod, masks) for queries at positions query_offset + i: causal hides key j iff
    j > query_offset + i, and the score and mask functions see those positions.  Causality
    that hides nothing (an int offset >= K - 1: a decoding step) is dropped."""
    offset = check_query_offset(ops, query_offset, sizes[0])
    if isinstance(offset, int) and offset == 0:
        return score_mod, masks
    sees_all = isinstance(offset, int) and sizes[2] is not None and offset >= sizes[2] - 1
    parts = [mods.causal_mask()] if masks.causal and not sees_all else []
    parts += [] if masks.mask_mod is None else [masks.mask_mod]
    mask_mod = (
        None if not parts else mods.at_offset(parts[0] if len(parts) == 1 else mods.and_masks(*parts), offset)
    )
    score_mod = None if score_mod is None else mods.score_at_offset(score_mod, offset)
    return score_mod, Masks(masks.valid_lens, masks.attention_mask, False, mask_mod, masks.block_mask)


def mod_sizes(ops: Ops, queries: Tensor, keys: Tensor, query_offset: Any = None) -> tuple:
    """(batch, queries, keys) of a call, for ``with_mods``; queries None with a query_offset (a
    mask function's arrays then cover the queries' positions, offset + i, not their rows)."""
    q_shape = ops.shape(queries)
    return q_shape[0], q_shape[-2] if query_offset is None else None, ops.shape(keys)[-2]


def check_arity(arg: str, fn: Any) -> None:
    """That fn can be called with the arguments of its kind (``MOD_ARGUMENTS``)."""
    if arg == "mask_mod" and isinstance(fn, mods.MaskFunction):  # multiattn's own take (b, h, q_idx, kv_idx)
        return
    if type(fn) is types.FunctionType and not hasattr(fn, "__wrapped__"):
        # its code read directly, uncached: torch.compile traces this, not inspect.signature
        problem = _arity_problem(arg, _code_parameters(fn))
    else:
        try:
            problem = _ARITY_CHECKED[arg, fn]
        except (KeyError, TypeError):  # not seen, or unhashable
            problem = _arity_problem(arg, _signature_parameters(fn))
            if len(_ARITY_CHECKED) > 256:
                _ARITY_CHECKED.clear()
            try:
                _ARITY_CHECKED[arg, fn] = problem
            except TypeError:
                pass
    if problem:
        raise TypeError(problem)


_ARITY_CHECKED: dict = {}  # (kind, function) -> its problem or None: signature() is slow per call


def _code_parameters(fn: Any) -> tuple:
    """``_signature_parameters`` of a plain Python function, from its code object."""
    code = fn.__code__
    names = code.co_varnames[: code.co_argcount]
    keyword_only = code.co_varnames[code.co_argcount : code.co_argcount + code.co_kwonlyargcount]
    keyword_defaults = (fn.__kwdefaults__ or {}) if keyword_only else {}  # read only where needed
    return (
        names,
        len(names) - len(fn.__defaults__ or ()),
        bool(code.co_flags & inspect.CO_VARARGS),
        any(name not in keyword_defaults for name in keyword_only),
    )


def _signature_parameters(fn: Any) -> Optional[tuple]:
    """(names of fn's positional parameters, how many of them lack a default, whether it takes
    *args, whether a keyword-only parameter lacks a default); None where unknown."""
    try:
        every = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or extension: not known
        return None
    params = [p for p in every if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (
        tuple(p.name for p in params),
        sum(p.default is p.empty for p in params),
        any(p.kind == p.VAR_POSITIONAL for p in every),
        any(p.kind == p.KEYWORD_ONLY and p.default is p.empty for p in every),
    )


def _arity_problem(arg: str, parameters: Optional[tuple]) -> Optional[str]:
    """What is wrong with a function of these parameters (``_signature_parameters``) as arg."""
    if parameters is None:
        return None
    names, required, var_positional, keyword_required = parameters
    count = MOD_ARGUMENTS[arg].count(",") + 1
    if (len(names) >= count or var_positional) and required <= count and not keyword_required:
        return None
    other = next((o for o, n in MOD_ARGUMENTS.items() if o != arg and n.count(",") + 1 == len(names)), None)
    hint = f"; it looks like a {other}" if other else ""
    return (
        f"{arg} must take {count} arguments ({MOD_ARGUMENTS[arg]}), got a function of {len(names)} "
        f"({', '.join(names)}){hint}"
    )


def check_block_size(block_size: Any, return_weights: Any) -> Any:
    """None (automatic) or a positive int; the block path gives no weights."""
    check_flag("return_weights", return_weights)
    if block_size is None:
        return None
    if isinstance(block_size, bool) or not hasattr(block_size, "__index__") or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer or None (automatic), got {block_size!r}")
    if return_weights:
        raise ValueError(
            f"block_size={block_size!r} needs return_weights=False: attention in blocks never holds "
            "the weights whole"
        )
    return block_size.__index__()


def returned(result: tuple, return_weights: bool, return_lse: bool) -> Any:
    """What dot_product_attention returns: output, and weights and lse where asked for."""
    out, weights = result[:2]
    if not (return_weights or return_lse):
        return out
    return (out,) + ((weights,) if return_weights else ()) + ((result[2],) if return_lse else ())


def check_attention_parts(ops: Ops, parts: Any) -> list:
    """A non-empty sequence of (output (..., Q, v), lse (..., Q)) pairs of one shape and dtype."""
    try:
        parts = [tuple(part) for part in parts]
    except TypeError:
        raise TypeError(
            f"parts must be a sequence of (output, lse) pairs, got {type(parts).__name__}"
        ) from None
    if not parts:
        raise ValueError("parts must hold at least one (output, lse) pair, got none")
    first_out = None
    for i, part in enumerate(parts):
        if len(part) != 2:
            raise ValueError(f"parts[{i}] must be an (output, lse) pair, got {len(part)} items")
        out, lse = part
        o_shape, l_shape = ops.shape(out), ops.shape(lse)
        if tuple(o_shape[:-1]) != tuple(l_shape):
            raise ValueError(
                f"parts[{i}]: lse must have the shape of output without its last axis, "
                f"{fmt(tuple(o_shape[:-1]))}, got {fmt(l_shape)}"
            )
        check_float(ops, f"parts[{i}][0]", out)
        check_float(ops, f"parts[{i}][1]", lse)
        if first_out is None:
            first_out = (o_shape, out.dtype)
        elif tuple(o_shape) != tuple(first_out[0]):
            raise ValueError(
                f"parts[{i}][0] must have the shape of parts[0][0], {fmt(first_out[0])}, got {fmt(o_shape)}"
            )
    return parts


def is_empty(shape: Shape) -> bool:
    return 0 in shape


# -- each public call's checks, and its masks gathered into one value ---------------------


def gather_masks(
    ops: Ops, valid_lens: Tensor, attention_mask: Tensor, causal: Any, scores_shape: Shape
) -> Masks:
    """The checked masks as one ``Masks`` (attention_mask as booleans)."""
    if attention_mask is None and causal is False:  # the common case, in two comparisons
        return NO_MASKS if valid_lens is None else Masks(valid_lens)
    check_causal(causal)
    return Masks(valid_lens, check_attention_mask(ops, attention_mask, scores_shape), causal)


def softmax_call(ops: Ops, X: Tensor, valid_lens: Tensor, attention_mask: Tensor, causal: Any) -> Masks:
    """The arguments of masked_softmax checked; its masks."""
    _, attention_mask = check_scores(ops, X, valid_lens, attention_mask, causal)
    return Masks(valid_lens, attention_mask, causal)


def dot_product_call(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor,
    attention_mask: Tensor,
    causal: Any,
) -> Masks:
    """The arguments of dot-product attention checked; its masks."""
    q_shape, k_shape, v_shape = ops.shape(queries), ops.shape(keys), ops.shape(values)
    # the common call (3-D, lengths (B,) or none) in one expression: toy sizes are dispatch bound
    if (
        attention_mask is None
        and causal is False
        and len(q_shape) == len(k_shape) == len(v_shape) == 3
        and q_shape[0] == k_shape[0] == v_shape[0] is not None
        and k_shape[1] == v_shape[1] is not None
        and q_shape[2] == k_shape[2] is not None
        and q_shape[2] != 0
        and queries.dtype == keys.dtype == values.dtype
        and ops.dtype_kind(queries) == "f"
    ):
        if valid_lens is None:
            return NO_MASKS
        if ops.shape(valid_lens) == (q_shape[0],) and ops.dtype_kind(valid_lens) in "iuf":
            return Masks(valid_lens)
    q_shape, k_shape, _ = check_attention_inputs(
        ops, queries, keys, values, valid_lens, same_width=True, heads=True
    )
    check_known_width(q_shape)
    return gather_masks(ops, valid_lens, attention_mask, causal, tuple(q_shape[:-1]) + (k_shape[-2],))


def additive_call(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor,
    attention_mask: Tensor,
    causal: Any,
    query_size: Any = None,
    key_size: Any = None,
) -> Masks:
    """The arguments of additive attention checked (query_size/key_size: the widths its
    projections take, None: not checked here); its masks."""
    q_shape, k_shape, _ = check_attention_inputs(
        ops, queries, keys, values, valid_lens, query_size=query_size, key_size=key_size
    )
    return gather_masks(ops, valid_lens, attention_mask, causal, q_shape[:2] + k_shape[1:2])


def multi_head_call(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor,
    attention_mask: Tensor,
    causal: Any,
    num_heads: Any,
    num_hiddens: Any,
    sizes: tuple = (None, None, None),
) -> Masks:
    """The arguments of multi-head attention checked (sizes: the widths of queries, keys and
    values its projections take, None: not checked here); its masks."""
    q_shape, k_shape, _ = check_attention_inputs(
        ops, queries, keys, values, valid_lens, query_size=sizes[0], key_size=sizes[1], value_size=sizes[2]
    )
    check_num_heads(num_heads, num_hiddens)
    scores_shape = (q_shape[0], num_heads, q_shape[1], k_shape[1])
    return gather_masks(ops, valid_lens, attention_mask, causal, scores_shape)


# -- keywords of other libraries ----------------------------------------------------------

FOREIGN_KEYWORDS = {
    "attn_mask": "use attention_mask= (boolean, True: may attend, SDPA's boolean polarity; a float mask "
    "that adds to the scores is a score_mod=)",
    "mask": "use attention_mask= (boolean, True: may attend)",
    "key_padding_mask": "use valid_lens (lengths) or attention_mask= (True: may attend, the opposite of "
    "torch.nn.MultiheadAttention's key_padding_mask)",
    "is_causal": "use causal=",
    "use_causal_mask": "use causal=",
    "enable_gqa": "drop it: grouped heads are read from the shapes (keys and values with fewer heads)",
    "need_weights": "use return_weights=",
    "return_attention_scores": "use return_weights=",
    "softmax_scale": "use scale=",
    "sm_scale": "use scale=",
    "dropout_p": "use the layers' dropout (DotProductAttention(dropout=...))",
    "lengths": "use valid_lens",
    "valid_length": "use valid_lens",
}


def unknown_keywords(function: str, unknown: dict, accepted: Any) -> None:
    """TypeError for keywords a function does not take: the name it has here for another
    library's keyword, or the closest of its own."""
    name = next(iter(unknown))
    message = f"{function}() got an unexpected keyword argument {name!r}"
    if name in FOREIGN_KEYWORDS:
        message += f"; {FOREIGN_KEYWORDS[name]}"
    else:
        close = difflib.get_close_matches(name, list(accepted), n=1, cutoff=0.6)
        if close:
            message += f"; did you mean {close[0]!r}?"
        else:
            message += f"; it takes {', '.join(accepted)}"
    raise TypeError(message)
