"""``multiattn check --native``: each framework's own attention (``native_wrappers``) through
check's battery, a subprocess per framework, judged against the reference: check's table per
implementation, the "where frameworks disagree" summary, and the page docs/native-attention.md
(``--markdown``; ``python -m multiattn.check.native --compare`` says whether a committed page is
current)."""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import reference
from .cases import MASKS, Case, tolerance
from .native_wrappers import (  # noqa: F401 - the implementations and their mask translations
    FRAMEWORKS,
    IMPLEMENTATIONS,
    Implementation,
    Unsupported,
    absent,
    implementation_version,
    implementations,
    jax_masks,
    native_layout,
    native_parameters,
    torch_mha_masks,
    visible,
)

Results = Dict[str, dict]

# ---------------------------------------------------------------- running


def run_implementation(impl: Implementation, seed: int = 0) -> dict:
    """``run_function``'s results for one implementation, with its label, kind and version;
    a case the native API cannot express is ``unsupported: <why>``."""
    from .._registry import get_backend
    from .against import run_function
    from .worker import framework_version

    module = get_backend(impl.framework)
    meta = {
        "backend": impl.framework,
        "kind": impl.kind,
        "framework_version": framework_version(impl.framework),
    }
    try:
        fn = impl.make()
        results = run_function(fn, impl.kind, impl.framework, seed)
        results["version"] = implementation_version(impl)
    except Exception as err:
        return {"version": "?", "status": f"failed: {type(err).__name__}: {err}", "cases": {}, **meta}
    notes = getattr(module, "DTYPE_NOTES", {})
    for name, result in results["cases"].items():
        status = result["status"]
        if status.startswith("error: Unsupported: "):
            result["status"] = "unsupported: " + status[len("error: Unsupported: ") :]
        elif status.startswith("unsupported: ") and status.endswith(" has no " + name.split("/")[-1]):
            why = notes.get(name.split("/")[-1])  # multiattn's backend does not run this dtype
            if isinstance(why, dict):
                why = why.get(impl.kind)
            if why:
                result["status"] = f"unsupported: {why}"
    return {**results, **meta}


def run_framework(framework: str, seed: int = 0) -> Results:
    """Every implementation of one framework, in this process: {label: results}."""
    from .._registry import get_backend

    module = get_backend(framework)
    if hasattr(module, "enable_float64"):
        module.enable_float64()
    skip = absent(framework)
    out = {}
    for impl in implementations(framework):
        if impl.label in skip:  # kept, so that the page can say why it has no rows
            out[impl.label] = {"version": "?", "status": f"absent: {skip[impl.label]}", "cases": {},
                               "backend": framework, "kind": impl.kind}  # fmt: skip
        else:
            out[impl.label] = run_implementation(impl, seed)
    return out


def split_absent(results: Results) -> Tuple[Results, Dict[str, str]]:
    """(the results of the implementations that ran, {label: why not} of those not importable)."""
    ran = {label: res for label, res in results.items() if not res["status"].startswith("absent: ")}
    missing = {label: res["status"][len("absent: ") :] for label, res in results.items() if label not in ran}
    return ran, missing


def save(results: Results, directory: str) -> None:
    """The worker's output: one ``worker.save`` file per implementation and an index."""
    from . import worker

    os.makedirs(directory, exist_ok=True)
    index = []
    for i, (label, res) in enumerate(results.items()):
        worker.save(res, os.path.join(directory, f"{i}.npz"))
        meta = {k: v for k, v in res.items() if k not in ("version", "status", "cases")}
        index.append({"label": label, "file": f"{i}.npz", **meta})
    with open(os.path.join(directory, "index.json"), "w") as f:
        json.dump(index, f)


def load(directory: str) -> Results:
    from . import worker

    with open(os.path.join(directory, "index.json")) as f:
        index = json.load(f)
    out = {}
    for entry in index:
        meta = {k: v for k, v in entry.items() if k not in ("label", "file")}
        out[entry["label"]] = {**worker.load(os.path.join(directory, entry["file"])), **meta}
    return out


# ---------------------------------------------------------------- judging and tables


def cases_of(kind: str, seed: int = 0) -> List[Case]:
    from .against import cases_for

    return cases_for(kind, seed)


