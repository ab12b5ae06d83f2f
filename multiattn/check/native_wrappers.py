"""The frameworks' own attention for ``multiattn check --native`` (run and judged by
``check.native``, reported by ``check.native_report``): each implementation wrapped as a
function of one of check's kinds.

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
  (``multiattn.layers.converters``), as framework tensors, so that gradients reach them
  (torch ``functional_call``, Keras ``stateless_call``, flax variables, paddle and mlx
  attributes);
* ``jax.nn.dot_product_attention`` needs values as wide as the keys: the 3-wide values are
  zero-padded to the key width and the output's extra columns dropped (exact: the weights
  are the framework's, each output column is its own weighted sum).

A size a native layer cannot take is a row with status ``unsupported: <why>``.
"""

from __future__ import annotations

import functools
import importlib
import math
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .results import framework_version


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
    the flattened canonical weights}), from ``multiattn.layers.converters``' converter of the
    framework; ``Unsupported`` with its message where the layer cannot take cfg's sizes."""
    from .. import validation
    from ..layers import converters

    to = {"torch": converters.torch_to, "tensorflow": converters.keras_to, "jax": converters.flax_to,
          "paddle": converters.paddle_to, "mlx": converters.mlx_to}[framework]  # fmt: skip
    if framework == "tensorflow" and cfg.kv_heads != cfg.num_heads:
        to = converters.keras_gqa_to
    shapes = validation.multi_head_weight_shapes(
        cfg.num_hiddens, cfg.query_size, cfg.key_size, cfg.value_size, cfg.bias, cfg.kv_hiddens
    )
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


def _config(queries: Any, keys: Any, values: Any, weights: dict, num_heads: int, num_kv_heads=None) -> Any:
    from ..layers import converters

    return converters.Config(
        int(weights["W_q"].shape[0]), int(num_heads), int(queries.shape[-1]), int(keys.shape[-1]),
        int(values.shape[-1]), "b_q" in weights, 0.0, num_kv_heads,
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
    kind: str  # dot_product, multi_head or grouped (check's functions)
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


def _torch_flex(compiled: bool = False) -> Callable:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def fn(queries, keys, values, valid_lens, attention_mask=None, causal=False, window=None,
           documents=None, softcap=None):  # fmt: skip
        if torch.is_grad_enabled() and any(t.requires_grad for t in (queries, keys, values)):
            raise Unsupported(f"flex_attention has no backward on CPU {COMPILED_FLEX_GRAD[compiled]}")
        if compiled and queries.dtype == torch.float64:
            raise Unsupported("compiled, FlexAttention's CPU kernel takes float32, float16 and bfloat16")
        (B, Q, _), K = queries.shape, keys.shape[1]
        allowed = visible(_numpy(valid_lens), _numpy(attention_mask), causal, B, Q, K)
        shown = None if allowed is None else torch.from_numpy(allowed)
        ids = None if documents is None else [torch.from_numpy(np.asarray(i)) for i in documents]

        def mask_mod(b, h, q, k):  # FlexAttention's signature, on its index tensors
            found = q >= 0
            if shown is not None:
                found = found & shown[b, q, k]
            if window is not None:
                found = found & (q - k >= 0) & (q - k < window)
            if ids is not None:
                found = found & (ids[0][b, q] == ids[1][b, k])
            return found

        masked = shown is not None or window is not None or ids is not None
        block_mask = create_block_mask(mask_mod, B, 1, Q, K, device="cpu") if masked else None
        score_mod = None if softcap is None else (lambda s, b, h, q, k: softcap * torch.tanh(s / softcap))
        head = [x[:, None] for x in (queries, keys, values)]  # (batch, 1 head, seq, width)
        attend = flex_attention
        if compiled:  # each case's functions are new: compiled afresh, clear of dynamo's recompile limit
            torch._dynamo.reset()
            attend = torch.compile(flex_attention)
        with warnings.catch_warnings():  # its advice to compile, on every eager call
            warnings.filterwarnings("ignore", message=".*flex_attention.*", category=UserWarning)
            return attend(*head, score_mod=score_mod, block_mask=block_mask)[:, 0]

    return fn


COMPILED_FLEX_GRAD = {False: "without torch.compile", True: "even compiled"}


def _heads_by_hand(framework: str, attend: Callable) -> Callable:
    """A grouped-query multi-head function of a framework's fused kernel, which takes grouped
    heads itself: the canonical weights' projections (x W^T + b), split into num_heads query and
    num_kv_heads key/value heads, attend(q, k, v, mask (batch, 1, queries, keys) or None) ->
    (batch, heads, queries, width), merged and projected by W_o."""
    module = importlib.import_module(f"multiattn.backends.{framework}")
    ops = module.ops

    def fn(queries, keys, values, valid_lens, *, weights, num_heads, num_kv_heads, attention_mask=None,
           causal=False):  # fmt: skip
        def project(x, n):
            W, b = weights["W_" + n], weights.get("b_" + n)
            y = ops.matmul_t(x, W)
            return y if b is None else y + b

        q = ops.split_heads(project(queries, "q"), num_heads)
        k, v = (ops.split_heads(project(x, n), num_kv_heads) for x, n in ((keys, "k"), (values, "v")))
        (B, Q, _), K = queries.shape, keys.shape[1]
        allowed = visible(_numpy(valid_lens), _numpy(attention_mask), causal, B, Q, K)
        mask = None if allowed is None else module.from_numpy(allowed[:, None])
        return project(ops.merge_heads(attend(q, k, v, mask)), "o")

    return fn


def _torch_sdpa_gqa() -> Callable:
    import torch.nn.functional as F

    return _heads_by_hand("torch", lambda q, k, v, mask: F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=True
    ))  # fmt: skip


