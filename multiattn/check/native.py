"""``multiattn check --native``: each framework's OWN attention through check's battery.

Every implementation below is wrapped as a "user function" of its kind (the signature that
``check.against.run_function`` takes) that only translates multiattn's arguments into the
native API, and is judged like ``check --against``: against the same float64 reference, in
every dtype, values and gradients, inputs checked for writes.  A disagreement is the
framework's, not the wrapper's: with no mask every wrapper agrees with the reference
(tests/test_native.py), and the translations are these:

* lengths: a boolean mask ``arange(keys) < length`` (per batch row for 1-D lengths, per
  query for 2-D), so zero, negative and over-long lengths mean what they mean in
  multiattn; where the native API takes lengths or a padding mask, 1-D lengths go there:
  ``key_padding_mask`` of ``torch.nn.MultiheadAttention`` and ``key_value_seq_lengths`` of
  ``jax.nn.dot_product_attention`` (its second row);
* ``attention_mask`` (True = may attend): as it is where the native polarity is the same
  (torch SDPA, Keras, jax, flax, paddle, mlx), inverted (``~mask``) for
  ``torch.nn.MultiheadAttention``'s ``attn_mask`` / ``key_padding_mask`` (True = may NOT);
  all masks of one case are ANDed into one where the API takes one;
* ``causal=True`` (top-left): the native flag where it has the same alignment and can be
  combined with the case's other masks (torch SDPA and paddle SDPA alone: they refuse or
  ignore a mask beside it; Keras and jax always), else an explicit lower-triangular mask
  (``torch.nn.MultiheadAttention``, flax, paddle's layer, mlx, whose ``mask="causal"`` is
  bottom-right aligned when queries != keys);
* multi-head layers: built by multiattn's ``MultiHeadAttention.to_native()`` for the
  case's sizes (4-wide queries, 3-wide keys and values, num_hiddens 4, 2 heads, biases),
  their parameters then replaced by the battery's canonical weights in the native layout
  (``multiattn.layers.native``'s converters), as framework tensors, so that gradients
  reach them (torch ``functional_call``, Keras ``stateless_call``, flax variables, paddle
  and mlx attributes);
* ``jax.nn.dot_product_attention`` needs values as wide as the keys: the 3-wide values are
  zero-padded to the key width and the output's extra columns dropped (exact: the weights
  are the framework's, each output column is its own weighted sum).

A size a native layer cannot take is a row with status ``unsupported: <why>``.
"""

from __future__ import annotations

import datetime
import importlib
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import reference
from .cases import MASKS, Case, tolerance

Results = Dict[str, dict]


class Unsupported(Exception):
    """A native implementation cannot express the case (its sizes, its arguments)."""


# ---------------------------------------------------------------- mask conversions (numpy)


def causal_mask(queries: int, keys: int) -> np.ndarray:
    """(queries, keys) True where query i may see key j: j <= i (top-left, multiattn's)."""
    return np.arange(keys)[None, :] <= np.arange(queries)[:, None]


def lengths_mask(valid_lens: Any, batch: int, queries: int, keys: int) -> np.ndarray:
    """(batch, queries, keys) True = visible: ``key < length``, lengths (batch,) or (batch, queries)."""
    lens = np.asarray(valid_lens)
    lens = lens[:, None] if lens.ndim == 1 else lens
    return np.broadcast_to(np.arange(keys) < lens[..., None], (batch, queries, keys))


def visible(
    valid_lens: Any, attention_mask: Any, causal: bool, batch: int, queries: int, keys: int
) -> Optional[np.ndarray]:
    """(batch, queries, keys) True = may attend: lengths AND mask AND causality; None if
    nothing is masked (the native no-mask path)."""
    if valid_lens is None and attention_mask is None and not causal:
        return None
    out = np.ones((batch, queries, keys), dtype=bool)
    if valid_lens is not None:
        out &= lengths_mask(valid_lens, batch, queries, keys)
    if attention_mask is not None:
        out &= np.broadcast_to(np.asarray(attention_mask).astype(bool), out.shape)
    if causal:
        out &= causal_mask(queries, keys)
    return out


def torch_mha_masks(
    valid_lens: Any, attention_mask: Any, causal: bool, batch: int, queries: int, keys: int, num_heads: int
) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """(key_padding_mask (batch, keys), attn_mask (batch * num_heads, queries, keys)) of
    ``torch.nn.MultiheadAttention``: True = may NOT attend.  1-D lengths become the padding
    mask; 2-D lengths, the boolean mask and causality the attention mask (None: not given)."""
    padding = None
    if valid_lens is not None and np.ndim(valid_lens) == 1:
        padding = ~(np.arange(keys)[None, :] < np.asarray(valid_lens)[:, None])
        valid_lens = None
    allowed = visible(valid_lens, attention_mask, causal, batch, queries, keys)
    attn = None if allowed is None else np.repeat(~allowed, num_heads, axis=0)  # batch-major, as torch
    return padding, attn


def jax_masks(
    valid_lens: Any, attention_mask: Any, batch: int, queries: int, keys: int, use_lengths: bool
) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """(mask (batch, 1, queries, keys) True = attend, key_value_seq_lengths (batch,) int32) of
    ``jax.nn.dot_product_attention`` (causality is its own ``is_causal``).  With use_lengths,
    1-D lengths go to key_value_seq_lengths (it takes only those); else everything is a mask."""
    lengths = None
    if use_lengths and valid_lens is not None and np.ndim(valid_lens) == 1:
        lengths = np.asarray(valid_lens).astype(np.int32)
        valid_lens = None
    allowed = visible(valid_lens, attention_mask, False, batch, queries, keys)
    return (None if allowed is None else allowed[:, None]), lengths


# ------------------------------------------------- canonical weights -> native parameters


