"""PaddlePaddle backend: ``paddle.nn.Layer`` classes over the shared core.

Two facts of paddle shape this adapter:
* importing paddle after tensorflow/keras segfaults the process, so loading
  this backend in such a process raises an ImportError that explains the way
  around instead;
* paddle's CPU build has no float16/bfloat16 kernels for matmul, tanh or
  where, so half-precision tensors on the CPU get a clear error (they work on
  a GPU).
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import numpy as np

from .._registry import BackendImportError

if "paddle" not in sys.modules and ({"tensorflow", "keras"} & set(sys.modules)):
    raise BackendImportError(
        "multiattn will not import paddle in this process: tensorflow/keras is already "
        "imported, and importing paddle after tensorflow crashes the process with a "
        "segmentation fault (a paddle bug). Either import paddle before tensorflow "
        "(e.g. 'import paddle' at the top of your program), or use paddle in another process."
    )

import paddle  # noqa: E402
from paddle import nn  # noqa: E402

from .. import _registry, core, functional, layers  # noqa: E402
from .._registry import check_framework  # noqa: E402
from ..core import per_row as _per_row  # noqa: E402
from ..functional import bind
from ..layers import CanonicalWeights, CanonicalWeightsMixin, check_dropout, check_sizes  # noqa: E402

SUPPORTED_DTYPES = ("float32", "float64")  # on the CPU; float16/bfloat16 need a GPU
_NO_HALF = "paddle's CPU build has no float16/bfloat16 matmul and tanh kernels"
DTYPE_NOTES = {"float16": _NO_HALF, "bfloat16": _NO_HALF}

_HALF = (paddle.float16, paddle.bfloat16)


class PaddleOps:
    name = "paddle"

    def shape(self, x):
        return tuple(None if d is None or d < 0 else d for d in x.shape)

    def dtype_kind(self, x):
        if x.dtype == paddle.bool:
            return "b"
        if paddle.is_complex(x):
            return "c"
        if paddle.is_floating_point(x):
            return "f"
        return "u" if x.dtype == paddle.uint8 else "i"

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

    def softmax_owned(self, x):
        # the weights take the scores' memory (softmax_): 4.1 vs 4.7 ms at (8, 512, 512).
        # Not where autograd needs x, in a static graph, or in half types (float32 math).
        if x.dtype in _HALF or not paddle.in_dynamic_mode() or not _untracked(x):
            return self.softmax(x)
        return nn.functional.softmax_(x, axis=-1)

    def length_mask(self, x, lens, axis=-1):
        # paddle does not promote int64 against int32: compare in int64 or float64
        common = "float64" if paddle.is_floating_point(lens) else "int64"
        positions = paddle.arange(x.shape[axis], dtype=common)
        return positions < _per_row(lens.astype(common))

    def where(self, mask, x, fill):
        return paddle.where(mask, x, paddle.full([], fill, dtype=x.dtype))

    def lowest(self, x):
        return float(paddle.finfo(x.dtype).min)

    def host_lengths(self, x, lens):
        # paddle's `where` takes 13 ms at (8, 512, 512) on the CPU, writing only the padding
        # (a slice per sequence) about 3.5 ms, and slices won at every size measured, the toy
        # one too (0.23 vs 0.30 ms).  Not under autograd (softmax's backward needs its
        # output as it was), not in a static graph (the lengths would be baked in).
        if not (
            len(lens.shape) == 1
            and paddle.in_dynamic_mode()
            and x.place.is_cpu_place()
            and lens.place.is_cpu_place()
            and _untracked(x)
        ):
            return None
        return lens.tolist()

    def copy(self, x):
        return x.clone()


def _untracked(x) -> bool:
    """Whether autograd keeps no record of x (so the core may write into it)."""
    return x.stop_gradient or not paddle.is_grad_enabled()


ops = PaddleOps()

# paddle.jit.to_static would transcribe every function a layer calls, the framework-free
# core included, and trips on its plain Python; those modules run as Python instead.
paddle.jit.ignore_module([_registry, core, functional, layers])


def _tensors(**tensors: Any) -> None:
    check_framework("paddle", **tensors)
    for arg, x in tensors.items():
        if x is not None and x.dtype in _HALF and x.place.is_cpu_place():
            raise core.InputDtypeError(
                f"{arg} is {x.dtype} on the CPU, but {_NO_HALF}; use float32 (or a GPU)"
            )


masked_softmax, dot_product_attention, additive_attention = bind(ops, _tensors)


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


class DotProductAttention(nn.Layer):
    """Scaled dot-product attention; dropout in train mode only (``.train()``/``.eval()``)."""

    def __init__(self, dropout: float = 0.0, need_weights: bool = True) -> None:
        super().__init__()
        self.dropout = nn.Dropout(check_dropout(dropout))
        self.need_weights = need_weights  # False: attention_weights is not kept
        self.attention_weights: Optional[paddle.Tensor] = None

    def forward(self, queries, keys, values, valid_lens=None) -> paddle.Tensor:
        _tensors(queries=queries, keys=keys, values=values, valid_lens=valid_lens)
        out, self.attention_weights = core.dot_product_attention(
            ops, queries, keys, values, valid_lens, self.dropout, self.need_weights
        )
        return out


class AdditiveAttention(CanonicalWeightsMixin, nn.Layer):
    """Additive attention with ``nn.Linear(bias_attr=False)``; paddle stores weights (in, out)."""

    def __init__(self, key_size: int, query_size: int, num_hiddens: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.key_size, self.query_size, self.num_hiddens = check_sizes(key_size, query_size, num_hiddens)
        self.W_k = nn.Linear(self.key_size, self.num_hiddens, bias_attr=False)
        self.W_q = nn.Linear(self.query_size, self.num_hiddens, bias_attr=False)
        self.w_v = nn.Linear(self.num_hiddens, 1, bias_attr=False)
        self.dropout = nn.Dropout(check_dropout(dropout))
        self.attention_weights: Optional[paddle.Tensor] = None

    def _read_weights(self) -> CanonicalWeights:
        return {
            "W_q": to_numpy(self.W_q.weight).T.copy(),
            "W_k": to_numpy(self.W_k.weight).T.copy(),
            "w_v": to_numpy(self.w_v.weight).reshape(-1),
        }

    def _write_weights(self, weights: CanonicalWeights) -> None:
        for key, value in weights.items():
            param = getattr(self, key).weight
            layout = value.T if value.ndim == 2 else value[:, None]
            param.set_value(paddle.to_tensor(np.ascontiguousarray(layout)).astype(param.dtype))

    def forward(self, queries, keys, values, valid_lens=None) -> paddle.Tensor:
        _tensors(queries=queries, keys=keys, values=values, valid_lens=valid_lens)
        out, self.attention_weights = core.additive_attention(
            ops,
            queries,
            keys,
            values,
            valid_lens,
            project_q=self.W_q,
            project_k=self.W_k,
            w_v=self.w_v.weight[:, 0],
            query_size=self.query_size,
            key_size=self.key_size,
            dropout=self.dropout,
        )
        return out
