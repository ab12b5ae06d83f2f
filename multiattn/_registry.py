"""Which backends exist, how to load one, and which framework a tensor belongs to.

Nothing here imports a framework: a backend module is imported only when it is
asked for by name, and a tensor's framework is read off its type's module path
(as einops does), so a framework the user has not imported stays unimported.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any, Callable, Iterator

# name -> (import name of the framework, pip extra, module prefixes of its tensor types).
# Adding a backend: one line here, one module in multiattn/backends/, one tox env.
BACKENDS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "numpy": ("numpy", "numpy", ("numpy",)),
    "torch": ("torch", "torch", ("torch",)),
    "tensorflow": ("tensorflow", "tensorflow", ("tensorflow", "keras", "tf_keras")),
    "jax": ("jax", "jax", ("jax", "jaxlib")),
    "mxnet": ("mxnet", "mxnet", ("mxnet",)),
    "paddle": ("paddle", "paddle", ("paddle",)),
    "mlx": ("mlx.core", "mlx", ("mlx.core",)),
    # any Array API library without a backend of its own (tested with array-api-strict)
    "array_api": ("array_api_strict", "array-api", ("array_api_strict", "cupy", "dask.array", "ndonnx")),
}

ENV_VAR = "MULTIATTN_BACKEND"
DEFAULT_BACKEND = "numpy"


class BackendImportError(ImportError):
    """A backend cannot be loaded; the message says why and what to do."""


_loaded: dict[str, ModuleType] = {}
_framework_of_type: dict[type, str | None] = {}
_types_of: dict[str, set[type]] = {name: set() for name in BACKENDS}


def did_you_mean(name: object) -> str:
    """' (did you mean 'torch'?)' for a near miss of a backend name, else ''."""
    close = difflib.get_close_matches(str(name), list(BACKENDS), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_name(name: object, source: str = "backend name") -> str:
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(
            f"unknown multiattn backend {name!r}{did_you_mean(name)} ({source}); "
            f"known backends: {', '.join(BACKENDS)}"
        )
    return name


def pip_install(extras: str, pip: str = "pip") -> str:
    """The command that installs multiattn with these extras from its clone (no index has it)."""
    return f'{pip} install ".[{extras}]" in multiattn\'s clone'


def install_hint(name: str) -> str:
    """How to install what backend ``name`` needs."""
    if name == "mxnet":  # mxnet 1.9.1 needs numpy<1.24, which would downgrade a shared environment
        return (
            f"python -m venv mxnet-env && {pip_install('mxnet', 'mxnet-env/bin/pip')} "
            "(an environment of its own: mxnet needs numpy<1.24)"
        )
    return pip_install(BACKENDS[name][1])


@contextlib.contextmanager
def framework_imports(name: str) -> Iterator[None]:
    """Around a backend's or layer module's imports of its framework: a framework that is not
    installed raises ``BackendImportError`` naming the install, however the module is imported."""
    try:
        yield
    except ModuleNotFoundError as err:
        if (err.name or "multiattn").startswith("multiattn"):
            raise
        raise BackendImportError(
            f"multiattn backend {name!r} needs the {(err.name or name).split('.')[0]!r} package, "
            f"which is not installed; install it with: {install_hint(name)}"
        ) from err


def selected_backend() -> str:
    """The name in MULTIATTN_BACKEND (default 'numpy'), checked against the registry."""
    name = os.environ.get(ENV_VAR, "").strip() or DEFAULT_BACKEND
    return _check_name(name, f"from the {ENV_VAR} environment variable")


def get_backend(name: str) -> ModuleType:
    """Import (once) and return the backend module ``multiattn.backends.<name>``."""
    module = _loaded.get(name)
    if module is not None:
        return module
    _check_name(name)
    try:
        with framework_imports(name):
            module = importlib.import_module(f"multiattn.backends.{name}")
    except BackendImportError:
        raise
    except ImportError as err:
        raise BackendImportError(
            f"multiattn backend {name!r}: importing {BACKENDS[name][0]!r} failed ({err}); "
            f"reinstall it with: {install_hint(name)}"
        ) from err
    _loaded[name] = module
    return module


def framework_of(x: Any) -> str | None:
    """The backend name whose framework made ``x`` (None for Python objects)."""
    cls = type(x)
    try:
        return _framework_of_type[cls]
    except KeyError:
        pass
    found = None
    for klass in cls.__mro__:
        module = getattr(klass, "__module__", "") or ""
        for name, (_, _, prefixes) in BACKENDS.items():
            if any(module == p or module.startswith(p + ".") for p in prefixes):
                found = name
                break
        if found:
            break
    _framework_of_type[cls] = found
    if found:
        _types_of[found].add(cls)
    return found


def register_graph_backend(name: str, value_type: type, module: ModuleType) -> None:
    """A backend outside ``BACKENDS`` whose tensors are the values of a graph being built
    (``multiattn.onnx``): ``framework_of`` knows its type and ``get_backend`` its module (the
    ``ops`` that score and mask functions use), so those functions build graph operations."""
    _framework_of_type[value_type] = name
    _types_of.setdefault(name, set()).add(value_type)
    _loaded[name] = module


def known_types(name: str) -> set[type]:
    """The types seen so far to be tensors of backend ``name``: a live set, for a membership
    test on every call before the full check (``check_framework``) runs."""
    return _types_of[name]


def loaded_backend_of(first: Any, *others: Any) -> ModuleType | None:
    """The backend module already loaded for first's type where every other argument is None
    or of that type: the common call in one lookup; else None (``framework_of_call`` then)."""
    cls = type(first)
    for x in others:
        if x is not None and type(x) is not cls:
            return None
    return _loaded.get(_framework_of_type.get(cls))  # type: ignore[arg-type]


def framework_of_call(**tensors: Any) -> str:
    """The one framework shared by the named tensors; TypeError naming both if mixed."""
    seen: tuple[str, str] | None = None
    for arg, x in tensors.items():
        if x is None:
            continue
        name = framework_of(x)
        if name is None:
            raise TypeError(
                f"{arg} must be a tensor of one of {', '.join(BACKENDS)}, "
                f"got {type(x).__module__}.{type(x).__qualname__}"
            )
        if seen is None:
            seen = (arg, name)
        elif name != seen[1]:
            raise TypeError(
                f"tensors of two frameworks in one call: {seen[0]} is a {seen[1]} tensor "
                f"but {arg} is a {name} tensor; convert them to one framework first"
            )
    if seen is None:
        raise TypeError("no tensor given")
    return seen[1]


def check_framework(expected: str, **tensors: Any) -> None:
    """Raise TypeError unless every non-None tensor belongs to ``expected``."""
    known = _types_of[expected]
    for x in tensors.values():  # the cheap common case: every type already seen as expected's
        if x is not None and type(x) not in known:
            break
    else:
        return
    for arg, x in tensors.items():
        name = None if x is None else framework_of(x)
        if x is not None and name != expected:
            raise TypeError(f"{arg} must be a {expected} tensor for the {expected} backend, got " + (
                f"a {name} tensor; for {name} tensors use the {name} backend (its layers: "
                f"MULTIATTN_BACKEND={name} or multiattn.backends.{name}; multiattn.masked_softmax and "
                "the other functions follow their tensors), or convert: "
                f"multiattn.get_backend({expected!r}).from_numpy(multiattn.get_backend({name!r}).to_numpy(x))"
                if name
                else f"{type(x).__module__}.{type(x).__qualname__}; convert it first: "
                f"multiattn.get_backend({expected!r}).from_numpy(numpy.asarray(x))"
            ))  # fmt: skip


def tensor_check(name: str) -> Callable[..., None]:
    """``check_framework`` for backend ``name``: call it with the tensors by argument name."""
    return functools.partial(check_framework, name)


def is_imported(name: str) -> bool:
    return BACKENDS[name][0] in sys.modules


def layer_exports(backend: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``multiattn.backends.<backend>`` that hands out the layer
    classes of ``multiattn.layers.<backend>`` on first use (no import cycle)."""

    def __getattr__(attr: str) -> Any:
        if attr in ("AdditiveAttention", "DotProductAttention", "MultiHeadAttention"):
            return getattr(importlib.import_module(f"multiattn.layers.{backend}"), attr)
        raise AttributeError(f"module 'multiattn.backends.{backend}' has no attribute {attr!r}")

    return __getattr__
