"""An ONNX graph under construction, and the part of the ops protocol that score and mask
functions use (``mods``), on its values: a function written once with Python operators and
``mods.where`` / ``tanh`` / ``logical_and`` / ``logical_or`` / ``take`` becomes graph operations
on the positions, so an exported model computes its mask or bias at any sequence length.

A ``Value`` is a named tensor of the graph with its element type and the sizes known when the
graph is built (None where they come with the inputs).  Python numbers mix with values as
they do with the positions of the other backends (``mods.Index``): integers stay integers, a
float makes the positions floats of the graph's float type first.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._registry import register_graph_backend

name = "onnx"
Shape = Tuple[Optional[int], ...]


class Graph:
    """Nodes, inputs and initializers, made through ``op``, ``input`` and ``constant``; ``model``
    keeps only what the outputs need."""

    def __init__(self, float_type: Any = np.float32) -> None:
        self.float = np.dtype(float_type)
        self.nodes: List[Any] = []
        self.inputs: List[Any] = []
        self.initializers: Dict[str, np.ndarray] = {}
        self._count = itertools.count()

    def fresh(self, hint: str = "t") -> str:
        return f"{hint}_{next(self._count)}"

    def input(self, name: str, dtype: Any, shape: Sequence[Any]) -> "Value":
        """A graph input; shape's strings are dynamic dimensions (named), its ints fixed."""
        from onnx import helper

        dtype = np.dtype(dtype)
        self.inputs.append(helper.make_tensor_value_info(name, _onnx_type(dtype), list(shape)))
        return Value(self, name, dtype, tuple(s if isinstance(s, int) else None for s in shape))

    def constant(self, array: Any, dtype: Any = None, hint: str = "c") -> "Value":
        array = np.asarray(array, dtype=dtype)
        if array.dtype.kind == "f" and dtype is None:
            array = array.astype(self.float)
        elif array.dtype.kind in "iu":
            array = array.astype(np.int64)
        name = self.fresh(hint)
        self.initializers[name] = array
        return Value(self, name, array.dtype, array.shape)

    def op(
        self, op_type: str, inputs: Sequence[Any], dtype: Any, shape: Optional[Shape], outputs: int = 1,
        **attributes: Any,
    ) -> Any:  # fmt: skip
        """A node; its first output (or its ``outputs`` outputs, a tuple) as values of dtype and shape."""
        from onnx import helper

        names = [self.fresh(op_type.lower()) for _ in range(outputs)]
        given = ["" if x is None else self.value(x).name for x in inputs]
        while given and given[-1] == "":
            given.pop()
        self.nodes.append(helper.make_node(op_type, given, names, **attributes))
        found = tuple(Value(self, n, np.dtype(dtype), shape) for n in names)
        return found[0] if outputs == 1 else found

    def value(self, x: Any, like: Optional["Value"] = None) -> "Value":
        """x as a value: itself, or a constant (a Python float in like's or the graph's float type)."""
        if isinstance(x, Value):
            return x
        if isinstance(x, bool):
            return self.constant(np.asarray(x))
        if isinstance(x, int):
            return self.constant(np.asarray(x, np.int64))
        if isinstance(x, float):
            float_type = like.dtype if like is not None and like.dtype.kind == "f" else self.float
            return self.constant(np.asarray(x, float_type))
        return self.constant(np.asarray(x))

    def model(self, outputs: Dict[str, "Value"], opset: int, doc: str = "") -> Any:
        """The ONNX model computing outputs (named), the nodes they do not need left out."""
        from onnx import helper

        nodes = list(self.nodes)
        for out, value in outputs.items():
            nodes.append(helper.make_node("Identity", [value.name], [out]))
        producer = {o: node for node in nodes for o in node.output}
        needed, kept, stack = set(), [], list(outputs)
        while stack:
            tensor = stack.pop()
            node = producer.get(tensor)
            if node is None or id(node) in needed:
                continue
            needed.add(id(node))
            stack.extend(i for i in node.input if i)
        kept = [node for node in nodes if id(node) in needed]
        used = {i for node in kept for i in node.input}
        infos = [
            helper.make_tensor_value_info(n, _onnx_type(v.dtype), _dims(v.shape)) for n, v in outputs.items()
        ]
        graph = helper.make_graph(
            kept, "multiattn", self.inputs, infos, doc_string=doc,
            initializer=[_tensor(n, a) for n, a in self.initializers.items() if n in used],
        )  # fmt: skip
        return helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10, producer_name="multiattn"
        )

    # -- shorthands for the exporter --------------------------------------------------------

    def size(self, x: "Value", axis: int) -> "Value":
        """x's size along axis, a 0-D int64 value."""
        shape = self.op("Shape", [x], np.int64, (len(x.shape),), start=axis, end=axis + 1)
        return self.op("Squeeze", [shape, self.constant([0])], np.int64, ())

    def shape_of(self, *sizes: Any) -> "Value":
        """A 1-D int64 shape from ints and 0-D values."""
        parts = [self.op("Unsqueeze", [self.value(s), self.constant([0])], np.int64, (1,)) for s in sizes]
        return self.op("Concat", parts, np.int64, (len(sizes),), axis=0)


