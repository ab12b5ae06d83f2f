"""Every mistake at the command line gets one line on stderr and exit status 2; a traceback
only with --debug.  `report` keeps every row it is given."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from multiattn.check.cases import DTYPES, FUNCTIONS


def run_cli(*args: str, setup: str = "", **env: str) -> subprocess.CompletedProcess:
    code = f"import sys\n{setup}\nfrom multiattn.cli import main\nsys.exit(main(sys.argv[1:]))"
    environ = {k: v for k, v in os.environ.items() if k != "MULTIATTN_BACKEND"}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=environ, timeout=300
    )


def one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args",
    [("demo", "--backend", "torhc"), ("check", "--backends", "numpy,torhc")],
    ids=["demo", "check"],
)
def test_a_misspelled_backend(args):
    line = one_line(run_cli(*args))
    assert line.startswith(f"multiattn {args[0]}:") and "'torhc' (did you mean 'torch'?)" in line
    assert "known" in line and "numpy, torch" in line


def test_an_uninstalled_backend_names_its_install_recipe():
    line = one_line(run_cli("demo", "--backend", "mxnet", setup="sys.modules['mxnet'] = None"))
    assert line.startswith("multiattn demo: multiattn backend 'mxnet' needs the 'mxnet' package")
    assert "an environment of its own: mxnet needs numpy<1.24" in line


def test_an_unknown_backend_in_the_environment_variable():
    line = one_line(run_cli("demo", MULTIATTN_BACKEND="caffe"))
    assert "unknown multiattn backend 'caffe'" in line and "MULTIATTN_BACKEND" in line


@pytest.mark.parametrize("content", [None, "not json", "{}", '{"seed": 0}'])
def test_report_of_a_file_that_is_not_a_check_result(tmp_path, content):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    line = one_line(run_cli("report", str(path)))
    assert line.startswith("multiattn report:") and str(path) in line


@pytest.mark.parametrize(
    "args", [("check", "--tolerance", "float32"), ("check", "--seed", "x"), ("report",), ("frobnicate",)]
)
def test_bad_options(args):
    line = one_line(run_cli(*args))
    assert line.startswith("multiattn") and "error:" in line and "--help" in line


def test_debug_shows_the_traceback():
    result = run_cli("--debug", "demo", "--backend", "torhc")
    assert result.returncode != 0 and "Traceback" in result.stderr and "did you mean" in result.stderr


def test_report_keeps_a_backend_found_in_two_files(tmp_path):
    paths = []
    for name in ("check-all", "check-mxnet"):
        paths.append(str(tmp_path / f"{name}.json"))
        result = run_cli("check", "--backends", "numpy", "--in-process", "--json", paths[-1])
        assert result.returncode == 0, result.stderr
    doc = json.loads(open(paths[1]).read())
    doc["backends"]["numpy"]["version"] = "1.23.5"  # as if from the mxnet environment
    open(paths[1], "w").write(json.dumps(doc))
    result = run_cli("report", *paths)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("numpy")]
    per_file = len(FUNCTIONS) * len(DTYPES)  # a row per function and dtype from each file, none dropped
    assert len(rows) == 2 * per_file
    assert sum(r.startswith("numpy [check-all]") for r in rows) == per_file
    assert sum(r.startswith("numpy [check-mxnet]") for r in rows) == per_file
    assert all("1.23.5" in r for r in rows if r.startswith("numpy [check-mxnet]"))


def test_a_labelled_backend_keeps_its_own_tolerances():
    from multiattn.check.cases import tolerance
    from multiattn.check.table import _name

    results = {"mlx [check-all]": {"backend": "mlx"}, "mlx [other]": {"backend": "mlx"}, "torch": {}}
    assert tolerance(_name(results, "mlx [other]"), "float64") == 1e-6  # mlx's float64 tolerance
    assert tolerance(_name(results, "torch"), "float64") == 1e-10
