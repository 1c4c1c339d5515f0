"""The peer stacks on the four family architectures (gemma-2-2b, gemma-3-4b, phi-4-mini, olmo-2-7b, cut to toy
size: tests/patch/tiny_models.TINY_ARCH): the attention the liger-peer stack gives each model computes the stock
model's function on packed rows with documents longer than the sliding windows, and Liger 0.8.5 has a function
for each family that takes the keywords the peer passes.

torch's varlen_attn runs on CUDA only and Liger's Triton kernels do not run under the Triton interpreter, so on
the CPU the peer's varlen wiring (cu_seqlens from position_ids, HF's window to FlashAttention's window_size, GQA,
layouts) runs against `reference_varlen_attn`, varlen_attn's documented function in fp64; the GPU test checks the
real varlen_attn against the same reference. Tolerance: fp32 model against fp32 stock per document, 1e-5 relative
(summation order only); GPU bf16 against the fp32 reference: 1e-2 output, 2e-2 gradients (FlashAttention keeps P
and dS in bf16: tests/attention/test_backends.py).
"""
import functools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "patch"))
from tiny_models import TINY_ARCH, packed_batch, packed_loss_and_grads, stock_per_document, tiny_arch  # noqa: E402

from novatune.bench import peer, stacks  # noqa: E402
from novatune.measure.numerics import assert_close  # noqa: E402

ROWS = [[5, 17, 1, 9], [32]]  # documents longer than the toy window (5), one of length 1, a one-document row
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def reference_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                          enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn's function (torch 2.12+ signature) in fp64: (tokens, heads, d) inputs,
    documents by cu_seqlens, query i sees keys [i - left, i + right] of its document (-1: unbounded), GQA by
    head groups."""
    assert torch.equal(cu_q, cu_k) and (enable_gqa or q.shape[1] == k.shape[1])
    left, right = window_size
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = []
    for a, b in zip(cu_q.tolist(), cu_q.tolist()[1:]):
        qd, kd, vd = (t[a:b].double() for t in (q, k, v))
        group = q.shape[1] // k.shape[1]
        kd, vd = kd.repeat_interleave(group, dim=1), vd.repeat_interleave(group, dim=1)
        i = torch.arange(b - a, device=q.device)
        allowed = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device)
        if right >= 0:
            allowed &= i[None, :] <= i[:, None] + right
        if left >= 0:
            allowed &= i[None, :] >= i[:, None] - left
        s = torch.einsum("ihd,jhd->hij", qd, kd) * scale
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
        out.append(torch.einsum("hij,jhd->ihd", p, vd))
    return torch.cat(out).to(q.dtype)


def without_gqa(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """torch 2.11's signature: no enable_gqa (the caller repeats the key/value heads)."""
    return reference_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)


@pytest.mark.parametrize("varlen", [reference_varlen_attn, without_gqa], ids=["torch2.12", "torch2.11"])
@pytest.mark.parametrize("arch", sorted(TINY_ARCH))
def test_peer_attention_computes_the_stock_function(arch, varlen, monkeypatch):
    """varlen where it computes the family's attention (Gemma 3's local layers through window_size), HF's own
    attention where it cannot (Gemma 2's soft-capped logits), and the row's `applied` says which."""
    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", varlen)
    ids, pos, lab = packed_batch(ROWS)
    model = tiny_arch(arch).train()
    stock_attention = model.config._attn_implementation
    loss_ref, grads_ref = stock_per_document(model, ids, pos, lab)
    applied = peer.use_peer_attention(model)
    loss, grads = packed_loss_and_grads(model, ids, pos, lab)
    assert_close(loss, loss_ref, 1e-5, "loss")
    for name in grads_ref:
        assert_close(grads[name], grads_ref[name], 1e-5, name)
    if arch == "gemma-2-2b":
        assert stock_attention == "eager" and model.config._attn_implementation == "eager"
        assert applied.startswith("attention=eager (Hugging Face's own: gemma2 soft-caps its attention logits")
    else:
        assert applied == "attention=peer_varlen" and model.config._attn_implementation == "peer_varlen"