def native_layout(framework: str, cfg: Any) -> Tuple[List[str], Dict[str, np.ndarray]]:
    """(canonical names in order, {native parameter path: indices into the concatenation of
    the flattened canonical weights}), from ``multiattn.layers.native``'s converter of the
    framework; ``Unsupported`` with its message where the layer cannot take cfg's sizes."""
    from .. import checks
    from ..layers import native

    to = {"torch": native.torch_to, "tensorflow": native.keras_to, "jax": native.flax_to,
          "paddle": native.paddle_to, "mlx": native.mlx_to}[framework]  # fmt: skip
    shapes = checks.multi_head_weight_shapes(cfg.num_hiddens, cfg.query_size, cfg.key_size, cfg.value_size,
                                             cfg.bias)  # fmt: skip
    index, offset = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape))
        index[name] = np.arange(offset, offset + size, dtype=np.float64).reshape(shape)
        offset += size
    try:
        arrays = to(cfg, index)[1]  # exact: the converters only reshape, transpose and concatenate
    except ValueError as err:
        raise Unsupported(str(err)) from None
    return list(shapes), {path: np.rint(a).astype(np.int64) for path, a in arrays.items()}


def _config(queries: Any, keys: Any, values: Any, weights: dict, num_heads: int) -> Any:
    from ..layers import native

    return native.Config(
        int(weights["W_q"].shape[0]), int(num_heads), int(queries.shape[-1]), int(keys.shape[-1]),
        int(values.shape[-1]), "b_q" in weights, 0.0,
    )  # fmt: skip


def native_parameters(
    framework: str, cfg: Any, weights: dict, concat: Callable, take: Callable, flatten: Callable
) -> Dict[str, Any]:
    """The native layer's parameters by path, as framework tensors computed from the canonical
    ones (differentiable: a gather of their concatenation)."""
    names, layout = native_layout(framework, cfg)
    flat = concat([flatten(weights[name]) for name in names])
    return {path: take(flat, index) for path, index in layout.items()}


# ---------------------------------------------------------------- the implementations


@dataclass(frozen=True)
class Implementation:
    label: str  # the framework's name for it
    framework: str  # the multiattn backend whose tensors it takes
    kind: str  # dot_product or multi_head (check.against's kinds)
    make: Callable[[], Callable]  # -> the wrapper (imports the framework)
    how: str  # how the wrapper calls it, for the docs
    version: str = ""  # the module whose __version__ is the row's version (default: the framework)


def _torch_sdpa() -> Callable:
    import torch
    import torch.nn.functional as F

    def fn(queries, keys, values, valid_lens, attention_mask=None, causal=False):
        lens, mask = _numpy(valid_lens), _numpy(attention_mask)
        (B, Q, _), K = queries.shape, keys.shape[1]
        if causal and lens is None and mask is None:
            return F.scaled_dot_product_attention(queries, keys, values, is_causal=True)
        allowed = visible(lens, mask, causal, B, Q, K)
        attn_mask = None if allowed is None else torch.from_numpy(allowed)
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=attn_mask)

    return fn


def _torch_mha(need_weights: bool) -> Callable[[], Callable]:
    def make() -> Callable:
        import torch
        from torch.func import functional_call

        from ..backends.torch import MultiHeadAttention

        def fn(queries, keys, values, valid_lens, *, weights, num_heads, attention_mask=None, causal=False):
            cfg = _config(queries, keys, values, weights, num_heads)
            params = native_parameters(
                "torch", cfg, weights, torch.cat, lambda flat, i: flat[torch.from_numpy(i)],
                lambda w: w.reshape(-1),
            )  # fmt: skip
            layer = MultiHeadAttention(**cfg.kwargs()).to_native(batch_first=True).eval()
            (B, Q, _), K = queries.shape, keys.shape[1]
            padding, attn = torch_mha_masks(_numpy(valid_lens), _numpy(attention_mask), causal, B, Q, K,
                                            num_heads)  # fmt: skip
            out, w = functional_call(
                layer, params, (queries, keys, values),
                dict(key_padding_mask=None if padding is None else torch.from_numpy(padding),
                     attn_mask=None if attn is None else torch.from_numpy(attn),
                     need_weights=need_weights, average_attn_weights=False),
            )  # fmt: skip
            return (out, w) if need_weights else out

        return fn

    return make


def _keras_ops() -> Callable:
    import keras

    def fn(queries, keys, values, valid_lens, attention_mask=None, causal=False):
        (B, Q, _), K = queries.shape, keys.shape[1]
        mask = visible(_numpy(valid_lens), _numpy(attention_mask), False, B, Q, K)
        head = keras.ops.expand_dims  # (batch, seq, 1 head, width)
        out = keras.ops.dot_product_attention(
            head(queries, 2), head(keys, 2), head(values, 2), mask=None if mask is None else mask[:, None],
            is_causal=causal,
        )  # fmt: skip
        return out[:, :, 0]

    return fn


def _keras_mha(scores: bool) -> Callable[[], Callable]:
    def make() -> Callable:
        from ..backends.tensorflow import MultiHeadAttention
        from ..layers import native

        def fn(queries, keys, values, valid_lens, *, weights, num_heads, attention_mask=None, causal=False):
            import tensorflow as tf

            cfg = _config(queries, keys, values, weights, num_heads)
            params = native_parameters(
                "tensorflow", cfg, weights, lambda xs: tf.concat(xs, 0), tf.gather,
                lambda w: tf.reshape(w, [-1]),
            )  # fmt: skip
            layer = MultiHeadAttention(**cfg.kwargs(), dtype=queries.dtype.name).to_native()
            by_variable = {id(native.attribute(layer, path)): value for path, value in params.items()}
            trainable = [by_variable[id(v)] for v in layer.trainable_variables]
            (B, Q, _), K = queries.shape, keys.shape[1]
            mask = visible(_numpy(valid_lens), _numpy(attention_mask), False, B, Q, K)
            out, _ = layer.stateless_call(
                trainable, [v.value for v in layer.non_trainable_variables], queries, values, key=keys,
                attention_mask=mask, use_causal_mask=causal, return_attention_scores=scores, training=False,
            )  # fmt: skip
            return tuple(out) if scores else out

        return fn

    return make


