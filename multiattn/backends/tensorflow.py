"""TensorFlow backend: Keras layers (Keras 3 on its TensorFlow backend) over the shared core.

The layers work eagerly, inside ``tf.function`` and inside Keras models;
``training=`` controls dropout as in any Keras layer.  Keras' own
``get_weights()`` list form stays available as ``get_weights(format="keras")``;
``set_weights`` takes either the canonical dict or Keras' list.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np

from .._registry import BackendImportError, tensor_check

if os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow":
    raise BackendImportError(
        f"multiattn's tensorflow backend needs Keras on its TensorFlow backend, but "
        f"KERAS_BACKEND={os.environ['KERAS_BACKEND']!r}; unset it or set KERAS_BACKEND=tensorflow "
        "before the first 'import keras'"
    )

import tensorflow as tf  # noqa: E402

try:
    import keras  # noqa: E402
except ImportError:  # pragma: no cover - TensorFlow < 2.16 ships Keras 2 as tf.keras
    keras = tf.keras

if (
    hasattr(keras, "backend")
    and hasattr(keras.backend, "backend")
    and keras.backend.backend() != "tensorflow"
):
    raise BackendImportError(
        f"multiattn's tensorflow backend needs Keras on its TensorFlow backend, but Keras was "
        f"already loaded with the {keras.backend.backend()!r} backend (KERAS_BACKEND); "
        "use multiattn's backend of that framework, or set KERAS_BACKEND=tensorflow"
    )

from .. import core  # noqa: E402
from ..core import per_row as _per_row  # noqa: E402
from ..functional import bind
from ..layers import CanonicalWeights, CanonicalWeightsMixin, check_dropout, check_sizes  # noqa: E402

SUPPORTED_DTYPES = ("float32", "float64", "float16", "bfloat16")

_HALF = (tf.float16, tf.bfloat16)


class TensorFlowOps:
    name = "tensorflow"
    # additive features in 16 MB float32 blocks: each eager op has a high fixed cost, and at
    # 4 MB blocks the additive benchmark took 1.6x the time (still a quarter of d2l's memory)
    feature_block_elements = 1 << 22

    def shape(self, x):
        return tuple(x.shape)

    def dtype_kind(self, x):
        dtype = tf.as_dtype(x.dtype)
        if dtype.is_bool:
            return "b"
        if dtype.is_complex:
            return "c"
        if dtype.is_floating:
            return "f"
        return "u" if dtype.is_unsigned else "i"

    def zeros(self, shape, like):
        return tf.zeros(shape, dtype=like.dtype)

    def any(self, mask, axis):
        return tf.reduce_any(mask, axis=axis, keepdims=True)

    def expand_dims(self, x, axis):
        return tf.expand_dims(x, axis)

    def matrix_transpose(self, x):
        return tf.linalg.matrix_transpose(x)

    def concat(self, xs, axis):
        return tf.concat(xs, axis=axis)

    def matmul(self, a, b):
        if len(b.shape) < 3:
            return _matmul_weight(a, b)
        return tf.matmul(a, b)

    def matmul_t(self, a, b):
        if len(b.shape) < 3:
            return _matmul_weight(a, tf.transpose(b))
        return tf.matmul(a, b, transpose_b=True)

    def tanh(self, x):
        return tf.tanh(x)

    def softmax(self, x):
        if x.dtype in _HALF:
            return tf.cast(tf.nn.softmax(tf.cast(x, tf.float32), axis=-1), x.dtype)
        return tf.nn.softmax(x, axis=-1)

    def length_mask(self, x, lens, axis=-1):
        # tf.range has no small or unsigned integer dtypes: compare in int64 or float64
        common = tf.float64 if lens.dtype.is_floating else tf.int64
        positions = tf.range(tf.shape(x)[axis], dtype=common)
        return positions < _per_row(tf.cast(lens, common))

    def where(self, mask, x, fill):
        return tf.where(mask, x, tf.constant(fill, dtype=x.dtype))

    def lowest(self, x):
        return float(tf.as_dtype(x.dtype).min)


def _matmul_weight(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """a (..., n) @ b (n, m) or (n,): a weight, not a batch, so one plain 2-D MatMul over a's
    rows.  Broadcasting BatchMatMulV2 over a rank-1/2 operand was seen to segfault in TF
    2.21's oneDNN kernels, and tf.tensordot took 1.25x as long on the additive blocks."""
    vector = len(b.shape) == 1
    static = a.shape.as_list()
    lead = static[:-1] if None not in static else tf.shape(a)[:-1]
    rows = tf.reshape(a, [-1, tf.shape(a)[-1] if static[-1] is None else static[-1]])
    out = tf.matmul(rows, b[:, None] if vector else b)
    if vector:
        return tf.reshape(out, lead)
    width = b.shape[-1] if b.shape[-1] is not None else tf.shape(b)[-1]
    return tf.reshape(out, lead + [width] if isinstance(lead, list) else tf.concat([lead, [width]], 0))


ops = TensorFlowOps()


_tensors = tensor_check("tensorflow")


masked_softmax, dot_product_attention, additive_attention = bind(ops)