def _mlx_sdpa_gqa() -> Callable:
    import math

    import mlx.core as mx

    return _heads_by_hand("mlx", lambda q, k, v, mask: mx.fast.scaled_dot_product_attention(
        q, k, v, scale=1.0 / math.sqrt(q.shape[-1]), mask=mask
    ))  # fmt: skip


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

    def fn(queries, keys, values, valid_lens, attention_mask=None, causal=False, softcap=None):
        (B, Q, _), K = queries.shape, keys.shape[1]
        mask = visible(_numpy(valid_lens), _numpy(attention_mask), False, B, Q, K)
        head = keras.ops.expand_dims  # (batch, seq, 1 head, width)
        try:
            out = keras.ops.dot_product_attention(
                head(queries, 2), head(keys, 2), head(values, 2),
                mask=None if mask is None else mask[:, None], is_causal=causal,
                **({} if softcap is None else {"attn_logits_soft_cap": softcap}),
            )  # fmt: skip
        except ValueError as err:  # Keras refuses the cap but on JAX's TPUs
            if softcap is not None and "attn_logits_soft_cap" in str(err):
                raise Unsupported(f"Keras: {err}") from None
            raise
        return out[:, :, 0]

    return fn


def _keras_mha(scores: bool) -> Callable[[], Callable]:
    def make() -> Callable:
        from ..backends.tensorflow import MultiHeadAttention
        from ..layers import converters

        def fn(queries, keys, values, valid_lens, *, weights, num_heads, num_kv_heads=None,
               attention_mask=None, causal=False):  # fmt: skip
            import tensorflow as tf

            cfg = _config(queries, keys, values, weights, num_heads, num_kv_heads)
            params = native_parameters(
                "tensorflow", cfg, weights, lambda xs: tf.concat(xs, 0), tf.gather,
                lambda w: tf.reshape(w, [-1]),
            )  # fmt: skip
            layer = MultiHeadAttention(**cfg.kwargs(), dtype=queries.dtype.name).to_native()
            by_variable = {id(converters.attribute(layer, path)): value for path, value in params.items()}
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

        def fn(queries, keys, values, valid_lens, attention_mask=None, causal=False, window=None):
            (B, Q, _), (_, K, width) = queries.shape, keys.shape
            mask, lengths = jax_masks(_numpy(valid_lens), _numpy(attention_mask), B, Q, K, use_lengths)
            extra = width - values.shape[-1]  # jax needs values as wide as the keys: zero columns
            padded = jnp.pad(values, ((0, 0), (0, 0), (0, max(extra, 0))))
            out = jax.nn.dot_product_attention(
                queries[:, :, None], keys[:, :, None], padded[:, :, None],
                mask=None if mask is None else jnp.asarray(mask), is_causal=causal,
                key_value_seq_lengths=None if lengths is None else jnp.asarray(lengths),
                local_window_size=None if window is None else (window - 1, 0),  # i - j in [0, window)
            )  # fmt: skip
            return out[:, :, 0, : values.shape[-1]]

        return fn

    return make