def _jax_sdpa(use_lengths: bool) -> Callable[[], Callable]:
    def make() -> Callable:
        import jax
        import jax.numpy as jnp

        def fn(queries, keys, values, valid_lens, attention_mask=None, causal=False):
            (B, Q, _), (_, K, width) = queries.shape, keys.shape
            mask, lengths = jax_masks(_numpy(valid_lens), _numpy(attention_mask), B, Q, K, use_lengths)
            extra = width - values.shape[-1]  # jax needs values as wide as the keys: zero columns
            padded = jnp.pad(values, ((0, 0), (0, 0), (0, max(extra, 0))))
            out = jax.nn.dot_product_attention(
                queries[:, :, None], keys[:, :, None], padded[:, :, None],
                mask=None if mask is None else jnp.asarray(mask), is_causal=causal,
                key_value_seq_lengths=None if lengths is None else jnp.asarray(lengths),
            )  # fmt: skip
            return out[:, :, 0, : values.shape[-1]]

        return fn

    return make


def _flax_mha() -> Callable:
    import jax.numpy as jnp
    from flax import nnx

    from ..backends.jax import MultiHeadAttention
    from ..layers import native

    def fn(queries, keys, values, valid_lens, *, weights, num_heads, attention_mask=None, causal=False):
        cfg = _config(queries, keys, values, weights, num_heads)
        params = native_parameters("jax", cfg, weights, jnp.concatenate, lambda f, i: f[i], jnp.ravel)
        layer = MultiHeadAttention(**cfg.kwargs(), rngs=nnx.Rngs(0), param_dtype=queries.dtype).to_native()
        for path, value in params.items():
            native.attribute(layer, path).set_value(value)
        (B, Q, _), K = queries.shape, keys.shape[1]
        mask = visible(_numpy(valid_lens), _numpy(attention_mask), causal, B, Q, K)
        out, sown = nnx.capture(layer, nnx.Intermediate)(
            queries, keys, values, mask=None if mask is None else jnp.asarray(mask[:, None]),
            deterministic=True, sow_weights=True,
        )  # fmt: skip
        (w,) = sown["attention_weights"].get_value()
        return out, w

    return fn


def _paddle_sdpa() -> Callable:
    import paddle
    import paddle.nn.functional as F

    def fn(queries, keys, values, valid_lens, attention_mask=None, causal=False):
        lens, mask = _numpy(valid_lens), _numpy(attention_mask)
        (B, Q, _), K = queries.shape, keys.shape[1]
        head = [queries.unsqueeze(2), keys.unsqueeze(2), values.unsqueeze(2)]  # (batch, seq, 1 head, width)
        if causal and lens is None and mask is None:  # paddle ignores a mask beside is_causal
            return F.scaled_dot_product_attention(*head, is_causal=True, training=False)[:, :, 0]
        allowed = visible(lens, mask, causal, B, Q, K)
        attn_mask = None if allowed is None else paddle.to_tensor(allowed[:, None])
        return F.scaled_dot_product_attention(*head, attn_mask=attn_mask, training=False)[:, :, 0]

    return fn


def _paddle_mha() -> Callable:
    import paddle

    from ..backends.paddle import MultiHeadAttention
    from ..layers import native

    def fn(queries, keys, values, valid_lens, *, weights, num_heads, attention_mask=None, causal=False):
        cfg = _config(queries, keys, values, weights, num_heads)
        params = native_parameters(
            "paddle", cfg, weights, lambda xs: paddle.concat(xs, 0),
            lambda flat, i: paddle.gather(flat, paddle.to_tensor(i.reshape(-1))).reshape(list(i.shape)),
            lambda w: w.reshape([-1]),
        )  # fmt: skip
        layer = MultiHeadAttention(**cfg.kwargs()).to_native()
        layer.eval()
        layer.need_weights = True
        for path, value in params.items():  # a tensor in place of the Parameter: gradients reach it
            owner_path, name = path.rsplit(".", 1)
            owner = native.attribute(layer, owner_path)
            del owner._parameters[name]
            object.__setattr__(owner, name, value)
        (B, Q, _), K = queries.shape, keys.shape[1]
        mask = visible(_numpy(valid_lens), _numpy(attention_mask), causal, B, Q, K)
        return layer(
            queries, keys, values, attn_mask=None if mask is None else paddle.to_tensor(mask[:, None])
        )

    return fn


def _mlx_sdpa() -> Callable:
    import mlx.core as mx

    def fn(queries, keys, values, valid_lens, attention_mask=None, causal=False):
        lens, mask = _numpy(valid_lens), _numpy(attention_mask)
        (B, Q, width), K = queries.shape, keys.shape[1]
        if causal and lens is None and mask is None and Q == K:  # mlx's "causal" is bottom-right aligned
            native_mask: Any = "causal"
        else:
            allowed = visible(lens, mask, causal, B, Q, K)
            native_mask = None if allowed is None else mx.array(allowed[:, None])
        out = mx.fast.scaled_dot_product_attention(
            queries[:, None], keys[:, None], values[:, None], scale=1.0 / math.sqrt(width), mask=native_mask
        )
        return out[:, 0]

    return fn


