"""CUDA graphs for checkpointed decoder layers (novatune/patch/graphs.py, graph_recompute.py).

GPU: a graphed model trains as the same model patched with cuda_graphs=False: per micro-batch losses and every
LoRA gradient after gradient accumulation, over batches whose document layouts change bucket, whose first batch
is the eager warm-up and whose second captures. Both run the same kernels on the same bf16 inputs; the graphed
attention reads padded document offsets (empty documents) and a rounded-up max_seqlen, which change the
FlashAttention grid, not any document's result (test_padded_offsets_attend_like_the_batch: bitwise equal on
torch 2.11). With deterministic algorithms and eager attending over the same padded offsets, the two must agree to
1e-6 (same kernels, same inputs). In the default mode eager picks cuDNN SDPA for the one-document batch where the
graphs always run varlen: two attention kernels, bf16 differences (1.5e-2 on the worst LoRA gradient, measured).
A wrong boundary or a stale static buffer is an O(1) error.
CPU: installation, the reasons a batch stays eager, revert, and the static PackedBatch.
"""
import copy

import pytest
import torch

import novatune
from novatune.attention import backends
from novatune.attention.packed import PackedBatch
from novatune.measure.numerics import assert_close
from novatune.patch import graph_recompute, graphs
from novatune.patch.apply import _find_state

peft = pytest.importorskip("peft")

ARCH = dict(vocab_size=257, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, use_cache=False, max_position_embeddings=1024)
SEQ = 256
# docs per row -> slots 16, 16, 32, 16, 16; max_seqlen 256 (> half the row) but for the 26 short documents (128)
LAYOUTS = [[100, 156], [256], [10] * 25 + [6], [60, 60, 136], [7, 249]]


def _model(device, dtype=torch.bfloat16, lora=True):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**ARCH), dtype=dtype).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not lora:
        return model.train()
    cfg = peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules="all-linear")
    return peft.get_peft_model(model, cfg).train()


def _batch(lens, device, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ARCH["vocab_size"], (1, SEQ), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    lab = ids.clone()
    return ids.to(device), pos.to(device), lab.to(device)


def _train(model, layouts, ga=2):
    """Per micro-batch losses and the LoRA gradients after each optimizer step's accumulation (no update)."""
    losses, grads = [], []
    for step in range(0, len(layouts), ga):
        model.zero_grad(set_to_none=True)
        for k in range(step, min(step + ga, len(layouts))):
            ids, pos, lab = _batch(layouts[k], "cuda", seed=k)
            out = model(input_ids=ids, position_ids=pos, labels=lab)
            (out.loss / ga).backward()
            losses.append(out.loss.detach().float())
        grads.append({n: p.grad.detach().float().clone() for n, p in model.named_parameters()
                      if p.grad is not None})
    return losses, grads


def _runner(model) -> graphs.LayerGraphRunner:
    state = _find_state(model.get_base_model() if hasattr(model, "get_base_model") else model)[1]
    return state.graphs


def _as_graphs_pad(packed: PackedBatch) -> PackedBatch:
    """The static offsets a graphed batch attends with: slots and max_seqlen rounded up as graphs._bucket_for."""
    slots = graphs._pow2_at_least(packed.num_docs, graphs.MIN_SLOTS)
    t = packed.total_tokens
    longest = t if 2 * packed.max_seqlen > t else t // 2
    cu = torch.full((slots + 1,), packed.total_tokens, dtype=torch.int32)
    cu[:packed.num_docs + 1] = packed.cu_seqlens_cpu
    return PackedBatch.graph_static(cu.to(packed.device), longest, packed.batch, packed.seq_len)


@pytest.fixture
def padded_eager_attention(monkeypatch):
    """Eager layers attend over the same padded offsets as the graphs (FlashAttention then runs the same grid and
    KV split in both), so graphed-vs-eager isolates the graphs' own machinery."""
    from novatune.patch import forwards

    orig = forwards.varlen_attention

    def padded(q, k, v, packed, scale=None, backend="auto", **kw):
        return orig(q, k, v, packed if packed.lengths is None else _as_graphs_pad(packed), scale=scale,
                    backend=backend, **kw)

    monkeypatch.setattr(forwards, "varlen_attention", padded)


def _max_err(a: list[dict], b: list[dict]) -> float:
    from novatune.measure.numerics import rel_err

    return max(rel_err(x[n], y[n]) for x, y in zip(a, b) for n in y)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["auto", "flash"])
