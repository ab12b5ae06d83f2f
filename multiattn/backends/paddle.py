"""PaddlePaddle backend: the ops of paddle tensors (layers: ``multiattn.layers.paddle``).

Two facts of paddle shape this adapter:
* importing paddle after tensorflow/keras segfaults the process, so loading
  this backend in such a process raises an ImportError that explains the way
  around instead;
* paddle's CPU build has no float16/bfloat16 kernels for matmul, tanh or
  where, so half-precision tensors on the CPU get a clear error (they work on
  a GPU).
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any, Optional

import numpy as np

from .._registry import BackendImportError, framework_imports, layer_exports
from ..validation import InputDtypeError

if "paddle" not in sys.modules and ({"tensorflow", "keras"} & set(sys.modules)):
    raise BackendImportError(
        "multiattn will not import paddle in this process: tensorflow/keras is already "
        "imported, and importing paddle after tensorflow crashes the process with a "
        "segmentation fault (a paddle bug). Either import paddle before tensorflow "
        "(e.g. 'import paddle' at the top of your program), or use paddle in another process."
    )

with framework_imports("paddle"):  # not installed: an error naming the install
    import paddle  # noqa: E402
    from paddle import nn  # noqa: E402

from .. import fast_paths, mods  # noqa: E402
from ..adapter import Ops  # noqa: E402
from ..functional import bind  # noqa: E402
from ..masks import visibility, visible_values  # noqa: E402
from ..protocol import dtype_kind_by_dtype, per_row, softmax_hiding_minus_inf  # noqa: E402

_CAUSAL: dict = {}  # (queries, keys, place) -> the causal mask
SUPPORTED_DTYPES = ("float32", "float64")  # on the CPU; float16/bfloat16 need a GPU
_NO_HALF = "paddle's CPU build has no float16/bfloat16 kernels for {}"
_KERNELS = {
    "masked_softmax": "where (the masking)",
    "dot_product": "matmul and where",
    "additive": "matmul, tanh and where",
    "multi_head": "matmul and where",
    "grouped": "matmul and where",
    "dot_product_4d": "matmul and where",
    "masked_softmax_4d": "where (the masking)",
}
DTYPE_NOTES = {
    dtype: {f: _NO_HALF.format(k) for f, k in _KERNELS.items()} for dtype in ("float16", "bfloat16")
}

_HALF = (paddle.float16, paddle.bfloat16)


class _Positions(paddle.Tensor):
    """paddle's integer positions for score and mask functions, a Tensor (so that paddle
    indexes with them), whose arithmetic with a Python float is done in the scores' dtype
    (``float_dtype``): paddle computes an integer tensor times a float in float32."""

    float_dtype: Any = paddle.float32

    def _apply(self, other: Any, op: str) -> Any:
        if isinstance(other, float):
            mine = paddle.cast(paddle.Tensor(self), self.float_dtype)
            return getattr(mine, op)(other)
        out = getattr(paddle.Tensor, op)(self, other)
        return type(self)(out) if not out.is_floating_point() and out.dtype != paddle.bool else out


def _operator(op: str) -> Any:
    return lambda self, other: self._apply(other, op)


for _op in ("add", "radd", "sub", "rsub", "mul", "rmul", "floordiv", "mod", "truediv", "rtruediv", "pow"):
    setattr(_Positions, f"__{_op}__", _operator(f"__{_op}__"))


@functools.lru_cache(maxsize=None)
def _positions_class(dtype: Any) -> type:
    return type("Positions", (_Positions,), {"float_dtype": dtype})


def _kind(dtype: Any) -> str:
    if dtype == paddle.bool:
        return "b"
    if paddle.is_complex(paddle.zeros([0], dtype=dtype)):
        return "c"
    if paddle.is_floating_point(paddle.zeros([0], dtype=dtype)):
        return "f"
    return "u" if dtype == paddle.uint8 else "i"


class PaddleOps(Ops):
    name = "paddle"

    def shape(self, x):
        return tuple(None if d is None or d < 0 else d for d in x.shape)

    # once per dtype: paddle's is_floating_point and is_complex cost microseconds per call
    dtype_kind = dtype_kind_by_dtype(_kind)

    def zeros(self, shape, like):
        return paddle.zeros(shape, dtype=like.dtype)

    def any(self, mask, axis):
        return paddle.any(mask, axis=axis, keepdim=True)

    def expand_dims(self, x, axis):
        return paddle.unsqueeze(x, axis)

    def matrix_transpose(self, x):
        perm = list(range(x.ndim))
        perm[-2:] = perm[-1], perm[-2]
        return paddle.transpose(x, perm)

    def concat(self, xs, axis):
        return paddle.concat(xs, axis=axis)

    def matmul(self, a, b):
        return paddle.matmul(a, b)

    def matmul_t(self, a, b):
        return paddle.matmul(a, b, transpose_y=True)

    def tanh(self, x):
        return paddle.tanh(x)

    def softmax(self, x):
        if x.dtype in _HALF:
            return nn.functional.softmax(x, axis=-1, dtype="float32").astype(x.dtype)
        return nn.functional.softmax(x, axis=-1)

    def safe_softmax(self, x):
        return self._safe_softmax(x, self.softmax)

    def _safe_softmax(self, x, softmax):
        # paddle's element-wise passes run at a quarter of its reductions' rate (RESULTS.md):
        # where no score is -inf (read eagerly), a plain softmax is the row rule's already
        if _no_minus_inf(x):
            return softmax(x)
        return softmax_hiding_minus_inf(self, x, self.where, softmax)

    def _softmax_owned(self, x):
        # the weights take the scores' memory (softmax_); not where autograd needs x, in a
        # static graph, or in half types (float32 math)
        if x.dtype in _HALF or not paddle.in_dynamic_mode() or not _untracked(x):
            return self.softmax(x)
        return nn.functional.softmax_(x, axis=-1)

    def length_mask(self, x, lens, axis=-1):
        # paddle does not promote int64 against int32: compare in int64 or float64
        common = "float64" if paddle.is_floating_point(lens) else "int64"
        positions = paddle.arange(x.shape[axis], dtype=common)
        return positions < per_row(lens.astype(common))

    def causal_mask(self, n_queries, n_keys, like):
        # kept: paddle's broadcast comparison costs a diagonal block much of its time (RESULTS.md)
        if not paddle.in_dynamic_mode():  # a static graph's (paddle.jit.to_static) is its own
            return paddle.arange(n_keys)[None, :] <= paddle.arange(n_queries)[:, None]
        key = (n_queries, n_keys, str(like.place))
        mask = _CAUSAL.get(key)
        if mask is None:
            if len(_CAUSAL) > 64:
                _CAUSAL.clear()
            mask = _CAUSAL[key] = paddle.arange(n_keys)[None, :] <= paddle.arange(n_queries)[:, None]
        return mask

    def logical_and(self, a, b):
        return paddle.logical_and(a, b)

    def split_heads(self, x, num_heads):
        batch, n, width = x.shape
        return paddle.transpose(x.reshape([batch, n, num_heads, width // num_heads]), [0, 2, 1, 3])

    def merge_heads(self, x):
        batch, heads, n, width = x.shape
        return paddle.transpose(x, [0, 2, 1, 3]).reshape([batch, n, heads * width])

    def reshape(self, x, shape):
        return x.reshape(list(shape))

    def where(self, mask, x, fill):
        return paddle.where(mask, x, paddle.full([], fill, dtype=x.dtype))

    def select(self, condition, x, y):
        x = x if isinstance(x, paddle.Tensor) else paddle.full([], x, dtype=y.dtype)
        return paddle.where(
            condition, x, y if isinstance(y, paddle.Tensor) else paddle.full([], y, dtype=x.dtype)
        )

    def positions(self, start, stop, like):
        return paddle.arange(start, stop)

    def call_mod(self, fn, args, like):
        return mods.call_with_positions_as(fn, args, _positions_class(like.dtype))

    def constant(self, values, like):
        return paddle.to_tensor(values, place=like.place)

    def lowest(self, x):
        return float(paddle.finfo(x.dtype).min)

    def cast(self, x, like):
        return x if x.dtype == like.dtype else x.astype(like.dtype)

    def widen(self, x):
        return x.astype("float32") if x.dtype in (paddle.float16, paddle.bfloat16) else x

    def exp(self, x):
        return paddle.exp(x)

    def log(self, x):
        return paddle.log(x)

    def max(self, x, axis):
        return paddle.max(x, axis=axis, keepdim=True)

    def sum(self, x, axis):
        return paddle.sum(x, axis=axis, keepdim=True)

    def maximum(self, a, b):
        return paddle.maximum(a, paddle.full([], b, dtype=a.dtype) if isinstance(b, float) else b)

    def host_values(self, x):
        return x.numpy() if paddle.in_dynamic_mode() and x.place.is_cpu_place() else None

    def custom_gradient(self, forward, backward, tensors, constants=(), tangent=None):
        # dynamic mode only: to_static's PyLayer takes tensor arguments alone, and no set_materialize_grads
        if not (
            paddle.in_dynamic_mode()
            and paddle.is_grad_enabled()
            and any(not t.stop_gradient for t in tensors)
        ):
            return forward(*tensors, *constants)
        return _CustomGradient.apply(forward, backward, len(tensors), *tensors, *constants)

    # -- specialisations --------------------------------------------------------------------

    def masked_softmax_writing_padding(self, scores, values, masks, owned):
        # paddle's CPU `where` is slow: a slice per sequence won at every size measured.  Not
        # under autograd (softmax's backward needs its output as it was).
        if not _untracked(scores):
            return "autograd records the scores"
        lengths = fast_paths.lengths_per_sequence(masks, lambda lens: _cpu_lengths(scores, lens))
        return fast_paths.offer_writing_padding(
            self, scores, values, owned, lengths, copy=paddle.clone, softmax=self._softmax_owned
        )

    def masked_softmax_in_scores_memory(self, scores, values, masks, owned):
        if owned and _no_minus_inf(scores):  # hidden scores the lowest, their weights 0 after
            return functools.partial(self._masked_softmax_of_finite, scores, values, masks)
        # some score is -inf (or the caller's): the formula, without reading them again
        return fast_paths.offer_in_scores_memory(
            self, scores, values, masks, owned, where=self.where, softmax=self._softmax_owned
        )

    def _masked_softmax_of_finite(self, scores, values, masks):
        # two passes fewer than the formula's: no score is -inf, so only the mask hides any
        mask = visibility(self, masks, scores)
        if mask is None:
            return self._softmax_owned(scores), values
        weights = self._softmax_owned(self.where(mask, scores, self.lowest(scores)))
        values = values if values is None else visible_values(self, values, mask)
        return self.where(mask, weights, 0.0), values

    def additive_scores_over_visible_keys(self, q_hidden, k_hidden, w_v, masks):
        return fast_paths.offer_additive_over_visible_keys(
            self, q_hidden, k_hidden, w_v, masks, read=lambda lens: _cpu_lengths(q_hidden, lens)
        )

    def check_tensors(self, **tensors):
        super().check_tensors(**tensors)
        for arg, x in tensors.items():  # lengths are only compared, which paddle does in any dtype
            if arg != "valid_lens" and x is not None and x.dtype in _HALF and x.place.is_cpu_place():
                kernels = _NO_HALF.format("matmul, tanh and where")
                raise InputDtypeError(f"{arg} is {x.dtype} on the CPU, but {kernels}; use float32 (or a GPU)")


class _CustomGradient(paddle.autograd.PyLayer):
    """``Ops.custom_gradient``: forward saves its inputs and outputs, backward is the core's."""

    @staticmethod
    def forward(ctx, forward, backward, n_tensors, *args):
        outputs = forward(*args)
        ctx.set_materialize_grads(False)  # an unused output's cotangent stays None
        ctx.core_backward, ctx.n_outputs = backward, len(outputs)  # not ctx.backward: paddle calls that
        ctx.needs_grad = [not t.stop_gradient for t in args[:n_tensors]]
        ctx.save_for_backward(*args, *outputs)
        return outputs

    @staticmethod
    def backward(ctx, *cotangents):
        saved, n = ctx.saved_tensor(), len(ctx.needs_grad)
        args, outputs = saved[: len(saved) - ctx.n_outputs], saved[len(saved) - ctx.n_outputs :]
        grads = ctx.core_backward(args[:n], args[n:], outputs, cotangents)
        # paddle wants one per tensor input, None (and only None) where it needs no gradient
        grads = [g if needed else None for g, needed in zip(grads, ctx.needs_grad)]
        return (*grads, *[None] * (len(args) - n))


