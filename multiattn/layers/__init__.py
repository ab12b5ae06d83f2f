"""The framework-native layer classes, one module per framework (``multiattn.layers.torch``,
...), and what they all share: argument checks, canonical weights and the call into
``multiattn.core`` (``AttentionCall``).

The canonical (math) layout of the weights is the one of d2l's formulas, y = W x:
additive a(q, k) = w_v^T tanh(W_q q + W_k k) has W_q (num_hiddens, query_size),
W_k (num_hiddens, key_size), w_v (num_hiddens,); multi-head attention has W_q
(num_hiddens, query_size), W_k, W_v (kv_hiddens, key/value_size), W_o (num_hiddens,
num_hiddens) and, with bias, b_q, b_o (num_hiddens,), b_k, b_v (kv_hiddens,), where
kv_hiddens = num_kv_heads * num_hiddens / num_heads (num_hiddens unless grouped-query
attention gives fewer key/value heads).  Adapters only say how to read and write one of
their own parameters (``_parameter``, ``_assign``).
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import numpy as np

from .. import core, validation
from ..adapter import Ops
from ..block_mask import unpacked
from ..cache import KVCache, cached_attention
from ..protocol import Tensor

WEIGHT_NAMES = ("W_q", "W_k", "w_v")
CanonicalWeights = Dict[str, np.ndarray]

# The keywords of the layers' calls and their defaults; a layer takes those of its ``_takes``.
CALL_KEYWORDS = {
    "attention_mask": None, "causal": False, "score_mod": None, "mask_mod": None, "block_mask": None,
    "cache": None,
}  # fmt: skip


def check_dropout(dropout: Any) -> float:
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
    return float(dropout)


def check_size(arg: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{arg} must be a positive integer, got {value!r}")
    return int(value)


def check_sizes(key_size: Any, query_size: Any, num_hiddens: Any) -> tuple[int, int, int]:
    return (
        check_size("key_size", key_size),
        check_size("query_size", query_size),
        check_size("num_hiddens", num_hiddens),
    )


def check_multi_head_sizes(num_hiddens: Any, num_heads: Any, sizes: tuple) -> tuple[int, int, tuple]:
    """(num_hiddens, num_heads, (query_size, key_size, value_size)), the sizes defaulting to
    num_hiddens; ValueError naming the argument."""
    num_hiddens = check_size("num_hiddens", num_hiddens)
    validation.check_num_heads(num_heads, num_hiddens)
    widths = tuple(
        num_hiddens if size is None else check_size(arg, size)
        for arg, size in zip(("query_size", "key_size", "value_size"), sizes)
    )
    return num_hiddens, num_heads, widths


def weight_shapes(key_size: int, query_size: int, num_hiddens: int) -> dict[str, tuple[int, ...]]:
    return {"W_q": (num_hiddens, query_size), "W_k": (num_hiddens, key_size), "w_v": (num_hiddens,)}


def canonical_weights(weights: Mapping[str, Any], shapes: Mapping[str, tuple]) -> CanonicalWeights:
    """Check a dict of canonical weights against a layer's shapes (name -> shape); numpy copies."""
    names = tuple(shapes)
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a dict with keys {', '.join(names)}, got {type(weights).__name__}")
    unknown = sorted(set(weights) - set(names))
    missing = [k for k in names if k not in weights]
    if unknown or missing:
        raise ValueError(
            f"weights must have exactly the keys {', '.join(names)}; "
            f"missing {missing or 'none'}, unknown {unknown or 'none'}"
        )
    out = {}
    for key, expected in shapes.items():
        value = np.array(weights[key])  # a copy: the layer never aliases the caller's array
        if value.shape != expected:
            raise ValueError(f"weights[{key!r}] must have shape {expected}, got {value.shape}")
        if value.dtype.kind not in "iuf":
            raise ValueError(f"weights[{key!r}] must be real numbers, got dtype {value.dtype}")
        out[key] = value
    return out


class CanonicalWeightsMixin:
    """get_weights()/set_weights() in the canonical layout, for every adapter.

    A class says which weights it has (``_weight_shapes``: name -> canonical shape) and how
    its framework stores matrices (``_stored_in_out``: (in, out) as Keras, flax and paddle;
    else (out, in) as torch, mlx and mxnet); its framework's base class reads a parameter as
    stored (``_parameter(name)``) and writes one from a numpy array in the stored layout
    (``_assign(name, array)``, reshaped to the parameter's shape)."""

    _to_numpy: Callable[[Any], np.ndarray]  # _stored_in_out: from AttentionCall or the framework's base

    def _weight_shapes(self) -> Dict[str, Tuple[int, ...]]:
        raise NotImplementedError

    # _parameter(name) -> Tensor and _assign(name, array) come from the framework's base class

    def _stored(self, value: np.ndarray) -> np.ndarray:
        """A canonical matrix in the stored layout (and back: a transpose is its own inverse)."""
        return np.ascontiguousarray(value.T) if value.ndim == 2 and self._stored_in_out else value

    def _read_weights(self) -> CanonicalWeights:
        return {
            name: np.array(self._stored(self._to_numpy(self._parameter(name)))).reshape(shape)
            for name, shape in self._weight_shapes().items()
        }

    def get_weights(self) -> CanonicalWeights:
        """The weights in the canonical layout (W: (out, in) as in y = W x), numpy arrays."""
        return self._read_weights()

    def set_weights(self, weights: Mapping[str, Any]) -> None:
        """Load weights given in the canonical layout (see get_weights)."""
        for name, value in canonical_weights(weights, self._weight_shapes()).items():
            self._assign(name, self._stored(value))


