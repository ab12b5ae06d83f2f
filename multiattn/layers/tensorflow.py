"""TensorFlow layers: Keras layers (Keras 3 on its TensorFlow backend).

The layers work eagerly, inside ``tf.function`` and inside Keras models;
``training=`` controls dropout as in any Keras layer.  Keras' own
``get_weights()`` list form stays available as ``get_weights(format="keras")``;
``set_weights`` takes either the canonical dict or Keras' list.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .._registry import framework_imports  # noqa: E402

with framework_imports("tensorflow"):  # not installed: an error naming the install
    import tensorflow as tf

from ..backends.tensorflow import keras, ops, to_numpy
from . import (
    AdditiveWeights,
    AttentionCall,
    CanonicalWeightsMixin,
    MultiHeadWeights,
    check_dropout,
    converters,
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

    def _parameter(self, name):
        return getattr(self, name)  # Keras variables, kernels stored (in, out)

    def _assign(self, name, value):
        variable = getattr(self, name)
        variable.assign(np.asarray(value.reshape(variable.shape), dtype=variable.dtype))

    def _call(self, queries, keys, values, valid_lens, training, taken, unknown):
        """What every ``call`` does: ``taken``, the values of its keywords (``_takes``, in order;
        Keras' functional API needs them in the signature), ``unknown``, its ``**unknown``."""
        keywords = {**dict(zip(self._takes, taken)), **unknown}
        out, self.attention_weights = self._attend(
            queries, keys, values, valid_lens, self._dropout(training), keywords
        )
        return out


class _Weighted(CanonicalWeightsMixin, _Layer):
    """Keras' own get_weights() list stays available as get_weights(format="keras")."""

    _stored_in_out = True

    def _add_linear(self, name, in_size, out_size, bias):
        """A kernel (in, out) (glorot_uniform, as Dense) and, with bias, b_<name> (zeros)."""
        kernel = dict(shape=(in_size, out_size), name=name, initializer="glorot_uniform")
        setattr(self, name, self.add_weight(**kernel))
        if bias:
            b = "b" + name[1:]
            setattr(self, b, self.add_weight(shape=(out_size,), name=b, initializer="zeros"))

    def get_weights(self, format: str = "canonical"):  # noqa: A002 - Keras' name
        """The canonical dict; ``format="keras"`` gives Keras' list of variables (in, out)."""
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


@keras.saving.register_keras_serializable(package="multiattn")
class DotProductAttention(_Layer):
    """Scaled dot-product attention as a Keras layer; dropout only when training."""

    def __init__(self, dropout: float = 0.0, need_weights: bool = True, **kwargs: Any) -> None:
        super().__init__(dropout, **kwargs)
        self.need_weights = need_weights  # False: attention_weights is not kept (no fused TF kernel)

    def call(
        self, queries, keys, values, valid_lens=None, training=None, attention_mask=None, causal=False,
        score_mod=None, mask_mod=None, block_mask=None, **unknown,
    ):  # fmt: skip
        taken = (attention_mask, causal, score_mod, mask_mod, block_mask)
        return self._call(queries, keys, values, valid_lens, training, taken, unknown)

    def get_config(self):
        return {**super().get_config(), "need_weights": self.need_weights}


@keras.saving.register_keras_serializable(package="multiattn")
class AdditiveAttention(AdditiveWeights, _Weighted):
    """Additive attention as a Keras layer with weights W_q, W_k, w_v (glorot_uniform, as Dense).

    Keras stores kernels (in, out): Keras' own weight list holds W_k (key_size, h),
    W_q (query_size, h), w_v (h, 1); get_weights()/set_weights(dict) speak the
    canonical layout and transpose.
    """

    def __init__(
        self, key_size: int, query_size: int, num_hiddens: int, dropout: float = 0.0, **kwargs: Any
    ) -> None:
        super().__init__(dropout, **kwargs)
        self._set_sizes(key_size, query_size, num_hiddens)
        # The sizes are known now: create the weights at once so get/set_weights work before a call.
        self._build()
        self.built = True

    def _w_v(self):
        return tf.reshape(self.w_v, [-1])

    def call(
        self, queries, keys, values, valid_lens=None, training=None, attention_mask=None, causal=False,
        score_mod=None, mask_mod=None, **unknown,
    ):  # fmt: skip
        taken = (attention_mask, causal, score_mod, mask_mod)
        return self._call(queries, keys, values, valid_lens, training, taken, unknown)

    def get_config(self):
        return {
            **super().get_config(),
            "key_size": self.key_size,
            "query_size": self.query_size,
            "num_hiddens": self.num_hiddens,
        }


@keras.saving.register_keras_serializable(package="multiattn")
class MultiHeadAttention(MultiHeadWeights, _Weighted):
    """Multi-head attention (d2l 11.5) as a Keras layer: kernels W_q, W_k, W_v, W_o stored
    (in, out) (glorot_uniform, as Dense) and, with bias, b_q, b_k, b_v, b_o (zeros).

    ``attention_weights``: (batch, num_heads, queries, keys) before dropout.
    ``num_kv_heads`` (default num_heads): grouped-query attention, W_k and W_v projecting to
    num_kv_heads heads of num_hiddens / num_heads, query head i using key/value head
    i // (num_heads / num_kv_heads); part of get_config.
    """

    def __init__(
        self, num_hiddens: int, num_heads: int, dropout: float = 0.0, bias: bool = False, *,
        query_size: Optional[int] = None, key_size: Optional[int] = None, value_size: Optional[int] = None,
        need_weights: bool = True, num_kv_heads: Optional[int] = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(dropout, **kwargs)
        self._set_sizes(num_hiddens, num_heads, (query_size, key_size, value_size), bias, num_kv_heads)
        self.need_weights = need_weights
        self._build()  # W_q, b_q, W_k, ...: Keras' weight list and saved files keep this order
        self.built = True

    def call(
        self, queries, keys, values, valid_lens=None, training=None, attention_mask=None, causal=False,
        score_mod=None, mask_mod=None, block_mask=None, cache=None, **unknown,
    ):  # fmt: skip
        taken = (attention_mask, causal, score_mod, mask_mod, block_mask, cache)
        return self._call(queries, keys, values, valid_lens, training, taken, unknown)

    def get_config(self):
        return {
            **super().get_config(),
            "num_hiddens": self.num_hiddens,
            "num_heads": self.num_heads,
            "bias": self.bias,
            "query_size": self.query_size,
            "key_size": self.key_size,
            "value_size": self.value_size,
            "need_weights": self.need_weights,
            "num_kv_heads": self.num_kv_heads,
        }

    @classmethod
    def from_native(cls, layer: Any) -> "MultiHeadAttention":
        """A MultiHeadAttention with the weights, sizes and dropout of a built
        ``keras.layers.MultiHeadAttention`` (value_dim == key_dim, output width num_heads * key_dim)
        or ``keras.layers.GroupQueryAttention`` (num_kv_heads = its num_key_value_heads)."""
        if isinstance(layer, keras.layers.GroupQueryAttention):
            return cls._from_grouped(layer)
        if not isinstance(layer, keras.layers.MultiHeadAttention):
            raise TypeError(
                "from_native takes a keras.layers.MultiHeadAttention or keras.layers.GroupQueryAttention, "
                f"got {type(layer).__name__}"
            )
        arrays = converters.read(
            lambda path: converters.attribute(layer, path), converters.KERAS_PATHS, to_numpy
        )
        config, weights = converters.keras_from(
            arrays, num_heads=layer.num_heads, key_dim=layer.key_dim, value_dim=layer.value_dim,
            dropout=layer.dropout, output_shape=layer._output_shape, attention_axes=layer.attention_axes,
            use_gate=getattr(layer, "_use_gate", False),
            sliding_window=getattr(layer, "_sliding_window", None),
        )  # fmt: skip
        out = cls(**config.kwargs(), dtype=layer.query_dense.kernel.dtype)
        out.set_weights(weights)
        return out

    @classmethod
    def _from_grouped(cls, layer: Any) -> "MultiHeadAttention":
        arrays = converters.read(
            lambda path: converters.attribute(layer, path), converters.KERAS_GQA_PATHS, to_numpy
        )
        config, weights = converters.keras_gqa_from(
            arrays, head_dim=layer.head_dim, num_query_heads=layer.num_query_heads,
            num_key_value_heads=layer.num_key_value_heads, dropout=layer.dropout,
            use_gate=getattr(layer, "use_gate", False), sliding_window=getattr(layer, "sliding_window", None),
        )  # fmt: skip
        out = cls(**config.kwargs(), dtype=layer._query_dense.kernel.dtype)
        out.set_weights(weights)
        return out

    def to_native(self, *, grouped: Optional[bool] = None) -> Any:
        """A new, built Keras layer with these weights: ``keras.layers.GroupQueryAttention`` where
        ``grouped`` is True or, by default (None), where num_kv_heads != num_heads (it needs
        query_size == num_hiddens), else ``keras.layers.MultiHeadAttention``."""
        if grouped is None:
            grouped = self.num_kv_heads != self.num_heads
        elif grouped is not True and grouped is not False:
            raise TypeError(f"grouped must be True, False or None (by num_kv_heads), got {grouped!r}")
        to = converters.keras_gqa_to if grouped else converters.keras_to
        kwargs, arrays, build = to(converters.config(self, self.rate), self.get_weights())
        native = keras.layers.GroupQueryAttention if grouped else keras.layers.MultiHeadAttention
        layer = native(**kwargs, dtype=self.W_o.dtype)
        layer.build(**build)
        for path, value in arrays.items():
            variable = converters.attribute(layer, path)
            variable.assign(np.asarray(value, dtype=variable.dtype))
        return layer