def _cpu_lengths(x, lens) -> Optional[list]:
    """lens (B,) as Python numbers where they and x are on the CPU, outside a static graph
    (which would bake them in); else None."""
    if not (
        len(lens.shape) == 1
        and paddle.in_dynamic_mode()
        and x.place.is_cpu_place()
        and lens.place.is_cpu_place()
    ):
        return None
    return lens.tolist()


def _no_minus_inf(x) -> bool:
    """Whether no element of x is -inf, read eagerly (one reduction); False in a static graph."""
    return paddle.in_dynamic_mode() and bool(paddle.min(x) > -math.inf)


def _untracked(x) -> bool:
    """Whether autograd keeps no record of x (so the core may write into it)."""
    return x.stop_gradient or not paddle.is_grad_enabled()


ops = PaddleOps()
masked_softmax, dot_product_attention, additive_attention, multi_head_attention = bind(ops)
__getattr__ = layer_exports("paddle")


def vjp(fn, args, cotangent):
    """(fn(*args), gradients of sum(fn(*args) * cotangent) with respect to args)."""
    args = [a.detach().clone() for a in args]
    for a in args:
        a.stop_gradient = False
    out = fn(*args)
    grads = paddle.grad([out], args, grad_outputs=[cotangent], allow_unused=True)
    return out.detach(), [paddle.zeros_like(a) if g is None else g for a, g in zip(args, grads)]


def from_numpy(array: Any, dtype: Optional[str] = None) -> paddle.Tensor:
    tensor = paddle.to_tensor(np.array(array))
    return tensor if dtype is None else tensor.astype(dtype)


def to_numpy(tensor: Any) -> np.ndarray:
    """A numpy copy (bfloat16 comes back as float32)."""
    if tensor.dtype == paddle.bfloat16:
        tensor = tensor.astype("float32")
    return np.array(tensor.detach().numpy())