def _onnx_type(dtype: np.dtype) -> int:
    from onnx import helper

    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _dims(shape: Optional[Shape]) -> Any:
    return None if shape is None else [s if s is not None else None for s in shape]


def _tensor(name: str, array: np.ndarray) -> Any:
    from onnx import numpy_helper

    return numpy_helper.from_array(np.asarray(array), name)


def _broadcast(a: Optional[Shape], b: Optional[Shape]) -> Optional[Shape]:
    if a is None or b is None:
        return None
    a, b = (1,) * (len(b) - len(a)) + tuple(a), (1,) * (len(a) - len(b)) + tuple(b)
    return tuple(y if x == 1 else x if y == 1 else (x if x is not None else y) for x, y in zip(a, b))


class Value:
    """A tensor of a ``Graph``: name, numpy dtype, shape (None: a size known at run time)."""

    __slots__ = ("graph", "name", "dtype", "shape")

    def __init__(self, graph: Graph, name: str, dtype: np.dtype, shape: Optional[Shape]) -> None:
        self.graph, self.name, self.dtype, self.shape = graph, name, np.dtype(dtype), shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"Value({self.name!r}, {self.dtype}, {self.shape})"

    def __bool__(self) -> bool:
        raise TypeError(
            "positions are arrays: combine conditions with mods.where / logical_and, not if/and/or"
        )

    __hash__ = None  # type: ignore[assignment]

    # -- promotion as Python's: ints stay ints, a float makes both floats ----------------------

    def _cast(self, dtype: Any) -> "Value":
        dtype = np.dtype(dtype)
        if dtype == self.dtype:
            return self
        return self.graph.op("Cast", [self], dtype, self.shape, to=_onnx_type(dtype))

    def _pair(self, other: Any, floats: bool = False) -> Tuple["Value", "Value"]:
        g = self.graph
        if not isinstance(other, Value):
            if isinstance(other, np.ndarray) and other.dtype.kind == "f":
                other = g.constant(other)
            elif isinstance(other, float) and self.dtype.kind != "f":
                other = g.value(other)
            else:
                other = g.value(other, like=self)
                other = other._cast(self.dtype) if self.dtype.kind == other.dtype.kind else other
        a, b = self, other
        if floats or a.dtype.kind == "f" or b.dtype.kind == "f":
            float_type = a.dtype if a.dtype.kind == "f" else b.dtype if b.dtype.kind == "f" else g.float
            return a._cast(float_type), b._cast(float_type)
        if a.dtype != b.dtype:  # booleans with integers: integers
            return a._cast(np.int64), b._cast(np.int64)
        return a, b

    def _binary(self, op_type: str, other: Any, reflected: bool = False, floats: bool = False,
                boolean: bool = False) -> "Value":  # fmt: skip
        """self op_type other (reflected: other op_type self), after Python's promotion."""
        a, b = self._pair(other, floats)
        if reflected:
            a, b = b, a
        if op_type == "FloorDiv":
            return _floor_divide(a, b)
        attributes = {"fmod": int(a.dtype.kind == "f")} if op_type == "Mod" else {}  # Python's sign for ints
        if op_type in ("And", "Or") and a.dtype.kind != "b":
            op_type = "Bitwise" + op_type
        dtype = np.bool_ if boolean else a.dtype
        return self.graph.op(op_type, [a, b], dtype, _broadcast(a.shape, b.shape), **attributes)

    def _operator(op_type: str, **options: Any) -> tuple:  # noqa: N805 (makes the methods)
        return (
            lambda self, other: self._binary(op_type, other, False, **options),
            lambda self, other: self._binary(op_type, other, True, **options),
        )

    __add__, __radd__ = _operator("Add")
    __sub__, __rsub__ = _operator("Sub")
    __mul__, __rmul__ = _operator("Mul")
    __truediv__, __rtruediv__ = _operator("Div", floats=True)
    __mod__, __rmod__ = _operator("Mod")
    __floordiv__, __rfloordiv__ = _operator("FloorDiv")
    __pow__, __rpow__ = _operator("Pow")
    __and__, __rand__ = _operator("And")
    __or__, __ror__ = _operator("Or")
    __lt__, __gt__ = _operator("Less", boolean=True)  # reflected: other < self, that is self > other
    __le__, __ge__ = _operator("LessOrEqual", boolean=True)
    __eq__ = _operator("Equal", boolean=True)[0]  # type: ignore[assignment]
    del _operator

    def __ne__(self, other):  # type: ignore[override]
        equal = self == other
        return self.graph.op("Not", [equal], np.bool_, equal.shape)

    def __invert__(self):
        return self.graph.op(
            "Not" if self.dtype.kind == "b" else "BitwiseNot", [self], self.dtype, self.shape
        )

    def __neg__(self):
        return self.graph.op("Neg", [self], self.dtype, self.shape)

    def __abs__(self):
        return self.graph.op("Abs", [self], self.dtype, self.shape)

    def __getitem__(self, index: Any) -> "Value":
        """Basic indexing: slices (bounds ints or 0-D values), ints, ``...``."""
        index = index if isinstance(index, tuple) else (index,)
        if Ellipsis in index:
            at = index.index(Ellipsis)
            index = index[:at] + (slice(None),) * (self.ndim - len(index) + 1) + index[at + 1 :]
        g, out, shape, squeeze = self.graph, self, list(self.shape), []
        for axis, item in enumerate(index):
            if isinstance(item, slice):
                if item.step not in (None, 1):
                    raise ValueError("positions are sliced with step 1 only")
                if item.start is None and item.stop is None:
                    continue
                start = g.shape_of(0 if item.start is None else item.start)
                stop = g.shape_of(np.iinfo(np.int64).max if item.stop is None else item.stop)
                shape[axis] = None
                out = g.op("Slice", [out, start, stop, g.constant([axis])], out.dtype, tuple(shape))
            else:
                at = g.shape_of(item)
                shape[axis] = 1
                out = g.op(
                    "Slice", [out, at, g.shape_of(item + 1), g.constant([axis])], out.dtype, tuple(shape)
                )
                squeeze.append(axis)
        if squeeze:
            kept = tuple(s for axis, s in enumerate(shape) if axis not in squeeze)
            out = g.op("Squeeze", [out, g.constant(squeeze)], out.dtype, kept)
        return out