def test_the_layers_own_window_applies_without_the_keyword(monkeypatch):
    """A layer that keeps its window in `sliding_window` (Gemma 2/3) but whose call does not pass the keyword still
    attends inside the window; a keyword of None (a global layer) stays global."""
    import types

    import transformers

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", reference_varlen_attn)
    forward = transformers.AttentionInterface._global_mapping[peer.register_peer_varlen()]
    q, k, v = (torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    pos = torch.arange(8)[None]
    local = types.SimpleNamespace(sliding_window=3)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    flat = [t[0].transpose(0, 1) for t in (q, k, v)]
    want_local = reference_varlen_attn(*flat, cu, cu, 8, 8, window_size=(2, 0))
    want_global = reference_varlen_attn(*flat, cu, cu, 8, 8, window_size=(-1, 0))
    assert_close(forward(local, q, k, v, None, position_ids=pos)[0][0], want_local, 1e-6, "local")
    assert_close(forward(local, q, k, v, None, position_ids=pos, sliding_window=None)[0][0], want_global, 1e-6,
                 "global")


def test_varlen_without_a_window_refuses_a_window_that_binds(monkeypatch):
    """A torch whose varlen_attn takes no window_size: a document longer than the window is refused (the peer would
    compute another function); one inside the window runs plain causal attention, the same function."""
    def no_window(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, is_causal=False):
        return reference_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale,
                                     window_size=(-1, 0) if is_causal else (-1, -1))

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", no_window)
    import transformers

    forward = transformers.AttentionInterface._global_mapping[peer.register_peer_varlen()]
    q = torch.randn(1, 2, 6, 4)
    short, long = torch.tensor([[0, 1, 2, 0, 1, 2]]), torch.tensor([[0, 1, 2, 3, 4, 5]])
    out, _ = forward(None, q, q, q, None, position_ids=short, sliding_window=4)
    assert out.shape == (1, 6, 2, 4)
    with pytest.raises(peer.PeerUnavailable, match="no window_size"):
        forward(None, q, q, q, None, position_ids=long, sliding_window=4)


def test_attention_dropout_keeps_hf_attention(monkeypatch):
    """A config that drops attention probabilities in training keeps HF's attention (varlen_attn has no dropout),
    and the varlen function refuses a call that asks for dropout."""
    import transformers

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", reference_varlen_attn)
    model = tiny_arch("olmo-2-7b")
    model.config.attention_dropout = 0.1
    assert "no dropout" in peer.use_peer_attention(model) and model.config._attn_implementation == "sdpa"
    forward = transformers.AttentionInterface._global_mapping[peer.register_peer_varlen()]
    q = torch.randn(1, 2, 6, 4)
    with pytest.raises(peer.PeerUnavailable, match="no dropout"):
        forward(None, q, q, q, None, dropout=0.1, position_ids=torch.arange(6)[None])


@pytest.mark.parametrize("arch", sorted(TINY_ARCH))
def test_liger_rope_equals_the_familys_own(arch):
    """Liger's rope, which the peer swaps into each family's modeling module, on that family's own cos/sin tables
    (Phi-4-mini: 12 of 16 features rotate; LongRoPE's attention scaling) equals the family's apply_rotary_pos_emb:
    it runs under the Triton interpreter (Liger's RMSNorm does not). fp32, 1e-6: the same products in another
    order."""
    pytest.importorskip("liger_kernel.transformers")
    import importlib

    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    model = tiny_arch(arch)
    modeling = importlib.import_module(type(model).__module__)
    g = torch.Generator().manual_seed(0)
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q = torch.randn(1, cfg.num_attention_heads, 24, hd, generator=g)
    k = torch.randn(1, cfg.num_key_value_heads, 24, hd, generator=g)
    pos = torch.tensor([[*range(10), *range(14)]])
    per_type = isinstance(model.model.rotary_emb.rope_type, dict)  # Gemma 3: a table per layer type
    for layer_type in dict.fromkeys(cfg.layer_types if per_type else [None]):
        kw = {"layer_type": layer_type} if per_type else {}
        cos, sin = model.model.rotary_emb(q, pos, **kw)
        want = modeling.apply_rotary_pos_emb(q, k, cos, sin)
        got = liger_rotary_pos_emb(q, k, cos, sin)
        for a, b, name in zip(got, want, "qk"):
            assert_close(a, b, 1e-6, f"{arch} {layer_type} {name}")


def test_hf_varlen_is_absent_for_a_soft_capped_family_before_it_builds():
    from novatune.train.config import load

    assert "soft-caps its attention logits at 50" in stacks.STACKS["hf-varlen"].unavailable(
        load(EXAMPLES / "gemma-2-2b.yaml"))


