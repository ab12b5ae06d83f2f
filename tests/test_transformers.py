"""multiattn inside Hugging Face transformers (``multiattn.integrations.transformers``): tiny,
randomly initialised Llama, Qwen2, Mistral (sliding window) and Gemma 2 (soft-capping and
sliding windows) in float64 give the logits of transformers' own attention to 1e-9 and the
same greedy tokens, padded (left) and not, through ``generate()``'s decoding steps and caches.

Two references: transformers' ``sdpa`` (torch's kernel; multiattn's default path may call the
same kernel) where it applies, and a float64 eager attention written here (the formula, plain
torch ops), against which multiattn runs its own steps (``primitives_only``, torch's SDPA made
to raise).  transformers is installed by the torch env (the ``transformers`` extra).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.backend("torch")

NAME = "multiattn"
REFERENCE = "multiattn_test_reference64"
TOL = 1e-9
NEW_TOKENS = 4
SEQ = 9  # longer than the sliding windows (4), so the windows hide keys
WINDOW = 4


@pytest.fixture(scope="module")
def hf():
    """transformers, with multiattn and the float64 reference registered."""
    try:
        import torch
        import transformers
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as err:  # the torch env installs it (MULTIATTN_TEST_TRANSFORMERS): a failure there
        message = f'transformers is not installed: pip install ".[transformers]" ({err})'
        if os.environ.get("MULTIATTN_TEST_TRANSFORMERS"):
            pytest.fail(message)
        pytest.skip(message + "; tox's torch env tests it")

    import multiattn.integrations.transformers as mt

    assert mt.register(NAME) == NAME

    def reference_attention(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
        # the formula in float64 with plain ops; a row that sees nothing gives 0 (multiattn's rule)
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        scores = query @ key.transpose(-1, -2) * scaling
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~attention_mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        return (weights @ value).transpose(1, 2).contiguous(), None

    def reference_mask(**kwargs):
        kwargs["allow_is_causal_skip"] = False  # always a boolean mask: the reference needs no alignment rule
        return sdpa_mask(**kwargs)

    AttentionInterface.register(REFERENCE, reference_attention)
    AttentionMaskInterface.register(REFERENCE, reference_mask)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matrices of a few hundred elements: a thread pool only waits on busy cores
    yield transformers
    torch.set_num_threads(threads)


def config(hf, model: str, **overrides):
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped heads
        max_position_embeddings=64,
        initializer_range=0.2,  # scores of a few units: the soft-cap and the masks change the logits
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,  # greedy decoding runs all NEW_TOKENS steps
    )
    if model == "llama":
        cfg = hf.LlamaConfig(**common)
    elif model == "qwen2":
        cfg = hf.Qwen2Config(**common)
    elif model == "mistral":
        cfg = hf.MistralConfig(**common, sliding_window=WINDOW)
    elif model == "gemma2":  # layers alternate sliding window and full attention
        cfg = hf.Gemma2Config(
            **common,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=None,
        )
    else:
        raise ValueError(f"model: expected llama, qwen2, mistral or gemma2, got {model!r}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def make_model(hf, cfg, dtype_name="float64", implementation=NAME):
    import torch

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    return hf.AutoModelForCausalLM.from_config(cfg, attn_implementation=implementation, dtype=dtype).eval()


def batch(padded: bool):
    """(input_ids, attention_mask or None): two sequences of SEQ tokens, the second left-padded
    by 3 when padded."""
    import torch

    ids = torch.randint(3, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))
    if not padded:
        return ids, None
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return ids, mask


def run(model, ids, mask, cache=None):
    """(forward logits, generated tokens, the logits of each generated token)."""
    import torch

    kwargs = {} if mask is None else {"attention_mask": mask}
    with torch.no_grad():
        logits = model(ids, **kwargs).logits
    out = model.generate(
        ids,
        **kwargs,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        cache_implementation=cache,
        disable_compile=True,
    )
    return logits, out.sequences, torch.stack(out.logits, dim=1)


def assert_same(got, want, mask, tol, what):
    """Forward logits at the tokens that are not padding (a padding query sees nothing: multiattn
    gives 0 where others give a mean or NaN), generated tokens, and every decoding step's logits."""
    import torch

    logits, tokens, step_logits = got
    ref_logits, ref_tokens, ref_step_logits = want
    keep = torch.ones(logits.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
    err = (logits - ref_logits)[keep].abs().max().item()
    assert err <= tol, f"{what}: forward logits differ by {err:.3g} > {tol}"
    assert torch.equal(tokens, ref_tokens), f"{what}: greedy tokens\n{tokens}\nwant\n{ref_tokens}"
    err = (step_logits - ref_step_logits).abs().max().item()
    assert err <= tol, f"{what}: decoding steps' logits differ by {err:.3g} > {tol}"


@pytest.fixture
def counted(monkeypatch):
    """The number of calls of multiattn.dot_product_attention (the integration calls it by name)."""
    import multiattn

    calls = []
    real = multiattn.dot_product_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(multiattn, "dot_product_attention", spy)
    return calls


@pytest.fixture
def no_torch_sdpa(monkeypatch):
    """torch's fused attention raises: what runs is multiattn's own steps."""
    import torch.nn.functional as F

    import multiattn

    def refuse(*args, **kwargs):
        raise AssertionError("torch's scaled_dot_product_attention ran under primitives_only")

    monkeypatch.setattr(F, "scaled_dot_product_attention", refuse)
    with multiattn.primitives_only():
        yield


MODELS = ["llama", "qwen2", "mistral", "gemma2"]


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("model", MODELS)
def test_against_sdpa(hf, model, padded, counted):
    """multiattn's default path (any path it picks) against transformers' sdpa; Gemma 2's soft-cap
    is refused by sdpa, so it is compared with the float64 reference instead."""
    cfg = config(hf, model)
    ours = make_model(hf, cfg)
    theirs = copy.deepcopy(ours)
    theirs.set_attn_implementation("sdpa" if model != "gemma2" else REFERENCE)
    ids, mask = batch(padded)
    want = run(theirs, ids, mask)
    assert not counted, "the reference ran through multiattn"
    got = run(ours, ids, mask)
    assert_same(got, want, mask, TOL, f"{model} ({'padded' if padded else 'unpadded'})")
    # each layer once for the forward, once for the prefill and once per later decoding step
    layers = cfg.num_hidden_layers
    assert len(counted) == layers * (2 + NEW_TOKENS - 1), f"{len(counted)} calls of dot_product_attention"
    assert [s[2] for s in counted[-layers:]] == [1] * layers, "the decoding steps' queries are not one token"


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("cache", [None, "static"], ids=["dynamic_cache", "static_cache"])
@pytest.mark.parametrize("model", MODELS)
def test_own_steps_against_float64_reference(hf, model, cache, padded, no_torch_sdpa):
    """multiattn's own steps (torch's SDPA refused) against the float64 formula, with HF's dynamic
    and static caches (a static cache's prefill: keys past the queries, no mask, causal top-left)."""
    cfg = config(hf, model)
    ours = make_model(hf, cfg)
    theirs = copy.deepcopy(ours)
    theirs.set_attn_implementation(REFERENCE)
    ids, mask = batch(padded)
    got = run(ours, ids, mask, cache)
    want = run(theirs, ids, mask, cache)
    what = f"{model} ({cache or 'dynamic'} cache, {'padded' if padded else 'unpadded'})"
    assert_same(got, want, mask, TOL, what)


def test_the_features_change_the_logits(hf):
    """The comparisons above can fail: at these sizes the soft-cap, the sliding window and the
    padding each change the logits far beyond the tolerance."""
    import torch

    ids, _ = batch(False)

    def logits(model_name, **overrides):
        with torch.no_grad():
            return make_model(hf, config(hf, model_name, **overrides))(ids).logits

    assert (logits("gemma2") - logits("gemma2", attn_logit_softcapping=None)).abs().max() > 1e-3
    assert (logits("mistral") - logits("mistral", sliding_window=None)).abs().max() > 1e-3
    model = make_model(hf, config(hf, "llama"))
    padded = torch.ones_like(ids)
    padded[1, :3] = 0
    with torch.no_grad():
        change = (model(ids).logits - model(ids, attention_mask=padded).logits)[1, 3:].abs().max()
    assert change > 1e-3


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_gemma2_against_eager_in_float32(hf, padded):
    """Gemma 2 against transformers' own eager attention (soft-capping and windows by its code),
    in float32 where its float32 softmax is exact enough (in float64 its masks overflow to NaN)."""
    cfg = config(hf, "gemma2")
    ours = make_model(hf, cfg, "float32")
    theirs = copy.deepcopy(ours)
    theirs.set_attn_implementation("eager")
    ids, mask = batch(padded)
    assert_same(run(ours, ids, mask), run(theirs, ids, mask), mask, 1e-5, "gemma2 float32 vs eager")


def test_output_attentions_against_eager(hf):
    """output_attentions=True returns multiattn's weights (B, H, Q, K), as eager's, in float32
    (eager's softmax is float32); the rows of padding queries aside (multiattn's are 0)."""
    import torch

    ours = make_model(hf, config(hf, "mistral"), "float32")
    theirs = copy.deepcopy(ours)
    theirs.set_attn_implementation("eager")
    ids, mask = batch(True)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask, output_attentions=True).attentions
        want = theirs(ids, attention_mask=mask, output_attentions=True).attentions
    assert len(got) == len(want) == 2 and got[0].shape == (2, 4, SEQ, SEQ)
    queries = mask.bool()[:, None, :, None].expand_as(got[0])
    for layer, (a, b) in enumerate(zip(got, want)):
        err = (a - b)[queries].abs().max().item()
        assert err <= 1e-5, f"layer {layer}: weights differ by {err:.3g}"
    assert not got[0][1, :, :3].any(), "a padding query's weights are not 0"