def test_graphed_layers_match_eager_exactly(padded_eager_attention, attention):
    """Deterministic algorithms, eager attending over the graphs' padded offsets: the same kernels on the same
    inputs, so any difference is the graphs' (stale static buffers, a missed gradient, a wrong replay). Both
    FlashAttention-2 routes: torch's varlen_attn (auto) and aten's ops (flash)."""
    _compare_graphed_with_eager(True, tol=1e-6, attention=attention)


@pytest.mark.gpu
def test_graphed_layers_train_like_eager():
    """The default mode, eager on its own offsets: graphed is no further from eager than 3x eager's own
    run-to-run spread (FlashAttention's dq atomics) + 2e-2: eager runs cuDNN SDPA on the one-document batch, the
    graphs FlashAttention varlen (measured 1.5e-2; the exact comparison is the test above)."""
    _compare_graphed_with_eager(False, tol=None)


@pytest.mark.gpu
def test_forward_graphs_train_a_full_fine_tuning_like_eager(padded_eager_attention):
    """Full fine-tuning under cuda_graphs="forward": each layer's forward from a graph, its recompute + backward
    eager on the graph's static inputs, every weight's gradient accumulated by autograd into .grad over the
    micro-batches. Deterministic, eager attending over the padded offsets: equal to eager to 1e-6."""
    _compare_graphed_with_eager(True, tol=1e-6, lora=False)


@pytest.mark.gpu
def test_forward_graphs_train_a_full_fine_tuning_like_eager_on_its_own_offsets():
    """The default mode: the graphs attend over padded offsets, the eager recompute over the batch's own (cuDNN
    SDPA for the one-document batch in both eager runs; the graphs recompute that one on their padded inputs)."""
    _compare_graphed_with_eager(False, tol=None, lora=False)


def _compare_graphed_with_eager(deterministic: bool, tol, attention: str = "auto", lora: bool = True):
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        eager = _model("cuda", lora=lora)
        eager2, graphed = copy.deepcopy(eager), copy.deepcopy(eager)
        rep_e = novatune.patch(eager, cuda_graphs=False, tune=False, attention=attention)
        novatune.patch(eager2, cuda_graphs=False, tune=False, attention=attention)
        rep_g = novatune.patch(graphed, tune=False, attention=attention, cuda_graphs="auto" if lora else "forward")
        assert rep_g.replaced("cuda_graphs") and not rep_e.replaced("cuda_graphs")
        layouts = LAYOUTS * 2  # the second pass replays every bucket's graphs
        le, ge = _train(eager, layouts)
        le2, ge2 = _train(eager2, layouts)
        lg, gg = _train(graphed, layouts)
    finally:
        torch.use_deterministic_algorithms(False)
    trained = sum(p.requires_grad for p in graphed.parameters())
    for a, b in zip(gg, ge):
        assert a.keys() == b.keys() and len(a) == (2 * 7 * ARCH["num_hidden_layers"] if lora else trained)
    noise, err = _max_err(ge2, ge), _max_err(gg, ge)
    loss_noise = max(abs(float(a - b)) for a, b in zip(le2, le))
    loss_err = max(abs(float(a - b)) for a, b in zip(lg, le))
    print(f"deterministic={deterministic}: grads graphed-vs-eager {err:.2e}, eager-vs-eager {noise:.2e}; "
          f"losses {loss_err:.2e} vs {loss_noise:.2e}")
    if deterministic:
        assert noise == 0.0 and loss_noise == 0.0  # the yardstick: eager is bitwise repeatable here
    assert err <= (tol if tol is not None else 3 * noise + 2e-2), (err, noise)
    assert loss_err <= (tol if tol is not None else 3 * loss_noise + 1e-3), (loss_err, loss_noise)
    runner = _runner(graphed)
    assert runner.forward_only is not lora
    st = runner.stats()
    assert st["broken"] is None, st
    # 1 warm-up; 2 capture batches (slots 16 and 32), each capturing both max_seqlen buckets of its slot count
    assert st["captured_batches"] == 2 and st["replayed_batches"] == len(layouts) - 3, st
    assert sorted(tuple(b) for b in st["buckets"]) == [(16, 128), (16, 256), (32, 128), (32, 256)], st


