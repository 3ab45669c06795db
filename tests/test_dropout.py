"""``training.fast_dropout_masks``: dropout masks drawn 16 bits at a time (``finetune.cpu.dropout``)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import finetune.cpu.dropout as fd
from finetune.cpu import cpu_speedups, plan_cpu_speedups
from helpers import ARCHITECTURES, tiny_bert, tiny_model
from tiny_run import fit_tiny_run


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


# the attention switch renames the implementation in transformers 5's registry; older releases keep the
# dropout modules' switch only (test_before_transformers_5_only_the_dropout_modules_switch)
needs_the_attention_registry = pytest.mark.skipif(_transformers_major() < 5, reason="transformers 5's attention registry")


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_masks_keep_each_element_with_the_rounded_probability(p):
    torch.manual_seed(0)
    n = 1_000_003  # not a multiple of 4: the last 64-bit draw is cut
    mask, scale = fd.keep_mask((n,), p)
    keep = 1 - round(p * 65536) / 65536
    assert scale == pytest.approx(1 / keep, rel=1e-15)
    sd = (keep * (1 - keep) / n) ** 0.5
    assert abs(mask.float().mean().item() - keep) < 5 * sd
    # every 16-bit quarter of the 64-bit draws is uniform, the sign-carrying top one included
    # (random_() without from=int64 min draws 63 bits: that quarter would be kept too often)
    quarters = mask[: n - n % 4].view(-1, 4).float().mean(0)
    assert (quarters - keep).abs().max().item() < 5 * sd * 2
    # neighbours are independent: P(both kept) = keep^2
    both = (mask[:-1] & mask[1:]).float().mean().item()
    assert abs(both - keep * keep) < 5 * sd


def test_masks_come_from_torchs_generator():
    torch.manual_seed(3)
    state = torch.get_rng_state()
    a, _ = fd.keep_mask((7, 9), 0.3)
    b, _ = fd.keep_mask((7, 9), 0.3)
    torch.set_rng_state(state)  # what a checkpoint restores
    again, _ = fd.keep_mask((7, 9), 0.3)
    assert torch.equal(a, again)
    assert not torch.equal(a, b)
    g = torch.Generator().manual_seed(3)
    assert torch.equal(fd.keep_mask((7, 9), 0.3, generator=g)[0], a)  # the same as the global one seeded alike


def test_edge_probabilities():
    mask, scale = fd.keep_mask((1000,), 0.0)
    assert mask.all() and scale == 1.0
    with pytest.raises(ValueError, match="in \\[0, 1\\)"):
        fd.keep_mask((10,), 1.0)
    x = torch.randn(5, 4)
    assert fd.drop(x, 0.0) is x
    assert fd.drop(x, 0.5, training=False) is x


def test_drop_scales_kept_elements_and_routes_the_gradient_through_the_mask():
    x = torch.randn(64, 33, requires_grad=True)
    torch.manual_seed(1)
    y = fd.drop(x, 0.25)
    torch.manual_seed(1)
    mask, scale = fd.keep_mask(x.shape, 0.25)
    assert torch.equal(y, x.detach() * mask * scale)
    grad = torch.randn_like(x)
    y.backward(grad)
    assert torch.equal(x.grad, grad * mask * scale)


def test_the_expected_output_is_the_input():
    torch.manual_seed(2)
    x = torch.full((2_000_000,), 3.0)
    mean = fd.drop(x, 0.1).mean().item()
    sd = 3.0 * (0.1 / 0.9 / x.numel()) ** 0.5
    assert abs(mean - 3.0) < 5 * sd


def _reference_attention(q, k, v, mask, scaling, p, seed):
    """The same formula through autograd, with the mask drawn from the same seed."""
    torch.manual_seed(seed)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1)
    keep, scale = fd.keep_mask(probs.shape, p)
    return torch.matmul(probs * keep * scale, v)


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
def test_attention_gradient_is_the_formulas(mask_kind):
    torch.manual_seed(0)
    b, h, L, d = 3, 2, 7, 4
    # BERT hands attention non-contiguous head views of its (b, L, h*d) projections
    q, k, v = (torch.randn(b, L, h, d).transpose(1, 2).requires_grad_() for _ in range(3))
    mask = None
    if mask_kind != "none":
        keep = torch.ones(b, 1, L, L, dtype=torch.bool)
        keep[0, :, :, 4:] = False  # padding in the first sequence
        mask = keep if mask_kind == "bool" else torch.zeros(b, 1, L, L).masked_fill(~keep, -1e9)
    grad = torch.randn(b, h, L, d)
    torch.manual_seed(5)
    out = fd._Attention.apply(q, k, v, mask, d**-0.5, 0.3)
    mine = torch.autograd.grad(out, (q, k, v), grad)
    ref = _reference_attention(q, k, v, mask, d**-0.5, 0.3, seed=5)
    theirs = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for a, r in zip(mine, theirs):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)

    # and the hand-written backward against finite differences, the mask held fixed by reseeding
    def seeded(q, k, v):
        torch.manual_seed(5)
        return fd._Attention.apply(q, k, v, None if mask is None else mask if mask.dtype == torch.bool
                                   else mask.double(), d**-0.5, 0.3)

    assert torch.autograd.gradcheck(seeded, tuple(t.detach().double().requires_grad_() for t in (q, k, v)))


def test_attention_without_dropout_or_plain_inputs_is_transformers_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4) for _ in range(3))
    module = SimpleNamespace(is_causal=False, training=False)
    out, _ = fd.attention_forward(module, q, k, v, None, dropout=0.0, scaling=0.5)
    assert torch.equal(out, sdpa_attention_forward(module, q, k, v, None, dropout=0.0, scaling=0.5)[0])
    causal = SimpleNamespace(is_causal=True, training=True)
    torch.manual_seed(1)
    out, _ = fd.attention_forward(causal, q, k, v, None, dropout=0.2, scaling=0.5)
    torch.manual_seed(1)
    expected = sdpa_attention_forward(causal, q, k, v, None, dropout=0.2, scaling=0.5)[0]
    assert torch.equal(out, expected)


@pytest.fixture
def mask_calls(monkeypatch):
    """Every keep_mask call's ``(shape, p)``, the masks still drawn."""
    calls = []
    original = fd.keep_mask

    def recording(shape, p, **kw):
        calls.append((tuple(shape), p))
        return original(shape, p, **kw)

    monkeypatch.setattr(fd, "keep_mask", recording)
    return calls


