"""TensorFlow layers: Keras layers (Keras 3 on its TensorFlow backend).

The layers work eagerly, inside ``tf.function`` and inside Keras models;
``training=`` controls dropout as in any Keras layer.  Keras' own
``get_weights()`` list form stays available as ``get_weights(format="keras")``;
``set_weights`` takes either the canonical dict or Keras' list.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from ..backends.tensorflow import keras, ops, to_numpy
from . import (
    AttentionCall,
    CanonicalWeights,
    CanonicalWeightsMixin,
    check_dropout,
    check_sizes,
)


class _Layer(AttentionCall, keras.layers.Layer):
    """Inputs keep their dtype (no Keras autocast): the output dtype is the input dtype."""

    _ops, _to_numpy = ops, staticmethod(to_numpy)

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


@keras.saving.register_keras_serializable(package="multiattn")
class DotProductAttention(_Layer):
    """Scaled dot-product attention as a Keras layer; dropout only when training."""

    def __init__(self, dropout: float = 0.0, need_weights: bool = True, **kwargs: Any) -> None:
        super().__init__(dropout, **kwargs)
        self.need_weights = need_weights  # False: attention_weights is not kept (no fused TF kernel)

    def call(self, queries, keys, values, valid_lens=None, training=None):
        out, self.attention_weights = self._dot_product(
            queries, keys, values, valid_lens, self._dropout(training), self.need_weights
        )
        return out

    def get_config(self):
        return {**super().get_config(), "need_weights": self.need_weights}


@keras.saving.register_keras_serializable(package="multiattn")
class AdditiveAttention(CanonicalWeightsMixin, _Layer):
    """Additive attention as a Keras layer with weights W_q, W_k, w_v (glorot_uniform, as Dense).

    Keras stores kernels (in, out): Keras' own weight list holds W_k (key_size, h),
    W_q (query_size, h), w_v (h, 1); get_weights()/set_weights(dict) speak the
    canonical layout and transpose.
    """

    _stored_in_out = True

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

    def _stored_weights(self):
        return self.W_q, self.W_k, tf.reshape(self.w_v, [-1])  # W_q, W_k stored (in, out); w_v (h,)

    def call(self, queries, keys, values, valid_lens=None, training=None):
        out, self.attention_weights = self._additive(
            queries, keys, values, valid_lens, self._dropout(training)
        )
        return out

    def get_config(self):
        return {
            **super().get_config(),
            "key_size": self.key_size,
            "query_size": self.query_size,
            "num_hiddens": self.num_hiddens,
        }