@pytest.mark.gpu
def test_padded_offsets_attend_like_the_batch():
    """The graphs' padded offsets (empty trailing documents, max_seqlen rounded up) give each real document the
    same attention: outputs and q/k/v gradients equal (measured bitwise on torch 2.11; 1e-6 allows nothing
    but a summation-order change). Deterministic algorithms: FlashAttention's dq atomics would add run-to-run
    noise to both sides otherwise."""
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        _padded_vs_real()
    finally:
        torch.use_deterministic_algorithms(False)


def _padded_vs_real():
    from novatune.attention.backends import varlen_attention

    for lens in LAYOUTS:
        packed = PackedBatch.from_cu_seqlens(torch.tensor([0] + list(torch.tensor(lens).cumsum(0))), device="cuda")
        q, k, v = (torch.randn(SEQ, h, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for h in (4, 2, 2))
        dout = torch.randn(SEQ, 4, 32, device="cuda", dtype=torch.bfloat16)
        res = []
        for pb in (packed, _as_graphs_pad(packed)):
            out = varlen_attention(q, k, v, pb, backend="varlen")
            res.append([out.detach().float(), *torch.autograd.grad(out, (q, k, v), dout)])
        errs = [assert_close(a.float(), b.float(), 1e-6, name) for a, b, name in zip(*res, ("out", "dq", "dk", "dv"))]
        print(f"{len(lens)} documents: padded vs real rel. errors {[f'{e:.1e}' for e in errs]}")


@pytest.mark.gpu
def test_second_forward_before_backward_runs_eagerly(padded_eager_attention):
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        _second_forward_before_backward()
    finally:
        torch.use_deterministic_algorithms(False)


def _second_forward_before_backward():
    eager = _model("cuda")
    graphed = copy.deepcopy(eager)
    novatune.patch(eager, cuda_graphs=False, tune=False)
    rep = novatune.patch(graphed, tune=False)
    _train(graphed, LAYOUTS[:2], ga=1)  # warm-up + capture
    _train(eager, LAYOUTS[:2], ga=1)
    results = []
    for model in (graphed, eager):
        model.zero_grad(set_to_none=True)
        outs = [model(**dict(zip(("input_ids", "position_ids", "labels"), _batch(LAYOUTS[k], "cuda", k))))
                for k in (3, 4)]  # two forwards, then both backwards
        (outs[0].loss + outs[1].loss).backward()
        results.append(({n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None},
                        [o.loss.float() for o in outs]))
    (g, lg), (e, le) = results
    for a, b in zip(lg, le):
        assert_close(a, b, 1e-6, "loss")
    for n in e:
        assert_close(g[n], e[n], 1e-6, n)
    assert any("second forward before" in x.detail for x in rep.entries if x.action == "note")


# ---------------------------------------------------------------------------------------------- CPU
def _cpu_model():
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**dict(ARCH, num_hidden_layers=2)))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cfg = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules="all-linear")
    return peft.get_peft_model(model, cfg).train()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only decision")
