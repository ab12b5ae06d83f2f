"""TensorFlow backend: the ops of tf tensors (layers: ``multiattn.layers.tensorflow``).

Keras must run on its TensorFlow backend (checked here, with a clear error).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np

from .._registry import BackendImportError, framework_imports, layer_exports

if os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow":
    raise BackendImportError(
        f"multiattn's tensorflow backend needs Keras on its TensorFlow backend, but "
        f"KERAS_BACKEND={os.environ['KERAS_BACKEND']!r}; unset it or set KERAS_BACKEND=tensorflow "
        "before the first 'import keras'"
    )

with framework_imports("tensorflow"):  # not installed: an error naming the install
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

from .. import mods  # noqa: E402
from ..adapter import Ops  # noqa: E402
from ..functional import bind  # noqa: E402
from ..protocol import per_row  # noqa: E402

SUPPORTED_DTYPES = ("float32", "float64", "float16", "bfloat16")
DTYPE_NOTES: dict = {}

_HALF = (tf.float16, tf.bfloat16)


class TensorFlowOps(Ops):
    name = "tensorflow"

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
        return positions < per_row(tf.cast(lens, common))

    def causal_mask(self, n_queries, n_keys, like):
        n_queries = tf.shape(like)[-2] if n_queries is None else n_queries
        n_keys = tf.shape(like)[-1] if n_keys is None else n_keys
        return tf.range(n_keys)[None, :] <= tf.range(n_queries)[:, None]

    def logical_and(self, a, b):
        return tf.logical_and(a, b)

    def split_heads(self, x, num_heads):
        batch, n, width = _dims(x)
        return tf.transpose(tf.reshape(x, [batch, n, num_heads, width // num_heads]), [0, 2, 1, 3])

    def merge_heads(self, x):
        batch, heads, n, width = _dims(x)
        return tf.reshape(tf.transpose(x, [0, 2, 1, 3]), [batch, n, heads * width])

    def reshape(self, x, shape):
        return tf.reshape(x, list(shape))

    def where(self, mask, x, fill):
        return tf.where(mask, x, tf.constant(fill, dtype=x.dtype))

    def select(self, condition, x, y):
        x = x if tf.is_tensor(x) else tf.constant(x, dtype=y.dtype)
        return tf.where(condition, x, y if tf.is_tensor(y) else tf.constant(y, dtype=x.dtype))

    def take(self, x, indices):
        return tf.gather(x, indices)

    def call_mod(self, fn, args, like):
        return mods.call_with_index(self, fn, args, like)  # tf.int32 * 0.1 raises

    def positions(self, start, stop, like):
        return tf.range(start, stop)

    def constant(self, values, like):
        return tf.constant(values)

    def lowest(self, x):
        return float(tf.as_dtype(x.dtype).min)

    def cast(self, x, like):
        return tf.cast(x, like.dtype)

    def widen(self, x):
        return tf.cast(x, tf.float32) if x.dtype in (tf.float16, tf.bfloat16) else x

    def exp(self, x):
        return tf.exp(x)

    def log(self, x):
        return tf.math.log(x)

    def max(self, x, axis):
        return tf.reduce_max(x, axis=axis, keepdims=True)

    def sum(self, x, axis):
        return tf.reduce_sum(x, axis=axis, keepdims=True)

    def maximum(self, a, b):
        return tf.maximum(a, tf.constant(b, dtype=a.dtype) if isinstance(b, float) else b)

    def compiled(self, step):
        # XLA fuses a block's exp, sums and rescaling; eagerly each would be an op of its own
        return _Concrete(tf.function(step, jit_compile=True))

    def split_rows(self, x, sizes):
        return tf.split(x, list(sizes), axis=-2)  # one op, not an eager slice per block

    loop_primitives = True

    def loop(self, count, body, state):
        def step(i, *state):
            return (i + 1, *body(i, state))

        return tuple(tf.while_loop(lambda i, *_: i < count, step, (0, *state), parallel_iterations=1)[1:])

    def map_rows(self, fn, count, likes):
        signature = tuple(tf.TensorSpec(None, like.dtype) for like in likes)
        found = tf.map_fn(fn, tf.range(count), fn_output_signature=signature, parallel_iterations=1)
        return tuple(self.joined_rows(x) for x in found)

    def joined_rows(self, x):
        rank = len(x.shape)  # one transpose and reshape, not a slice per block
        x = tf.transpose(x, list(range(1, rank - 2)) + [0, rank - 2, rank - 1])
        return tf.reshape(x, x.shape[:-3] + [x.shape[-3] * x.shape[-2], x.shape[-1]])

    def row_windows(self, x, start, size, step, count):
        if step != size:
            return super().row_windows(x, start, size, step, count)
        x = x[..., start : start + count * size, :]  # tiles: one reshape and transpose
        x = tf.reshape(x, tf.concat([tf.shape(x)[:-2], [count, size, tf.shape(x)[-1]]], 0))
        rank = len(x.shape)
        return tf.transpose(x, [rank - 3] + list(range(rank - 3)) + [rank - 2, rank - 1])

    def write_rows(self, x, split, start, rows):
        if isinstance(split, int):
            return super().write_rows(x, split, start, rows)
        row, n = tf.gather(x, split), rows.shape[-2]  # traced: one update, the storage's shape kept
        if not (isinstance(start, int) and start == 0 and n == row.shape[-2]):
            rows = tf.concat([row[..., :start, :], rows, row[..., start + n :, :]], -2)
        return tf.tensor_scatter_nd_update(x, tf.reshape(tf.cast(split, tf.int32), (1, 1)), rows[None])

    def rows_at(self, x, start, size, axis=-2):
        rank = len(x.shape)
        axis %= rank
        if isinstance(start, int):
            return x[(slice(None),) * axis + (slice(start, start + size),)]
        begin = tf.stack([0] * axis + [tf.cast(start, tf.int32)] + [0] * (rank - axis - 1))
        found = tf.slice(x, begin, [-1] * axis + [size] + [-1] * (rank - axis - 1))
        return tf.ensure_shape(found, x.shape[:axis] + [size] + x.shape[axis + 1 :])

    def host_values(self, x):
        return x.numpy() if tf.executing_eagerly() and hasattr(x, "numpy") else None

    def custom_gradient(self, forward, backward, tensors, constants=(), tangent=None):
        if tf.executing_eagerly() and not _recording():  # no tape: the wrapper's cost for nothing
            return forward(*tensors, *constants)
        if (
            tangent is not None
            and tf.executing_eagerly()
            and all(np.isfinite(t.numpy()).all() for t in tensors)
        ):
            return forward(*tensors, *constants)  # the tape's own gradients are the rule's
        n = len(tensors)

        @tf.custom_gradient
        def wrapped(*args):
            # stop_gradient: else the tape would record, and keep, every block of the forward
            outputs = forward(*map(tf.stop_gradient, args))

            def grad(*cotangents):
                return (*backward(args[:n], args[n:], outputs, cotangents), *[None] * (len(args) - n))

            return outputs, grad

        return wrapped(*tensors, *constants)


def _recording() -> bool:
    """Whether a gradient tape or forward accumulator may record (TensorFlow's own test; where
    it has moved, assume one may)."""
    return _record is None or _record.could_possibly_record()


try:
    from tensorflow.python.eager import record as _record
except ImportError:  # pragma: no cover (a TensorFlow that moved it)
    _record = None


def _dims(x: tf.Tensor) -> list:
    """x's dimensions, static where known, else read at run time (a traced graph)."""
    dynamic = tf.shape(x)
    return [dynamic[i] if d is None else d for i, d in enumerate(x.shape.as_list())]


def _matmul_weight(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """a (..., n) @ b (n, m) or (n,): a weight, not a batch, so one plain 2-D MatMul over a's
    rows (broadcasting BatchMatMulV2 over a rank-1/2 operand segfaulted in TF 2.21's oneDNN
    kernels; tf.tensordot is slower)."""
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
masked_softmax, dot_product_attention, additive_attention, multi_head_attention = bind(ops)
__getattr__ = layer_exports("tensorflow")


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


class _Concrete:
    """A tf.function called through its concrete function per input signature: tf.function's
    own dispatch (matching the arguments to a trace) costs a millisecond per call, and the
    concrete function's own binding of structured arguments costs a little per tensor, which
    its flat call (``_call_flat``, where this version of tensorflow has it) does not pay."""

    def __init__(self, function):
        self.function, self.traced = function, {}

    def __call__(self, *args):
        signature = tuple((tuple(arg.shape), arg.dtype) for arg in args)
        found = self.traced.get(signature)
        if found is None:
            concrete = self.function.get_concrete_function(*args)
            flat = getattr(concrete, "_call_flat", None)
            found = self.traced[signature] = (
                concrete if flat is None else lambda *xs: flat(list(xs), concrete.captured_inputs)
            )
        return found(*args)
