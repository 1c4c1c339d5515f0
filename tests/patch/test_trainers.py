"""novatune.patch(trainer) with a real TRL SFTTrainer and a plain transformers Trainer (CPU, tiny random Qwen3, the
repo's byte-level demo tokenizer, an in-memory dataset): per-micro-step loss parity with the unpatched trainer, the
fused loss actually called, TRL's fused-LM-head contract honoured, and what cannot be honoured refused.

Tolerance: fp32 end to end (bf16=False: TRL's default bf16 autocast would add ~1% bf16 noise to the gradients); the
patched path differs from stock only in summation order (kernels under the Triton interpreter, the fused loss summed
per chunk) -> ~1e-6 relative per op; over 4 micro-steps with 2 AdamW updates the losses stay within 2e-5 relative
(measured: <= 2e-7)."""

import pytest
import torch
import transformers

import novatune
from novatune.patch import loss as loss_module

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

REL_TOL = 2e-5


def tiny_qwen3(tokenizer, seed=0):
    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, use_cache=False, tie_word_embeddings=True,
                                   pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg)


MODES = {
    "packing": dict(packing=True, max_length=64),
    "padding_free": dict(padding_free=True, max_length=None),
    "padding": dict(max_length=64),
    "peft_lora": dict(max_length=64),
}


def sft_trainer(mode, tokenizer, dataset, tmp_path, model=None, **extra):
    import peft

    settings = dict(output_dir=str(tmp_path / mode), max_steps=2, per_device_train_batch_size=2,
                    gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, report_to=[],
                    use_cpu=True, bf16=False, seed=0, save_strategy="no", disable_tqdm=True, **MODES[mode])
    args = trl.SFTConfig(**{**settings, **extra})
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") if mode == "peft_lora" else None
    return trl.SFTTrainer(model=model or tiny_qwen3(tokenizer), args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora)


def train_recording_losses(trainer):
    """Runs trainer.train() and returns every micro-step's training loss, as compute_loss returned it."""
    losses, compute_loss = [], trainer.compute_loss

    def recording(*args, **kwargs):
        out = compute_loss(*args, **kwargs)
        losses.append(float((out[0] if isinstance(out, tuple) else out).detach()))
        return out

    trainer.compute_loss = recording
    trainer.train()
    return losses


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the calls of novatune's fused linear cross-entropy made by the loss forward."""
    calls = []
    real = loss_module.linear_cross_entropy

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(loss_module, "linear_cross_entropy", counting)
    return calls


def assert_losses_match(patched, stock):
    assert len(patched) == len(stock) == 4
    for i, (a, b) in enumerate(zip(patched, stock)):
        assert abs(a - b) <= REL_TOL * abs(b), f"micro-step {i}: patched {a} vs stock {b}"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_sft_trainer_patched_matches_stock_and_uses_fused_loss(mode, tokenizer, dataset, tmp_path, fused_calls):
    stock = train_recording_losses(sft_trainer(mode, tokenizer, dataset, tmp_path))
    assert not fused_calls
    trainer = sft_trainer(mode, tokenizer, dataset, tmp_path)
    report = novatune.patch(trainer)
    assert report.replaced("cross_entropy"), str(report)
    patched = train_recording_losses(trainer)
    assert_losses_match(patched, stock)
    assert len(fused_calls) == 4, "one fused loss per micro-step"
    assert report.calls["cross_entropy"] == 4 and report.calls["bypassed_loss"] == 0
    assert "fused cross-entropy ran 4 times" in str(report)
    logged = [h for h in trainer.state.log_history if "entropy" in h]
    assert logged and all(0 < h["entropy"] < 7 and 0 <= h["mean_token_accuracy"] <= 1 for h in logged)


def test_fused_head_outputs_equal_trls_own(tokenizer):
    """The fields of TRL's fused head (log_probs, entropy, is_top1, label_mask, loss) and the gradients equal TRL's
    own add_fused_lm_head on the same model and batch."""
    from trl.trainer.utils import add_fused_lm_head

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (2, 23), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    results = []
    for patched in (False, True):
        model = tiny_qwen3(tokenizer)
        model.train()
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
        if patched:  # on top of TRL's head, as novatune.patch(trainer) binds it
            novatune.patch(model)
        out = model(input_ids=ids, labels=labels, fused_lm_head=True, use_cache=False)
        (-out.log_probs.sum() / out.label_mask.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out, grads))
    (ref, ref_grads), (got, got_grads) = results
    assert torch.equal(got.label_mask, ref.label_mask)
    assert got.log_probs.shape == ref.log_probs.shape == (2, 22)
    torch.testing.assert_close(got.log_probs, ref.log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.entropy, ref.entropy, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.is_top1.bool(), ref.is_top1.bool())
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(got_grads[name], ref_grads[name], rtol=2e-4, atol=2e-6, msg=name)


