"""How the tests drive each backend's layers: the one place where tests name frameworks.

A harness builds a layer in a dtype with given canonical weights, calls it in
inference mode, and converts tensors; the test files stay framework-free.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

import numpy as np

import multiattn


class Harness:
    """Defaults fit numpy and most frameworks; subclasses override what differs."""

    layers_convert_numpy = False  # do the layers accept numpy arrays (converting them)?
    has_layers = True  # framework-native layer classes (AdditiveAttention, DotProductAttention)

    def __init__(self, name: str) -> None:
        self.name = name
        self.module = multiattn.get_backend(name)
        self.dtypes = self.module.SUPPORTED_DTYPES

    def __repr__(self) -> str:
        return f"Harness({self.name})"

    def tensor(self, array: Any, dtype: Optional[str] = None) -> Any:
        return self.module.from_numpy(np.asarray(array), dtype)

    def numpy(self, tensor: Any) -> np.ndarray:
        return self.module.to_numpy(tensor)

    def eval(self, layer: Any) -> Any:
        return layer.eval()

    def train(self, layer: Any) -> Any:
        return layer.train()

    def cast_layer(self, layer: Any, dtype: str) -> Any:
        raise NotImplementedError

    def additive(self, key_size, query_size, num_hiddens, dropout=0.0, dtype="float32", weights=None):
        layer = self.cast_layer(
            self.module.AdditiveAttention(key_size, query_size, num_hiddens, dropout), dtype
        )
        if weights is not None:
            layer.set_weights(weights)
        return self.eval(layer)

    def dot(self, dropout=0.0):
        return self.eval(self.module.DotProductAttention(dropout))

    def multi_head(
        self, num_hiddens, num_heads, dropout=0.0, bias=False, dtype="float32", weights=None, **kwargs
    ):
        """A MultiHeadAttention layer in dtype (kwargs: query_size, ..., need_weights)."""
        layer = self._new_multi_head(num_hiddens, num_heads, dropout, bias, dtype, **kwargs)
        if weights is not None:
            layer.set_weights(weights)
        return self.eval(layer)

    def _new_multi_head(self, num_hiddens, num_heads, dropout, bias, dtype, **kwargs):
        layer = self.module.MultiHeadAttention(num_hiddens, num_heads, dropout, bias, **kwargs)
        return self.cast_layer(layer, dtype)

    def call(self, layer, queries, keys, values, valid_lens=None, **masks):
        return layer(queries, keys, values, valid_lens, **masks)


class NumpyHarness(Harness):
    def cast_layer(self, layer, dtype):
        layer.dtype = np.dtype(dtype)
        layer.set_weights(layer.get_weights())
        return layer


class TorchHarness(Harness):
    def cast_layer(self, layer, dtype):
        return layer.to(getattr(importlib.import_module("torch"), dtype))


class PaddleHarness(Harness):
    def cast_layer(self, layer, dtype):
        layer.to(dtype=dtype)
        return layer


class MlxHarness(Harness):
    def cast_layer(self, layer, dtype):
        layer.set_dtype(getattr(importlib.import_module("mlx.core"), dtype))
        return layer


class MxnetHarness(Harness):
    """Gluon: inference outside autograd.record(), training inside it."""

    def eval(self, layer):
        layer._harness_training = False
        return layer

    def train(self, layer):
        layer._harness_training = True
        return layer

    def cast_layer(self, layer, dtype):
        layer.cast(dtype)
        return layer

    def call(self, layer, queries, keys, values, valid_lens=None, **masks):
        if getattr(layer, "_harness_training", False):
            with importlib.import_module("mxnet").autograd.record():
                return layer(queries, keys, values, valid_lens, **masks)
        return layer(queries, keys, values, valid_lens, **masks)


class TensorFlowHarness(Harness):
    """Keras: the mode is the training= argument of each call; the dtype a constructor argument."""

    layers_convert_numpy = True

    def eval(self, layer):
        layer._harness_training = False
        return layer

    def train(self, layer):
        layer._harness_training = True
        return layer

    def additive(self, key_size, query_size, num_hiddens, dropout=0.0, dtype="float32", weights=None):
        layer = self.module.AdditiveAttention(key_size, query_size, num_hiddens, dropout, dtype=dtype)
        if weights is not None:
            layer.set_weights(weights)
        return self.eval(layer)

    def _new_multi_head(self, num_hiddens, num_heads, dropout, bias, dtype, **kwargs):
        return self.module.MultiHeadAttention(num_hiddens, num_heads, dropout, bias, dtype=dtype, **kwargs)

    def call(self, layer, queries, keys, values, valid_lens=None, **masks):
        training = getattr(layer, "_harness_training", False)
        return layer(queries, keys, values, valid_lens, training=training, **masks)


class JaxHarness(Harness):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.module.enable_float64()  # for the float64 rows

    def additive(self, key_size, query_size, num_hiddens, dropout=0.0, dtype="float32", weights=None):
        param_dtype = getattr(importlib.import_module("jax.numpy"), dtype)
        layer = self.module.AdditiveAttention(
            key_size, query_size, num_hiddens, dropout, param_dtype=param_dtype
        )
        if weights is not None:
            layer.set_weights(weights)
        return self.eval(layer)

    def _new_multi_head(self, num_hiddens, num_heads, dropout, bias, dtype, **kwargs):
        param_dtype = getattr(importlib.import_module("jax.numpy"), dtype)
        return self.module.MultiHeadAttention(
            num_hiddens, num_heads, dropout, bias, param_dtype=param_dtype, **kwargs
        )

    def eval(self, layer):
        layer.eval()
        return layer

    def train(self, layer):
        layer.train()
        return layer


class _FunctionalLayer:
    """A stand-in for the layer classes of a backend that has none (array_api): the functional
    API with canonical weights, so that the matrix runs the same cases through it."""

    def __init__(self, harness: "Harness", kind: str, dtype: str, weights=None, num_heads=None) -> None:
        self.harness, self.kind, self.dtype, self.num_heads = harness, kind, dtype, num_heads
        self.weights = None if weights is None else {k: np.asarray(w) for k, w in weights.items()}
        self.attention_weights = None

    def get_weights(self):
        return {k: self.harness.numpy(self.harness.tensor(w, self.dtype)) for k, w in self.weights.items()}

    def set_weights(self, weights):
        self.weights = {k: np.asarray(w) for k, w in weights.items()}

    def __call__(self, queries, keys, values, valid_lens=None, **masks):
        module = self.harness.module
        if self.kind == "dot":
            out, self.attention_weights = module.dot_product_attention(
                queries, keys, values, valid_lens, return_weights=True, **masks
            )
            return out
        tensors = {k: self.harness.tensor(w, self.dtype) for k, w in self.weights.items()}
        if self.kind == "multi_head":
            out, self.attention_weights = module.multi_head_attention(
                queries, keys, values, valid_lens, weights=tensors, num_heads=self.num_heads,
                return_weights=True, **masks,
            )  # fmt: skip
        else:
            out, self.attention_weights = module.additive_attention(
                queries, keys, values, valid_lens, return_weights=True, **tensors, **masks
            )
        return out


class ArrayApiHarness(Harness):
    """No layer classes: the harness' layers are the functional API, always in eval mode."""

    has_layers = False

    def eval(self, layer):
        return layer

    def train(self, layer):
        raise AssertionError("array_api has no layers, hence no training mode (mark the test layers)")

    def additive(self, key_size, query_size, num_hiddens, dropout=0.0, dtype="float32", weights=None):
        if weights is None:
            rng = np.random.default_rng(0)
            weights = {
                "W_q": rng.uniform(-0.5, 0.5, (num_hiddens, query_size)),
                "W_k": rng.uniform(-0.5, 0.5, (num_hiddens, key_size)),
                "w_v": rng.uniform(-0.5, 0.5, (num_hiddens,)),
            }
        return _FunctionalLayer(self, "additive", dtype, weights)

    def dot(self, dropout=0.0):
        return _FunctionalLayer(self, "dot", "float32")

    def multi_head(
        self, num_hiddens, num_heads, dropout=0.0, bias=False, dtype="float32", weights=None, **kwargs
    ):
        if weights is None:
            rng = np.random.default_rng(0)
            q, k, v = (kwargs.get(f"{n}_size") or num_hiddens for n in ("query", "key", "value"))
            names = {"W_q": (num_hiddens, q), "W_k": (num_hiddens, k), "W_v": (num_hiddens, v)}
            names["W_o"] = (num_hiddens, num_hiddens)
            if bias:
                names.update({f"b_{n}": (num_hiddens,) for n in "qkvo"})
            weights = {name: rng.uniform(-0.5, 0.5, shape) for name, shape in names.items()}
        return _FunctionalLayer(self, "multi_head", dtype, weights, num_heads)


HARNESSES = {
    "numpy": NumpyHarness,
    "torch": TorchHarness,
    "tensorflow": TensorFlowHarness,
    "jax": JaxHarness,
    "mxnet": MxnetHarness,
    "paddle": PaddleHarness,
    "mlx": MlxHarness,
    "array_api": ArrayApiHarness,
}


def harness(name: str) -> Harness:
    return HARNESSES[name](name)