def _mlx_mha() -> Callable:
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    from ..backends.mlx import MultiHeadAttention

    def fn(queries, keys, values, valid_lens, *, weights, num_heads, attention_mask=None, causal=False):
        cfg = _config(queries, keys, values, weights, num_heads)
        params = native_parameters(
            "mlx", cfg, weights, mx.concatenate, lambda f, i: mx.take(f, mx.array(i)), lambda w: w.reshape(-1)
        )
        layer = MultiHeadAttention(**cfg.kwargs()).to_native()
        layer.update(tree_unflatten(list(params.items())))
        (B, Q, _), K = queries.shape, keys.shape[1]
        mask = visible(_numpy(valid_lens), _numpy(attention_mask), causal, B, Q, K)
        return layer(queries, keys, values, mask=None if mask is None else mx.array(mask[:, None]))

    return fn


def d2l_torch() -> Any:
    """d2l's torch module (``from d2l import torch as d2l``); ImportError where it is not importable."""
    return importlib.import_module("d2l.torch")


def _d2l_dot_product() -> Callable:
    d2l = d2l_torch()

    def fn(queries, keys, values, valid_lens):  # d2l takes lengths only
        attention = d2l.DotProductAttention(dropout=0.0).eval()
        out = attention(queries, keys, values, valid_lens)
        return out, attention.attention_weights

    return fn


def _d2l_multi_head() -> Callable:
    import torch
    from torch.func import functional_call

    d2l = d2l_torch()

    def fn(queries, keys, values, valid_lens, *, weights, num_heads):
        bias = "b_q" in weights
        layer = d2l.MultiHeadAttention(int(weights["W_q"].shape[0]), num_heads, 0.0, bias=bias).eval()
        with torch.no_grad():  # its lazy layers take their sizes from a first call (float32 parameters,
            layer(queries.detach().float(), keys.detach().float(), values.detach().float(), valid_lens)
        params = {f"W_{n}.weight": weights[f"W_{n}"] for n in "qkvo"}  # all replaced by the case's)
        params.update({f"W_{n}.bias": weights[f"b_{n}"] for n in "qkvo"} if bias else {})
        out = functional_call(layer, params, (queries, keys, values, valid_lens))
        B, Q, K = queries.shape[0], queries.shape[1], keys.shape[1]
        return out, layer.attention.attention_weights.reshape(B, num_heads, Q, K)

    return fn


_SDPA_CAUSAL = "the native is_causal where causality is the only mask, else an explicit mask"
IMPLEMENTATIONS: Tuple[Implementation, ...] = (
    Implementation(
        "torch.nn.functional.scaled_dot_product_attention",
        "torch",
        "dot_product",
        _torch_sdpa,
        f"`attn_mask` (bool, True = attend) of lengths AND mask; {_SDPA_CAUSAL} (torch refuses both)",
    ),
    Implementation(
        "torch.nn.MultiheadAttention (need_weights=True)",
        "torch",
        "multi_head",
        _torch_mha(True),
        "1-D lengths as `key_padding_mask`, the rest as `attn_mask` (batch * heads, queries, keys), both "
        "inverted (True = may not attend), causality explicit; `average_attn_weights=False`",
    ),
    Implementation(
        "torch.nn.MultiheadAttention (need_weights=False)",
        "torch",
        "multi_head",
        _torch_mha(False),
        "as with need_weights=True; output only",
    ),
    Implementation(
        "keras.ops.dot_product_attention",
        "tensorflow",
        "dot_product",
        _keras_ops,
        "`mask` (True = attend) of lengths AND mask, `is_causal`",
        "keras",
    ),
    Implementation(
        "keras.layers.MultiHeadAttention (return_attention_scores=True)",
        "tensorflow",
        "multi_head",
        _keras_mha(True),
        "`attention_mask` (True = attend) of lengths AND mask, `use_causal_mask`",
        "keras",
    ),
    Implementation(
        "keras.layers.MultiHeadAttention (return_attention_scores=False)",
        "tensorflow",
        "multi_head",
        _keras_mha(False),
        "as with return_attention_scores=True; output only (Keras then calls "
        "`keras.ops.dot_product_attention`)",
        "keras",
    ),
    Implementation(
        "jax.nn.dot_product_attention (mask=)",
        "jax",
        "dot_product",
        _jax_sdpa(False),
        "`mask` (True = attend) of lengths AND mask, `is_causal`; values zero-padded to the key width",
    ),
    Implementation(
        "jax.nn.dot_product_attention (key_value_seq_lengths=)",
        "jax",
        "dot_product",
        _jax_sdpa(True),
        "1-D lengths as `key_value_seq_lengths`, 2-D lengths and the mask as `mask`, `is_causal`; values "
        "zero-padded to the key width",
    ),
    Implementation(
        "flax.nnx.MultiHeadAttention",
        "jax",
        "multi_head",
        _flax_mha,
        "`mask` (True = attend) of lengths AND mask AND causality; weights by `sow_weights=True`",
        "flax",
    ),
    Implementation(
        "paddle.nn.functional.scaled_dot_product_attention",
        "paddle",
        "dot_product",
        _paddle_sdpa,
        f"`attn_mask` (bool, True = attend) of lengths AND mask; {_SDPA_CAUSAL} (paddle ignores the mask "
        "beside is_causal)",
    ),
    Implementation(
        "paddle.nn.MultiHeadAttention",
        "paddle",
        "multi_head",
        _paddle_mha,
        "`attn_mask` (bool, True = attend) of lengths AND mask AND causality; `need_weights=True`",
    ),
    Implementation(
        "mlx.core.fast.scaled_dot_product_attention",
        "mlx",
        "dot_product",
        _mlx_sdpa,
        '`mask` (bool, True = attend) of lengths AND mask AND causality (its `"causal"` is bottom-right '
        "aligned), `scale=1/sqrt(d)`",
    ),
    Implementation(
        "mlx.nn.MultiHeadAttention",
        "mlx",
        "multi_head",
        _mlx_mha,
        "`mask` (bool, True = attend) of lengths AND mask AND causality; output only",
    ),
    Implementation(
        "d2l.torch.DotProductAttention",
        "torch",
        "dot_product",
        _d2l_dot_product,
        "valid_lens as they are (d2l takes no other mask)",
        "d2l",
    ),
    Implementation(
        "d2l.torch.MultiHeadAttention",
        "torch",
        "multi_head",
        _d2l_multi_head,
        "valid_lens as they are; the canonical weights are d2l's `W_q`, ..., `W_o` (`nn.LazyLinear`)",
        "d2l",
    ),
)
FRAMEWORKS = tuple(dict.fromkeys(impl.framework for impl in IMPLEMENTATIONS))