@pytest.mark.parametrize("arch,function,mlp", [
    ("gemma-2-2b", "apply_liger_kernel_to_gemma2", "geglu"),
    ("gemma-3-4b", "apply_liger_kernel_to_gemma3_text", "geglu"),
    ("phi-4-mini", "apply_liger_kernel_to_phi3", "swiglu"),
    ("olmo-2-7b", "apply_liger_kernel_to_olmo2", "swiglu")])
def test_liger_function_and_keywords_for_each_family(arch, function, mlp, monkeypatch):
    """The installed Liger's function for the architecture's model_type, called with its own keywords (Gemma's
    GeGLU, the others' SwiGLU) and the fused linear cross-entropy; spied, so nothing is patched here."""
    lk = pytest.importorskip("liger_kernel.transformers")
    from novatune.train.arch import arch_config

    real, seen = getattr(lk, function), {}

    @functools.wraps(real)
    def spy(**kw):
        seen.update(kw)

    monkeypatch.setattr(lk, function, spy)
    assert peer.apply_liger(arch_config(arch).model_type) == function
    assert seen == {"rope": True, "rms_norm": True, mlp: True, "cross_entropy": False,
                    "fused_linear_cross_entropy": True}


# ---------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 257])
def test_gpu_peer_varlen_matches_the_reference(window):
    """The real varlen_attn through the peer's wiring at Gemma 3's head shape (8 / 4 heads of 256), a 4096-token row
    of 7 documents, against reference_varlen_attn (fp32 math on the same bf16 values)."""
    import transformers

    forward = transformers.AttentionInterface._global_mapping[peer.register_peer_varlen()]
    lens = [700, 300, 1200, 50, 900, 646, 300]
    pos = torch.tensor([[p for n in lens for p in range(n)]], device="cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, h, 4096, 256, generator=g).to("cuda", torch.bfloat16).requires_grad_()
               for h in (8, 4, 4))
    out, _ = forward(None, q, k, v, None, scaling=256 ** -0.5, position_ids=pos, sliding_window=window)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = reference_varlen_attn(*(t[0].transpose(0, 1) for t in (qf, kf, vf)), cu, cu, 1200, 1200,
                                scale=256 ** -0.5, window_size=(window - 1, 0) if window else (-1, 0),
                                enable_gqa=True)
    assert_close(out[0], ref, 1e-2, "out")
    go = torch.randn_like(ref)
    (out[0].float() * go).sum().backward()
    (ref.float() * go).sum().backward()
    for name, a, b in (("dq", q, qf), ("dk", k, kf), ("dv", v, vf)):
        assert_close(a.grad, b.grad, 2e-2, name)