def test_fused_head_computes_the_logits_once(tokenizer):
    """TRL's fused head reads per-token statistics (log_probs, entropy, is_top1): they come from the fused loss's
    own pass over the logits, so one forward + backward computes the (tokens x vocab) logits once, not twice."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LogitsGemms(TorchDispatchMode):
        def __init__(self, shape):
            super().__init__()
            self.shape, self.count = shape, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            fused = func.overloadpacket is torch.ops.novatune.linear_cross_entropy  # its logits GEMMs run inside
            gemm = func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm) and \
                sorted(out.shape) == sorted(self.shape)
            self.count += fused or gemm
            return out

    model = tiny_qwen3(tokenizer)
    model.train()
    novatune.patch(model)
    ids = torch.randint(0, 512, (2, 23), generator=torch.Generator().manual_seed(3))
    with LogitsGemms((2 * 23, 512)) as gemms:  # the (tokens, vocab) logits
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
        (-out.log_probs.sum() / out.label_mask.sum()).backward()
    assert gemms.count == 1
    assert out.entropy.shape == out.is_top1.shape == (2, 22)


@pytest.mark.gpu
def test_fused_head_loss_and_statistics_make_no_host_sync():
    """What TRL's fused head runs per micro-step on CUDA (the fused loss with its token statistics, the uniformly
    weighted log-probs and their backward, the metrics' sums) queues everything on the device: no host sync
    (torch.cuda.set_sync_debug_mode("error") raises on one). One warm-up call first (kernel compilation, the
    one-time fp32-addmm probe)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(512, 256, generator=g).cuda().bfloat16().requires_grad_(True)
    w = (torch.randn(3001, 256, generator=g) / 16).cuda().bfloat16().requires_grad_(True)
    y = torch.randint(0, 3001, (2, 256), generator=g).cuda()
    y[:, :7] = -100

    def micro_step():
        nll_sum, st = loss_module.linear_cross_entropy(h, w, y.reshape(-1), reduction="sum", return_token_stats=True)
        mask = y != -100
        log_probs = loss_module._UniformlyWeightedLogProbs.apply(nll_sum, -st.nll.view(mask.shape), mask)
        (-log_probs.sum() / mask.sum().clamp(min=1)).backward()
        return st.entropy.sum() / mask.sum(), (st.argmax.view(mask.shape) == y).sum()

    micro_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        micro_step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_fused_head_refuses_per_token_weights(tokenizer):
    """A gradient that weights tokens differently (TRL's DFT, RL losses) cannot flow through the fused SUM: it
    raises instead of training on a wrong gradient."""
    model = tiny_qwen3(tokenizer)
    model.train()
    novatune.patch(model)
    ids = torch.randint(0, 512, (1, 17), generator=torch.Generator().manual_seed(2))
    out = model(input_ids=ids, labels=ids, fused_lm_head=True)
    weights = torch.linspace(0.5, 1.5, out.log_probs.shape[-1])
    with pytest.raises(RuntimeError, match="SUM of the token log-probs"):
        (out.log_probs * weights).sum().backward()


def test_dft_loss_is_refused_with_reason(tokenizer, dataset, tmp_path, fused_calls):
    trainer = sft_trainer("packing", tokenizer, dataset, tmp_path, loss_type="dft")
    report = novatune.patch(trainer)
    (entry,) = report.skipped("cross_entropy")
    assert "loss_type='dft'" in entry.detail
    assert not report.replaced("cross_entropy")
    train_recording_losses(trainer)
    assert not fused_calls