class AdditiveWeights(CanonicalWeightsMixin):
    """W_q (num_hiddens, query_size), W_k (num_hiddens, key_size), w_v (num_hiddens,); the
    call takes no block_mask= and no cache=."""

    key_size: int
    query_size: int
    num_hiddens: int
    _takes = ("attention_mask", "causal", "score_mod", "mask_mod")

    def _set_sizes(self, key_size: Any, query_size: Any, num_hiddens: Any) -> None:
        self.key_size, self.query_size, self.num_hiddens = check_sizes(key_size, query_size, num_hiddens)

    def _weight_shapes(self):
        return weight_shapes(self.key_size, self.query_size, self.num_hiddens)

    def _build(self, **options: Any) -> None:
        """W_k, W_q, w_v without bias, in this order (the frameworks' parameter order and
        initial values), through the framework's ``_add_linear``."""
        h = self.num_hiddens
        for name, sizes in (("W_k", (self.key_size, h)), ("W_q", (self.query_size, h)), ("w_v", (h, 1))):
            self._add_linear(name, *sizes, False, **options)

    def _attention(self, queries, keys, values, valid_lens, dropout, need_weights, **keywords):
        return self._additive(queries, keys, values, valid_lens, dropout, **keywords)  # always weights


class MultiHeadWeights(CanonicalWeightsMixin):
    """W_q (h, query_size), W_k (kv, key_size), W_v (kv, value_size), W_o (h, h) and, with
    bias, b_q, b_o (h,), b_k, b_v (kv,); h = num_hiddens, kv = ``_kv_hiddens()``."""

    num_hiddens: int
    num_heads: int
    num_kv_heads: int
    query_size: int
    key_size: int
    value_size: int
    bias: bool

    def _set_sizes(
        self, num_hiddens: Any, num_heads: Any, sizes: tuple, bias: Any, num_kv_heads: Any
    ) -> None:
        """Check and keep the sizes (``check_multi_head_sizes``), ``num_kv_heads`` (None: one
        key/value head per query head, kept as num_heads) and ``bias``; ValueError naming the argument."""
        self.num_hiddens, self.num_heads, sizes = check_multi_head_sizes(num_hiddens, num_heads, sizes)
        self.num_kv_heads = validation.check_num_kv_heads(num_kv_heads, self.num_heads)
        self.query_size, self.key_size, self.value_size = sizes
        self.bias = bool(bias)

    def _kv_hiddens(self) -> int:
        """The rows of W_k and W_v: num_kv_heads heads of num_hiddens / num_heads."""
        # getattr: a layer pickled before num_kv_heads existed has one key/value head per query head
        return validation.kv_hiddens(self.num_hiddens, self.num_heads, getattr(self, "num_kv_heads", None))

    def _weight_shapes(self):
        return validation.multi_head_weight_shapes(
            self.num_hiddens, self.query_size, self.key_size, self.value_size, self.bias,
            kv_width=self._kv_hiddens(),
        )  # fmt: skip

    def _build(self, **options: Any) -> None:
        """W_q, W_k, W_v, W_o (with bias where ``bias``), in this order (the frameworks'
        parameter order and initial values), through the framework's ``_add_linear``."""
        shapes = self._weight_shapes()
        for name in ("W_q", "W_k", "W_v", "W_o"):
            rows, columns = shapes[name]
            self._add_linear(name, columns, rows, self.bias, **options)

    _takes = tuple(CALL_KEYWORDS)

    def _attention(self, *args, **keywords):
        return self._multi_head(*args, **keywords)