@needs_the_attention_registry
def test_the_switch_routes_every_dropout_and_hands_the_model_back(tmp_path, mask_calls):
    model = tiny_bert(dropout=0.1)
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(5, 30, (3, 6))
    attention = torch.ones(3, 6, dtype=torch.long)
    attention[0, 4:] = 0
    model.train()
    with fd.fast_dropout(model) as switched:
        model(input_ids=ids, attention_mask=attention).logits.sum().backward()
        assert model.config._attn_implementation == fd.ATTENTION_NAME
    # embeddings, per layer: attention probabilities, attention output, feed-forward output; the classifier
    shapes = [shape for shape, _ in mask_calls]
    assert shapes.count((3, 2, 6, 6)) == 2
    assert shapes.count((3, 6, 32)) == 1 + 2 * 2
    assert shapes.count((3, 32)) == 1
    assert len(shapes) == 8
    assert switched == sum(1 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert all(type(m) is torch.nn.Dropout for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert model.config._attn_implementation == "sdpa"
    model.save_pretrained(tmp_path)
    assert fd.ATTENTION_NAME not in (tmp_path / "config.json").read_text()
    json.loads((tmp_path / "config.json").read_text())

    mask_calls.clear()
    with pytest.raises(RuntimeError, match="boom"):
        with fd.fast_dropout(model):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    assert all(type(m) is torch.nn.Dropout for m in model.modules() if isinstance(m, torch.nn.Dropout))
    model(input_ids=ids, attention_mask=attention)
    assert mask_calls == []  # outside the switch, torch's dropout again


def test_evaluation_inside_the_switch_is_unchanged():
    model = tiny_bert(dropout=0.3)
    ids = torch.randint(5, 30, (4, 7))
    attention = torch.ones(4, 7, dtype=torch.long)
    attention[1, 3:] = 0
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=attention).logits
        with fd.fast_dropout(model):
            inside = model(input_ids=ids, attention_mask=attention).logits
    assert torch.equal(inside, expected)


@pytest.mark.parametrize(
    "device, compiled, expected",
    [("cpu", None, True), ("cuda", None, False), ("cpu", "wrapped", False), ("cpu", "in place", False),
     ("cpu", "in place inside DDP", False), ("cpu", "a block in place", False),
     ("cpu", "a block in place inside DDP", False)],
)
def test_it_applies_on_the_cpu_to_an_uncompiled_model(device, compiled, expected):
    model = tiny_bert()
    if compiled == "wrapped":
        model = SimpleNamespace(_orig_mod=model)  # what torch.compile(model) returns carries
    elif compiled is not None and compiled.startswith("a block"):
        model.bert.encoder.layer[1]._compiled_call_impl = lambda *a, **kw: None  # training.torch_compile: blocks
        if compiled.endswith("DDP"):
            model = SimpleNamespace(module=model)
    elif compiled is not None:
        model._compiled_call_impl = lambda *a, **kw: None  # what model.compile() (training.torch_compile) sets
        if compiled.endswith("DDP"):
            model = SimpleNamespace(module=model)
    accelerator = SimpleNamespace(device=torch.device(device), num_processes=1, scaler=None)
    assert plan_cpu_speedups(model, accelerator).dropout_masks is expected


@pytest.mark.parametrize("fast", [True, False])
def test_the_key_chooses_the_masks_in_a_run(tmp_path, mask_calls, fast):
    seen = {}

    def watch(run):
        from finetune.start_line import describe

        seen["config"] = run.model.config
        seen["line"] = describe(run)

    fit_tiny_run(tmp_path, before_fit=watch, model={"dropout": 0.1}, training={"fast_dropout_masks": fast})
    assert bool(mask_calls) is fast
    assert {p for _, p in mask_calls} <= {0.1}
    assert seen["config"]._attn_implementation == "sdpa"  # handed back after training
    assert ("dropout_masks=fast" in seen["line"]) is fast  # the start-up line says which
    assert "embedding_grad=sparse" in seen["line"]


def test_bf16_autocast_on_the_cpu_trains_through_the_switch():
    # fp32 inputs under autocast: the forward's products run in bf16 while q, k and v are saved in fp32, so the
    # hand-written backward has to run under the same autocast state to multiply them
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4, requires_grad=True) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fd._Attention.apply(q, k, v, None, 0.5, 0.2)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert all(t.grad.dtype == torch.float32 and torch.isfinite(t.grad).all() for t in (q, k, v))

    model = tiny_bert(dropout=0.2)
    model.train()
    ids = torch.randint(5, 30, (3, 6))
    attention = torch.ones(3, 6, dtype=torch.long)
    attention[2, 3:] = 0
    with fd.fast_dropout(model), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, attention_mask=attention).logits.float().square().mean()
    loss.backward()
    query = model.bert.encoder.layer[0].attention.self.query.weight
    assert query.grad is not None and query.grad.dtype == torch.float32
    assert torch.isfinite(query.grad).all() and query.grad.abs().sum() > 0