def build_native_rows(results: Results, seed: int = 0, overrides: Optional[Dict[str, float]] = None) -> list:
    """check's rows (``table.build_rows``), one implementation at a time (never compared
    with each other: each is judged against the reference)."""
    from .table import build_rows

    rows = []
    for label, res in results.items():
        kind = res.get("kind")
        if kind is None:  # a framework whose worker died: its status, one row
            kind = "dot_product"
        rows += build_rows({label: res}, cases_of(kind, seed), overrides, functions=(kind,))
    return rows


def _dead_rows(case: Case) -> np.ndarray:
    """(batch, queries): where the reference sees no key."""
    weights = case.expected["weights"]
    dead = weights.sum(-1) == 0
    return dead.all(1) if case.function == "multi_head" else dead


def _uniform_alternative(case: Case) -> np.ndarray:
    """The output of a row that weighs every key alike (a fully masked row where the mask is a
    large negative number rather than nothing): the mean of the (projected) values."""
    args = case.inputs
    B, Q = _dead_rows(case).shape
    if case.function == "dot_product":
        mean = args["values"].mean(1)
    else:
        zero = np.zeros(args["W_o"].shape[0])
        projected = args["values"] @ args["W_v"].T + args.get("b_v", zero)
        mean = projected.mean(1) @ args["W_o"].T + args.get("b_o", zero)
    return np.broadcast_to(mean[:, None, :], (B, Q, mean.shape[-1]))


UNMASKED = (
    "fully masked rows: the weights of the unmasked scores (a finite additive mask cancels in the softmax)"
)


def _unmasked(case: Case) -> dict:
    """The reference without any mask: what a row gets where its mask, a constant added to every
    score of the row, cancels in the softmax."""
    args = case.inputs
    if case.function == "dot_product":
        return reference.dot_product_attention(args["queries"], args["keys"], args["values"], None)
    from .cases import NUM_HEADS

    weights = {n: v for n, v in args.items() if n not in ("queries", "keys", "values")}
    return reference.multi_head_attention(
        args["queries"], args["keys"], args["values"], None, weights, NUM_HEADS
    )


def _max_err(got: Any, want: np.ndarray, rows: np.ndarray) -> float:
    got = np.asarray(got, dtype=np.float64)
    if got.shape != want.shape:
        return float("inf")
    if got.ndim == rows.ndim + 2:  # per-head weights
        rows = np.broadcast_to(rows[:, None], got.shape[:-1])
    diff = np.abs(got - want)[rows]
    return float("inf") if np.isnan(diff).any() else float(diff.max(initial=0.0))


SEPARATOR = "; "
FLOAT32_ACCURACY = "float64 at float32 accuracy"  # within float32's tolerance, not float64's


def classify(case: Case, result: dict, backend: str, overrides: Optional[Dict[str, float]] = None) -> str:
    """'' where the case agrees with the reference, else why not, in a few words (the
    summary's cell): a status, NaN or non-zero weights in fully masked rows, a difference in
    the rows that see keys, or the gradients."""
    status = result["status"]
    if status != "ok":
        return status
    if result.get("modified"):
        return "writes into its inputs: " + ", ".join(result["modified"])
    want = case.expected
    scale = max([1.0] + [float(np.abs(a).max(initial=0.0)) for a in (want["out"], want["weights"])])
    tol = tolerance(backend, case.dtype, overrides) * scale
    dead = _dead_rows(case)
    live = ~dead
    got = {k: result[k] for k in ("out", "weights") if k in result}
    for key, value in got.items():
        if np.shape(value) != want[key].shape:
            name = "output" if key == "out" else "weights"
            return f"{name} of shape {np.shape(value)}, reference {want[key].shape}"
    reasons = []
    live_errors = {k: _max_err(v, want[k], live) for k, v in got.items()}
    if any(not err <= tol for err in live_errors.values()):
        key = max(live_errors, key=lambda k: live_errors[k])
        err, name = live_errors[key], "output" if key == "out" else "weights"
        if case.dtype == "float64" and err <= tolerance(backend, "float32") * scale:
            reasons.append(FLOAT32_ACCURACY)
        else:
            what = "NaN" if math.isinf(err) else f"{err:.2g} from the reference"
            reasons.append(f"{name} {what} where keys are visible")
    if dead.any():  # what the rows that see nothing get, recognised at a float32 tolerance
        reasons += _fully_masked(case, got, dead, max(tol, tolerance(backend, "float32") * scale))
    if reasons:
        return SEPARATOR.join(reasons)
    for arg, grad in result.get("grads", {}).items():
        g_want = want["grads"][arg]
        g_err = _max_err(grad, g_want, np.ones(np.shape(g_want)[:-1], bool))
        if not g_err <= 10 * tolerance(backend, case.dtype, overrides) * max(
            1.0, float(np.abs(g_want).max())
        ):
            if math.isinf(g_err):
                return f"gradient of {arg}: NaN"
            if case.dtype == "float64" and g_err <= 10 * tolerance(backend, "float32") * max(
                1.0, float(np.abs(g_want).max())
            ):
                return FLOAT32_ACCURACY
            return f"gradient of {arg}: {g_err:.2g} from the reference"
    return ""


