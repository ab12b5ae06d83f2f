"""The ``multiattn`` command: check, report, demo."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Any, Dict, List, Optional

from . import __version__
from ._registry import BACKENDS, did_you_mean, pip_install


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, exit status 2 (argparse prints the usage too)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _names(text: str, known: Any, what: str, hint: Any = lambda name: "") -> List[str]:
    """The comma-separated names of ``text``, each one of ``known``; else the error naming it."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known] or ([] if names else [text])
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {unknown[0]!r}{hint(unknown[0])}; known: {', '.join(known)}"
        )
    return names


def _backend_list(text: str) -> List[str]:
    return _names(text, BACKENDS, "backend", did_you_mean)


def _native_list(text: str) -> List[str]:
    """--native's frameworks: backends with attention of their own, or onnxruntime (numpy arrays in)."""
    from .check.native_wrappers import FRAMEWORKS

    return _names(text, FRAMEWORKS, "framework")


def _tolerance(text: str) -> tuple:
    from .check.cases import DTYPES

    dtype, _, value = text.partition("=")
    if dtype not in DTYPES or not value:
        raise argparse.ArgumentTypeError(
            f"expected DTYPE=VALUE with DTYPE one of {', '.join(DTYPES)}, got {text!r}"
        )
    try:
        return dtype, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"tolerance {value!r} is not a number") from None


_IN_PLACE = [0]  # the length of the line shown in place, to clear (0: none)


def _progress(message: str, in_place: bool = False) -> None:
    """A line on stderr; in_place: one the next line replaces, shown on a terminal only."""
    sys.stdout.flush()  # what was printed before stays before it where both streams go to one log
    terminal = sys.stderr.isatty()
    if in_place and not terminal:
        return
    clear = "\r" + " " * _IN_PLACE[0] + "\r" if _IN_PLACE[0] else ""
    _IN_PLACE[0] = len(message) if in_place else 0
    sys.stderr.write(clear + message + ("" if in_place else "\n"))
    sys.stderr.flush()


def _finish(results: Dict[str, dict], seed: int, args: argparse.Namespace) -> int:
    from .check import build_rows, render, save_json
    from .check.cases import make_cases

    overrides = dict(args.tolerance or [])
    rows = build_rows(results, make_cases(seed), overrides)
    print(render(rows))
    if getattr(args, "json", None):
        save_json(args.json, results, rows, seed)
        _progress(f"results written to {args.json}")
    return 1 if any(r.verdict == "FAIL" for r in rows) else 0


def cmd_check(args: argparse.Namespace) -> int:
    from .check import installed_backends, run_check

    if args.native:
        return cmd_native(args)
    if args.markdown:
        raise ValueError("--markdown PATH goes with --native")
    if args.against:
        return cmd_against(args)
    if args.kind or args.backend or args.skip_fully_masked or args.dtypes:
        raise ValueError(
            "--kind, --backend, --dtypes and --skip-fully-masked go with --against MODULE:FUNCTION"
        )
    backends = args.backends or installed_backends()
    _progress(f"multiattn {__version__}: checking {', '.join(backends)} (seed {args.seed})")
    results = run_check(backends, seed=args.seed, in_process=args.in_process, progress=_progress)
    code = _finish(results, args.seed, args)
    note = "" if args.backends else _not_installed_note(backends)
    if note:
        _progress(note)
    return code


def _not_installed_note(installed: List[str]) -> str:
    """What a check of the installed backends left out, and how to add it ('' if nothing)."""
    from ._registry import BACKENDS

    absent = [name for name in BACKENDS if name not in installed]
    if not absent:
        return ""
    report = "`multiattn report`: docs/check.md"
    if "mxnet" in installed:
        how = [f"with mxnet's numpy<1.24 they join from another environment ({report})"]
    else:
        extras = [BACKENDS[name][1] for name in absent if name != "mxnet"]
        how = []
        if extras:
            them = "them" if len(extras) > 1 else "it"
            how.append(f"{pip_install(','.join(extras))} adds {them}")
        if "mxnet" in absent:
            how.append(f"mxnet joins from an environment of its own (numpy<1.24; {report})")
    return f"(not installed here, so not checked: {', '.join(absent)}; {'; '.join(how)})"