def _flax_mha() -> Callable:
    import jax.numpy as jnp
    from flax import nnx

    from ..backends.jax import MultiHeadAttention
    from ..layers import converters

    def fn(queries, keys, values, valid_lens, *, weights, num_heads, num_kv_heads=None, attention_mask=None,
           causal=False):  # fmt: skip
        cfg = _config(queries, keys, values, weights, num_heads, num_kv_heads)
        params = native_parameters("jax", cfg, weights, jnp.concatenate, lambda f, i: f[i], jnp.ravel)
        layer = MultiHeadAttention(**cfg.kwargs(), rngs=nnx.Rngs(0), param_dtype=queries.dtype).to_native()
        for path, value in params.items():
            converters.attribute(layer, path).set_value(value)
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
    from ..layers import converters

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
            owner = converters.attribute(layer, owner_path)
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


def _one_node(
    op_type: str, domain: str, inputs: list, dtype: Any, opset: int = 23, **attributes: Any
) -> Callable:
    """A function of numpy arrays (by input name) running one ONNX node in onnxruntime (CPU);
    inputs: (name, numpy dtype), or "" for an input left out; one output."""
    import onnxruntime
    from onnx import helper

    float_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    given = [(n, helper.np_dtype_to_tensor_dtype(np.dtype(t))) for n, t in (x for x in inputs if x)]
    node = helper.make_node(op_type, [x[0] if x else "" for x in inputs], ["Y"], domain=domain, **attributes)
    graph = helper.make_graph(
        [node], op_type, [helper.make_tensor_value_info(n, t, None) for n, t in given],
        [helper.make_tensor_value_info("Y", float_type, None)],
    )  # fmt: skip
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(domain, 1)] * bool(domain)
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4  # what it refuses is the row's status, not a log line
    session = onnxruntime.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )

    def run(**feeds: np.ndarray) -> np.ndarray:
        try:
            return session.run(None, feeds)[0]
        except Exception as err:  # its message's last sentence: what it refused
            raise RuntimeError(str(err).rsplit("was false.", 1)[-1].strip()) from None

    return run


def _mods_mask(allowed: Optional[np.ndarray], window: Any, documents: Any, B: int, Q: int, K: int) -> Any:
    """allowed AND the window's and the documents' formulas (B, Q, K); None: nothing masked."""
    if window is None and documents is None:
        return allowed
    allowed = np.ones((B, Q, K), bool) if allowed is None else allowed
    i, j = np.arange(Q)[:, None], np.arange(K)[None, :]
    if window is not None:
        allowed = allowed & (0 <= i - j) & (i - j < window)
    if documents is not None:
        allowed = allowed & (documents[0][:, :, None] == documents[1][:, None, :])
    return allowed