def _switched_on_a_cpu(model):
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1, scaler=None,
                                  gradient_accumulation_steps=1)
    return cpu_speedups(model, torch.optim.SGD(model.parameters(), lr=0.1), accelerator)


def test_before_transformers_5_only_the_dropout_modules_switch(monkeypatch):
    # older releases pick attention classes at construction: renaming the implementation would not reach them
    import transformers

    monkeypatch.setattr(transformers, "__version__", "4.57.1")
    model = tiny_bert(dropout=0.1)
    with _switched_on_a_cpu(model) as plan:
        assert plan.dropout_masks and not plan.attention
        assert model.config._attn_implementation == "sdpa"
        assert any(type(m) is fd.FastDropout for m in model.modules())
    assert model.config._attn_implementation == "sdpa"
    assert not any(type(m) is fd.FastDropout for m in model.modules())


@needs_the_attention_registry
def test_modeling_code_with_an_attention_table_of_its_own_keeps_its_attention(monkeypatch, caplog):
    """ModernBERT's modeling code in transformers 5.0 picks its attention from a dict of its own, where the
    switched name is a KeyError mid-run: a modeling module that does not import the registry is left alone."""
    import transformers.models.bert.modeling_bert as modeling_bert

    model = tiny_bert(dropout=0.1)
    assert fd.attention_switch_unavailable(model.config, model) is None
    monkeypatch.delattr(modeling_bert, "ALL_ATTENTION_FUNCTIONS")  # as a modeling module that never imported it
    assert fd.attention_switch_unavailable(model.config, model) == (
        "transformers.models.bert.modeling_bert picks its attention from a table of its own, not transformers' "
        "registry")
    with caplog.at_level("INFO", logger="finetune"), _switched_on_a_cpu(model) as plan:
        assert plan.dropout_masks and not plan.attention
        assert model.config._attn_implementation == "sdpa"
    assert "attention left as sdpa (transformers.models.bert.modeling_bert picks its attention" in caplog.text