def implementations(framework: Optional[str] = None) -> List[Implementation]:
    return [impl for impl in IMPLEMENTATIONS if framework is None or impl.framework == framework]


def absent(framework: str) -> Dict[str, str]:
    """label -> why, for the implementations of framework that cannot be imported here (d2l)."""
    out = {}
    for impl in implementations(framework):
        if impl.version == "d2l":
            try:
                d2l_torch()
            except Exception as err:
                out[impl.label] = f"{type(err).__name__}: {err}"
    return out


def _numpy(tensor: Any) -> Optional[np.ndarray]:
    """A mask or lengths argument as numpy (they never need gradients); None stays None."""
    if tensor is None:
        return None
    if hasattr(tensor, "detach"):  # torch, paddle
        tensor = tensor.detach()
        tensor = tensor.cpu() if hasattr(tensor, "cpu") else tensor
    return np.asarray(tensor.numpy() if hasattr(tensor, "numpy") else tensor)


def _version(impl: Implementation) -> str:
    from .worker import framework_version

    if impl.version:
        module = sys.modules.get(impl.version) or importlib.import_module(impl.version)
        return str(getattr(module, "__version__", "?"))
    return framework_version(impl.framework)


# ---------------------------------------------------------------- running


def run_implementation(impl: Implementation, seed: int = 0) -> dict:
    """``run_function``'s results for one implementation, with its label, kind and version;
    a case the native API cannot express is ``unsupported: <why>``."""
    from .._registry import get_backend
    from .against import run_function
    from .worker import framework_version

    module = get_backend(impl.framework)
    meta = {
        "backend": impl.framework,
        "kind": impl.kind,
        "framework_version": framework_version(impl.framework),
    }
    try:
        fn = impl.make()
        results = run_function(fn, impl.kind, impl.framework, seed)
        results["version"] = _version(impl)
    except Exception as err:
        return {"version": "?", "status": f"failed: {type(err).__name__}: {err}", "cases": {}, **meta}
    notes = getattr(module, "DTYPE_NOTES", {})
    for name, result in results["cases"].items():
        status = result["status"]
        if status.startswith("error: Unsupported: "):
            result["status"] = "unsupported: " + status[len("error: Unsupported: ") :]
        elif status.startswith("unsupported: ") and status.endswith(" has no " + name.split("/")[-1]):
            why = notes.get(name.split("/")[-1])  # multiattn's backend does not run this dtype
            if isinstance(why, dict):
                why = why.get(impl.kind)
            if why:
                result["status"] = f"unsupported: {why}"
    return {**results, **meta}


def run_framework(framework: str, seed: int = 0) -> Results:
    """Every implementation of one framework, in this process: {label: results}."""
    from .._registry import get_backend

    module = get_backend(framework)
    if hasattr(module, "enable_float64"):
        module.enable_float64()
    skip = absent(framework)
    out = {}
    for impl in implementations(framework):
        if impl.label in skip:  # kept, so that the page can say why it has no rows
            out[impl.label] = {"version": "?", "status": f"absent: {skip[impl.label]}", "cases": {},
                               "backend": framework, "kind": impl.kind}  # fmt: skip
        else:
            out[impl.label] = run_implementation(impl, seed)
    return out


def split_absent(results: Results) -> Tuple[Results, Dict[str, str]]:
    """(the results of the implementations that ran, {label: why not} of those not importable)."""
    ran = {label: res for label, res in results.items() if not res["status"].startswith("absent: ")}
    missing = {label: res["status"][len("absent: ") :] for label, res in results.items() if label not in ran}
    return ran, missing


def save(results: Results, directory: str) -> None:
    """The worker's output: one ``worker.save`` file per implementation and an index."""
    from . import worker

    os.makedirs(directory, exist_ok=True)
    index = []
    for i, (label, res) in enumerate(results.items()):
        worker.save(res, os.path.join(directory, f"{i}.npz"))
        meta = {k: v for k, v in res.items() if k not in ("version", "status", "cases")}
        index.append({"label": label, "file": f"{i}.npz", **meta})
    with open(os.path.join(directory, "index.json"), "w") as f:
        json.dump(index, f)


def load(directory: str) -> Results:
    from . import worker

    with open(os.path.join(directory, "index.json")) as f:
        index = json.load(f)
    out = {}
    for entry in index:
        meta = {k: v for k, v in entry.items() if k not in ("label", "file")}
        out[entry["label"]] = {**worker.load(os.path.join(directory, entry["file"])), **meta}
    return out


# ---------------------------------------------------------------- judging and tables


def cases_of(kind: str, seed: int = 0) -> List[Case]:
    from .against import cases_for

    return cases_for(kind, seed)


def build_native_rows(results: Results, seed: int = 0, overrides: Optional[Dict[str, float]] = None) -> list:
    """check's rows (``table.build_rows``), one implementation at a time (never compared
    with each other: each is judged against the reference)."""
    from .table import build_rows

    rows = []
    for label, res in results.items():
        kind = res.get("kind")
        if kind is None:  # a framework whose worker died: its status, one row
            kind = "dot_product"
        rows += build_rows({label: res}, cases_of(kind, seed), overrides, functions=(kind,))
    return rows


