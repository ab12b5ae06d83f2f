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

    def call(self, layer, queries, keys, values, valid_lens=None):
        return layer(queries, keys, values, valid_lens)


class NumpyHarness(Harness):
    def cast_layer(self, layer, dtype):
        layer.dtype = np.dtype(dtype)
        layer.set_weights(layer.get_weights())
        return layer


class TorchHarness(Harness):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.torch = importlib.import_module("torch")

    def cast_layer(self, layer, dtype):
        return layer.to(getattr(self.torch, dtype))


HARNESSES = {"numpy": NumpyHarness, "torch": TorchHarness}


def harness(name: str) -> Harness:
    return HARNESSES[name](name)