def _floor_divide(a: Value, b: Value) -> Value:
    """Python's a // b (ONNX's Div truncates integers towards 0): (a - a mod b) / b."""
    g, shape = a.graph, _broadcast(a.shape, b.shape)
    if a.dtype.kind == "f":
        return g.op("Floor", [g.op("Div", [a, b], a.dtype, shape)], a.dtype, shape)
    rest = g.op("Mod", [a, b], a.dtype, shape, fmod=0)
    return g.op("Div", [g.op("Sub", [a, rest], a.dtype, shape), b], a.dtype, shape)


class GraphOps:
    """What ``multiattn.mods`` asks of a backend, on graph values."""

    name = name

    def shape(self, x: Value) -> Shape:
        return x.shape

    def dtype_kind(self, x: Value) -> str:
        return x.dtype.kind

    def expand_dims(self, x: Value, axis: int) -> Value:
        at = axis if axis >= 0 else x.ndim + 1 + axis
        shape = x.shape[:at] + (1,) + x.shape[at:]
        return x.graph.op("Unsqueeze", [x, x.graph.constant([axis])], x.dtype, shape)

    def positions(self, start: Any, stop: Any, like: Value) -> Value:
        g = like.graph
        known = isinstance(start, int) and isinstance(stop, int)
        return g.op(
            "Range", [g.value(start), g.value(stop), g.value(1)], np.int64, (stop - start if known else None,)
        )

    def call_mod(self, fn: Callable, args: tuple, like: Value) -> Any:
        return fn(*args)

    def select(self, condition: Value, x: Any, y: Any) -> Value:
        g = condition.graph
        if isinstance(x, Value):
            a, b = x._pair(y)
        elif isinstance(y, Value):
            b, a = y._pair(x)
        else:
            a, b = g.value(x), g.value(y)
        if a.dtype.kind == "b":  # onnxruntime has no Where of booleans
            return (condition & a) | (~condition & b)
        return g.op(
            "Where", [condition, a, b], a.dtype, _broadcast(condition.shape, _broadcast(a.shape, b.shape))
        )

    def logical_and(self, a: Value, b: Value) -> Value:
        g = a.graph if isinstance(a, Value) else b.graph
        a, b = g.value(a), g.value(b)
        return g.op("And", [a, b], np.bool_, _broadcast(a.shape, b.shape))

    def tanh(self, x: Value) -> Value:
        return x.graph.op("Tanh", [x], x.dtype, x.shape)

    def take(self, x: Any, indices: Value) -> Value:
        g = indices.graph
        x = g.value(x)
        return g.op("Gather", [x, indices], x.dtype, indices.shape, axis=0)

    def constant(self, values: Any, like: Value) -> Value:
        return like.graph.constant(np.asarray(values))

    def cast(self, x: Value, like: Value) -> Value:
        return x._cast(like.dtype)

    def reshape(self, x: Any, shape: Sequence[int]) -> Any:
        if not isinstance(x, Value):  # a table of numbers the function holds (``mods.take``)
            return np.reshape(x, shape)
        g = x.graph
        known = tuple(None if s == -1 else s for s in shape)
        return g.op("Reshape", [x, g.constant(np.asarray(shape, np.int64))], x.dtype, known)

    def host_values(self, x: Any) -> None:
        return None  # a graph's values are known only when it runs


ops = GraphOps()
register_graph_backend(name, Value, sys.modules[__name__])
