"""The public contract: registry, MULTIATTN_BACKEND, lazy imports, dispatch on tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import multiattn
from multiattn import _registry
from multiattn.adapter import Ops
from multiattn.protocol import BACKEND_EXPORTS, LAYER_EXPORTS

ALL = ["numpy", "torch", "tensorflow", "jax", "mxnet", "paddle", "mlx", "array_api"]
FRAMEWORK_MODULES = ["torch", "tensorflow", "keras", "jax", "flax", "mxnet", "paddle", "mlx"]


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "MULTIATTN_BACKEND"}
    environ.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ)


def test_registry_knows_every_backend():
    assert list(multiattn.BACKENDS) == ALL


def test_import_multiattn_imports_no_framework():
    code = (
        "import sys, json, multiattn\n"
        "multiattn.backend()\n"
        f"print(json.dumps([m for m in {FRAMEWORK_MODULES!r} if m in sys.modules]))"
    )
    result = run_python(code, MULTIATTN_BACKEND="torch")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_default_backend_is_numpy(monkeypatch):
    monkeypatch.delenv("MULTIATTN_BACKEND", raising=False)
    assert multiattn.backend() == "numpy"
    assert multiattn.DotProductAttention is multiattn.get_backend("numpy").DotProductAttention


@pytest.mark.layers
def test_env_var_selects_backend_classes(bk, monkeypatch):
    monkeypatch.setenv("MULTIATTN_BACKEND", bk.name)
    assert multiattn.backend() == bk.name
    assert multiattn.AdditiveAttention is bk.module.AdditiveAttention
    assert multiattn.DotProductAttention is bk.module.DotProductAttention
    from multiattn import AdditiveAttention

    assert AdditiveAttention is bk.module.AdditiveAttention


def test_unknown_backend_fails_at_first_use_not_import(monkeypatch):
    result = run_python("import multiattn", MULTIATTN_BACKEND="caffe")
    assert result.returncode == 0, result.stderr
    monkeypatch.setenv("MULTIATTN_BACKEND", "caffe")
    message = (
        "unknown multiattn backend 'caffe' (from the MULTIATTN_BACKEND environment variable); "
        "known backends: " + ", ".join(ALL)
    )
    with pytest.raises(ValueError) as info:
        multiattn.backend()
    assert str(info.value) == message
    with pytest.raises(ValueError, match="known backends: numpy, torch"):
        _ = multiattn.AdditiveAttention
    with pytest.raises(ValueError, match="unknown multiattn backend 'caffe'"):
        multiattn.get_backend("caffe")


@pytest.mark.parametrize(
    "name, extra", [("torch", "torch"), ("jax", "jax"), ("mlx", "mlx"), ("paddle", "paddle")]
)
def test_uninstalled_backend_names_the_extra(name, extra):
    # sys.modules[x] = None makes "import x" fail as if x were not installed
    framework = _registry.BACKENDS[name][0].split(".")[0]
    code = (
        f"import sys; sys.modules[{framework!r}] = None\n"
        "import multiattn\n"
        f"try:\n    multiattn.get_backend({name!r})\n"
        "except ImportError as err:\n    print(type(err).__name__, err)\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert f'pip install ".[{extra}]" in multiattn\'s clone' in result.stdout
    assert f"multiattn backend {name!r} needs the {framework!r} package" in result.stdout


@pytest.mark.parametrize("module", ["backends.mxnet", "layers.mxnet", "backends.torch", "layers.jax"])
def test_importing_a_framework_module_without_its_framework_names_the_install(module):
    name = module.split(".")[1]
    code = (
        "import sys; sys.modules['mxnet'] = sys.modules['torch'] = sys.modules['flax'] = None\n"
        f"try:\n    from multiattn.{module} import ops\n"
        "except ImportError as err:\n    print(type(err).__name__, err)\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "BackendImportError" in result.stdout, result.stdout
    assert _registry.install_hint(name) in result.stdout, result.stdout


def test_dir_lists_the_api_alone():
    names = [n for n in dir(multiattn) if not n.startswith("__")]
    assert names == sorted(multiattn.__all__)
    assert "flex_attention" in names and "Any" not in names and "annotations" not in names


def test_get_backend_returns_the_backend_module(bk):
    assert bk.module.__name__ == f"multiattn.backends.{bk.name}"
    for name in BACKEND_EXPORTS + (LAYER_EXPORTS if bk.has_layers else ()):
        assert hasattr(bk.module, name), name
    assert multiattn.get_backend(bk.name) is bk.module
    assert isinstance(bk.module.ops, Ops) and bk.module.ops.name == bk.name


@pytest.mark.backend("array_api")
def test_a_backend_without_layer_classes_says_so(monkeypatch):
    monkeypatch.setenv("MULTIATTN_BACKEND", "array_api")
    with pytest.raises(AttributeError, match="the array_api backend has no layer classes"):
        _ = multiattn.AdditiveAttention


def test_functional_api_follows_the_tensors(bk):
    X = bk.tensor(np.ones((1, 2, 3)), "float32")
    out = multiattn.masked_softmax(X)
    assert _registry.framework_of(out) == bk.name
    out = multiattn.dot_product_attention(X, X, X)
    assert _registry.framework_of(out) == bk.name


def test_two_frameworks_in_one_call_is_a_type_error(bk):
    if bk.name == "numpy":
        pytest.xfail("needs a second framework; covered by every other backend's run")
    q = bk.tensor(np.ones((1, 2, 3)), "float32")
    with pytest.raises(TypeError, match=f"queries is a {bk.name} tensor but values is a numpy tensor"):
        multiattn.dot_product_attention(q, q, np.ones((1, 2, 3), "float32"))
    with pytest.raises(TypeError, match=f"X is a numpy tensor but valid_lens is a {bk.name} tensor"):
        multiattn.masked_softmax(np.ones((1, 2, 3)), bk.tensor(np.array([1])))


def test_layer_refuses_foreign_tensors_with_advice(bk):
    if bk.name == "numpy":
        pytest.xfail("needs a second framework; covered by every other backend's run")
    q = np.ones((1, 2, 3), "float32")
    if bk.layers_convert_numpy:  # Keras layers convert numpy inputs, as every Keras layer does
        out = bk.call(bk.dot(), q, bk.tensor(q), bk.tensor(q))
        np.testing.assert_allclose(bk.numpy(out), q, rtol=1e-6)
        return
    with pytest.raises(TypeError, match=f"queries must be a {bk.name} tensor .*from_numpy"):
        bk.call(bk.dot(), q, bk.tensor(q), bk.tensor(q))


def test_backend_functions_refuse_foreign_tensors_in_any_argument(bk):
    # after a valid call (the backend's tensor type is then known), a foreign tensor in any
    # position still gets the check's error, not a failure deep inside the math
    q = bk.tensor(np.ones((1, 2, 3)), "float32")
    lens = bk.tensor(np.array([1]))
    bk.module.dot_product_attention(q, q, q, lens)
    bk.module.masked_softmax(q, lens)
    foreign = [[[1.0, 1.0, 1.0]] * 2]
    for arg, args in (
        ("keys", (q, foreign, q, lens)),
        ("values", (q, q, foreign, lens)),
        ("valid_lens", (q, q, q, [1])),
    ):
        with pytest.raises(TypeError, match=f"{arg} must be a {bk.name} tensor for the {bk.name} backend"):
            bk.module.dot_product_attention(*args)
    with pytest.raises(TypeError, match=f"valid_lens must be a {bk.name} tensor"):
        bk.module.masked_softmax(q, [1])


def test_python_objects_are_not_tensors():
    with pytest.raises(TypeError, match="X must be a tensor of one of numpy, torch"):
        multiattn.masked_softmax([[[1.0, 2.0]]])


def test_the_installed_package_is_complete(tmp_path):
    # run outside the checkout, so the installed distribution is imported, not the source tree
    code = (
        "import importlib, importlib.resources, multiattn\n"
        "for m in ['core', 'validation', 'masks', 'specialise', 'specialisations', 'fast_paths',\n"
        "          'protocol', 'functional', 'layers', 'layers.numpy',\n"
        "          'reference', 'plot', 'cli', 'demo',\n"
        "          'check', 'check.cases', 'check.worker', 'check.table', 'backends.numpy']:\n"
        "    importlib.import_module('multiattn.' + m)\n"
        "assert importlib.resources.files('multiattn').joinpath('py.typed').is_file()\n"
        "print(multiattn.__file__)\n"
    )
    result = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