def vjp(fn, args, cotangent):
    """(fn(*args), gradients of sum(fn(*args) * cotangent) with respect to args)."""
    with tf.GradientTape() as tape:
        tape.watch(args)
        out = fn(*args)
    grads = tape.gradient(out, args, output_gradients=cotangent)
    return out, [tf.zeros_like(a) if g is None else g for a, g in zip(args, grads)]


def from_numpy(array: Any, dtype: Optional[str] = None) -> tf.Tensor:
    tensor = tf.constant(np.array(array))
    return tensor if dtype is None else tf.cast(tensor, dtype)


def to_numpy(tensor: Any) -> np.ndarray:
    """A numpy copy (bfloat16 comes back as float32)."""
    tensor = tf.convert_to_tensor(tensor)
    if tensor.dtype == tf.bfloat16:
        tensor = tf.cast(tensor, tf.float32)
    return np.array(tensor.numpy())


class _Layer(keras.layers.Layer):
    """Inputs keep their dtype (no Keras autocast): the output dtype is the input dtype."""

    def __init__(self, dropout: float, **kwargs: Any) -> None:
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        self.rate = check_dropout(dropout)
        self.dropout = keras.layers.Dropout(self.rate, autocast=False)
        self.attention_weights = None

    def _dropout(self, training):
        return lambda weights: self.dropout(weights, training=training)

    def get_config(self):
        return {**super().get_config(), "dropout": self.rate}


class DotProductAttention(_Layer):
    """Scaled dot-product attention as a Keras layer; dropout only when training."""

    def __init__(self, dropout: float = 0.0, need_weights: bool = True, **kwargs: Any) -> None:
        super().__init__(dropout, **kwargs)
        self.need_weights = need_weights  # False: attention_weights is not kept (no fused TF kernel)

    def call(self, queries, keys, values, valid_lens=None, training=None):
        _tensors(queries=queries, keys=keys, values=values, valid_lens=valid_lens)
        out, self.attention_weights = core.dot_product_attention(
            ops, queries, keys, values, valid_lens, self._dropout(training), self.need_weights
        )
        return out


class AdditiveAttention(CanonicalWeightsMixin, _Layer):
    """Additive attention as a Keras layer with weights W_q, W_k, w_v (glorot_uniform, as Dense).

    Keras stores kernels (in, out): Keras' own weight list holds W_k (key_size, h),
    W_q (query_size, h), w_v (h, 1); get_weights()/set_weights(dict) speak the
    canonical layout and transpose.
    """

    def __init__(
        self, key_size: int, query_size: int, num_hiddens: int, dropout: float = 0.0, **kwargs: Any
    ) -> None:
        super().__init__(dropout, **kwargs)
        self.key_size, self.query_size, self.num_hiddens = check_sizes(key_size, query_size, num_hiddens)
        # The sizes are known now: create the weights at once so get/set_weights work before a call.
        kernel = dict(initializer="glorot_uniform", trainable=True)
        self.W_k = self.add_weight(shape=(self.key_size, self.num_hiddens), name="W_k", **kernel)
        self.W_q = self.add_weight(shape=(self.query_size, self.num_hiddens), name="W_q", **kernel)
        self.w_v = self.add_weight(shape=(self.num_hiddens, 1), name="w_v", **kernel)
        self.built = True

    def _read_weights(self) -> CanonicalWeights:
        return {
            "W_q": to_numpy(self.W_q).T.copy(),
            "W_k": to_numpy(self.W_k).T.copy(),
            "w_v": to_numpy(self.w_v).reshape(-1),
        }

    def _write_weights(self, weights: CanonicalWeights) -> None:
        for key, value in weights.items():
            variable = getattr(self, key)
            variable.assign(np.asarray(value.T if value.ndim == 2 else value[:, None], dtype=variable.dtype))

    def get_weights(self, format: str = "canonical"):  # noqa: A002 - Keras' name
        """The canonical dict; ``format="keras"`` gives Keras' list [W_k, W_q, w_v] (in, out)."""
        if format == "keras":
            return keras.layers.Layer.get_weights(self)
        if format != "canonical":
            raise ValueError(f"format must be 'canonical' or 'keras', got {format!r}")
        return self._read_weights()

    def set_weights(self, weights) -> None:
        """The canonical dict, or Keras' list (as from get_weights(format="keras"))."""
        if isinstance(weights, (list, tuple)):
            keras.layers.Layer.set_weights(self, weights)
        else:
            CanonicalWeightsMixin.set_weights(self, weights)

    def call(self, queries, keys, values, valid_lens=None, training=None):
        _tensors(queries=queries, keys=keys, values=values, valid_lens=valid_lens)
        dtype = queries.dtype
        out, self.attention_weights = core.additive_attention(
            ops,
            queries,
            keys,
            values,
            valid_lens,
            project_q=lambda q: ops.matmul(q, tf.cast(self.W_q, dtype)),
            project_k=lambda k: ops.matmul(k, tf.cast(self.W_k, dtype)),
            w_v=tf.reshape(tf.cast(self.w_v, dtype), [-1]),
            query_size=self.query_size,
            key_size=self.key_size,
            dropout=self._dropout(training),
        )
        return out

    def get_config(self):
        return {
            **super().get_config(),
            "key_size": self.key_size,
            "query_size": self.query_size,
            "num_hiddens": self.num_hiddens,
        }