def _onnxruntime(opset: int, kind: str) -> Callable[[], Callable]:
    """onnxruntime's ``Attention`` node (CPU): dot_product on 3-D inputs as one head, or grouped
    heads by hand; at opset 24, 1-D lengths as ``nonpad_kv_seqlen`` and ``is_causal`` beside a mask."""

    def make() -> Callable:
        nodes: Dict[tuple, Callable] = {}

        def attend(q, k, v, mask=None, is_causal=False, softcap=None, lens=None):
            key = (q.dtype.str, mask is not None, is_causal, softcap, lens is not None)
            if key not in nodes:
                inputs = [
                    ("Q", q.dtype),
                    ("K", q.dtype),
                    ("V", q.dtype),
                    ("attn_mask", bool) if mask is not None else "",
                ]
                inputs += ["", "", ("nonpad_kv_seqlen", np.int64)] if lens is not None else []
                extra = {"softcap": float(softcap)} if softcap else {}
                nodes[key] = _one_node(
                    "Attention", "", inputs, q.dtype, opset=opset, is_causal=int(is_causal), **extra
                )
            feeds = {"Q": q, "K": k, "V": v}
            feeds.update({"attn_mask": mask} if mask is not None else {})
            feeds.update({"nonpad_kv_seqlen": lens.astype(np.int64)} if lens is not None else {})
            return nodes[key](**feeds)

        if kind == "grouped":
            return _heads_by_hand("numpy", lambda q, k, v, mask: attend(q, k, v, mask))

        def fn(queries, keys, values, valid_lens, attention_mask=None, causal=False, window=None,
               documents=None, softcap=None):  # fmt: skip
            lens, mask = _numpy(valid_lens), _numpy(attention_mask)
            (B, Q, _), K = queries.shape, keys.shape[1]
            nonpad = lens if opset >= 24 and lens is not None and lens.ndim == 1 else None
            lens = None if nonpad is not None else lens
            native_causal = causal and (opset >= 24 or (lens is None and mask is None and window is None
                                                         and documents is None))  # fmt: skip
            allowed = _mods_mask(
                visible(lens, mask, causal and not native_causal, B, Q, K), window, documents, B, Q, K
            )
            given = [x[:, None] for x in (queries, keys, values)]  # one head: (B, 1, seq, width)
            mask = None if allowed is None else allowed[:, None]
            return attend(*given, mask=mask, is_causal=native_causal, softcap=softcap, lens=nonpad)[:, 0]

        return fn

    return make


