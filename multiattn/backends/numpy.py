"""numpy backend: the ops of numpy arrays (layers: ``multiattn.layers.numpy``).

numpy is a first-class backend, not only a test reference; it has no autograd.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .. import fast_paths
from .._registry import layer_exports
from ..functional import bind
from .numpy_like import NumpyLikeOps

SUPPORTED_DTYPES = ("float32", "float64", "float16")
DTYPE_NOTES = {"bfloat16": "numpy has no bfloat16 dtype"}


class NumpyOps(NumpyLikeOps):
    name = "numpy"
    xp = np

    def dtype_kind(self, x):
        return x.dtype.kind

    def matrix_transpose(self, x):
        return np.ascontiguousarray(np.swapaxes(x, -1, -2))  # no copy where an axis has size 1

    def exp_minus(self, x, m, owned=False):
        if not (owned and x.flags.writeable and x.dtype == np.result_type(x, m)):
            return np.exp(x - m)
        return np.exp(np.subtract(x, m, out=x), out=x)  # no new block of scores (RESULTS.md)

    def tanh_of_sum(self, a, b, buffers):
        # no autograd: one buffer for all additive blocks, written in place
        dead = buffers.pop() if buffers else None
        shape = np.broadcast_shapes(a.shape, b.shape)
        if dead is None or dead.shape != shape or dead.dtype != np.result_type(a, b):
            features = np.add(a, b)
        else:
            features = np.add(a, b, out=dead)
        buffers.append(np.tanh(features, out=features))
        return features

    def softmax(self, x):
        # half types in float32; a copy either way, so the steps can run in place
        work = x.astype(np.float32) if x.dtype.itemsize < 4 else x.copy()
        return _softmax_in_place(work).astype(x.dtype, copy=False)

    def cast(self, x, like):
        return x.astype(like.dtype, copy=False)

    def host_values(self, x):
        return x

    def log(self, x):
        with np.errstate(divide="ignore"):  # log 0 = -inf is meant: rows that see nothing
            return np.log(x)

    # -- specialisations --------------------------------------------------------------------

    def masked_softmax_writing_padding(self, scores, values, masks, owned):
        # host data: writing only the padding beats two masked passes at every size measured
        lengths = fast_paths.lengths_per_sequence(masks, np.ndarray.tolist)
        return fast_paths.offer_writing_padding(
            self, scores, values, owned, lengths, copy=np.copy, softmax=self._softmax_owned
        )

    def masked_softmax_in_scores_memory(self, scores, values, masks, owned):
        return fast_paths.offer_in_scores_memory(
            self, scores, values, masks, owned, where=self.where, softmax=self._softmax_owned
        )

    def additive_scores_over_visible_keys(self, q_hidden, k_hidden, w_v, masks):
        return fast_paths.offer_additive_over_visible_keys(
            self, q_hidden, k_hidden, w_v, masks, read=np.ndarray.tolist
        )

    def _softmax_owned(self, x):
        # the core's own scores: the steps run in x, no (B, Q, K) temporaries to page in
        if x.dtype.itemsize < 4 or not x.flags.writeable:
            return self.softmax(x)
        return _softmax_in_place(x)


def _softmax_in_place(x: np.ndarray) -> np.ndarray:
    """Softmax over x's last axis, written into x (max-subtracted)."""
    with np.errstate(invalid="ignore"):  # a row of -inf is NaN here; the core's row rule says 0
        x -= x.max(axis=-1, keepdims=True, initial=-np.inf)
        np.exp(x, out=x)
        x /= x.sum(axis=-1, keepdims=True)
    return x


ops = NumpyOps()
masked_softmax, dot_product_attention, additive_attention, multi_head_attention = bind(ops)
vjp = None  # no autodiff: the check command and the gradient tests say so
__getattr__ = layer_exports("numpy")


def from_numpy(array: Any, dtype: Optional[str] = None) -> np.ndarray:
    """A numpy copy of ``array`` (in ``dtype`` if given)."""
    return np.array(array, dtype=dtype)


def to_numpy(tensor: Any) -> np.ndarray:
    return np.asarray(tensor)
