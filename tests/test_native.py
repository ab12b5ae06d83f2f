"""`multiattn check --native`: each framework's own attention through check's battery.

The mask conversions, that every wrapper agrees with the reference where the framework's
semantics are multiattn's (no mask, causality, the rows that see keys: so a disagreement is the
framework's), the disagreements each framework really shows (measured on this project's
versions, see docs/native-attention.md), the command, and that the committed page is current.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import types

import numpy as np
import pytest

from multiattn.check import native
from multiattn.check import native_wrappers as wrappers
from multiattn.check import results as results_io
from multiattn.check.against import cases_for, run_function
from multiattn.check.native_report import (
    DATE_LINE,
    PAGE_COMMAND,
    compare_pages,
    markdown,
    render,
    versions_of,
)

from .conftest import backends_under_test
from .test_cli_errors import one_line, run_cli

PAGE = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "native-attention.md")
FRAMEWORKS = [pytest.param(fw, marks=pytest.mark.backend(fw)) for fw in wrappers.FRAMEWORKS]
RAN = [impl for impl in wrappers.IMPLEMENTATIONS if impl.version != "d2l"]  # d2l: where importable
IMPLEMENTATIONS = [
    pytest.param(impl, marks=pytest.mark.backend(impl.framework), id=impl.label) for impl in RAN
]


@functools.lru_cache(maxsize=None)
def results_of(framework: str) -> dict:
    """The whole battery over a framework's own attention, in this process (once per run), saved
    and loaded as the worker's are (its order of the gradients: the command's rows exactly)."""
    with tempfile.TemporaryDirectory() as tmp:
        results_io.save_native(native.run_framework(framework), tmp)
        return results_io.load_native(tmp)


def summary_of(framework: str) -> dict:
    return dict(native.summarize(results_of(framework)))


def case(kind: str, mask: str, dtype: str = "float32"):
    return next(c for c in cases_for(kind) if c.mask == mask and c.dtype == dtype)


# --- mask conversions (numpy) ----------------------------------------------------------------


def test_lengths_masks_and_causality_become_one_boolean_mask():
    lens_1d = wrappers.visible(np.array([0, 7]), None, False, 2, 3, 5)
    assert not lens_1d[0].any() and lens_1d[1].all()  # zero: nothing; over-long: everything
    lens_2d = wrappers.visible(np.array([[2, 0, 7], [5, -1, 3]]), None, False, 2, 3, 5)
    np.testing.assert_array_equal(lens_2d[0, 0], [1, 1, 0, 0, 0])
    assert not lens_2d[0, 1].any() and not lens_2d[1, 1].any()  # zero and negative lengths
    causal = wrappers.visible(None, None, True, 1, 3, 5)[0]
    np.testing.assert_array_equal(causal, [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])  # top-left
    mask = np.random.default_rng(0).random((2, 3, 5)) > 0.5
    both = wrappers.visible(np.array([2, 4]), mask, True, 2, 3, 5)
    np.testing.assert_array_equal(both, mask & (np.arange(5) < np.array([2, 4])[:, None, None]) & causal)
    assert wrappers.visible(None, None, False, 2, 3, 5) is None  # no mask: the native no-mask path


def test_torch_masks_are_inverted_and_1d_lengths_are_the_key_padding_mask():
    padding, attn = wrappers.torch_mha_masks(np.array([0, 3]), None, False, 2, 3, 5, num_heads=2)
    np.testing.assert_array_equal(padding, [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]])  # True: may NOT attend
    assert attn is None
    mask = np.random.default_rng(1).random((2, 3, 5)) > 0.5
    padding, attn = wrappers.torch_mha_masks(np.array([[1, 2, 3], [4, 5, 0]]), mask, True, 2, 3, 5, 2)
    allowed = wrappers.visible(np.array([[1, 2, 3], [4, 5, 0]]), mask, True, 2, 3, 5)
    assert padding is None and attn.shape == (4, 3, 5)
    for b in range(2):
        for h in range(2):
            np.testing.assert_array_equal(attn[b * 2 + h], ~allowed[b])  # batch-major, as torch's heads


def test_jax_takes_1d_lengths_as_key_value_seq_lengths_and_the_rest_as_a_mask():
    mask, lengths = wrappers.jax_masks(np.array([0, 7]), None, 2, 3, 5, use_lengths=True)
    assert mask is None and lengths.dtype == np.int32 and lengths.tolist() == [0, 7]
    mask, lengths = wrappers.jax_masks(np.array([[2, 0, 7], [5, -1, 3]]), None, 2, 3, 5, use_lengths=True)
    assert lengths is None and mask.shape == (2, 1, 3, 5)  # 2-D lengths: only a mask can say them
    mask, lengths = wrappers.jax_masks(np.array([0, 7]), None, 2, 3, 5, use_lengths=False)
    assert lengths is None and not mask[0].any() and mask[1].all()


def test_a_size_the_native_layer_cannot_take_is_unsupported_with_the_reason():
    from multiattn.layers.converters import Config

    cfg = Config(num_hiddens=4, num_heads=2, query_size=5, key_size=3, value_size=3, bias=True, dropout=0.0)
    with pytest.raises(wrappers.Unsupported, match="query_size == num_hiddens"):
        wrappers.native_layout("torch", cfg)  # torch's embed_dim is its query width
    names, layout = wrappers.native_layout("paddle", cfg._replace(query_size=4))
    assert names[:4] == ["W_q", "W_k", "W_v", "W_o"] and layout["q_proj.weight"].shape == (4, 4)

    def refuses(queries, keys, values, valid_lens, **masks):
        raise wrappers.Unsupported("the layer needs 8 columns")

    impl = wrappers.Implementation("refuses", "numpy", "dot_product", lambda: refuses, "a test")
    result = native.run_implementation(impl)
    assert {r["status"] for r in result["cases"].values()} == {
        "unsupported: the layer needs 8 columns", "unsupported: numpy has no bfloat16 dtype"
    }  # fmt: skip
    rows = native.build_native_rows({"refuses": result})
    assert {(r.verdict, r.reason) for r in rows} >= {("n/a", "the layer needs 8 columns")}


# --- the wrappers are right: where the framework means what multiattn means, they agree ------------


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_every_wrapper_agrees_without_masks_and_with_causality(impl):
    results = run_function(impl.make(), impl.kind, impl.framework, dtypes=["float32"])
    for mask in ("none", "causal"):  # every framework's semantics are multiattn's here
        c = case(impl.kind, mask)
        assert native.classify(c, results["cases"][c.name], impl.framework) == "", (mask, impl.label)
    for mask in ("1d", "2d", "mask", "all"):  # and in every row that sees a key (the translation)
        c = case(impl.kind, mask)
        why = native.classify(c, results["cases"][c.name], impl.framework)
        assert all(reason.startswith("fully masked rows: ") for reason in why.split("; ") if reason), why
        if "weights" in results["cases"][c.name]:
            assert results["cases"][c.name]["weights"].shape == c.expected["weights"].shape
    for m in ("none", "mask"):  # gradients, but where the kernel has no backward here (flex, eager)
        result = results["cases"][case(impl.kind, m).name]
        no_backward = result.get("grads_unsupported", "").startswith("flex_attention has no backward on CPU")
        assert "grads" in result or (no_backward and "flex_attention" in impl.label), (m, impl.label)


def test_the_native_layout_is_a_gather_of_the_canonical_weights():
    from multiattn.layers import converters

    weights = {n: v for n, v in case("multi_head", "none", "float64").inputs.items() if len(n) == 3}
    cfg = converters.Config(4, 2, 4, 3, 3, True, 0.0)
    for framework, to in (("torch", converters.torch_to), ("paddle", converters.paddle_to)):
        names, layout = wrappers.native_layout(framework, cfg)
        flat = np.concatenate([weights[n].reshape(-1) for n in names])
        arrays = to(cfg, weights)[1]
        assert set(layout) == set(arrays)
        for path, array in arrays.items():
            np.testing.assert_array_equal(flat[layout[path]], array, err_msg=path)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_native_parameters_are_to_natives(framework):
    """The differentiable parameters (a gather of the canonical weights) are exactly what
    MultiHeadAttention.to_native() puts into the native layer."""
    import importlib

    from multiattn.layers import converters

    weights = {n: v for n, v in case("multi_head", "none", "float64").inputs.items() if len(n) == 3}
    cfg = converters.Config(4, 2, 4, 3, 3, True, 0.0)
    module = importlib.import_module(f"multiattn.backends.{framework}")
    layer = module.MultiHeadAttention(**cfg.kwargs())
    layer.set_weights(weights)
    target = layer.to_native()
    names, layout = wrappers.native_layout(framework, cfg)
    flat = np.concatenate([weights[n].reshape(-1) for n in names])
    for path, index in layout.items():
        value = converters.attribute(target, path)
        got = np.asarray(module.to_numpy(value[...] if framework == "jax" else value), dtype=np.float64)
        np.testing.assert_allclose(got, flat[index].reshape(got.shape), rtol=1e-6, atol=1e-7, err_msg=path)


# --- what each framework does differently (measured) -------------------------------------------------

DEAD = ("1d", "2d", "mask", "all")  # the mask cases with fully masked rows
MASKS = ("none", "causal") + DEAD
MODS = ("window", "document", "softcap")  # given to an implementation whose API has them
UNIFORM_OUT = "fully masked rows: uniform weights (an output of the mean of the values), reference "


@pytest.mark.backend("torch")
def test_torch():
    s = summary_of("torch")
    sdpa = s["torch.nn.functional.scaled_dot_product_attention"]
    assert {sdpa[m] for m in MASKS} == {"agree"} and {sdpa[m] for m in MODS} == {"not run"}  # all dtypes
    flex = s["torch.nn.attention.flex_attention (eager)"]  # every mask as its mask_mod; values only
    assert set(flex.values()) == {"agree"}
    gqa = s["torch.nn.functional.scaled_dot_product_attention (enable_gqa=True)"]
    assert {gqa[m] for m in MASKS} == {"agree"}
    mha = s["torch.nn.MultiheadAttention (need_weights=True)"]
    assert {mha[m] for m in DEAD} == {"fully masked rows: NaN output and weights"}
    assert mha["none"] == mha["causal"] == "agree"
    assert {s["torch.nn.MultiheadAttention (need_weights=False)"][m] for m in MASKS} == {
        "agree"
    }  # 0 heads: b_o


@pytest.mark.backend("tensorflow")
def test_keras():
    s = summary_of("tensorflow")
    assert {s["keras.ops.dot_product_attention"][m] for m in DEAD} == {UNIFORM_OUT + "0"}
    assert s["keras.ops.dot_product_attention"]["none"] == "agree"
    assert s["keras.ops.dot_product_attention"]["softcap"] == "n/a"  # attn_logits_soft_cap: JAX on TPU only
    scores = s["keras.layers.MultiHeadAttention (return_attention_scores=True)"]
    assert {scores[m] for m in MASKS} == {native.FLOAT32_ACCURACY}  # weights 0 where nothing is visible
    grouped = s["keras.layers.GroupQueryAttention (return_attention_scores=True)"]
    assert {grouped[m] for m in MASKS} == {"agree"}
    fused = s["keras.layers.MultiHeadAttention (return_attention_scores=False)"]  # ops.dot_product_attention
    assert {fused[m] for m in DEAD} == {f"{UNIFORM_OUT}b_o; {native.FLOAT32_ACCURACY}"}
    rows = {(r.backend, r.dtype): r for r in native.build_native_rows(results_of("tensorflow"))}
    assert rows["keras.layers.MultiHeadAttention (return_attention_scores=True)", "float32"].verdict == "ok"


@pytest.mark.backend("jax")
def test_jax_and_flax():
    s = summary_of("jax")
    for label in (
        "jax.nn.dot_product_attention (mask=)",
        "jax.nn.dot_product_attention (key_value_seq_lengths=)",
    ):
        assert {s[label][m] for m in DEAD} == {f"{UNIFORM_OUT}0; {native.FLOAT32_ACCURACY}"}, label
        assert s[label]["none"] == native.FLOAT32_ACCURACY  # its softmax is float32, also for float64
        assert s[label]["window"] == native.FLOAT32_ACCURACY  # local_window_size, alone
    flax = s["flax.nnx.MultiHeadAttention"]
    assert {flax[m] for m in DEAD} == {"fully masked rows: uniform weights 0.2, reference 0"}
    assert flax["none"] == flax["causal"] == "agree"
    grouped = s["flax.nnx.MultiHeadAttention (num_kv_heads=2)"]
    assert {grouped[m] for m in DEAD} == {"fully masked rows: uniform weights 0.2, reference 0"}
    assert grouped["none"] == grouped["causal"] == "agree"


@pytest.mark.backend("paddle")
def test_paddle():
    s = summary_of("paddle")
    sdpa = s["paddle.nn.functional.scaled_dot_product_attention"]
    assert {sdpa[m] for m in DEAD} == {"fully masked rows: NaN output"}  # a bool mask is -inf there
    layer = s["paddle.nn.MultiHeadAttention"]  # a bool mask is -1e9 added: uniform, or cancelled in float64
    assert {layer[m] for m in DEAD} == {
        f"fully masked rows: uniform weights 0.2, reference 0 (float32); {native.UNMASKED} (float64)"
    }
    rows = native.build_native_rows(results_of("paddle"))
    assert {r.reason for r in rows if r.dtype in ("float16", "bfloat16")} == {
        "paddle's CPU build has no float16/bfloat16 kernels for matmul and where"
    }


@pytest.mark.backend("mlx")
def test_mlx():
    s = summary_of("mlx")
    assert {s["mlx.core.fast.scaled_dot_product_attention"][m] for m in DEAD} == {UNIFORM_OUT + "0"}
    assert {s["mlx.nn.MultiHeadAttention"][m] for m in DEAD} == {UNIFORM_OUT + "b_o"}
    assert s["mlx.nn.MultiHeadAttention"]["causal"] == "agree"  # an explicit top-left mask, not "causal"
    grouped = s["mlx.core.fast.scaled_dot_product_attention (grouped heads)"]
    assert {grouped[m] for m in DEAD} == {UNIFORM_OUT + "b_o"} and grouped["none"] == "agree"


@pytest.mark.backend("torch")
def test_d2l_where_importable(monkeypatch):
    """d2l's classes (here d2l 11.3/11.5's own code, tests/test_multi_head.py, as a stand-in
    module): lengths only, -1e6 for the masked scores."""
    from .test_multi_head import d2l_torch_multi_head_attention

    assert set(wrappers.absent("torch")) <= {"d2l.torch.DotProductAttention", "d2l.torch.MultiHeadAttention"}
    layer = d2l_torch_multi_head_attention(4, 2, 0.0, bias=True)
    module = types.ModuleType("d2l.torch")
    module.DotProductAttention, module.MultiHeadAttention = type(layer.attention), type(layer)
    package = types.ModuleType("d2l")
    package.__version__, package.torch = "11.5 (tests)", module
    monkeypatch.setitem(sys.modules, "d2l", package)
    monkeypatch.setitem(sys.modules, "d2l.torch", module)
    assert wrappers.absent("torch") == {}
    results = {
        i.label: native.run_implementation(i) for i in wrappers.implementations("torch") if i.version == "d2l"
    }
    s = dict(native.summarize(results))
    dot, multi = s["d2l.torch.DotProductAttention"], s["d2l.torch.MultiHeadAttention"]
    assert dot["none"] == multi["none"] == "agree"
    assert dot["mask"] == dot["causal"] == multi["all"] == "not run"  # d2l takes lengths only
    assert dot["1d"] == (  # -1e6 is -inf in float16
        "fully masked rows: uniform weights 0.2, reference 0 (float32, float64, bfloat16); "
        "fully masked rows: NaN output and weights (float16)"
    )
    assert multi["2d"].startswith("fully masked rows: uniform weights 0.2, reference 0")
    assert results["d2l.torch.MultiHeadAttention"]["version"] == "11.5 (tests)"


# --- the command and the page ---------------------------------------------------------------------


@pytest.mark.backend("torch")
def test_the_command_prints_both_tables_and_exits_0(tmp_path):
    out, page = tmp_path / "native.json", tmp_path / "page.md"
    result = run_cli(
        "check", "--native", "--backends", "numpy,torch", "--json", str(out), "--markdown", str(page)
    )
    assert result.returncode == 0, result.stdout + result.stderr  # a disagreement is a finding
    rows = [line for line in result.stdout.splitlines() if line.startswith("torch.nn.MultiheadAttention (ne")]
    assert any("multi_head float32" in r and "FAIL: 1d, 2d, mask, all: NaN in the output" in r for r in rows)
    assert "Where frameworks disagree" in result.stdout
    assert "fully masked rows: NaN output and weights" in result.stdout
    assert "rows disagree with multiattn's reference" in result.stdout
    doc = json.loads(out.read_text())
    assert set(doc["backends"]) == {i.label for i in RAN if i.framework == "torch"}
    assert any(r["verdict"] == "FAIL" for r in doc["rows"])
    text = page.read_text()
    assert text.startswith("# Where frameworks' own attention disagrees") and DATE_LINE in text
    assert "| `torch.nn.MultiheadAttention (need_weights=True)` | 1d, 2d, mask, all |" in text
    # report reads the file back as the same native tables, never comparing the natives
    reported = run_cli("report", str(out))
    assert reported.returncode == 0, reported.stdout + reported.stderr
    assert reported.stdout.strip() in result.stdout  # check also names what it could not import
    assert doc["not_importable"] == wrappers.absent("torch")  # d2l, where it is not installed
    for label in doc["not_importable"]:  # and report names them too, from the file
        assert f"({label}: not run, not importable here: " in reported.stdout
    doc["native"] = False  # as a `check --json` file: the kinds do not mix
    mixed = tmp_path / "check.json"
    mixed.write_text(json.dumps(doc))
    refused = run_cli("report", str(out), str(mixed))
    assert refused.returncode == 2 and "report merges files of one kind" in refused.stderr


def test_report_names_an_implementation_no_file_could_import(tmp_path):
    # one environment without d2l, another with it: d2l ran, so it is not listed as absent
    from multiattn.check import load_json

    def write(name, backends, not_importable):
        path = tmp_path / f"{name}.json"
        doc = {"seed": 0, "native": True, "backends": backends, "rows": [], "not_importable": not_importable}
        path.write_text(json.dumps(doc))
        return str(path)

    ran = {"version": "1", "status": "ok", "cases": {}, "backend": "torch"}
    without = write(
        "a", {"torch.sdpa": ran}, {"d2l.torch.X": "ModuleNotFoundError: d2l", "d2l.torch.Y": "no"}
    )
    with_d2l = write("b", {"d2l.torch.X": {**ran, "version": "d2l"}}, {})
    results, _, of_natives = load_json([without, with_d2l])
    assert of_natives
    assert results_io.split_absent(results) == (
        {
            "torch.sdpa": {**ran, "backend": "torch.sdpa"},
            "d2l.torch.X": {**ran, "version": "d2l", "backend": "d2l.torch.X"},
        },
        {"d2l.torch.Y": "no"},
    )
    assert results_io.split_absent(load_json([without])[0])[1] == {
        "d2l.torch.X": "ModuleNotFoundError: d2l",
        "d2l.torch.Y": "no",
    }


@pytest.mark.parametrize(
    "args, message",
    [(["--native", "--backends", "numpy"], "none of numpy has attention of its own"),
     (["--native", "--against", "x:y"], "--against does not go with it"),
     (["--markdown", "page.md"], "--markdown PATH goes with --native")],
)  # fmt: skip
@pytest.mark.backend("numpy")
def test_usage_errors(args, message):
    assert message in one_line(run_cli("check", *args))


def test_a_dead_worker_is_its_frameworks_failed_row(monkeypatch):
    import multiattn.check

    monkeypatch.setattr(multiattn.check, "WORKER_COMMAND", [sys.executable, "-c", "import sys; sys.exit(3)"])
    results = multiattn.check.run_native(["numpy", "torch"])  # numpy has no attention of its own
    assert list(results) == ["torch"] and results["torch"]["status"] == "failed: worker exit 3: no output"
    assert "failed: worker exit 3" in render(results)
    assert dict(native.summarize(results))["torch"]["1d"] == "failed: worker exit 3: no output"


def test_the_page_comparison_ignores_the_date_and_the_last_bits():
    page = markdown({}, {"torch": "1"}, today="2000-01-01")
    assert compare_pages(page, markdown({}, {"torch": "2"}, today="2001-02-03")) == []
    old = "| `a` | 1d | output 0.68 from the reference > 1e-05 |"
    assert compare_pages(old, old.replace("0.68", "0.71")) == []  # the same size
    keras = "| `k` | none: gradient of W_o 3.3e-08 from the reference > 2.4e-09 |"  # float32 accuracy
    assert compare_pages(keras, keras.replace("3.3e-08", "3.1e-08")) == []  # either side of 10**-7.5
    assert compare_pages(keras, keras.replace("3.3e-08", "4.0e-09")) == []
    grown = keras.replace("3.3e-08", "4.0e-07")
    assert compare_pages(keras, grown) == [f"- {keras}", f"+ {grown}"]
    exact = "| `m` | dot_product float64 | 0.0e+00 | 2.2e-16 |"  # float64 round-off is CPU-specific
    assert compare_pages(exact, "| `m` | dot_product float64 | 1.1e-16 | 0.0e+00 |") == []
    wrong = "| `m` | dot_product float64 | 0.0e+00 | 2.2e-06 |"
    assert compare_pages(exact, wrong) == [f"- {exact}", f"+ {wrong}"]
    assert compare_pages(old, old.replace("1d", "2d")) == [f"- {old}", f"+ {old.replace('1d', '2d')}"]
    assert compare_pages(old, "| `b` | x |", labels=["a"]) == [f"- {old}"]


def test_the_page_comparison_command_of_tox(tmp_path):
    """tox's `native` env runs `python -m multiattn.check.native_report --compare COMMITTED FRESH`:
    exit 0 where the tables agree, 1 with the lines where they do not, 2 for a wrong call."""
    import subprocess

    committed, fresh = tmp_path / "committed.md", tmp_path / "fresh.md"
    committed.write_text(markdown({}, {"torch": "1"}, today="2000-01-01") + "| `a` | 1d | agree |\n")
    fresh.write_text(markdown({}, {"torch": "2"}, today="2001-02-03") + "| `a` | 1d | agree |\n")
    command = [sys.executable, "-m", "multiattn.check.native_report", "--compare"]
    same = subprocess.run([*command, str(committed), str(fresh)], capture_output=True, text=True)
    assert same.returncode == 0 and "its tables are current" in same.stdout, same.stderr
    fresh.write_text(fresh.read_text().replace("| agree |", "| fully masked rows: NaN output |"))
    stale = subprocess.run([*command, str(committed), str(fresh)], capture_output=True, text=True)
    assert stale.returncode == 1 and "is stale" in stale.stderr
    assert "- | `a` | 1d | agree |" in stale.stderr and PAGE_COMMAND in stale.stderr
    wrong = subprocess.run(command[:-1], capture_output=True, text=True)
    assert wrong.returncode == 2 and "usage: python -m multiattn.check.native_report" in wrong.stderr


@pytest.mark.shared
def test_the_committed_page_is_current():
    """What `tox` checks (the `native` commands), for the frameworks under test (run in this
    process): the committed page's tables are a fresh run's; and it has every implementation's rows."""
    with open(PAGE) as f:
        committed = f.read()
    assert committed.startswith("# Where frameworks' own attention disagrees")
    assert sum(line.startswith(DATE_LINE) for line in committed.splitlines()) == 1
    for impl in RAN:
        assert f"| `{impl.label}` | {impl.kind} float32 |" in committed, f"regenerate: {PAGE_COMMAND}"
    fresh = {}
    for fw in (fw for fw in backends_under_test() if fw in wrappers.FRAMEWORKS):
        fresh.update(results_io.split_absent(results_of(fw))[0])
    page = markdown(fresh, versions_of(fresh))
    diff = compare_pages(committed, page, labels=list(fresh))
    assert not diff, f"{PAGE} is stale; regenerate it with `{PAGE_COMMAND}`:\n" + "\n".join(diff)