def cmd_against(args: argparse.Namespace) -> int:
    """`check --against MODULE:FUNCTION --kind KIND --backend NAME`: the user's function."""
    from .check import build_rows, render, run_against, save_json
    from .check.against import KINDS, cases_for

    if not args.kind or not args.backend:
        raise ValueError(f"--against needs --kind (one of {', '.join(KINDS)}) and --backend (its framework)")
    if args.backends:
        raise ValueError("--against checks one function on one framework: use --backend NAME, not --backends")
    backend = _backend_list(args.backend)[0]
    result = run_against(args.against, args.kind, backend, args.seed, args.dtypes, args.skip_fully_masked)
    if result["status"].startswith("usage: "):
        raise ValueError(result["status"][len("usage: ") :])
    results = {args.against: {**result, "backend": backend}}
    cases = cases_for(args.kind, args.seed, args.skip_fully_masked)
    rows = build_rows(results, cases, dict(args.tolerance or []), functions=(args.kind,))
    rows = [r for r in rows if not args.dtypes or r.dtype in args.dtypes]
    print(render(rows))
    if args.skip_fully_masked:
        print("(--skip-fully-masked: rows where nothing is visible were not judged)")
    if args.json:
        save_json(args.json, results, rows, args.seed)
        _progress(f"results written to {args.json}")
    return 1 if any(r.verdict == "FAIL" for r in rows) else 0


def _finish_native(results: Dict[str, dict], seed: int, args: argparse.Namespace, missing: dict) -> None:
    """The native tables (each implementation against the reference) and, with --json, the file."""
    from .check import native, native_report, save_json

    overrides = dict(args.tolerance or [])
    print(native_report.render(results, seed, overrides))
    for label, why in missing.items():
        print(f"({label}: not run, not importable here: {why})")
    if getattr(args, "json", None):
        rows = native.build_native_rows(results, seed, overrides)
        save_json(args.json, results, rows, seed, native=True, not_importable=missing)
        _progress(f"results written to {args.json}")


def cmd_native(args: argparse.Namespace) -> int:
    """`check --native`: each framework's own attention through the battery; exit 0 with the
    table (a disagreement is a finding about the framework, not a failure)."""
    from .check import installed_backends, native_report, run_native
    from .check.native_wrappers import FRAMEWORKS, TENSORS
    from .check.results import split_absent

    others = [flag for flag, given in (("--against", args.against), ("--kind", args.kind),
              ("--backend", args.backend), ("--dtypes", args.dtypes), ("--skip-fully-masked",
              args.skip_fully_masked), ("--in-process", args.in_process)) if given]  # fmt: skip
    if others:
        raise ValueError(
            f"--native runs each framework's own attention: {', '.join(others)} does not go with it"
        )
    runtimes = [name for name in TENSORS if importlib.util.find_spec(name) is not None]  # onnxruntime
    asked = args.native if isinstance(args.native, list) else args.backends or installed_backends() + runtimes
    backends = [b for b in asked if b in FRAMEWORKS]
    if not backends:
        raise ValueError(
            f"--native: none of {', '.join(asked)} has attention of its own "
            f"(those that do: {', '.join(FRAMEWORKS)})"
        )
    _progress(f"multiattn {__version__}: the own attention of {', '.join(backends)} (seed {args.seed})")
    results, missing = split_absent(run_native(backends, seed=args.seed, progress=_progress))
    _finish_native(results, args.seed, args, missing)
    if args.markdown:
        page = native_report.markdown(results, native_report.versions_of(results), args.seed, missing)
        with open(args.markdown, "w") as f:
            f.write(page)
        _progress(f"page written to {args.markdown}")
    return 0


def _dtype_list(text: str) -> List[str]:
    from .check.cases import DTYPES

    return _names(text, DTYPES, "dtype")


