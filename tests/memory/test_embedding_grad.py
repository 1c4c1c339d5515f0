"""memory.embedding_grad rows on the CPU: the rows of each micro-step are torch's own embedding backward, the
gradient built in the step's last backward is stock's accumulated `.grad` bit for bit (fp32 and bf16, repeated
ids, the padding id, ids no micro-step shares), no `.grad` exists between micro-steps, a backward outside the
trainer's context is stock's, and every table it cannot serve is refused with the reason. The run builder's side
is tests/train/test_embedding_grad_run.py."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from novatune.memory import embedding_grad as eg

VOCAB, HIDDEN = 97, 24


def _model(tied=False, dtype=torch.float32, pad=None):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=40, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=12, tie_word_embeddings=tied,
                      use_cache=False, pad_token_id=pad)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad", [None, 5])
def test_each_micro_steps_rows_are_torchs_embedding_backward(dtype, pad):
    torch.manual_seed(1)
    n, vocab = 37, 23  # few ids for many tokens: most repeat
    ids = torch.randint(0, vocab, (n,))
    ids[:4] = 5  # the padding id, where there is one
    grad = torch.randn(n, HIDDEN).to(dtype)
    slot_ids, rows = eg.distinct_rows(ids.view(1, n), grad.view(1, n, HIDDEN), vocab, pad)
    assert slot_ids.shape == (n,) and rows.shape == (n, HIDDEN) and rows.dtype == dtype
    dense = torch.full((vocab, HIDDEN), float("nan"), dtype=dtype)  # poisoned: every row must be written
    dense.zero_().index_add_(0, slot_ids, rows)
    ref = torch.ops.aten.embedding_dense_backward(grad, ids, vocab, -1 if pad is None else pad, False)
    assert torch.equal(dense, ref)
    distinct = ids.unique().numel()
    assert torch.equal(rows[distinct:], torch.zeros(n - distinct, HIDDEN, dtype=dtype))  # the spare slots add 0
    assert torch.equal(slot_ids[:distinct], ids.unique())
    assert torch.equal(slot_ids[distinct:], torch.arange(distinct, n) % vocab)  # spread over rows, not one row


def _micro_batches(k=3, seq=19, seed=2):
    g = torch.Generator().manual_seed(seed)
    # ids 60..96 appear in the first micro-batch only, so some rows get one add and others several
    out = []
    for i in range(k):
        hi = VOCAB if i == 0 else 60
        out.append(torch.randint(0, hi, (2, seq), generator=g))
    return out


def _accumulate(model, batches, rows: bool):
    """Gradients of one optimizer step over `batches`; with rows, the trainer's contexts around each forward.
    Returns (every parameter's .grad, whether the table had a .grad between micro-steps)."""
    model.zero_grad(set_to_none=True)
    emb = model.get_input_embeddings().weight
    seen_between = []
    for i, ids in enumerate(batches):
        last = i == len(batches) - 1
        with eg.micro_step(model, last) if rows else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if not last:
            seen_between.append(emb.grad is not None)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, seen_between


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad", [None, 7])
def test_the_steps_gradient_is_stocks_bit_for_bit_and_no_grad_lives_between_micro_steps(dtype, pad):
    model = _model(dtype=dtype, pad=pad)
    batches = _micro_batches()
    ref, stock_between = _accumulate(model, batches, rows=False)
    assert stock_between == [True, True]  # stock holds the table's gradient from the first micro-step on
    table = eg.install(model)
    assert table == VOCAB * HIDDEN * (4 if dtype == torch.float32 else 2)
    state = eg.state_of(model)
    got, between = _accumulate(model, batches, rows=True)
    assert between == [False, False]
    assert not state.pending and not state.defer
    assert got.keys() == ref.keys()
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    if pad is not None:
        assert torch.equal(got["model.embed_tokens.weight"][pad], torch.zeros(HIDDEN, dtype=dtype))


def test_the_kept_rows_are_tokens_by_hidden_per_micro_step():
    model = _model()
    eg.install(model)
    state = eg.state_of(model)
    batches = _micro_batches()
    for ids in batches[:2]:
        with eg.micro_step(model, last=False):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    tokens = batches[0].numel()
    assert len(state.pending) == 2
    assert state.pending_bytes() == 2 * tokens * (8 + HIDDEN * 4)  # int64 ids and fp32 rows
    assert model.get_input_embeddings().weight.grad is None
    eg.discard(model)  # an abandoned step: its rows go, as zero_grad drops a .grad
    assert not state.pending


def test_a_backward_outside_the_trainers_context_is_stocks():
    """Who runs forward and backward without the trainer's contexts (a user loop, HF Trainer) gets the dense
    gradient from every backward, as from stock."""
    model = _model()
    ids = _micro_batches(k=1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    ref = model.get_input_embeddings().weight.grad.clone()
    model.zero_grad(set_to_none=True)
    eg.install(model)
    model(input_ids=ids, labels=ids).loss.backward()
    assert torch.equal(model.get_input_embeddings().weight.grad, ref)
    assert not eg.state_of(model).pending


def test_the_flag_is_read_at_the_forward():
    """A forward told it is not the last keeps its rows even when its backward runs after the context closed."""
    model = _model()
    eg.install(model)
    ids = _micro_batches(k=1)[0]
    with eg.micro_step(model, last=False):
        loss = model(input_ids=ids, labels=ids).loss
    assert not eg.state_of(model).defer  # the context restores the flag
    loss.backward()
    assert model.get_input_embeddings().weight.grad is None and len(eg.state_of(model).pending) == 1


def test_uninstall_gives_the_module_its_forward_back():
    model = _model()
    emb = model.get_input_embeddings()
    eg.install(model)
    assert "forward" in emb.__dict__ and eg.state_of(model) is not None
    eg.uninstall(model)
    assert "forward" not in emb.__dict__ and eg.state_of(model) is None
    with eg.micro_step(model, last=False):  # nothing installed: the context does nothing
        pass
    eg.discard(model)


@pytest.mark.parametrize("case, match", [
    ("tied", "tied to lm_head"),
    ("frozen", "frozen"),
    ("subclass", "not a plain nn.Embedding"),
    ("max_norm", "max_norm"),
    ("scale_grad_by_freq", "scale_grad_by_freq"),
    ("sparse", "sparse"),
])
def test_tables_it_cannot_serve_are_refused_with_the_reason(case, match):
    model = _model(tied=case == "tied")
    emb = model.get_input_embeddings()
    if case == "frozen":
        emb.weight.requires_grad_(False)
    elif case == "subclass":
        class Scaled(nn.Embedding):
            def forward(self, ids):
                return super().forward(ids) * 2.0
        model.set_input_embeddings(Scaled(VOCAB, HIDDEN))
    elif case in ("max_norm", "scale_grad_by_freq", "sparse"):
        setattr(emb, case, 1.0 if case == "max_norm" else True)
    assert match in eg.why_not(model)
    with pytest.raises(eg.EmbeddingGradRefused, match=match) as e:
        eg.install(model)
    assert "memory.embedding_grad: dense" in str(e.value)
    assert eg.state_of(model) is None


@pytest.mark.gpu
@pytest.mark.parametrize("pad", [None, 3])
@pytest.mark.parametrize("tokens", [3000, 4096])  # torch's CUDA embedding backward takes another kernel past 3,072
def test_on_the_gpu_the_steps_gradient_is_stocks_bit_for_bit(pad, tokens):
    """CUDA's embedding backward (sorted segment sums) and bf16 index_add (atomic adds, each one rounding) at a
    realistic size: 4 micro-steps of `tokens` over a 50,000-row table, ids drawn so rows repeat within and across
    micro-steps."""
    torch.manual_seed(3)
    vocab, hidden = 50_000, 256
    emb = nn.Embedding(vocab, hidden, padding_idx=pad, device="cuda", dtype=torch.bfloat16)
    model = nn.Module()
    model.get_input_embeddings = lambda: emb
    model.get_output_embeddings = lambda: None
    model.config = None
    ids = [torch.randint(0, 2_000 if i else vocab, (tokens,), device="cuda") for i in range(4)]
    grads = [torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(4)]

    def step(rows: bool):
        emb.weight.grad = None
        for i, (x, g) in enumerate(zip(ids, grads)):
            with eg.micro_step(model, i == 3) if rows else contextlib.nullcontext():
                out = emb(x)
            out.backward(g)
        return emb.weight.grad.clone()

    ref = step(False)
    eg.install(model)
    assert torch.equal(step(True), ref)