def test_training_gradients_against_sdpa(hf):
    """In train mode (attention dropout 0, the configs' default) a padded batch's loss and its
    gradients match sdpa's in float64."""
    ours = make_model(hf, config(hf, "qwen2")).train()
    theirs = copy.deepcopy(ours)
    theirs.set_attn_implementation("sdpa")
    ids, mask = batch(True)
    labels = ids.masked_fill(mask == 0, -100)
    losses = []
    for model in (ours, theirs):
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= TOL
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        err = (a.grad - b.grad).abs().max().item()
        assert err <= TOL, f"{name}: gradients differ by {err:.3g}"


def test_set_attn_implementation(hf, counted):
    """A model made with sdpa switches to multiattn and back; its logits do not change."""
    import torch

    model = make_model(hf, config(hf, "mistral"), implementation="sdpa")
    ids, mask = batch(True)
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
        model.set_attn_implementation(NAME)
        assert model.config._attn_implementation == NAME
        during = model(ids, attention_mask=mask).logits
        assert len(counted) == model.config.num_hidden_layers
        model.set_attn_implementation("sdpa")
        model(ids, attention_mask=mask)
    assert len(counted) == model.config.num_hidden_layers
    keep = mask.bool()
    assert (during - before)[keep].abs().max().item() <= TOL