def test_auto_says_why_it_is_off_without_cuda_and_true_raises():
    rep = novatune.patch(_cpu_model(), tune=False)
    assert not rep.replaced("cuda_graphs")
    assert any(e.kind == "cuda_graphs" and "CUDA is not available" in e.detail for e in rep.entries)
    with pytest.raises(ValueError, match="cuda_graphs=True cannot apply"):
        novatune.patch(_cpu_model(), cuda_graphs=True, tune=False)
    with pytest.raises(ValueError, match="cuda_graphs='forward' cannot apply"):
        novatune.patch(_cpu_model(), cuda_graphs="forward", tune=False)
    with pytest.raises(ValueError, match="choose 'auto', 'forward', True or False"):
        novatune.patch(_cpu_model(), cuda_graphs="yes", tune=False)


def test_runner_wraps_checkpointing_falls_back_with_a_reason_and_reverts():
    """A runner installed on a CPU model: the pre-hook wraps every layer's checkpoint function, each batch runs
    the stock checkpoint (hidden states on the CPU, said once in the report), and revert restores HF's."""
    model = _cpu_model()
    ref = copy.deepcopy(model)
    rep = novatune.patch(model, cuda_graphs=False, tune=False)
    novatune.patch(ref, cuda_graphs=False, tune=False)
    stack, state = _find_state(model.get_base_model())
    runner = graphs.LayerGraphRunner(list(stack.layers), state, full_training=False)
    state.graphs = runner
    inner = [layer._gradient_checkpointing_func for layer in stack.layers]
    results = []
    for m in (model, ref):
        ids, pos, lab = _batch([100, 156], "cpu", 0)
        out = m(input_ids=ids, position_ids=pos, labels=lab)
        out.loss.backward()
        results.append((out.loss, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    assert all(isinstance(layer._gradient_checkpointing_func, graphs._CheckpointHook) for layer in stack.layers)
    assert_close(results[0][0], results[1][0], 1e-6, "loss")
    for n, g in results[1][1].items():
        assert_close(results[0][1][n], g, 1e-5, n)
    assert any("hidden states on cpu" in e.detail for e in rep.entries if e.action == "note")
    assert runner.stats()["eager_batches"] == 1 and runner.stats()["captured_batches"] == 0
    runner.uninstall()
    assert [layer._gradient_checkpointing_func for layer in stack.layers] == inner


def test_graph_static_packed_batch_and_isolated_choices():
    cu = torch.tensor([0, 5, 12, 12, 12], dtype=torch.int32)
    pb = PackedBatch.graph_static(cu, 256, batch=1, seq_len=12)
    assert (pb.num_docs, pb.max_seqlen, pb.total_tokens, pb.one_doc_per_row) == (4, 256, 12, False)
    assert pb.cu_seqlens is cu and pb.lengths is None
    q = torch.randn(12, 2, 8)
    assert backends.why_unavailable("sdpa", q, q, pb) is not None  # never per-row causal SDPA on padded slots
    backends._BROKEN.pop("test_backend", None)
    with pytest.raises(RuntimeError):
        with backends.isolated_choices() as seen:
            backends._BROKEN["test_backend"] = "raised inside a capture"
            backends.varlen_attention(q, q, q, PackedBatch.from_cu_seqlens([0, 5, 12]), backend="reference")
            raise RuntimeError("capture failed")
    assert "test_backend" not in backends._BROKEN and [c.backend for c in seen] == ["reference"]


def test_buckets_round_up_to_powers_of_two():
    assert [graphs._pow2_at_least(n, 8) for n in (1, 8, 9, 33)] == [8, 8, 16, 64]
    assert graphs._pow2_at_least(1500, 256) == 2048


def test_layers_with_another_memory_policy_stay_out_of_the_graphs():
    """The graphs capture the stock recompute; a layer that keeps or offloads its activations (novatune/memory)
    makes the runner leave the batch eager, with the reason in the report; recompute layers do not."""
    from novatune.memory.offload import OffloadEngine
    from novatune.memory.policy import install

    model = _cpu_model()
    novatune.patch(model, cuda_graphs=False, tune=False)
    stack, state = _find_state(model.get_base_model())
    layers = list(stack.layers)
    runner = graphs.LayerGraphRunner(layers, state, full_training=False)
    install(layers, ["recompute"] * len(layers))
    runner.ensure_installed()
    assert runner._check_layers() is None
    runner.uninstall()
    install(layers, ["offload"] + ["recompute"] * (len(layers) - 1), OffloadEngine("cpu"))
    runner.ensure_installed()
    assert "memory policy keeps or offloads" in runner._check_layers()


@pytest.mark.gpu
def test_a_capture_out_of_memory_releases_the_cache_and_captures_again(monkeypatch):
    """A card that is nearly full (or a memory cap) can leave the graphs' pool no room while the eager pool's cache
    holds it; a capture cannot release that cache itself. Each capture batch releases it first; an out-of-memory
    before any graph lives in the pool captures again into a fresh pool: the graphs stay on (one release per
    capture batch, one more for the retry) and the losses equal eager's."""
    eager = _model("cuda")
    graphed = copy.deepcopy(eager)
    novatune.patch(eager, cuda_graphs=False, tune=False)
    novatune.patch(graphed, tune=False)
    runner = _runner(graphed)
    orig = graphs.LayerGraphRunner._capturing
    failed = []

    def failing_once(self, graph):
        if not failed:
            failed.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return orig(self, graph)

    monkeypatch.setattr(graphs.LayerGraphRunner, "_capturing", failing_once)
    le, _ = _train(eager, LAYOUTS * 2)
    lg, _ = _train(graphed, LAYOUTS * 2)
    st = runner.stats()
    assert failed and st["broken"] is None and st["cache_releases"] == st["captured_batches"] + 1, st
    assert st["replayed_batches"] == 2 * len(LAYOUTS) - 3, st
    assert max(abs(float(a - b)) for a, b in zip(lg, le)) < 2e-2


class _ReplayOnCPU:
    """Stands in for a captured forward graph on the CPU: replay() runs the layer into its static output."""

    def __init__(self, layer, src, out):
        self.layer, self.src, self.out = layer, src, out

    def replay(self):
        with torch.no_grad():
            self.out.copy_(self.layer(self.src))


class _WatchedLinear(torch.autograd.Function):
    """x @ w^T whose backward records whether it may add w's gradient into .grad itself (ops/moe_wgrad.py)."""
    seen: list = []

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        from novatune.ops.grad_accumulation import accumulates_into_grad

        x, w = ctx.saved_tensors
        _WatchedLinear.seen.append(accumulates_into_grad(w))
        return g @ w, g.t() @ x


class _Layer(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.up, self.down = torch.nn.Linear(h, 2 * h), torch.nn.Parameter(torch.randn(h, 2 * h) / h)

    def forward(self, x):
        return x + _WatchedLinear.apply(torch.nn.functional.silu(self.up(x)), self.down)


def _forward_graphed(layers, xs, x0, runner=None):
    """The runner's forward-graph path on the CPU: layer i's "graph" writes xs[i + 1]; its backward recomputes."""
    runner = runner or graphs.LayerGraphRunner(layers, state=None, full_training=True, forward_only=True)
    runner.xs, runner.batch_id, runner.token = xs, 1, graphs._Token()
    runner.layer_slots = [[(m, k) for m in layer.modules() for k, p in m._parameters.items() if p is not None]
                          for layer in layers]
    runner.layer_params = [[m._parameters[k] for m, k in slots] for slots in runner.layer_slots]
    xs[0].copy_(x0)
    h = x0
    for i, layer in enumerate(layers):
        params = runner.layer_params[i]
        lg = graphs._LayerGraphs(_ReplayOnCPU(layer, xs[i], xs[i + 1]), None, xs[i + 1], x0[:0], x0[:0], True,
                                 [], [], len(params), recompute=layer)
        rc = graph_recompute.Recompute(layer, xs[i], params, runner.layer_slots[i], True)
        h = graphs._GraphedLayer.apply(runner, lg, 1, runner.token, rc, h, *params)
    return h


def test_forward_graphs_recompute_and_accumulate_like_the_stock_checkpoint():
    """The forward-only graphs' backward (graphs._recompute_backward), driven on the CPU with a stand-in replay:
    over three micro-batches of gradient accumulation every parameter's .grad and the input's gradient equal
    plain autograd's; the nested backward lets in-place weight-gradient paths add into .grad as autograd would
    (ops/grad_accumulation.accumulates_into_grad true from the second micro-batch); torch.autograd.grad() gets the
    gradients returned and leaves .grad alone."""
    torch.manual_seed(0)
    h, t = 12, 7
    layers = torch.nn.ModuleList([_Layer(h) for _ in range(3)])
    ref = copy.deepcopy(layers)
    xs = [torch.empty(t, h) for _ in range(4)]
    inputs = [torch.randn(t, h, requires_grad=True) for _ in range(3)]
    _WatchedLinear.seen = []
    for k, x in enumerate(inputs):
        for buf in xs:  # poisoned static buffers: a read before the replay writes them would show
            buf.fill_(torch.nan)
        out = _forward_graphed(list(layers), xs, x)
        (out.square().sum() * (k + 1)).backward()
    assert _WatchedLinear.seen == [False] * 3 + [True] * 6
    ref_inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    for k, x in enumerate(ref_inputs):
        h_ = x
        for layer in ref:
            h_ = layer(h_)
        (h_.square().sum() * (k + 1)).backward()
    for (n, p), q in zip(layers.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, 1e-5, n)
    for x, r in zip(inputs, ref_inputs):
        assert_close(x.grad, r.grad, 1e-5, "input")
    before = [p.grad.clone() for p in layers.parameters()]
    x = torch.randn(t, h, requires_grad=True)
    out = _forward_graphed(list(layers), xs, x)
    got = torch.autograd.grad(out.square().sum(), [x, *layers.parameters()])
    h_ = x.detach().requires_grad_(True)
    ref_out = h_
    for layer in ref:
        ref_out = layer(ref_out)
    want = torch.autograd.grad(ref_out.square().sum(), [h_, *ref.parameters()])
    for a, b in zip(got, want):
        assert_close(a, b, 1e-5, "autograd.grad")
    assert all(torch.equal(a, p.grad) for a, p in zip(before, layers.parameters()))


def test_forward_graphs_backward_survives_a_broken_batch_and_fires_hooks_once():
    """A capture failing later in the batch drops the runner's static buffers (_break): the layers already replayed
    still recompute from the buffers their backward holds. A gradient hook on a parameter fires once per
    micro-batch with the gradient autograd would give it (the hooked layer's gradients are returned, not added
    by the nested backward)."""
    torch.manual_seed(1)
    h, t = 8, 5
    layers = torch.nn.ModuleList([_Layer(h) for _ in range(2)])
    ref = copy.deepcopy(layers)
    seen = []
    layers[1].down.register_hook(lambda g: seen.append(g.clone()))
    xs = [torch.empty(t, h) for _ in range(3)]
    runner = graphs.LayerGraphRunner(list(layers), state=None, full_training=True, forward_only=True)
    inputs = [torch.randn(t, h, requires_grad=True) for _ in range(2)]
    for x in inputs:
        out = _forward_graphed(list(layers), xs, x, runner)
        runner.xs = None  # as _break leaves it
        out.square().sum().backward()
    ref_seen = []
    ref[1].down.register_hook(lambda g: ref_seen.append(g.clone()))
    for x in inputs:
        h_ = x.detach()
        for layer in ref:
            h_ = layer(h_)
        h_.square().sum().backward()
    assert len(seen) == len(ref_seen) == 2
    for a, b in zip(seen, ref_seen):
        assert_close(a, b, 1e-5, "hooked gradient")
    for (n, p), q in zip(layers.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, 1e-5, n)