def test_patch_before_trainer_is_reported_then_fixed_by_patching_the_trainer(tokenizer, dataset, tmp_path,
                                                                              fused_calls):
    """novatune.patch(model) and then SFTTrainer(model): TRL's head wraps the loss forward, so the fused loss is
    not used; the report must say so (not "replaced"), and novatune.patch(trainer) puts it back on top."""
    model = tiny_qwen3(tokenizer)
    report = novatune.patch(model)
    trainer = sft_trainer("packing", tokenizer, dataset, tmp_path, model=model)
    with pytest.warns(RuntimeWarning, match="fused loss is NOT in use"):
        train_recording_losses(trainer)
    assert not fused_calls
    assert report.skipped("cross_entropy") and not report.replaced("cross_entropy")
    assert report.calls["bypassed_loss"] == 4 and report.calls["cross_entropy"] == 0

    stock = train_recording_losses(sft_trainer("packing", tokenizer, dataset, tmp_path))
    model = tiny_qwen3(tokenizer)
    report = novatune.patch(model)
    trainer = sft_trainer("packing", tokenizer, dataset, tmp_path, model=model)
    assert novatune.patch(trainer) is report
    assert report.replaced("cross_entropy") and not report.skipped("cross_entropy")
    assert_losses_match(train_recording_losses(trainer), stock)
    assert len(fused_calls) == 4 and report.calls["bypassed_loss"] == 0


def test_plain_trainer_patched_matches_stock(tokenizer, dataset, tmp_path, fused_calls):
    """transformers.Trainer: compute_loss passes num_items_in_batch (model_accepts_loss_kwargs), which the fused
    loss uses as its normaliser, so gradient accumulation matches stock."""
    def build():
        tokenized = dataset.map(lambda r: tokenizer(r["text"]), remove_columns=["text"])
        args = transformers.TrainingArguments(output_dir=str(tmp_path / "plain"), max_steps=2,
                                              per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                              learning_rate=1e-3, report_to=[], use_cpu=True, seed=0,
                                              save_strategy="no", disable_tqdm=True)
        collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
        return transformers.Trainer(model=tiny_qwen3(tokenizer), args=args, train_dataset=tokenized,
                                    data_collator=collator)

    stock = train_recording_losses(build())
    trainer = build()
    assert trainer.model_accepts_loss_kwargs
    report = novatune.patch(trainer)
    patched = train_recording_losses(trainer)
    assert_losses_match(patched, stock)
    assert len(fused_calls) == 4 and report.calls["cross_entropy"] == 4


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_sft_trainer_on_moe_adds_the_router_loss_as_stock_does(family, tokenizer, dataset, tmp_path, fused_calls):
    """TRL turns the MoE load-balancing loss on by default (router_aux_loss_coef != 0): its fused-head call then
    asks for the router logits and adds coef x outputs.aux_loss itself. The fused head returns the family's own
    aux loss, so the per-micro-step losses (with the router loss in them) equal the unpatched trainer's."""
    from tiny_models import tiny_gpt_oss, tiny_model

    def moe():
        ids = dict(vocab_size=512, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        if family == "gpt_oss":
            model = tiny_gpt_oss()
            model.resize_token_embeddings(512)
            model.config.update(ids)
            return model
        return tiny_model(family, **ids)

    # GPT-OSS: padded rows, one document each (stock's eager attention would attend across packed documents)
    mode = "padding" if family == "gpt_oss" else "packing"
    stock_trainer = sft_trainer(mode, tokenizer, dataset, tmp_path, model=moe())
    assert stock_trainer.aux_loss_enabled
    stock = train_recording_losses(stock_trainer)
    trainer = sft_trainer(mode, tokenizer, dataset, tmp_path, model=moe())
    report = novatune.patch(trainer)
    assert report.replaced("cross_entropy"), str(report)
    patched = train_recording_losses(trainer)
    assert_losses_match(patched, stock)
    assert len(fused_calls) == 4
    logged = [h["aux_loss"] for h in trainer.state.log_history if "aux_loss" in h]
    stock_logged = [h["aux_loss"] for h in stock_trainer.state.log_history if "aux_loss" in h]
    assert logged and len(logged) == len(stock_logged)
    for a, b in zip(logged, stock_logged):
        assert abs(a - b) <= 1e-4 * abs(b), (logged, stock_logged)


def test_patching_the_model_then_a_label_smoothing_trainer_reports_the_refusal(tokenizer, dataset, tmp_path):
    """patch(model), then a Trainer that computes its loss from the logits (label smoothing), then patch(trainer):
    the report says why the fused loss is not used, and the trainer's forwards without labels raise no warning
    about a bypassed loss (they are the trainer's own, deliberate)."""
    import warnings

    model = tiny_qwen3(tokenizer)
    report = novatune.patch(model)
    tokenized = dataset.map(lambda r: tokenizer(r["text"]), remove_columns=["text"])
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "ls2"), label_smoothing_factor=0.1, max_steps=1,
                                          report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=tokenized,
                                   data_collator=transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False))
    assert novatune.patch(trainer) is report
    (entry,) = report.skipped("cross_entropy")
    assert "label smoothing" in entry.detail
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        trainer.train()
    assert report.calls["bypassed_loss"] == 0 and report.calls["cross_entropy"] == 0