def _fully_masked(case: Case, got: dict, dead: np.ndarray, tol: float) -> List[str]:
    """What the implementation gives in the rows that see no key, where it is not the reference's."""
    want = case.expected
    out_dead = np.asarray(got["out"], dtype=np.float64)[dead]
    weights_dead = None
    if "weights" in got:
        weights = np.asarray(got["weights"], dtype=np.float64)
        weights_dead = (weights.transpose(0, 2, 1, 3) if weights.ndim == 4 else weights)[dead]
    nan = [
        n for n, a in (("output", out_dead), ("weights", weights_dead)) if a is not None and np.isnan(a).any()
    ]
    if nan:
        return [f"fully masked rows: NaN {' and '.join(nan)}"]
    unmasked = _unmasked(case)
    if weights_dead is not None and np.abs(weights_dead).max() > tol:
        if np.ptp(weights_dead, axis=-1).max() <= tol:
            return [f"fully masked rows: uniform weights {weights_dead.flat[0]:.2g}, reference 0"]
        if _max_err(got["weights"], unmasked["weights"], dead) <= tol:
            return [UNMASKED]
        return ["fully masked rows: non-zero weights, reference 0"]
    if not _max_err(got["out"], want["out"], dead) > tol:
        return []
    if _max_err(got["out"], _uniform_alternative(case), dead) <= tol:
        want_what = "0" if case.function == "dot_product" else "b_o"
        return [
            f"fully masked rows: uniform weights (an output of the mean of the values), reference {want_what}"
        ]
    if _max_err(got["out"], unmasked["out"], dead) <= tol:
        return [UNMASKED]
    if np.abs(out_dead).max() <= tol:
        return ["fully masked rows: output 0, reference b_o"]
    return [f"fully masked rows: output {_max_err(got['out'], want['out'], dead):.2g} from the reference"]


def summarize(results: Results, seed: int = 0, overrides: Optional[Dict[str, float]] = None) -> List[tuple]:
    """[(label, {mask: cell})]: 'agree', 'n/a', 'not run' or the reasons, each with the dtypes
    that show it where not every dtype that ran does."""
    out = []
    for label, res in results.items():
        cells = {}
        kind = res.get("kind", "dot_product")
        for mask in MASKS:
            if res["status"] != "ok":
                cells[mask] = res["status"]
                continue
            reasons: Dict[str, List[str]] = {}
            ran, statuses = [], set()
            for case in (c for c in cases_of(kind, seed) if c.mask == mask):
                result = res["cases"].get(case.name, {"status": "error: missing"})
                if result["status"].startswith(("unsupported", "skipped")):
                    statuses.add("not run" if result["status"].startswith("skipped") else "n/a")
                    continue
                ran.append(case.dtype)
                why = classify(case, result, res.get("backend", label), overrides)
                for reason in why.split(SEPARATOR) if why else ():
                    reasons.setdefault(reason, []).append(case.dtype)
            cells[mask] = _cell(reasons, ran, statuses)
        out.append((label, cells))
    return out


def _cell(reasons: Dict[str, List[str]], ran: List[str], statuses: set) -> str:
    if not ran:
        return "not run" if "not run" in statuses else "n/a"
    if not reasons:
        return "agree"
    return SEPARATOR.join(
        why if set(dtypes) >= set(ran) or why == FLOAT32_ACCURACY else f"{why} ({', '.join(dtypes)})"
        for why, dtypes in reasons.items()
    )


AGREE = ("agree", "n/a", "not run")


def disagreements(summary: List[tuple]) -> int:
    """How many implementation x mask cells disagree with the reference."""
    return sum(cell not in AGREE for _, cells in summary for cell in cells.values())


def grouped(summary: List[tuple]) -> List[Tuple[str, str, str]]:
    """(label, 'mask, mask', cell): the masks of one implementation with the same cell together."""
    out = []
    for label, cells in summary:
        by_cell: Dict[str, List[str]] = {}
        for mask in MASKS:
            by_cell.setdefault(cells[mask], []).append(mask)
        out += [(label, ", ".join(masks), cell) for cell, masks in by_cell.items()]
    return out