@pytest.mark.slow
def test_gemma_2_example_stock_and_novatune_rows(tmp_path):
    """examples/gemma-2-2b.yaml cut to toy size on the CPU, through the bench worker: the stock row names its
    attention (eager: sdpa cannot soft-cap), the novatune row's patch skipped nothing, and their per-step losses
    agree (fp32; 1e-5 relative: summation order through two layers and two optimizer steps). ~20 s: the Triton
    interpreter runs every kernel."""
    import gc

    import yaml

    from novatune.bench.worker import run_stack

    cfg = yaml.safe_load((EXAMPLES / "gemma-2-2b.yaml").read_text())
    cfg["model"].update(device="cpu", dtype="fp32", arch_overrides=TINY_ARCH["gemma-2-2b"])
    cfg["data"].update(max_length=48, sources=[{**cfg["data"]["sources"][0], "num_docs": 20, "median_length": 20}])
    cfg["train"]["grad_accum"] = 1
    path = tmp_path / "gemma-2-2b.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rows = {}
    try:
        for stack in ("stock", "novatune"):
            rows[stack] = run_stack({"stack": stack, "stack_dir": str(tmp_path / stack), "config": str(path),
                                     "overrides": [], "warm": 1, "steps": 1}, log=lambda s: None)
    finally:
        gc.unfreeze()
    stock, nova = rows["stock"], rows["novatune"]
    assert stock["model_type"] == nova["model_type"] == "gemma2"
    assert stock["hf_attention"] == "eager" and stock["patch"] is None
    assert nova["patch"]["skipped"] == [] and nova["attention_backend"] is not None, nova["patch"]
    assert len(stock["losses"]) == len(nova["losses"]) == 2
    for a, b in zip(nova["losses"], stock["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (nova["losses"], stock["losses"])


def _gpt_oss():
    from tiny_models import tiny_gpt_oss

    return tiny_gpt_oss().train()


def _with_own_attention(arch):
    return _gpt_oss() if arch == "gpt-oss" else tiny_arch(arch).train()


@pytest.mark.parametrize("arch", sorted(TINY_ARCH) + ["gpt-oss"])
def test_document_masks_make_hf_attention_per_document(arch):
    """The hf-flex stack's masks, built from position_ids for every layer type, under the family's own CPU
    attention (eager / sdpa take the same mask mapping as flex): packed rows compute the stock model one document at
    a time, GPT-OSS included, whose own forward builds its masks without position_ids and lets documents attend to
    each other (checked first, so the test sees the hook change something there)."""
    ids, pos, lab = packed_batch(ROWS)
    model = _with_own_attention(arch)
    loss_ref, grads_ref = stock_per_document(model, ids, pos, lab)
    leaked, _ = packed_loss_and_grads(model, ids, pos, lab)
    if arch == "gpt-oss":
        assert abs(float(leaked - loss_ref)) > 1e-5, "GPT-OSS's own masks cross documents (the trap fixed here)"
    handle = peer.document_masks(model)
    loss, grads = packed_loss_and_grads(model, ids, pos, lab)
    assert_close(loss, loss_ref, 1e-5, "loss")
    for name in grads_ref:
        assert_close(grads[name], grads_ref[name], 1e-5, name)
    handle.remove()
    again, _ = packed_loss_and_grads(model, ids, pos, lab)
    assert torch.equal(again, leaked), "without the hook the model builds its own masks again"


def test_document_masks_leave_a_padded_batch_to_the_model():
    """A forward with an attention_mask (a padded batch) keeps the model's own masks: the hook only acts on packed
    rows described by position_ids alone."""
    model = _gpt_oss()
    ids, pos, _ = packed_batch([[9, 7]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        peer.document_masks(model)
        got = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert torch.equal(got, want)


def test_document_masks_refuse_a_layer_type_without_a_builder():
    model = tiny_arch("olmo-2-7b")
    model.config.layer_types = ["chunked_attention"] * model.config.num_hidden_layers
    with pytest.raises(peer.PeerUnavailable, match="chunked_attention"):
        peer.document_masks(model)


def test_flex_stack_is_absent_on_the_cpu_with_the_reason():
    from novatune.train.config import load

    cfg = load(EXAMPLES / "gpt-oss-20b-cut.yaml", ["model.device=cpu"])
    why = stacks.STACKS["hf-flex"].unavailable(cfg)
    assert why is not None and "CUDA only" in why and "did not run" in why


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gpt-oss", "gemma-2-2b"])
def test_flex_attention_computes_the_stock_function_on_cuda(arch):
    """hf-flex on CUDA: flex_attention with the sinks (GPT-OSS) or the soft-cap (Gemma 2) and per-document block
    masks against the stock model one document at a time, both fp32 on the GPU (flex's fp32 kernels: summation
    order only, 1e-4 relative through 2 layers)."""
    ids, pos, lab = (t.cuda() for t in packed_batch(ROWS))
    model = _with_own_attention(arch).cuda()
    loss_ref, grads_ref = stock_per_document(model, ids, pos, lab)
    assert peer.use_flex_attention(model).startswith("attention=flex_attention")
    loss, grads = packed_loss_and_grads(model, ids, pos, lab)
    assert_close(loss, loss_ref, 1e-4, "loss")
    for name in grads_ref:
        assert_close(grads[name], grads_ref[name], 1e-4, name)


def test_document_masks_keep_the_window_of_a_family_without_layer_types():
    """Mistral keeps its window in `sliding_window` alone (no layer_types): the masks handed to it slide too, so a
    document longer than the window computes what the model computes on it alone."""
    from tiny_models import tiny_model

    ids, pos, lab = packed_batch(ROWS)
    model = tiny_model("mistral", sliding_window=5, attn="eager").train()
    assert getattr(model.config, "layer_types", None) is None, "the case under test: no layer_types"
    loss_ref, grads_ref = stock_per_document(model, ids, pos, lab)
    peer.document_masks(model)
    loss, grads = packed_loss_and_grads(model, ids, pos, lab)
    assert_close(loss, loss_ref, 1e-5, "loss")
    for name in grads_ref:
        assert_close(grads[name], grads_ref[name], 1e-5, name)