def test_register_refuses_transformers_own_names(hf):
    import multiattn.integrations.transformers as mt

    with pytest.raises(ValueError, match="must not replace transformers' own 'sdpa'"):
        mt.register("sdpa")
    with pytest.raises(TypeError, match="name must be a non-empty str, got ''"):
        mt.register("")


def test_attention_forward_errors_and_masks(hf):
    """The contract's edges, called directly: dropout and unsupported keywords refused with their
    names; an additive float mask of 0 / min works as the boolean one; a bias is refused."""
    import torch
    from transformers.masking_utils import eager_mask, sdpa_mask

    import multiattn.integrations.transformers as mt

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 5, 8, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(2, 2, 5, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    module = torch.nn.Module()
    padding = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.bool)
    sizes = dict(batch_size=2, q_length=5, kv_length=5, attention_mask=padding)
    boolean = sdpa_mask(**sizes)
    additive = eager_mask(**sizes, dtype=torch.float64)
    out, weights = mt.attention_forward(module, q, k, v, boolean, scaling=0.3)
    assert out.shape == (2, 5, 4, 8) and weights is None
    same, _ = mt.attention_forward(module, q, k, v, additive, scaling=0.3)
    assert torch.equal(out, same)
    with pytest.raises(ValueError, match="attention_mask: expected an additive mask of 0"):
        mt.attention_forward(module, q, k, v, additive + 0.5, scaling=0.3)
    with pytest.raises(NotImplementedError, match="dropout must be 0.*got 0.1"):
        mt.attention_forward(module, q, k, v, boolean, scaling=0.3, dropout=0.1)
    with pytest.raises(NotImplementedError, match="s_aux="):
        mt.attention_forward(module, q, k, v, boolean, scaling=0.3, s_aux=torch.zeros(4))


def test_missing_transformers_names_the_extra(monkeypatch):
    import multiattn.integrations.transformers as mt

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(ImportError, match=r'pip install "\.\[transformers\]"'):
        mt.register()


def test_importing_the_integration_imports_no_framework():
    code = (
        "import sys, multiattn, multiattn.integrations.transformers\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