def _dead_rows(case: Case) -> np.ndarray:
    """(batch, queries): where the reference sees no key."""
    weights = case.expected["weights"]
    dead = weights.sum(-1) == 0
    return dead.all(1) if case.function == "multi_head" else dead


def _uniform_alternative(case: Case) -> np.ndarray:
    """The output of a row that weighs every key alike (a fully masked row where the mask is a
    large negative number rather than nothing): the mean of the (projected) values."""
    args = case.inputs
    B, Q = _dead_rows(case).shape
    if case.function == "dot_product":
        mean = args["values"].mean(1)
    else:
        zero = np.zeros(args["W_o"].shape[0])
        projected = args["values"] @ args["W_v"].T + args.get("b_v", zero)
        mean = projected.mean(1) @ args["W_o"].T + args.get("b_o", zero)
    return np.broadcast_to(mean[:, None, :], (B, Q, mean.shape[-1]))


UNMASKED = (
    "fully masked rows: the weights of the unmasked scores (a finite additive mask cancels in the softmax)"
)


def _unmasked(case: Case) -> dict:
    """The reference without any mask: what a row gets where its mask, a constant added to every
    score of the row, cancels in the softmax."""
    args = case.inputs
    if case.function == "dot_product":
        return reference.dot_product_attention(args["queries"], args["keys"], args["values"], None)
    from .cases import NUM_HEADS

    weights = {n: v for n, v in args.items() if n not in ("queries", "keys", "values")}
    return reference.multi_head_attention(
        args["queries"], args["keys"], args["values"], None, weights, NUM_HEADS
    )


def _max_err(got: Any, want: np.ndarray, rows: np.ndarray) -> float:
    got = np.asarray(got, dtype=np.float64)
    if got.shape != want.shape:
        return float("inf")
    if got.ndim == rows.ndim + 2:  # per-head weights
        rows = np.broadcast_to(rows[:, None], got.shape[:-1])
    diff = np.abs(got - want)[rows]
    return float("inf") if np.isnan(diff).any() else float(diff.max(initial=0.0))


SEPARATOR = "; "
FLOAT32_ACCURACY = "float64 at float32 accuracy"  # within float32's tolerance, not float64's


def classify(case: Case, result: dict, backend: str, overrides: Optional[Dict[str, float]] = None) -> str:
    """'' where the case agrees with the reference, else why not, in a few words (the
    summary's cell): a status, NaN or non-zero weights in fully masked rows, a difference in
    the rows that see keys, or the gradients."""
    status = result["status"]
    if status != "ok":
        return status
    if result.get("modified"):
        return "writes into its inputs: " + ", ".join(result["modified"])
    want = case.expected
    scale = max([1.0] + [float(np.abs(a).max(initial=0.0)) for a in (want["out"], want["weights"])])
    tol = tolerance(backend, case.dtype, overrides) * scale
    dead = _dead_rows(case)
    live = ~dead
    got = {k: result[k] for k in ("out", "weights") if k in result}
    for key, value in got.items():
        if np.shape(value) != want[key].shape:
            name = "output" if key == "out" else "weights"
            return f"{name} of shape {np.shape(value)}, reference {want[key].shape}"
    reasons = []
    live_errors = {k: _max_err(v, want[k], live) for k, v in got.items()}
    if any(not err <= tol for err in live_errors.values()):
        key = max(live_errors, key=lambda k: live_errors[k])
        err, name = live_errors[key], "output" if key == "out" else "weights"
        if case.dtype == "float64" and err <= tolerance(backend, "float32") * scale:
            reasons.append(FLOAT32_ACCURACY)
        else:
            what = "NaN" if math.isinf(err) else f"{err:.2g} from the reference"
            reasons.append(f"{name} {what} where keys are visible")
    if dead.any():  # what the rows that see nothing get, recognised at a float32 tolerance
        reasons += _fully_masked(case, got, dead, max(tol, tolerance(backend, "float32") * scale))
    if reasons:
        return SEPARATOR.join(reasons)
    for arg, grad in result.get("grads", {}).items():
        g_want = want["grads"][arg]
        g_err = _max_err(grad, g_want, np.ones(np.shape(g_want)[:-1], bool))
        if not g_err <= 10 * tolerance(backend, case.dtype, overrides) * max(
            1.0, float(np.abs(g_want).max())
        ):
            if math.isinf(g_err):
                return f"gradient of {arg}: NaN"
            if case.dtype == "float64" and g_err <= 10 * tolerance(backend, "float32") * max(
                1.0, float(np.abs(g_want).max())
            ):
                return FLOAT32_ACCURACY
            return f"gradient of {arg}: {g_err:.2g} from the reference"
    return ""


def magnitude(x: float) -> str:
    """x to its power of ten ('1e-07'): a size that does not change with the last bits."""
    return f"{10.0 ** round(math.log10(x)):.0e}" if x > 0 else "0"


