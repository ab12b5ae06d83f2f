"""Attention as ONNX models: any framework's multiattn layers (``export``: ``MultiHeadAttention``,
d2l's ``DotProductAttention`` and ``AdditiveAttention``) and the functional call with its masks
(``export_attention``), dot-product attention as one ``Attention`` node (opset 23 or 24) with its
mask or bias computed from positions inside the graph, so the model runs at any batch size and
sequence length; with ``cache=True`` a decoding step over past keys and values.  A score
function the node cannot take (neither a bias nor a soft-cap), and additive attention, are the
formula's operations instead.  Needs the ``onnx`` package (``pip install ".[onnx]"``;
onnxruntime to run them).

Inputs: ``queries``, ``keys``, ``values``; ``valid_lens`` (batch,) int64 with ``lengths=True``,
(batch, queries) with ``lengths="per_query"``;
``attention_mask`` (batch, queries, keys) bool (True: may attend) with ``attention_mask=True``;
``document_ids`` (batch, keys) int64 where ``mask_mod`` holds ``mods.document``; ``past_key``,
``past_value`` with ``cache=True`` (the mask's and the ids' keys then count the past ones
first).  Outputs: ``output`` (and ``present_key``, ``present_value``).  Masks and scores mean
what they mean in multiattn's calls: causality is top-left aligned at the queries' positions
(``query_offset``, or the past's length), never left to the runtime's reading of
``is_causal``; a query that sees no key gives 0.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import numpy as np

from .. import mods
from .._registry import BackendImportError
from ..layers import AdditiveWeights, AttentionCall, MultiHeadWeights
from .graph import Graph, Value, ops

OPSETS = (23, 24)
DTYPES = ("float32", "float16")
__all__ = ["export", "export_attention", "OPSETS"]


def _onnx() -> Any:
    try:
        import onnx
    except ModuleNotFoundError as err:
        raise BackendImportError(
            "multiattn.onnx needs the 'onnx' package, which is not installed; install it with: "
            'pip install ".[onnx]" in multiattn\'s clone (onnxruntime runs the models)'
        ) from err
    return onnx


def export_attention(
    path: Any = None, *, num_heads: int, head_dim: int, num_kv_heads: Optional[int] = None,
    value_dim: Optional[int] = None, causal: bool = False, mask_mod: Any = None, score_mod: Any = None,
    scale: Optional[float] = None, lengths: bool = False, attention_mask: bool = False, query_offset: int = 0,
    cache: bool = False, opset: int = 23, dtype: str = "float32",
) -> Any:  # fmt: skip
    """``multiattn.dot_product_attention`` on 4-D inputs as an ONNX model (returned, and saved
    to ``path`` where given): queries (batch, num_heads, queries, head_dim), keys (batch,
    num_kv_heads, keys, head_dim), values (batch, num_kv_heads, keys, value_dim) -> output
    (batch, num_heads, queries, value_dim); query head h reads key/value head h // (num_heads
    / num_kv_heads).  With ``cache=True``: past_key, past_value (batch, num_kv_heads, past,
    .) in, present_key, present_value (the past and these keys) out, queries at positions
    past .. past + queries - 1 (``multiattn.cached_attention``'s step)."""
    _onnx()
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    _check_heads(num_heads, num_kv_heads)
    head_dim, value_dim = (
        _size("head_dim", head_dim),
        _size("value_dim", head_dim if value_dim is None else value_dim),
    )
    spec = _Spec(num_heads, num_kv_heads, head_dim, causal, mask_mod, score_mod, scale, lengths,
                 attention_mask, query_offset, cache, opset, dtype)  # fmt: skip
    g = Graph(spec.dtype)
    q = g.input("queries", spec.dtype, ("batch", num_heads, "queries", head_dim))
    k = g.input("keys", spec.dtype, ("batch", num_kv_heads, "keys", head_dim))
    v = g.input("values", spec.dtype, ("batch", num_kv_heads, "keys", value_dim))
    outputs = _attend(g, q, k, v, spec, value_dim)
    return _save(g.model(outputs, opset, doc=f"multiattn.onnx.export_attention: {spec}"), path)


def export(
    layer: Any, path: Any = None, *, opset: int = 23, cache: bool = False, causal: bool = False,
    lengths: bool = False, attention_mask: bool = False, mask_mod: Any = None, score_mod: Any = None,
    dtype: str = "float32", num_heads: Optional[int] = None, num_kv_heads: Optional[int] = None,
) -> Any:  # fmt: skip
    """A multiattn ``MultiHeadAttention`` of any framework as an ONNX model (returned, and saved
    to ``path`` where given), from its canonical weights (``get_weights()``): queries (batch,
    queries, query_size), keys (batch, keys, key_size), values (batch, keys, value_size) ->
    output (batch, queries, num_hiddens): the projections, one ``Attention`` node, the output
    projection.  ``layer`` may also be ``multi_head_attention``'s canonical weights (a dict of
    arrays W_q, W_k, W_v, W_o and, with biases, b_q, ...) with ``num_heads`` (and
    ``num_kv_heads``).  ``lengths=True``: valid_lens (batch,) as the layer's call takes them.
    With ``cache=True``: past_key, past_value (batch, num_kv_heads, past, num_hiddens /
    num_heads) of the projected keys and values in, present_key, present_value out (the
    layer's call with ``cache=``).  d2l's ``DotProductAttention`` (inputs of any width) and
    ``AdditiveAttention`` (or a dict of its weights W_q, W_k, w_v) export likewise, without a
    cache."""
    _onnx()
    kind = _d2l_kind(layer)
    if kind is not None:
        if num_heads is not None or num_kv_heads is not None:
            raise TypeError(f"num_heads= and num_kv_heads= are for multi-head attention, not {kind}")
        if cache:
            raise ValueError(f"cache=True is for MultiHeadAttention's decoding step, not {kind}")
        spec = _Spec(1, 1, None, causal, mask_mod, score_mod, None, lengths, attention_mask, 0, False, opset,
                     dtype)  # fmt: skip
        build = _dot_product_layer if kind == "DotProductAttention" else _additive_layer
        outputs, g = build(layer, spec)
        name = type(layer).__name__ if isinstance(layer, AttentionCall) else kind  # a layer, or weights
        return _save(g.model(outputs, opset, doc=f"multiattn.onnx.export of {name}: {spec}"), path)
    weights, heads, kv_heads = _weights_of(layer, num_heads, num_kv_heads)
    head_dim = weights["W_q"].shape[0] // heads
    spec = _Spec(heads, kv_heads, head_dim, causal, mask_mod, score_mod, None, lengths, attention_mask, 0,
                 cache, opset, dtype)  # fmt: skip
    g = Graph(spec.dtype)
    sizes = [weights["W_" + n].shape[1] for n in "qkv"]
    x = {n: g.input(n, spec.dtype, ("batch", s, size)) for n, s, size in zip(
        ("queries", "keys", "values"), ("queries", "keys", "keys"), sizes)}  # fmt: skip

    def project(name: str, x: Value) -> Value:
        W = g.constant(weights["W_" + name].T, spec.dtype, hint="W_" + name)
        y = g.op("MatMul", [x, W], spec.dtype, x.shape[:-1] + W.shape[-1:])
        bias = weights.get("b_" + name)
        return y if bias is None else y + g.constant(bias, spec.dtype, hint="b_" + name)

    q, k, v = (project(n, x[full]) for n, full in zip("qkv", ("queries", "keys", "values")))
    outputs = _attend(g, q, k, v, spec, head_dim)
    outputs["output"] = project("o", outputs["output"])
    return _save(
        g.model(outputs, opset, doc=f"multiattn.onnx.export of {type(layer).__name__}: {spec}"), path
    )


def _d2l_kind(layer: Any) -> Optional[str]:
    """The kind, DotProductAttention or AdditiveAttention, of those layers (of any framework) and
    for additive attention's weights (a dict with w_v), else None."""
    if isinstance(layer, AdditiveWeights) or (
        isinstance(layer, Mapping) and not isinstance(layer, AttentionCall) and "w_v" in layer
    ):
        return "AdditiveAttention"
    if isinstance(layer, AttentionCall) and not isinstance(layer, MultiHeadWeights):
        return "DotProductAttention"
    return None


def _dot_product_layer(layer: Any, spec: _Spec) -> tuple:
    """d2l's scaled dot-product attention (any query and value widths): one ``Attention`` node."""
    g = Graph(spec.dtype)
    q = g.input("queries", spec.dtype, ("batch", "queries", "query_size"))
    k = g.input("keys", spec.dtype, ("batch", "keys", "query_size"))
    v = g.input("values", spec.dtype, ("batch", "keys", "value_size"))
    # as one head of 4-D inputs: onnx infers a 3-D output's width as 0 where the values' is unknown
    out = _attend(g, *(ops.expand_dims(x, 1) for x in (q, k, v)), spec, None)["output"]
    return {"output": g.op("Squeeze", [out, g.constant([1])], spec.dtype, (None,) * 3)}, g


def _additive_layer(layer: Any, spec: _Spec) -> tuple:
    """d2l's additive attention, w_v^T tanh(W_q q + W_k k), by the formula's operations (the
    features (batch, queries, keys, num_hiddens) of each call, as the layer's own)."""
    given = layer.get_weights() if isinstance(layer, AttentionCall) else layer  # an mlx layer is a dict
    weights = {name: np.asarray(w) for name, w in given.items()}
    missing = [n for n in ("W_q", "W_k", "w_v") if n not in weights]
    if missing:
        raise ValueError(
            f"additive weights must hold W_q, W_k and w_v, got {sorted(weights)}: no {missing[0]}"
        )
    g = Graph(spec.dtype)
    sizes = {"queries": weights["W_q"].shape[1], "keys": weights["W_k"].shape[1], "values": "value_size"}
    x = {
        n: g.input(n, spec.dtype, ("batch", "keys" if n != "queries" else n, size))
        for n, size in sizes.items()
    }
    fq, fk = (
        g.op("MatMul", [x[n], g.constant(weights[w].T, spec.dtype, hint=w)], spec.dtype, (None,) * 3)
        for n, w in (("queries", "W_q"), ("keys", "W_k"))
    )
    features = ops.tanh(ops.expand_dims(fq, 2) + ops.expand_dims(fk, 1))  # (batch, queries, keys, hiddens)
    w_v = g.constant(weights["w_v"], spec.dtype, hint="w_v")
    scores = g.op("MatMul", [features, w_v], spec.dtype, (None,) * 3)
    scores = ops.expand_dims(scores, 1)  # one head: the masks' and score functions' layout
    batch, n_queries, n_keys = g.size(x["queries"], 0), g.size(x["queries"], 1), g.size(x["keys"], 1)
    block = (0, n_queries, 0, n_keys)
    if spec.score_mod is not None:
        scores = mods.apply_score_mod(ops, spec.score_mod, scores, block, batch)
    mask, _ = _mask(g, spec, scores, block, batch, n_keys, False)
    weights = _softmax_weights(g, scores, mask)
    out = g.op("MatMul", [weights, ops.expand_dims(x["values"], 1)], spec.dtype, (None,) * 4)
    return {"output": g.op("Squeeze", [out, g.constant([1])], spec.dtype, (None,) * 3)}, g


def _weights_of(layer: Any, num_heads: Any, num_kv_heads: Any) -> tuple:
    """(canonical weights as numpy, heads, key/value heads) of a layer or of a weights dict."""
    is_layer = callable(getattr(layer, "get_weights", None)) and hasattr(layer, "num_heads")
    if isinstance(layer, Mapping) and not is_layer:  # an mlx.nn.Module is a dict: a layer first
        if num_heads is None:
            raise TypeError("export of multi_head_attention's weights needs num_heads= (and num_kv_heads=)")
        weights = {name: np.asarray(w) for name, w in layer.items()}
        missing = [n for n in ("W_q", "W_k", "W_v", "W_o") if n not in weights]
        if missing:
            raise ValueError(
                f"weights must hold W_q, W_k, W_v and W_o, got {sorted(weights)}: no {missing[0]}"
            )
        heads, kv_heads = num_heads, num_heads if num_kv_heads is None else num_kv_heads
        _check_heads(heads, kv_heads)
        rows_q, rows_k = weights["W_q"].shape[0], weights["W_k"].shape[0]
        if rows_q % heads or rows_k * heads != rows_q * kv_heads:
            raise ValueError(
                f"W_q {weights['W_q'].shape} and W_k {weights['W_k'].shape} must have num_heads={heads} and "
                f"num_kv_heads={kv_heads} heads of one width"
            )
        return weights, heads, kv_heads
    if num_heads is not None or num_kv_heads is not None:
        raise TypeError("num_heads= and num_kv_heads= go with a weights dict; a layer has its own")
    if not is_layer:
        raise TypeError(
            "layer must be a multiattn MultiHeadAttention (of any framework) or multi_head_attention's "
            f"weights (a dict), got {type(layer).__name__}"
        )
    heads = layer.num_heads
    weights = {name: np.asarray(w) for name, w in layer.get_weights().items()}
    return weights, heads, getattr(layer, "num_kv_heads", None) or heads


# -- what both build -------------------------------------------------------------------------


class _Spec:
    """An export's arguments, checked (ValueError or TypeError naming the argument)."""

    def __init__(self, heads, kv_heads, head_dim, causal, mask_mod, score_mod, scale, lengths,
                 attention_mask, query_offset, cache, opset, dtype) -> None:  # fmt: skip
        if opset not in OPSETS:
            raise ValueError(f"opset must be one of {OPSETS} (ONNX's Attention node), got {opset!r}")
        if str(dtype) not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        for arg, flag in (("causal", causal), ("attention_mask", attention_mask), ("cache", cache)):
            if not isinstance(flag, bool):
                raise TypeError(f"{arg} must be True or False, got {flag!r}")
        if not isinstance(lengths, bool) and lengths != "per_query":
            raise TypeError(f"lengths must be True, False or 'per_query', got {lengths!r}")
        if isinstance(query_offset, bool) or not isinstance(query_offset, int):
            raise TypeError(f"query_offset must be an int (the first query's position), got {query_offset!r}")
        if cache and query_offset:
            raise ValueError("cache=True places the queries after the past keys: query_offset must be 0")
        for arg, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
            if fn is not None and not callable(fn) and fn is not mods.document:
                raise TypeError(f"{arg} must be a function (as in multiattn.mods) or None, got {fn!r}")
        if scale is not None and (
            isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0
        ):
            raise ValueError(f"scale must be a number > 0 or None (1 / sqrt(head_dim)), got {scale!r}")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.causal, self.mask_mod, self.score_mod = causal, mask_mod, score_mod
        # head_dim None (a layer without weights takes any width): the node's 1 / sqrt(width)
        self.scale = None if scale is None and head_dim is None else float(scale or 1 / math.sqrt(head_dim))
        self.lengths, self.attention_mask, self.query_offset = lengths, attention_mask, query_offset
        self.cache, self.opset, self.dtype = cache, opset, np.dtype(str(dtype))

    def __str__(self) -> str:
        names = ("heads", "kv_heads", "head_dim", "causal", "mask_mod", "score_mod", "scale", "lengths",
                 "attention_mask", "query_offset", "cache")  # fmt: skip
        shown = {name: getattr(self, name) for name in names}
        return ", ".join(f"{k}={v!r}" for k, v in shown.items() if v not in (None, False, 0) or k == "scale")


def _attend(g: Graph, q: Value, k: Value, v: Value, spec: _Spec, value_dim: int) -> dict:
    """{"output": ..., and with a cache "present_key", "present_value"}: one ``Attention`` node
    over q, k, v (4-D, or 3-D as the layers' projections give them), its mask or bias built here."""
    three_d = q.ndim == 3
    seq = 1 if three_d else 2
    batch, n_queries = g.size(q, 0), g.size(q, seq)
    past_key = past_value = None
    n_keys: Any = g.size(k, seq)
    offset: Any = spec.query_offset
    if spec.cache:
        past_key = g.input("past_key", spec.dtype, ("batch", spec.kv_heads, "past", spec.head_dim))
        past_value = g.input("past_value", spec.dtype, ("batch", spec.kv_heads, "past", value_dim))
        offset = g.size(past_key, 2)
        n_keys = offset + n_keys
    first = n_queries if isinstance(offset, int) and offset == 0 else offset + n_queries
    block = (offset, first, 0, n_keys)  # the queries at their positions, every key
    softcap, bias = None, None
    if isinstance(spec.score_mod, mods.softcap):
        softcap = spec.score_mod.c
    elif spec.score_mod is not None:
        bias = _bias(g, spec.score_mod, q, spec.heads, block, batch)
    fused = spec.score_mod is None or softcap is not None or bias is not None
    # ONNX forbids nonpad_kv_seqlen beside a past
    mask, nonpad = _mask(g, spec, q, block, batch, n_keys, fused and spec.opset >= 24 and not spec.cache)
    if not fused:  # a score function the node cannot take: the graph of the formula
        return _unfused(g, q, k, v, spec, mask, past_key, past_value, block, batch)
    attn_mask = bias if mask is None else mask if bias is None else ops.select(mask, bias, -math.inf)
    if attn_mask is not None:  # the queries and keys axes whole, as the runtimes want them
        attn_mask = g.op("Expand", [attn_mask, g.shape_of(1, 1, n_queries, n_keys)], attn_mask.dtype, None)

    attributes = dict(is_causal=0) if spec.scale is None else dict(scale=spec.scale, is_causal=0)
    if softcap is not None:
        attributes["softcap"] = softcap
    if three_d:
        attributes.update(q_num_heads=spec.heads, kv_num_heads=spec.kv_heads)
    inputs = [q, k, v, attn_mask, past_key, past_value] + ([nonpad] if nonpad is not None else [])
    width = None if value_dim is None else spec.heads * value_dim
    out_shape = (None, None, width) if three_d else (None, spec.heads, None, value_dim)
    if not spec.cache:
        return {"output": g.op("Attention", inputs, spec.dtype, out_shape, **attributes)}
    out, present_key, present_value = g.op(
        "Attention", inputs, spec.dtype, out_shape, outputs=3, **attributes
    )
    present_key.shape, present_value.shape = past_key.shape, past_value.shape
    return {"output": out, "present_key": present_key, "present_value": present_value}


def _mask(g: Graph, spec: _Spec, like: Value, block: tuple, batch: Value, n_keys: Any, nonpad_ok: bool):
    """(the boolean mask (batch or 1, 1, queries or 1, keys) or None, nonpad_kv_seqlen or None):
    causality, the mask function, the lengths (as the node's nonpad_kv_seqlen where nonpad_ok),
    the given mask."""
    mask, nonpad = None, None
    fns = ([mods.causal_mask()] if spec.causal else []) + (
        [_with_ids(g, spec.mask_mod)] if spec.mask_mod else []
    )
    for fn in fns:
        found = fn.values(ops, like, spec.heads, block, batch)
        mask = found if mask is None else ops.logical_and(mask, found)
    if spec.lengths:
        per_query = spec.lengths == "per_query"
        lens = g.input("valid_lens", np.int64, ("batch", "queries") if per_query else ("batch",))
        if nonpad_ok and not per_query:  # clipped to [0, keys] as multiattn reads them
            nonpad = g.op(
                "Max", [g.op("Min", [lens, n_keys], np.int64, (None,)), g.value(0)], np.int64, (None,)
            )
        else:
            keys = ops.reshape(ops.positions(0, n_keys, like), (1, 1, 1, -1))
            if per_query:  # (batch, queries) -> (batch, 1, queries, 1)
                bound = ops.expand_dims(ops.expand_dims(lens, 1), -1)
            else:
                bound = ops.reshape(lens, (-1, 1, 1, 1))
            found = keys < bound
            mask = found if mask is None else ops.logical_and(mask, found)
    if spec.attention_mask:
        keys = "past_and_keys" if spec.cache else "keys"  # every key the queries see
        given = ops.expand_dims(g.input("attention_mask", np.bool_, ("batch", "queries", keys)), 1)
        mask = given if mask is None else ops.logical_and(mask, given)
    return mask, nonpad


def _unfused(g: Graph, q, k, v, spec: _Spec, mask, past_key, past_value, block: tuple, batch: Value) -> dict:
    """``_attend``'s outputs by the formula's operations (no ``Attention`` node): the scores,
    the score function on them, the softmax over the visible ones, the values.  The query
    heads of one key/value head are rows of one product (the keys and values never repeated)."""
    three_d = q.ndim == 3
    if three_d:  # (batch, n, heads * width) -> (batch, heads, n, width)
        heads = (spec.heads, spec.kv_heads, spec.kv_heads)
        q, k, v = (_split_heads(g, x, h) for x, h in zip((q, k, v), heads))
    found = {}  # present_key, present_value
    if past_key is not None:
        pairs = ((past_key, k), (past_value, v))
        k, v = (g.op("Concat", [p, x], spec.dtype, p.shape, axis=2) for p, x in pairs)
        found.update(present_key=k, present_value=v)
    scale = spec.scale
    if scale is None:  # 1 / sqrt(width), the width known when the model runs
        width = ops.cast(g.size(q, 3), q)
        scale = g.op("Reciprocal", [g.op("Sqrt", [width], spec.dtype, ())], spec.dtype, ())
    by_kv = (0, spec.kv_heads, -1, 0)  # each key/value head's query heads as rows
    k_t = g.op("Transpose", [k], spec.dtype, (None,) * 4, perm=[0, 1, 3, 2])
    scores = g.op("MatMul", [_reshape(q, by_kv), k_t], spec.dtype, (None,) * 4)
    scores = _reshape(scores, (0, spec.heads, -1, 0)) * scale
    scores = mods.apply_score_mod(ops, spec.score_mod, scores, block, batch)
    weights = _reshape(_softmax_weights(g, scores, mask), by_kv)
    out = _reshape(g.op("MatMul", [weights, v], spec.dtype, (None,) * 4), (0, spec.heads, -1, 0))
    if three_d:  # back to (batch, n, heads * width)
        out = _reshape(g.op("Transpose", [out], spec.dtype, (None,) * 4, perm=[0, 2, 1, 3]), (0, 0, -1))
    return {"output": out, **found}  # the node's order: output, then present_key, present_value


def _split_heads(g: Graph, x: Value, heads: int) -> Value:
    return g.op("Transpose", [_reshape(x, (0, 0, heads, -1))], x.dtype, (None,) * 4, perm=[0, 2, 1, 3])


def _reshape(x: Value, shape: tuple) -> Value:
    """ONNX's Reshape: 0 keeps the input's size on that axis, -1 takes what is left."""
    g = x.graph
    known = tuple(None if size in (0, -1) else size for size in shape)
    return g.op("Reshape", [x, g.constant(np.asarray(shape, np.int64))], x.dtype, known)


def _softmax_weights(g: Graph, scores: Value, mask: Optional[Value]) -> Value:
    """The softmax over each row's visible scores (mask, and not -inf); 0 for the others, and
    a row that sees nothing all 0 (hidden scores as the lowest float: no NaN)."""
    shown = scores != -math.inf
    shown = shown if mask is None else ops.logical_and(mask, shown)
    lowest = float(np.finfo(scores.dtype).min)
    weights = g.op("Softmax", [ops.select(shown, scores, lowest)], scores.dtype, scores.shape, axis=-1)
    return ops.select(shown, weights, 0.0)


def _with_ids(g: Graph, fn: Any) -> mods.MaskFunction:
    """fn with every ``mods.document`` in it reading the graph's input document_ids (batch, keys)."""
    if fn is mods.document or isinstance(fn, mods.document):
        ids = [x for x in g.inputs if x.name == "document_ids"]
        found = Value(g, "document_ids", np.int64, (None, None))
        if not ids:
            past = any(x.name == "past_key" for x in g.inputs)
            g.input("document_ids", np.int64, ("batch", "past_and_keys" if past else "keys"))
        return mods.document(found, found)
    if isinstance(fn, (mods.and_masks, mods.or_masks)):
        return type(fn)(*[_with_ids(g, part) for part in fn.fns])
    if isinstance(fn, mods.at_offset):
        return mods.at_offset(_with_ids(g, fn.fn), fn.offset, fn.kv_offset)
    return mods.as_mask_function(fn)


def _bias(g: Graph, score_mod: Any, like: Value, heads: int, block: tuple, batch: Value) -> Value:
    """What score_mod adds to the scores (score + f(b, h, q_idx, kv_idx)), as graph operations;
    None for a function that does something else with them (the node takes only a bias)."""
    score = Value(g, g.fresh("score"), like.dtype, (None, heads, None, None))
    found = mods.apply_score_mod(ops, score_mod, score, block, batch)
    producer = {out: node for node in g.nodes for out in node.output}
    node = producer.get(found.name)
    if node is not None and node.op_type == "Add" and score.name in node.input:
        other = node.input[1] if node.input[0] == score.name else node.input[0]
        if score.name not in _ancestors(producer, other):
            return Value(g, other, like.dtype, (None, None, None, None))
    return None


def _ancestors(producer: dict, name: str) -> set:
    seen, stack = set(), [name]
    while stack:
        tensor = stack.pop()
        if tensor in seen:
            continue
        seen.add(tensor)
        node = producer.get(tensor)
        if node is not None:
            stack.extend(i for i in node.input if i)
    return seen


def _check_heads(heads: Any, kv_heads: Any) -> None:
    _size("num_heads", heads)
    _size("num_kv_heads", kv_heads)
    if heads % kv_heads:
        raise ValueError(f"num_kv_heads must divide num_heads={heads}, got {kv_heads}")


def _size(arg: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{arg} must be an int >= 1, got {value!r}")
    return int(value)


def _save(model: Any, path: Any) -> Any:
    onnx = _onnx()
    onnx.checker.check_model(model)
    if path is not None:
        onnx.save(model, path)
    return model
