"""check's results as files, and what every part of check reads off them.

A result is ``{"version", "status", "cases": {case name: {"status", "out", "weights", "fast",
"blocks", "grads", "block_grads", "modified"}}}`` (``--native``'s also carry ``backend``, ``kind`` and
``framework_version``).  Here: the framework version a result names, the worker's files (one
``.npz`` per backend; a directory of them and an index for ``--native``), the files of
``check --json`` and ``multiattn report``, and the split of the natives that ran from those that
could not be imported.

A leaf: it imports nothing else of ``multiattn.check`` (and of multiattn only ``_registry``), so
that the worker, the runners (``check``, ``against``, ``native``) and the reports
(``table``, ``native_report``) share it without importing one another.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .._registry import BACKENDS

Results = Dict[str, dict]


ARRAYS = ("out", "weights", "fast", "blocks")  # a case's arrays (blocks: the block path forced)
GRADIENTS = {"grads": "grad", "block_grads": "block_grad"}  # its gradients by argument: file key


def framework_version(name: str) -> str:
    """The ``__version__`` of backend name's framework, once imported ('?' before, or without one)."""
    module = sys.modules.get(BACKENDS[name][0])
    return str(getattr(module, "__version__", "?"))


# ---------------------------------------------------------------- the worker's files


def save_results(results: Dict[str, Any], path: str) -> None:
    """One backend's (or implementation's) results as ``path`` (.npz): every array, and a JSON
    ``meta`` entry with the version and each case's status."""
    arrays, meta = {}, {"version": results["version"], "status": results["status"], "cases": {}}
    for case, result in results["cases"].items():
        meta["cases"][case] = {
            "status": result["status"],
            "grads": sorted(result.get("grads", {})),
            "block_grads": sorted(result.get("block_grads", {})),
            **({"modified": result["modified"]} if result.get("modified") else {}),
        }
        for key in ARRAYS:
            if key in result:
                arrays[f"{case}|{key}"] = result[key]
        for key, stored in GRADIENTS.items():
            for arg, grad in result.get(key, {}).items():
                arrays[f"{case}|{stored}|{arg}"] = grad
    np.savez(path, meta=np.array(json.dumps(meta)), **arrays)


def load_results(path: str) -> Dict[str, Any]:
    """What ``save_results`` wrote."""
    with np.load(path) as data:
        meta = json.loads(str(data["meta"]))
        results = {"version": meta["version"], "status": meta["status"], "cases": {}}
        for case, info in meta["cases"].items():
            result: Dict[str, Any] = {"status": info["status"]}
            if info.get("modified"):
                result["modified"] = info["modified"]
            for key in ARRAYS:
                if f"{case}|{key}" in data:
                    result[key] = data[f"{case}|{key}"]
            for key, stored in GRADIENTS.items():
                if info.get(key):
                    result[key] = {arg: data[f"{case}|{stored}|{arg}"] for arg in info[key]}
            results["cases"][case] = result
    return results


def save_native(results: Results, directory: str) -> None:
    """The ``--native`` worker's output: one ``save_results`` file per implementation and an index."""
    os.makedirs(directory, exist_ok=True)
    index = []
    for i, (label, res) in enumerate(results.items()):
        save_results(res, os.path.join(directory, f"{i}.npz"))
        meta = {k: v for k, v in res.items() if k not in ("version", "status", "cases")}
        index.append({"label": label, "file": f"{i}.npz", **meta})
    with open(os.path.join(directory, "index.json"), "w") as f:
        json.dump(index, f)


def load_native(directory: str) -> Results:
    """What ``save_native`` wrote: {implementation label: results}."""
    with open(os.path.join(directory, "index.json")) as f:
        index = json.load(f)
    out = {}
    for entry in index:
        meta = {k: v for k, v in entry.items() if k not in ("label", "file")}
        out[entry["label"]] = {**load_results(os.path.join(directory, entry["file"])), **meta}
    return out


def split_absent(results: Results) -> Tuple[Results, Dict[str, str]]:
    """(the results of the implementations that ran, {label: why not} of those not importable)."""
    ran = {label: res for label, res in results.items() if not res["status"].startswith("absent: ")}
    missing = {label: res["status"][len("absent: ") :] for label, res in results.items() if label not in ran}
    return ran, missing


# ---------------------------------------------------------------- `check --json` files


def _to_lists(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _to_lists(v) for k, v in value.items()}
    return value


def _to_arrays(case: dict) -> dict:
    out = dict(case)
    for key in ARRAYS:
        if key in out:
            out[key] = np.asarray(out[key], dtype=np.float64)
    for key in GRADIENTS:
        if key in out:
            out[key] = {k: np.asarray(v, dtype=np.float64) for k, v in out[key].items()}
    return out


def write_json(
    path: str, multiattn_version: str, results: Results, rows: List[dict], seed: int, native: bool = False,
    not_importable: Optional[Dict[str, str]] = None,
) -> None:  # fmt: skip
    """A `check --json` file: the results (arrays as lists) and the rows, already as dicts
    (``table.rows_as_json``); native: of `check --native --json`, with the implementations that
    could not be imported, {label: why}.  ``check.save_json`` is the one caller."""
    doc = {"multiattn": multiattn_version, "seed": seed, "native": native, "backends": _to_lists(results)}
    if native:
        doc["not_importable"] = dict(not_importable or {})
    doc["rows"] = rows
    with open(path, "w") as f:
        json.dump(doc, f)


def load_json(paths: List[str]) -> tuple:
    """(merged results, seed, native) of several `check --json` files, or of several `check
    --native --json` files (native True); their seeds must agree, and the kinds must not mix.

    A backend found in more than one file keeps every one of its results, each labelled with
    its file (``numpy [check-mxnet]``): never a silent choice of one.  A native implementation
    that no file could import is among the results with the status ``absent: why``
    (``split_absent``)."""
    loaded: List[tuple] = []
    not_importable: Dict[str, str] = {}
    seed = native = None
    for path in paths:
        with open(path) as f:
            try:
                doc = json.load(f)
                doc_seed, backends = doc["seed"], doc["backends"]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(
                    f"{path} is not a file written by `multiattn check --json` ({err})"
                ) from None
        if seed is not None and doc_seed != seed:
            raise ValueError(f"{path} was made with seed {doc_seed}, the others with seed {seed}")
        doc_native = bool(doc.get("native", False))
        if native is not None and doc_native != native:
            kinds = ("`check --json`", "`check --native --json`")
            raise ValueError(
                f"{path} is from {kinds[doc_native]}, the others from {kinds[native]}: "
                "report merges files of one kind"
            )
        seed, native = doc_seed, doc_native
        for name, res in backends.items():
            res["cases"] = {c: _to_arrays(r) for c, r in res["cases"].items()}
            loaded.append((name, os.path.splitext(os.path.basename(path))[0], res))
        for label, why in (doc.get("not_importable") or {}).items():
            not_importable.setdefault(label, why)
    counts = Counter(name for name, _, _ in loaded)
    merged: Dict[str, dict] = {}
    for name, source, res in loaded:
        merged[f"{name} [{source}]" if counts[name] > 1 else name] = {**res, "backend": name}
    for label, why in not_importable.items():
        if label not in counts:  # imported by none of the files
            merged[label] = {"version": "?", "status": f"absent: {why}", "cases": {}, "backend": label}
    return merged, seed, bool(native)