def _fully_masked(case: Case, got: dict, dead: np.ndarray, tol: float) -> List[str]:
    """What the implementation gives in the rows that see no key, where it is not the reference's."""
    want = case.expected
    out_dead = np.asarray(got["out"], dtype=np.float64)[dead]
    weights_dead = None
    if "weights" in got:
        weights = np.asarray(got["weights"], dtype=np.float64)
        weights_dead = (weights.transpose(0, 2, 1, 3) if weights.ndim == 4 else weights)[dead]
    nan = [
        n for n, a in (("output", out_dead), ("weights", weights_dead)) if a is not None and np.isnan(a).any()
    ]
    if nan:
        return [f"fully masked rows: NaN {' and '.join(nan)}"]
    unmasked = _unmasked(case)
    if weights_dead is not None and np.abs(weights_dead).max() > tol:
        if np.ptp(weights_dead, axis=-1).max() <= tol:
            return [f"fully masked rows: uniform weights {weights_dead.flat[0]:.2g}, reference 0"]
        if _max_err(got["weights"], unmasked["weights"], dead) <= tol:
            return [UNMASKED]
        return ["fully masked rows: non-zero weights, reference 0"]
    if not _max_err(got["out"], want["out"], dead) > tol:
        return []
    if _max_err(got["out"], _uniform_alternative(case), dead) <= tol:
        want_what = "0" if case.function == "dot_product" else "b_o"
        return [
            f"fully masked rows: uniform weights (an output of the mean of the values), reference {want_what}"
        ]
    if _max_err(got["out"], unmasked["out"], dead) <= tol:
        return [UNMASKED]
    if np.abs(out_dead).max() <= tol:
        return ["fully masked rows: output 0, reference b_o"]
    return [f"fully masked rows: output {_max_err(got['out'], want['out'], dead):.2g} from the reference"]


def summarize(results: Results, seed: int = 0, overrides: Optional[Dict[str, float]] = None) -> List[tuple]:
    """[(label, {mask: cell})]: 'agree', 'n/a', 'not run' or the reasons, each with the dtypes
    that show it where not every dtype that ran does."""
    out = []
    for label, res in results.items():
        cells = {}
        kind = res.get("kind", "dot_product")
        for mask in MASKS:
            if res["status"] != "ok":
                cells[mask] = res["status"]
                continue
            reasons: Dict[str, List[str]] = {}
            ran, statuses = [], set()
            for case in (c for c in cases_of(kind, seed) if c.mask == mask):
                result = res["cases"].get(case.name, {"status": "error: missing"})
                if result["status"].startswith(("unsupported", "skipped")):
                    statuses.add("not run" if result["status"].startswith("skipped") else "n/a")
                    continue
                ran.append(case.dtype)
                why = classify(case, result, res.get("backend", label), overrides)
                for reason in why.split(SEPARATOR) if why else ():
                    reasons.setdefault(reason, []).append(case.dtype)
            cells[mask] = _cell(reasons, ran, statuses)
        out.append((label, cells))
    return out


def _cell(reasons: Dict[str, List[str]], ran: List[str], statuses: set) -> str:
    if not ran:
        return "not run" if "not run" in statuses else "n/a"
    if not reasons:
        return "agree"
    return SEPARATOR.join(
        why if set(dtypes) >= set(ran) or why == FLOAT32_ACCURACY else f"{why} ({', '.join(dtypes)})"
        for why, dtypes in reasons.items()
    )


AGREE = ("agree", "n/a", "not run")


def disagreements(summary: List[tuple]) -> int:
    """How many implementation x mask cells disagree with the reference."""
    return sum(cell not in AGREE for _, cells in summary for cell in cells.values())


def grouped(summary: List[tuple]) -> List[Tuple[str, str, str]]:
    """(label, 'mask, mask', cell): the masks of one implementation with the same cell together."""
    out = []
    for label, cells in summary:
        by_cell: Dict[str, List[str]] = {}
        for mask in MASKS:
            by_cell.setdefault(cells[mask], []).append(mask)
        out += [(label, ", ".join(masks), cell) for cell, masks in by_cell.items()]
    return out


def render_summary(summary: List[tuple]) -> str:
    """The 'where frameworks disagree' table, plain text."""
    header = ["implementation", "masks", "against the reference"]
    lines, last = [], None
    for label, masks, cell in grouped(summary):
        lines.append(["" if label == last else label, masks, cell])
        last = label
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    widths[-1] = len(header[-1])

    def fmt(cells):
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines])


def render(results: Results, seed: int = 0, overrides: Optional[Dict[str, float]] = None) -> str:
    """The command's output: check's table of every row, then where the frameworks disagree."""
    from .table import render as render_rows

    rows = build_native_rows(results, seed, overrides)
    table = render_rows(rows).rsplit("\n\n", 1)[0]  # its footer counts backends: ours follows
    summary = summarize(results, seed, overrides)
    failed = sum(r.verdict == "FAIL" for r in rows)
    return "\n".join([
        table, "",
        f"{len(rows)} rows, {len(results)} native implementations: {failed} rows disagree with multiattn's "
        "reference (FAIL: the framework's own semantics, not an error of this command)", "",
        "Where frameworks disagree (each mask case over every dtype):", "",
        render_summary(summary), "",
        f"{disagreements(summary)} of {len(summary) * len(MASKS)} implementation x mask cases disagree",
    ])  # fmt: skip


# ---------------------------------------------------------------- the docs page

DATE_LINE = "Generated on "
PAGE_COMMAND = "multiattn check --native --markdown docs/native-attention.md"


def _md(text: str) -> str:
    return str(text).replace("|", "\\|")


