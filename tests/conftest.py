"""Which backends this run tests.

MULTIATTN_TEST_BACKENDS=numpy,torch names them; a named backend that cannot be
imported fails the whole run (never a skip).  Unset: every installed backend.
"""

from __future__ import annotations

import os

import pytest

import multiattn
from multiattn._registry import BACKENDS

from .harness import harness

# paddle must be imported before tensorflow/keras (the other order segfaults in paddle).
LOAD_ORDER = sorted(BACKENDS, key=lambda name: name != "paddle")

_TESTED: list[str] = []
_NOT_INSTALLED: list[str] = []


def requested_backends() -> tuple[list[str], bool]:
    raw = os.environ.get("MULTIATTN_TEST_BACKENDS", "").strip()
    if not raw:
        return list(BACKENDS), False
    names = [n.strip() for n in raw.split(",") if n.strip()]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise pytest.UsageError(
            f"MULTIATTN_TEST_BACKENDS names unknown backends {unknown}; known: {', '.join(BACKENDS)}"
        )
    return names, True


def pytest_configure(config):
    names, explicit = requested_backends()
    failures = []
    for name in sorted(names, key=LOAD_ORDER.index):
        try:
            multiattn.get_backend(name)
        except ImportError as err:
            if explicit:
                failures.append(f"  {name}: {err}")
            else:
                _NOT_INSTALLED.append(name)
        else:
            _TESTED.append(name)
    if failures:
        raise pytest.UsageError(
            "MULTIATTN_TEST_BACKENDS names backends that cannot be imported; "
            "a named backend is tested or the run fails:\n" + "\n".join(failures)
        )
    _TESTED.sort(key=list(BACKENDS).index)


def pytest_report_header(config):
    line = f"multiattn backends under test: {', '.join(_TESTED) or 'none'}"
    if _NOT_INSTALLED:
        line += f" (not installed, so not tested: {', '.join(_NOT_INSTALLED)})"
    return line


def pytest_terminal_summary(terminalreporter):
    for name, count in _WITHOUT_LAYERS.items():
        terminalreporter.write_line(
            f"multiattn: {count} tests of layer classes deselected for {name}, which has none"
        )


def backends_under_test() -> list[str]:
    return list(_TESTED)


_WITHOUT_LAYERS: dict[str, int] = {}


# tox's all env: only what a shared environment can test (each backend's own env runs the rest)
SHARED_ONLY = os.environ.get("MULTIATTN_TEST_SHARED_ONLY", "") == "1"


def _frameworks_together(item, needed: list) -> bool:
    """Whether a test takes two frameworks other than numpy into one process (a pair of
    backends, two backend markers) or is marked shared (every backend under test at once)."""
    params = getattr(item, "callspec", None) and item.callspec.params or {}
    named = set(needed) | set(params.get("pair", ())) | ({params["bk"]} if "bk" in params else set())
    return item.get_closest_marker("shared") is not None or len(named - {"numpy"}) >= 2


def pytest_collection_modifyitems(config, items):
    """Tests marked backend(name) run when that backend is under test, else are deselected;
    tests marked layers (of the layer classes) are deselected, and counted in the summary,
    for a backend that has none (array_api: functions only).  MULTIATTN_TEST_SHARED_ONLY=1
    (tox's all env) keeps only the tests of several frameworks in one process."""
    keep, drop = [], []
    for item in items:
        needed = [marker.args[0] for marker in item.iter_markers("backend")]
        bk = getattr(item, "callspec", None) and item.callspec.params.get("bk")
        if bk and item.get_closest_marker("layers") and not harness(bk).has_layers:
            _WITHOUT_LAYERS[bk] = _WITHOUT_LAYERS.get(bk, 0) + 1
            drop.append(item)
            continue
        wanted = all(name in _TESTED for name in needed)
        (keep if wanted and (not SHARED_ONLY or _frameworks_together(item, needed)) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_generate_tests(metafunc):
    if "bk" in metafunc.fixturenames:
        metafunc.parametrize("bk", backends_under_test(), indirect=True)
    if "pair" in metafunc.fixturenames:
        # each tested backend with itself, with numpy and with every other tested backend
        names = backends_under_test()
        partners = sorted(set(names) | {"numpy"}, key=list(BACKENDS).index)
        pairs = [(a, b) for i, a in enumerate(partners) for b in partners[i:] if a in names or b in names]
        metafunc.parametrize("pair", pairs, ids=[f"{a}-{b}" for a, b in pairs], indirect=True)


@pytest.fixture
def bk(request):
    return harness(request.param)


@pytest.fixture
def pair(request):
    a, b = request.param
    return harness(a), harness(b)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report on the item (``item.rep_call``): fixtures check after a test
    that passed what it must have done."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