def cmd_report(args: argparse.Namespace) -> int:
    """`report`: one table from `check --json` files (exit 1 on a failed row), or the native
    tables from `check --native --json` files (exit 0, as `check --native`)."""
    from .check import load_json
    from .check.results import split_absent

    results, seed, of_natives = load_json(args.files)
    if not of_natives:
        return _finish(results, seed, args)
    ran, missing = split_absent(results)
    _finish_native(ran, seed, args, missing)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.backend, args.out)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="multiattn",
        description="d2l 11.3/11.5 attention on every framework, and proof that they agree.",
    )
    parser.add_argument("--version", action="version", version=f"multiattn {__version__}")
    parser.add_argument("--debug", action="store_true", help="show a traceback for errors, not one line")
    sub = parser.add_subparsers(dest="command", required=True)

    tolerance_help = "override a dtype's tolerance, e.g. float32=1e-4 (repeatable)"
    check = sub.add_parser(
        "check",
        help="run every installed backend on fixed cases; one agreement table",
        description="Run fixed, seeded cases (masked softmax, additive, dot-product and multi-head "
        "attention, masks, every dtype the backend supports, values and gradients) on each backend "
        "in its own subprocess; print one table of errors against a float64 numpy reference and against "
        "every other backend. Exit status 1 if any row is outside its tolerance.",
    )
    check.add_argument(
        "--backends", type=_backend_list, help="comma-separated, e.g. torch,jax (default: installed)"
    )
    check.add_argument("--seed", type=int, default=0, help="seed of the inputs and weights (default 0)")
    check.add_argument("--tolerance", type=_tolerance, action="append", help=tolerance_help)
    check.add_argument("--json", metavar="PATH", help="also write the results (arrays included) as JSON")
    check.add_argument(
        "--native",
        nargs="?",
        const=True,
        default=False,
        type=_native_list,
        metavar="FRAMEWORKS",
        help="run each framework's OWN attention (torch SDPA and nn.MultiheadAttention, Keras, jax/flax, "
        "paddle, mlx, d2l where importable; onnxruntime's Attention node when named: --native onnxruntime) "
        "through the same cases: where they disagree; exit 0",
    )
    check.add_argument(
        "--markdown", metavar="PATH", help="with --native: also write the tables as a Markdown page"
    )
    check.add_argument(
        "--in-process",
        action="store_true",
        help="run backends in this process (no crash isolation; for debugging)",
    )
    against = check.add_argument_group(
        "checking your own function",
        "--against MODULE:FUNCTION --kind KIND --backend FRAMEWORK runs your function (same "
        "arguments as multiattn's functional form of KIND) through the same cases, in a subprocess",
    )
    against.add_argument(
        "--against",
        metavar="MODULE:FUNCTION",
        help="an importable module or a .py file, and a function in it",
    )
    against.add_argument(
        "--kind",
        choices=("masked_softmax", "dot_product", "additive", "multi_head"),
        help="what the function computes",
    )
    against.add_argument(
        "--backend", metavar="FRAMEWORK", help="the framework whose tensors it takes, e.g. torch"
    )
    against.add_argument(
        "--dtypes", type=_dtype_list, help="comma-separated (default: every dtype the framework runs)"
    )
    against.add_argument(
        "--skip-fully-masked",
        action="store_true",
        help="do not judge rows where nothing is visible (code that leaves them undefined, as d2l does)",
    )
    check.set_defaults(func=cmd_check)

    report = sub.add_parser(
        "report",
        help="merge `check --json` files from several environments into one table",
        description="Merge the JSON results of `multiattn check --json` runs made in different "
        "environments (e.g. mxnet's, which needs numpy<1.24) into one table, comparing every "
        "backend with every other. Exit status 1 if any row is outside its tolerance. Files from "
        "`check --native --json` give the native tables instead (each implementation against the "
        "reference only; exit 0).",
    )
    report.add_argument(
        "files",
        nargs="+",
        help="JSON files written by `multiattn check --json` (or all by `check --native --json`)",
    )
    report.add_argument("--tolerance", type=_tolerance, action="append", help=tolerance_help)
    report.add_argument("--json", metavar="PATH", help="write the merged results as JSON")
    report.set_defaults(func=cmd_report)

    demo = sub.add_parser(
        "demo",
        help="the worked example of d2l 11.3 on one backend, with a heatmap PNG",
        description="Run the books' example (all keys equal, valid_lens [2, 6]) through both "
        "scoring functions, print the outputs and save the attention weights as a heatmap.",
    )
    demo.add_argument("--backend", default=None, help="backend name (default: MULTIATTN_BACKEND or numpy)")
    demo.add_argument("--out", default="weights.png", help="PNG path for the heatmap (default weights.png)")
    demo.set_defaults(func=cmd_demo)
    return parser


# What goes wrong outside multiattn's control (a backend that is unknown or not installed, a
# file that cannot be read): one line and exit status 2, the traceback only with --debug.
USER_ERRORS = (ImportError, ValueError, OSError, KeyError, TypeError)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as err:
        if args.debug:
            raise
        message = (
            str(err) if not isinstance(err, KeyError) else f"missing entry {err} (not a check --json file?)"
        )
        print(f"multiattn {args.command}: {message}", file=sys.stderr)
        return 2