def markdown(
    results: Results, versions: Dict[str, str], seed: int = 0, missing: Optional[Dict[str, str]] = None,
    today: Optional[str] = None,
) -> str:  # fmt: skip
    """docs/native-attention.md: a header (how, versions, date) and the tables."""
    from .. import __version__

    rows = build_native_rows(results, seed)
    summary = summarize(results, seed)
    today = today or datetime.date.today().isoformat()
    lines = [
        "# Where frameworks' own attention disagrees",
        "",
        f"<!-- Generated by `{PAGE_COMMAND}`: do not edit by hand; `tox -e native` fails when the tables "
        "here differ from a fresh run. -->",
        "",
        f"{DATE_LINE}{today} by `{PAGE_COMMAND}` (multiattn {__version__}, seed {seed}) with "
        + ", ".join(f"{name} {version}" for name, version in versions.items())
        + ".",
        "",
        "Each framework's own attention, run by `multiattn check --native` through the battery of "
        "[`multiattn check`](check.md), each framework in its own subprocess, judged against multiattn's "
        "float64 reference, whose semantics are [docs/multihead.md](multihead.md)'s: `attention_mask` "
        "True = may attend, causality top-left, and a row that sees no key gets weights 0 and output 0 "
        "(for multi-head attention the heads give 0 and the layer its output bias `b_o`). The mask cases: "
        "`none`; `1d`: lengths `[0, 7]` (5 keys: a fully masked batch row and an over-long length); "
        "`2d`: lengths `[[2, 0, 7], [5, -1, 3]]` (zero and negative: fully masked rows); `mask`: a "
        "boolean (batch, queries, keys) mask with a fully masked row; `causal`: `causal=True` (3 queries, "
        "5 keys); `all`: 2-D lengths, mask and causality together. Each in float32, float64, float16 and "
        "bfloat16, values and (float32, float64) gradients with respect to every input and weight.",
        "",
        "A disagreement is the framework's own answer, not an error of the translation: with no mask "
        "every implementation agrees with the reference in float32 (tests/test_native.py). How each is "
        "called (lengths become the mask `arange(keys) < length`; the multi-head layers are built by "
        "`MultiHeadAttention.to_native()` for the battery's sizes, queries 4 wide, keys and values 3 "
        "wide, num_hiddens 4, 2 heads, biases, and take the battery's canonical weights):",
        "",
    ]
    for impl in IMPLEMENTATIONS:
        if impl.label in results:
            lines.append(f"* `{impl.label}`: {impl.how}.")
    for label, why in (missing or {}).items():
        lines.append(f"* `{label}`: not run here, d2l is not importable ({_md(why)}).")
    lines += [
        "",
        "## Where frameworks disagree",
        "",
        "Per implementation, the mask cases with the same answer together, over every dtype that ran (a "
        "dtype in brackets: only there). `agree`: within check's tolerance of the reference, values and "
        "gradients; `n/a`: the framework cannot run it here; `not run`: the API takes no such mask; "
        "`float64 at float32 accuracy`: float64 results only within float32's tolerance.",
        "",
        "| implementation | masks | against the reference |",
        "|---|---|---|",
    ]
    for label, masks, cell in grouped(summary):
        lines.append(f"| `{_md(label)}` | {masks} | {_md(cell)} |")
    lines += [
        "",
        "## Every row",
        "",
        "`multiattn check`'s rows (kind x dtype, the six mask cases together) with its verdicts and "
        "reasons (its first three); `FAIL` is outside the tolerance of multiattn's reference, which here "
        "is the framework's own answer. The errors of every row are in `multiattn check --native`'s "
        "output and `--json`.",
        "",
        "| implementation | case | verdict |",
        "|---|---|---|",
    ]
    for r in rows:
        verdict = r.verdict + (f": {r.reason}" if r.reason else "")
        if r.not_run:
            verdict += "; not run: " + "; ".join(f"{', '.join(m)} ({why})" for why, m in r.not_run.items())
        lines.append(f"| `{_md(r.backend)}` | {r.function} {r.dtype} | {_md(verdict)} |")
    return "\n".join(lines) + "\n"


def table_lines(page: str) -> List[str]:
    """The lines of a page's tables (what `tox -e native` compares; never the date)."""
    return [line for line in page.splitlines() if line.startswith("|")]


def compare_pages(committed: str, fresh: str, labels: Optional[Sequence[str]] = None) -> List[str]:
    """The table lines that differ ('-' committed, '+' fresh), only of the implementations in
    labels where given (a run of some frameworks against the whole page)."""

    def keep(line: str) -> bool:
        if labels is None:
            return True
        label = re.match(r"\| `(.*?)` \|", line)
        return label is None or label.group(1).replace("\\|", "|") in labels

    old = [line for line in table_lines(committed) if keep(line)]
    new = [line for line in table_lines(fresh) if keep(line)]
    old_sizes, new_sizes = {_sizes(line) for line in old}, {_sizes(line) for line in new}
    return [f"- {line}" for line in old if _sizes(line) not in new_sizes] + [
        f"+ {line}" for line in new if _sizes(line) not in old_sizes
    ]


_NUMBER = re.compile(r"(?<![\w.])(\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+)(?![\w.])")


def _sizes(line: str) -> str:
    """A table line with every decimal number (an error's size) at its power of ten: the last
    bits of float32 arithmetic, which differ between CPUs, never make the page stale."""
    return _NUMBER.sub(lambda m: magnitude(float(m.group(1))), line)


def versions_of(results: Results) -> Dict[str, str]:
    """framework (and keras/flax/d2l) -> version, in the order of the implementations."""
    names = {"tensorflow": "tensorflow", "keras": "keras", "flax": "flax", "d2l": "d2l"}
    out: Dict[str, str] = {}
    for impl in IMPLEMENTATIONS:
        res = results.get(impl.label)
        if res is None:
            continue
        out.setdefault(impl.framework, res.get("framework_version", "?"))
        if impl.version in names:
            out.setdefault(impl.version, res["version"])
    return out


def main(argv: List[str]) -> int:
    """``python -m multiattn.check.native --compare COMMITTED FRESH``: exit 1 (and the lines)
    where the tables of two pages differ."""
    if len(argv) != 3 or argv[0] != "--compare":
        print("usage: python -m multiattn.check.native --compare COMMITTED.md FRESH.md", file=sys.stderr)
        return 2
    with open(argv[1]) as f, open(argv[2]) as g:
        diff = compare_pages(f.read(), g.read())
    if diff:
        print(f"{argv[1]} is stale: its tables differ from a fresh run ({argv[2]}); regenerate it with "
              f"`{PAGE_COMMAND}`:", file=sys.stderr)  # fmt: skip
        print("\n".join(diff), file=sys.stderr)
        return 1
    print(f"{argv[1]}: its tables are current")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