def _onnxruntime_contrib_mha() -> Callable:
    """onnxruntime's ``com.microsoft.MultiHeadAttention`` (CPU) on 3-D inputs, one head."""
    nodes: Dict[tuple, Callable] = {}

    def fn(queries, keys, values, valid_lens, attention_mask=None, causal=False, window=None, documents=None):
        lens, mask = _numpy(valid_lens), _numpy(attention_mask)
        if queries.dtype == np.float64:
            raise Unsupported("its CPU kernel takes float32 and float16")
        (B, Q, _), K = queries.shape, keys.shape[1]
        padding = lens if lens is not None and lens.ndim == 1 else None
        lens = None if padding is not None else lens
        native_causal = causal and lens is None and mask is None and window is None and documents is None
        allowed = _mods_mask(
            visible(lens, mask, causal and not native_causal, B, Q, K), window, documents, B, Q, K
        )
        key = (queries.dtype.str, padding is not None, allowed is not None, native_causal)
        if key not in nodes:
            inputs = [("query", queries.dtype), ("key", queries.dtype), ("value", queries.dtype), ""]
            inputs += [("key_padding_mask", np.int32) if padding is not None else ""]
            inputs += [("attention_bias", queries.dtype)] if allowed is not None else []
            nodes[key] = _one_node("MultiHeadAttention", "com.microsoft", inputs, queries.dtype, num_heads=1,
                                   unidirectional=int(native_causal))  # fmt: skip
        feeds = {"query": queries, "key": keys, "value": values}
        if padding is not None:
            feeds["key_padding_mask"] = padding.astype(np.int32)
        if allowed is not None:  # the mask as its additive form: 0 where visible, -inf where not
            feeds["attention_bias"] = np.where(allowed[:, None], 0, -np.inf).astype(queries.dtype)
        return nodes[key](**feeds)

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
        "torch.nn.attention.flex_attention (eager)",
        "torch",
        "dot_product",
        _torch_flex,
        "one `mask_mod` through `create_block_mask` (lengths AND mask AND causality as a lookup of their "
        "boolean mask, the window and the documents as their formulas), soft-capping as its `score_mod`; "
        "values only: eager flex_attention has no backward on CPU (it asks for `torch.compile`)",
    ),
    Implementation(
        "torch.nn.attention.flex_attention (torch.compile)",
        "torch",
        "dot_product",
        functools.partial(_torch_flex, compiled=True),
        "as the eager row, through `torch.compile(flex_attention)` (inductor), compiled afresh for each "
        "case (its CPU kernel refuses float64); values only: no backward on CPU, compiled or not",
    ),
    Implementation(
        "torch.nn.functional.scaled_dot_product_attention (enable_gqa=True)",
        "torch",
        "grouped",
        _torch_sdpa_gqa,
        "the canonical weights' projections by hand, 4 query heads and 2 key/value heads given as they are "
        "with `enable_gqa=True`, `attn_mask` (bool) of lengths AND mask AND causality",
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
        "`mask` (True = attend) of lengths AND mask, `is_causal`, soft-capping as `attn_logits_soft_cap`",
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
        "keras.layers.GroupQueryAttention (return_attention_scores=True)",
        "tensorflow",
        "grouped",
        _keras_mha(True),
        "built by `MultiHeadAttention(num_kv_heads=2).to_native()`; `attention_mask` (True = attend) of "
        "lengths AND mask, `use_causal_mask`",
        "keras",
    ),
    Implementation(
        "jax.nn.dot_product_attention (mask=)",
        "jax",
        "dot_product",
        _jax_sdpa(False),
        "`mask` (True = attend) of lengths AND mask, `is_causal`, the window as `local_window_size=(1, 0)`; "
        "values zero-padded to the key width",
    ),
    Implementation(
        "jax.nn.dot_product_attention (key_value_seq_lengths=)",
        "jax",
        "dot_product",
        _jax_sdpa(True),
        "1-D lengths as `key_value_seq_lengths`, 2-D lengths and the mask as `mask`, `is_causal`, the "
        "window as `local_window_size=(1, 0)`; values zero-padded to the key width",
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
        "flax.nnx.MultiHeadAttention (num_kv_heads=2)",
        "jax",
        "grouped",
        _flax_mha,
        "built by `MultiHeadAttention(num_kv_heads=2).to_native()`; `mask` (True = attend) of lengths AND "
        "mask AND causality; weights by `sow_weights=True`",
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
        "mlx.core.fast.scaled_dot_product_attention (grouped heads)",
        "mlx",
        "grouped",
        _mlx_sdpa_gqa,
        "the canonical weights' projections by hand, 4 query heads and 2 key/value heads given as they are, "
        "`mask` (bool) of lengths AND mask AND causality",
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
    Implementation(
        "onnxruntime Attention (opset 23)",
        "onnxruntime",
        "dot_product",
        _onnxruntime(23, "dot_product"),
        "one `Attention` node (CPU), the 3-D inputs as one head; `attn_mask` (bool, True = attend) of "
        f"lengths AND mask AND the window and documents' formulas; {_SDPA_CAUSAL}; soft-capping as its "
        "`softcap`; values only (an inference runtime)",
    ),
    Implementation(
        "onnxruntime Attention (opset 24)",
        "onnxruntime",
        "dot_product",
        _onnxruntime(24, "dot_product"),
        "as at opset 23, with 1-D lengths as `nonpad_kv_seqlen` and causality always as `is_causal` "
        "(opset 24 takes it beside a mask)",
    ),
    Implementation(
        "onnxruntime MultiHeadAttention (com.microsoft)",
        "onnxruntime",
        "dot_product",
        _onnxruntime_contrib_mha,
        "the contrib operator (CPU), the 3-D inputs as one head; 1-D lengths as `key_padding_mask`, the "
        "other masks and the window and documents' formulas as `attention_bias` (0 visible, -inf hidden); "
        "`unidirectional=1` where causality is the only mask; no soft-capping",
    ),
    Implementation(
        "onnxruntime Attention (grouped heads)",
        "onnxruntime",
        "grouped",
        _onnxruntime(23, "grouped"),
        "the canonical weights' projections by hand, 4 query heads and 2 key/value heads given as they are "
        "(opset 23), `attn_mask` (bool) of lengths AND mask AND causality",
    ),
)
FRAMEWORKS = tuple(dict.fromkeys(impl.framework for impl in IMPLEMENTATIONS))
# a native framework that is not a multiattn backend -> the backend whose arrays it takes
TENSORS = {"onnxruntime": "numpy"}


def backend_of(framework: str) -> str:
    return TENSORS.get(framework, framework)


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


def implementation_version(impl: Implementation) -> str:
    if impl.version or impl.framework in TENSORS:
        name = impl.version or impl.framework
        module = sys.modules.get(name) or importlib.import_module(name)
        return str(getattr(module, "__version__", "?"))
    return framework_version(impl.framework)