@needs_the_attention_registry
def test_a_missing_private_api_leaves_the_attention_alone_with_one_line(monkeypatch, caplog):
    model = tiny_bert(dropout=0.1)
    monkeypatch.delattr(torch, "_softmax_backward_data")
    with caplog.at_level("INFO", logger="finetune"), _switched_on_a_cpu(model) as plan:
        assert plan.dropout_masks and not plan.attention
        assert model.config._attn_implementation == "sdpa"
        assert any(type(m) is fd.FastDropout for m in model.modules())
        model.train()
        ids = torch.randint(5, 30, (2, 6))
        model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.sum().backward()  # trains, no failure
    lines = [r.getMessage() for r in caplog.records if "attention left as sdpa" in r.getMessage()]
    assert len(lines) == 1 and "_softmax_backward_data" in lines[0]


@needs_the_attention_registry
def test_each_private_api_is_checked():
    model = tiny_bert(dropout=0.1)
    assert fd.attention_switch_unavailable(model.config) is None
    assert "_attn_implementation_internal" in fd.attention_switch_unavailable(SimpleNamespace())


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_model_dropout_reaches_every_dropout_of_each_family(tmp_path, model_type):
    # model.dropout sets the family's own names (DistilBERT's `dropout`, ModernBERT's `mlp_dropout`, ...):
    # at 0 a training-mode forward is the evaluation forward; at 0.5 it is not
    from finetune.config import ModelConfig
    from finetune.modeling import load_model

    tiny_model(model_type, num_labels=2, dropout=0.1).save_pretrained(tmp_path)
    ids = torch.tensor([[2, 7, 9, 11, 12, 13, 3]])

    def train_and_eval_logits(p):
        model = load_model(ModelConfig(name_or_path=str(tmp_path), dropout=p), {0: "a", 1: "b"})
        torch.manual_seed(0)
        trained = model.train()(input_ids=ids).logits
        return trained, model.eval()(input_ids=ids).logits

    kept_off, eval_off = train_and_eval_logits(0.0)
    assert torch.equal(kept_off, eval_off)
    dropped, evaluated = train_and_eval_logits(0.5)
    assert not torch.allclose(dropped, evaluated)
    # and the saved 0.1 was not already off: without the override, training mode drops out
    model = load_model(ModelConfig(name_or_path=str(tmp_path)), {0: "a", 1: "b"})
    assert not torch.allclose(model.train()(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_the_switched_attention_computes_each_familys_own(model_type, monkeypatch):
    # A dropout of 1e-7 rounds to no drop at all, so inside the switch a training forward must be the
    # family's evaluation forward, padding masks included; ModernBERT's and UltraBERT's local layers (a sliding window)
    # and the attention DeBERTa, MPNet (a position bias) and RoFormer (rotary) compute themselves stay with
    # transformers, the others' plain layers take the switched path.
    written_out = []
    original = fd._Attention.apply
    monkeypatch.setattr(fd._Attention, "apply", lambda *args: written_out.append(1) or original(*args))
    model = tiny_model(model_type, num_labels=2, dropout=1e-7)
    ids = torch.tensor([[2, 7, 9, 11, 12, 13, 3, 0, 0], [2, 8, 8, 9, 10, 11, 12, 13, 3]])
    mask = (torch.arange(9) < torch.tensor([[7], [9]])).long()
    expected = model.eval()(input_ids=ids, attention_mask=mask).logits
    switchable = fd.attention_switch_unavailable(model.config, model) is None
    with fd.fast_dropout(model.train(), attention=switchable):
        switched = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(switched, expected, rtol=1e-6, atol=1e-7)
    plain_layers = {"deberta-v2": 0, "modernbert": 1, "ultrabert": 1, "mpnet": 0, "roformer": 0}.get(model_type, 2)
    # before transformers 5 there is no attention registry to switch, and ModernBERT's code in 5.0 keeps a table
    # of its own: there only the dropout modules are switched
    assert len(written_out) == (plain_layers if switchable else 0)