class AttentionCall:
    """The call from a layer into the core, shared by every framework's classes.

    A framework's layers set ``_ops`` (the backend's ``Ops``); layers with parameters are also
    ``CanonicalWeightsMixin``s (``_parameter`` and ``_stored_in_out``).
    """

    _ops: Ops
    _stored_in_out: bool = False
    query_size: Optional[int] = None
    key_size: Optional[int] = None

    _weight_field = "weight"  # what the framework's linear map calls its matrix (flax: kernel)

    def _linear_and_field(self, name: str) -> Tuple[Any, str]:
        """Where the parameter of a canonical name lives, for layers made of linear maps:
        W_q and b_q are the matrix and bias of the map W_q; w_v is its own map's matrix."""
        if name.startswith("b_"):
            return getattr(self, "W_" + name[2:]), "bias"
        return getattr(self, name), self._weight_field

    def _variable(self, name: str) -> Any:
        """The framework's parameter of a canonical name (see ``_linear_and_field``)."""
        linear, field = self._linear_and_field(name)
        return getattr(linear, field)

    # The call's keywords (dot-product attention's; AdditiveWeights and MultiHeadWeights say theirs)
    _takes: Tuple[str, ...] = ("attention_mask", "causal", "score_mod", "mask_mod", "block_mask")

    def _add_linear(self, name: str, in_size: int, out_size: int, bias: bool, **options: Any) -> None:
        """The framework's hook: a linear map in_size -> out_size named ``name`` (for Keras, its
        kernel and bias b_<name>), made with the framework's ``options``."""
        raise NotImplementedError

    def _wants_weights(self) -> bool:
        """need_weights (additive attention has none: it always keeps its weights)."""
        return getattr(self, "need_weights", True)

    def _call_keywords(self, given: Mapping[str, Any], none_absent: bool = False) -> Dict[str, Any]:
        """The keywords of a call, checked (TypeError for one this layer does not take, see
        ``_no_unknown``; ``none_absent``: one of CALL_KEYWORDS given as None counts as not
        given), as every keyword of ``_takes`` with its default where not given."""
        unknown = {
            name: value for name, value in given.items()
            if name not in self._takes and not (none_absent and value is None and name in CALL_KEYWORDS)
        }  # fmt: skip
        self._no_unknown(unknown)
        return {name: given.get(name, CALL_KEYWORDS[name]) for name in self._takes}

    def _attend(self, queries, keys, values, valid_lens, dropout, keywords, keep_weights=False):
        """(output, weights or None) of this layer's attention: what every framework's call
        does with its inputs, its dropout now (None, or a function on the weights) and the
        keywords it was given (a dict, see ``_call_keywords``); keep_weights: weights even
        with need_weights=False (flax's return_weights)."""
        keywords = self._call_keywords(keywords)
        need_weights = self._wants_weights() or keep_weights
        return self._attention(queries, keys, values, valid_lens, dropout, need_weights, **keywords)

    def _attention(self, *args, **keywords):
        return self._dot_product(*args, **keywords)

    def _no_unknown(self, unknown: dict) -> None:
        """TypeError for keywords the call does not take: did you mean, or ours for torch's."""
        if "cache" in unknown:
            raise TypeError(
                f"{type(self).__name__} takes no cache=: MultiHeadAttention's call decodes with one "
                "(multiattn.cached_attention for the functions)"
            )
        if unknown:
            keywords = ("valid_lens", "attention_mask", "causal", "score_mod", "mask_mod", "block_mask")
            validation.unknown_keywords(f"{type(self).__name__}.__call__", unknown, keywords)

    def _check(self, queries, keys, values, valid_lens, attention_mask):
        self._ops.check_tensors(
            queries=queries, keys=keys, values=values, valid_lens=valid_lens, attention_mask=attention_mask
        )

    def _dot_product(
        self, queries, keys, values, valid_lens, dropout, need_weights=True, attention_mask=None,
        causal=False, score_mod=None, mask_mod=None, block_mask=None,
    ):  # fmt: skip
        """(output, weights or None) of dot-product attention."""
        self._check(queries, keys, values, valid_lens, attention_mask)
        valid_lens, attention_mask, causal, mask_mod, block_size = unpacked(
            block_mask, self._ops, queries, keys, valid_lens, attention_mask, causal, mask_mod, None,
            need_weights,
        )  # fmt: skip
        masks = validation.dot_product_call(
            self._ops, queries, keys, values, valid_lens, attention_mask, causal
        )
        score_mod, masks = validation.with_mods(
            score_mod, mask_mod, masks, validation.mod_sizes(self._ops, queries, keys)
        )
        return core.dot_product_attention(
            self._ops, queries, keys, values, masks.with_block_mask(block_mask), dropout=dropout,
            need_weights=need_weights, score_mod=score_mod, block_size=block_size,
        )  # fmt: skip

    def _project(self, name: str, like: Tensor) -> Callable[[Tensor], Tensor]:
        """x -> W x (+ b) with this layer's parameters W_<name> (and b_<name>), cast to like's
        dtype (computed in the inputs' dtype; a no-op where they match)."""
        ops = self._ops
        W = ops.cast(self._parameter("W_" + name), like)
        b = ops.cast(self._parameter("b_" + name), like) if getattr(self, "bias", False) else None
        if not self._stored_in_out:
            return lambda x: core.linear(ops, x, W, b)
        return lambda x: ops.matmul(x, W) if b is None else ops.matmul(x, W) + b

    def _additive(
        self, queries, keys, values, valid_lens, dropout, attention_mask=None, causal=False, score_mod=None,
        mask_mod=None,
    ):  # fmt: skip
        """(output, weights) of additive attention with this layer's parameters."""
        self._check(queries, keys, values, valid_lens, attention_mask)
        ops = self._ops
        masks = validation.additive_call(
            ops, queries, keys, values, valid_lens, attention_mask, causal, self.query_size, self.key_size
        )
        score_mod, masks = validation.with_mods(
            score_mod, mask_mod, masks, validation.mod_sizes(self._ops, queries, keys)
        )
        return core.additive_attention(
            ops, queries, keys, values, masks,
            project_q=self._project("q", queries), project_k=self._project("k", queries),
            w_v=ops.cast(self._w_v(), queries), dropout=dropout, score_mod=score_mod,
        )  # fmt: skip

    def _multi_head(
        self, queries, keys, values, valid_lens, dropout, need_weights, attention_mask, causal,
        score_mod=None, mask_mod=None, block_mask=None, cache=None,
    ):  # fmt: skip
        """(output, weights or None) of multi-head attention with this layer's parameters; with
        a cache, ((output, cache), None) (``_decoding``)."""
        self._check(queries, keys, values, valid_lens, attention_mask)
        if cache is not None:
            return self._decoding(queries, keys, values, cache, causal, score_mod, mask_mod, valid_lens,
                                  attention_mask, block_mask), None  # fmt: skip
        valid_lens, attention_mask, causal, mask_mod, block_size = unpacked(
            block_mask, self._ops, queries, keys, valid_lens, attention_mask, causal, mask_mod, None,
            need_weights,
        )  # fmt: skip
        sizes = (self.query_size, self.key_size, self.value_size)
        masks = validation.multi_head_call(
            self._ops,
            queries,
            keys,
            values,
            valid_lens,
            attention_mask,
            causal,
            self.num_heads,
            self.num_hiddens,
            sizes,
        )
        score_mod, masks = validation.with_mods(
            score_mod, mask_mod, masks, validation.mod_sizes(self._ops, queries, keys)
        )
        return core.multi_head_attention(
            self._ops, queries, keys, values, masks.with_block_mask(block_mask),
            project={n: self._project(n, queries) for n in "qkvo"}, num_heads=self.num_heads,
            num_hiddens=self.num_hiddens, dropout=dropout, need_weights=need_weights, score_mod=score_mod,
            num_kv_heads=getattr(self, "num_kv_heads", None),  # None: pickled before it existed
            block_size=block_size,
        )  # fmt: skip

    def _decoding(
        self, queries, keys, values, cache, causal, score_mod, mask_mod, valid_lens, attention_mask,
        block_mask,
    ):  # fmt: skip
        """(output, cache): the keys and values of these positions, projected, appended to the
        cache, and the queries, projected, attending over every position it holds
        (``multiattn.cached_attention``): no projection recomputed, no weights, no dropout."""
        if not (valid_lens is None and attention_mask is None and block_mask is None):
            raise ValueError(
                "cache= takes causal=, mask_mod= and score_mod=: valid_lens, attention_mask and "
                "block_mask hide keys of one call, not the cache's positions"
            )
        ops = self._ops
        sizes = (self.query_size, self.key_size, self.value_size)
        validation.multi_head_call(
            ops, queries, keys, values, None, None, causal, self.num_heads, self.num_hiddens, sizes
        )
        project = {n: self._project(n, queries) for n in "qkvo"}
        kv_heads = getattr(self, "num_kv_heads", None) or self.num_heads
        q = ops.split_heads(project["q"](queries), self.num_heads)
        k, v = (ops.split_heads(project[n](x), kv_heads) for n, x in zip("kv", (keys, values)))
        out, cache = cached_attention(q, k, v, cache, causal=causal, score_mod=score_mod, mask_mod=mask_mod)
        return project["o"](ops.merge_heads(out)), cache

    def new_cache(self, batch: int, *, like: Tensor, page_size: Optional[int] = None, capacity: int = 0):
        """An empty ``multiattn.KVCache`` for this layer's projected keys and values (its
        key/value heads of num_hiddens / num_heads), in like's dtype and device, for ``cache=``."""
        kv_heads = getattr(self, "num_kv_heads", None) or self.num_heads
        return KVCache(
            batch,
            kv_heads,
            self.num_hiddens // self.num_heads,
            like=like,
            page_size=page_size,
            capacity=capacity,
        )