def render_summary(summary: List[tuple]) -> str:
    """The 'where frameworks disagree' table, plain text."""
    header = ["implementation", "masks", "against the reference"]
    lines, last = [], None
    for label, masks, cell in grouped(summary):
        lines.append(["" if label == last else label, masks, cell])
        last = label
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    widths[-1] = len(header[-1])

    def fmt(cells):
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines])


def render(results: Results, seed: int = 0, overrides: Optional[Dict[str, float]] = None) -> str:
    """The command's output: check's table of every row, then where the frameworks disagree."""
    from .table import render as render_rows

    rows = build_native_rows(results, seed, overrides)
    table = render_rows(rows).rsplit("\n\n", 1)[0]  # its footer counts backends: ours follows
    summary = summarize(results, seed, overrides)
    failed = sum(r.verdict == "FAIL" for r in rows)
    return "\n".join([
        table, "",
        f"{len(rows)} rows, {len(results)} native implementations: {failed} rows disagree with multiattn's "
        "reference (FAIL: the framework's own semantics, not an error of this command)", "",
        "Where frameworks disagree (each mask case over every dtype):", "",
        render_summary(summary), "",
        f"{disagreements(summary)} of {len(summary) * len(MASKS)} implementation x mask cases disagree",
    ])  # fmt: skip


# ---------------------------------------------------------------- the docs page

DATE_LINE = "Generated on "
PAGE_COMMAND = "multiattn check --native --markdown docs/native-attention.md"


def _md(text: str) -> str:
    return str(text).replace("|", "\\|")


def markdown(
    results: Results, versions: Dict[str, str], seed: int = 0, missing: Optional[Dict[str, str]] = None,
    today: Optional[str] = None,
) -> str:  # fmt: skip
    """docs/native-attention.md: a header (how, versions, date) and the tables."""
    from .. import __version__

    rows = build_native_rows(results, seed)
    summary = summarize(results, seed)
    today = today or datetime.date.today().isoformat()
    lines = [
        "# Where frameworks' own attention disagrees",
        "",
        f"<!-- Generated by `{PAGE_COMMAND}`: do not edit by hand; `tox` fails when the tables here "
        "differ from a fresh run. -->",
        "",
        f"{DATE_LINE}{today} by `{PAGE_COMMAND}` (multiattn {__version__}, seed {seed}) with "
        + ", ".join(f"{name} {version}" for name, version in versions.items())
        + ".",
        "",
        "Each framework's own attention, run by `multiattn check --native` through the battery of "
        "[`multiattn check`](check.md), each framework in its own subprocess, judged against multiattn's "
        "float64 reference, whose semantics are [docs/multihead.md](multihead.md)'s: `attention_mask` "
        "True = may attend, causality top-left, and a row that sees no key gets weights 0 and output 0 "
        "(for multi-head attention the heads give 0 and the layer its output bias `b_o`). The mask cases: "
        "`none`; `1d`: lengths `[0, 7]` (5 keys: a fully masked batch row and an over-long length); "
        "`2d`: lengths `[[2, 0, 7], [5, -1, 3]]` (zero and negative: fully masked rows); `mask`: a "
        "boolean (batch, queries, keys) mask with a fully masked row; `causal`: `causal=True` (3 queries, "
        "5 keys); `all`: 2-D lengths, mask and causality together. Each in float32, float64, float16 and "
        "bfloat16, values and (float32, float64) gradients with respect to every input and weight.",
        "",
        "A disagreement is the framework's own answer, not an error of the translation: with no mask "
        "every implementation agrees with the reference in float32 (tests/test_native.py). How each is "
        "called (lengths become the mask `arange(keys) < length`; the multi-head layers are built by "
        "`MultiHeadAttention.to_native()` for the battery's sizes, queries 4 wide, keys and values 3 "
        "wide, num_hiddens 4, 2 heads, biases, and take the battery's canonical weights):",
        "",
    ]
    for impl in IMPLEMENTATIONS:
        if impl.label in results:
            lines.append(f"* `{impl.label}`: {impl.how}.")
    for label, why in (missing or {}).items():
        lines.append(f"* `{label}`: not run here, d2l is not importable ({_md(why)}).")
    lines += [
        "",
        "## Where frameworks disagree",
        "",
        "Per implementation, the mask cases with the same answer together, over every dtype that ran (a "
        "dtype in brackets: only there). `agree`: within check's tolerance of the reference, values and "
        "gradients; `n/a`: the framework cannot run it here; `not run`: the API takes no such mask; "
        "`float64 at float32 accuracy`: float64 results only within float32's tolerance.",
        "",
        "| implementation | masks | against the reference |",
        "|---|---|---|",
    ]
    for label, masks, cell in grouped(summary):
        lines.append(f"| `{_md(label)}` | {masks} | {_md(cell)} |")
    lines += [
        "",
        "## Every row",
        "",
        "`multiattn check`'s rows (kind x dtype, the six mask cases together) with its verdicts and "
        "reasons (its first three); `FAIL` is outside the tolerance of multiattn's reference, which here "
        "is the framework's own answer. The errors of every row are in `multiattn check --native`'s "
        "output and `--json`.",
        "",
        "| implementation | case | verdict |",
        "|---|---|---|",
    ]
    for r in rows:
        verdict = r.verdict + (f": {r.reason}" if r.reason else "")
        if r.not_run:
            verdict += "; not run: " + "; ".join(f"{', '.join(m)} ({why})" for why, m in r.not_run.items())
        lines.append(f"| `{_md(r.backend)}` | {r.function} {r.dtype} | {_md(verdict)} |")
    return "\n".join(lines) + "\n"