def test_plain_trainer_with_label_smoothing_keeps_stock_loss(tokenizer, tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "ls"), label_smoothing_factor=0.1, report_to=[],
                                          use_cpu=True)
    trainer = transformers.Trainer(model=tiny_qwen3(tokenizer), args=args)
    report = novatune.patch(trainer)
    (entry,) = report.skipped("cross_entropy")
    assert "label smoothing" in entry.detail


def _demo_config(tmp_path, *overrides):
    from novatune.train.config import load
    from novatune.train.demo import demo_config_path

    return load(demo_config_path(), [f"checkpoint.output_dir={tmp_path / 'run'}", "train.max_steps=3",
                                     "train.micro_batch=1", "train.grad_accum=2", "train.warmup=1",
                                     "logging.every=1", *overrides])


def test_trl_stack_matches_novatune_train_on_cpu(tmp_path):
    """The bench's TRL stack (SFTTrainer + novatune.patch(trainer)) trains the trainer's rows with the trainer's
    optimizer: per-step losses equal `novatune train`'s (fp32 on the CPU: summation order only, 2e-5 relative).
    Rows of 256 tokens: the kernels run in the Triton interpreter in CI, where the demo's 512 cost ~100 s."""
    from novatune.bench.trl_stack import run_trl_stack
    from novatune.train.loop import train

    short = ["data.max_length=256"]
    ours = train(_demo_config(tmp_path, *short))
    stack = run_trl_stack(_demo_config(tmp_path, *short), steps=3, warmup=1, output_dir=tmp_path / "trl")
    expected = [ours.losses[s] for s in sorted(ours.losses)]
    assert len(stack["losses"]) == len(expected) == 3
    for got, want in zip(stack["losses"], expected):
        assert abs(got - want) <= REL_TOL * abs(want), (stack["losses"], expected)
    assert stack["tokens_per_s"] > 0
    assert "cross_entropy" in stack["patch_report"] and "ran 6 times" in stack["patch_report"]


@pytest.mark.timing
@pytest.mark.gpu
def test_trl_stack_headline_within_bf16_noise_and_97_percent_speed(tmp_path):
    """Acceptance on the GPU: SFTTrainer + novatune.patch(trainer) on the headline config (Qwen3-4B architecture,
    random init, packed 4096-token rows, bf16, gradient checkpointing, micro-batch 1, GA 4) trains with per-step
    losses equal to novatune train's within bf16 noise and >= 97% of its tokens/s (two runs a side, interleaved)."""
    from pathlib import Path

    from novatune.bench.trl_stack import run_trl_stack
    from novatune.bench.worker import WarmClock
    from novatune.train.config import load
    from novatune.train.loop import train

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    seed_cfg = Path(__file__).resolve().parents[2] / "examples" / "qwen3-4b-seed.yaml"
    # each side twice in the order train, TRL, TRL, train (2 warm-up + 8 timed steps a run): the GPU host's speed
    # drifts within a call (+20% step time seen between two runs of the same program), and a ratio of one run a
    # side taken in a fixed order measures the drift with it; the pooled tokens / seconds of the two runs compare
    steps = ["train.max_steps=10", "checkpoint.save_every=0"]

    def train_run(i: int) -> tuple[dict, int, float]:
        # timed as the TRL stack is (WarmClock): synchronised at the window's two ends only, so neither side's host
        # is held back from running ahead of its GPU
        clock, tokens = WarmClock(torch.device("cuda"), 2, 10), {}

        def meter(step, micro_batches):
            clock.step_end(step)
            tokens[step] = sum(mb["num_tokens"] for mb in micro_batches)

        result = train(load(seed_cfg, [*steps, f"checkpoint.output_dir={tmp_path / f'run{i}'}"]), step_hook=meter)
        return result.losses, sum(tokens[s] for s in range(3, 11)), clock.timed_s

    def trl_run(i: int) -> dict:
        return run_trl_stack(load(seed_cfg, [*steps, f"checkpoint.output_dir={tmp_path / f'trl_run{i}'}"]), steps=10,
                             warmup=2, output_dir=tmp_path / f"trl{i}")

    first, trl = train_run(0), [trl_run(0), trl_run(1)]
    last = train_run(1)
    ours_tps = (first[1] + last[1]) / (first[2] + last[2])
    trl_tps = sum(r["timed_tokens"] for r in trl) / sum(r["timed_s"] for r in trl)
    expected = [first[0][s] for s in sorted(first[0])]
    print({"novatune_train": {"losses": expected, "tokens_per_s": [first[1] / first[2], last[1] / last[2]],
                              "pooled": ours_tps},
           "trl_stack": {"tokens_per_s": [r["tokens_per_s"] for r in trl], "pooled": trl_tps,
                         "step_ms": [r["step_ms"] for r in trl], "losses": [r["losses"] for r in trl]},
           "ratio": trl_tps / ours_tps})
    for got, want in zip([last[0][s] for s in sorted(last[0])], expected, strict=True):
        assert abs(got - want) <= 2e-2 * abs(want), (last[0], expected)
    for stack in trl:
        for got, want in zip(stack["losses"], expected, strict=True):
            assert abs(got - want) <= 2e-2 * abs(want), (stack["losses"], expected)  # bf16 noise over 10 steps
        assert len(stack["step_ms"]) == len(stack["tokens_per_step"]) == 8  # each timed step, to see outliers
    assert trl_tps >= 0.97 * ours_tps


@pytest.mark.parametrize("mode", ["packing", "padding_free", "padding"])
def test_sft_metrics_are_read_at_logging_time_with_stocks_values(mode, tokenizer, dataset, tmp_path, monkeypatch):
    """TRL reads entropy / token accuracy with .item() after each forward (a host wait before the backward is
    queued). Patched, compute_loss makes no .item() call on padding-free batches (packing, padding_free) and the
    logged metrics equal stock TRL's; padded batches (an attention_mask, whose token count TRL also reads with a
    sync) run TRL's own compute_loss."""
    stock = sft_trainer(mode, tokenizer, dataset, tmp_path)
    stock.train()
    trainer = sft_trainer(mode, tokenizer, dataset, tmp_path)
    report = novatune.patch(trainer)
    assert report.replaced("trainer_metrics"), str(report)
    items, inside, real_item, bound = [], [], torch.Tensor.item, trainer.compute_loss

    def counting_item(t):
        if inside:
            items.append(t.shape)
        return real_item(t)

    def watched(*args, **kwargs):
        inside.append(True)
        try:
            return bound(*args, **kwargs)
        finally:
            inside.pop()

    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    trainer.compute_loss = watched
    trainer.train()
    assert (not items) if mode != "padding" else items, items
    got = [h for h in trainer.state.log_history if "entropy" in h]
    want = [h for h in stock.state.log_history if "entropy" in h]
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert g["num_tokens"] == w["num_tokens"]
        assert g["entropy"] == pytest.approx(w["entropy"], rel=1e-4)
        assert g["mean_token_accuracy"] == pytest.approx(w["mean_token_accuracy"], abs=1e-6)
        assert isinstance(g["entropy"], float) and isinstance(g["mean_token_accuracy"], float)


def test_sft_metrics_stay_with_trl_where_its_compute_loss_is_the_users(tokenizer, dataset, tmp_path):
    class MySFT(trl.SFTTrainer):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    args = trl.SFTConfig(output_dir=str(tmp_path / "own"), max_steps=1, per_device_train_batch_size=2,
                         report_to=[], use_cpu=True, bf16=False, save_strategy="no", packing=True, max_length=64)
    trainer = MySFT(model=tiny_qwen3(tokenizer), args=args, train_dataset=dataset, processing_class=tokenizer)
    report = novatune.patch(trainer)
    assert report.replaced("cross_entropy") and not report.replaced("trainer_metrics")
    assert "MySFT defines its own compute_loss" in str(report) and "compute_loss" not in trainer.__dict__
    report.revert()