def table_lines(page: str) -> List[str]:
    """The lines of a page's tables (what `tox` compares; never the date)."""
    return [line for line in page.splitlines() if line.startswith("|")]


def compare_pages(committed: str, fresh: str, labels: Optional[Sequence[str]] = None) -> List[str]:
    """The table lines that differ ('-' committed, '+' fresh), only of the implementations in
    labels where given (a run of some frameworks against the whole page)."""

    def keep(line: str) -> bool:
        if labels is None:
            return True
        label = re.match(r"\| `(.*?)` \|", line)
        return label is None or label.group(1).replace("\\|", "|") in labels

    old = [line for line in table_lines(committed) if keep(line)]
    new = [line for line in table_lines(fresh) if keep(line)]
    return [f"- {line}" for line in old if not any(_same_sizes(line, other) for other in new)] + [
        f"+ {line}" for line in new if not any(_same_sizes(line, other) for other in old)
    ]


_NUMBER = re.compile(r"(?<![\w.])(\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+)(?![\w.])")
ROUND_OFF = 1e-12  # an error below it is float64 round-off, which differs between CPUs as zero does


def _same_sizes(line: str, other: str) -> bool:
    """Two table lines with the same words and each decimal number (an error's size) within a
    factor of ten of the other's: the last bits of the arithmetic, which differ between CPUs,
    never make the page stale (a power-of-ten rounding would flip at 3.16e-8)."""
    if _NUMBER.sub("#", line) != _NUMBER.sub("#", other):
        return False
    sizes = [[float(x) for x in _NUMBER.findall(text)] for text in (line, other)]
    pairs = [[x if x >= ROUND_OFF else 0.0 for x in pair] for pair in zip(*sizes)]
    return all(max(pair) <= 10 * min(pair) for pair in pairs)


def versions_of(results: Results) -> Dict[str, str]:
    """framework (and keras/flax/d2l) -> version, in the order of the implementations."""
    names = {"tensorflow": "tensorflow", "keras": "keras", "flax": "flax", "d2l": "d2l"}
    out: Dict[str, str] = {}
    for impl in IMPLEMENTATIONS:
        res = results.get(impl.label)
        if res is None:
            continue
        out.setdefault(impl.framework, res.get("framework_version", "?"))
        if impl.version in names:
            out.setdefault(impl.version, res["version"])
    return out


def main(argv: List[str]) -> int:
    """``python -m multiattn.check.native --compare COMMITTED FRESH``: exit 1 (and the lines)
    where the tables of two pages differ."""
    if len(argv) != 3 or argv[0] != "--compare":
        print("usage: python -m multiattn.check.native --compare COMMITTED.md FRESH.md", file=sys.stderr)
        return 2
    with open(argv[1]) as f, open(argv[2]) as g:
        diff = compare_pages(f.read(), g.read())
    if diff:
        print(f"{argv[1]} is stale: its tables differ from a fresh run ({argv[2]}); regenerate it with "
              f"`{PAGE_COMMAND}`:", file=sys.stderr)  # fmt: skip
        print("\n".join(diff), file=sys.stderr)
        return 1
    print(f"{argv[1]}: its tables are current")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
