"""The parallel pieces without a second process: rank-strided batches, the launcher's command line, the config
rules, and FSDP2 / DDP in a one-member process group (the same code path as N ranks, gathering from itself)."""
import pytest
import torch

from novatune.data.collate import collate
from novatune.data.dataset import BatchStream
from novatune.parallel import dist as pdist
from novatune.parallel.launch import strip_nproc, torchrun_command


def rows(n: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        docs = []
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            length = int(torch.randint(3, 12, (1,), generator=g))
            ids = torch.randint(5, 100, (length,), generator=g).tolist()
            mask = (torch.rand(length, generator=g) < 0.7).tolist()
            docs.append((ids, mask))
        out.append(docs)
    return out


def test_ranks_split_the_global_micro_batch_and_share_its_counts():
    data = rows(23)
    one = BatchStream(data, micro_batch=4, seed=3, world=1)
    ranks = [BatchStream(data, micro_batch=2, seed=3, rank=r, world=2) for r in range(2)]
    assert ranks[0].batches_per_epoch == one.batches_per_epoch == 6
    for _ in range(8):  # across the epoch boundary (23 rows: the last global micro-batch holds 3)
        whole = one.next()
        parts = [s.next() for s in ranks]
        n_rows = sum(p["input_ids"].shape[0] for p in parts)
        assert n_rows == whole["input_ids"].shape[0]
        for p in parts:
            assert p["global_target_tokens"] == whole["num_target_tokens"]
            assert p["global_tokens"] == whole["num_tokens"] == sum(q["num_tokens"] for q in parts)
            assert p["global_attn_keys"] == pytest.approx(whole["attn_keys"])
        assert sum(p["num_target_tokens"] for p in parts) == whole["num_target_tokens"]
        assert ranks[0].state_dict() == ranks[1].state_dict() == one.state_dict()


def test_rank_r_takes_rows_r_r_plus_world():
    data = rows(8)
    s = BatchStream(data, micro_batch=2, seed=0, shuffle=False, rank=1, world=2)
    got = s.next()
    want = collate([data[1], data[3]])
    assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["labels"], want["labels"])


def test_an_epoch_end_with_fewer_rows_than_ranks_trains_them_and_idles_the_rank_left_without_one():
    """5 rows, 2 ranks x 2: the second global micro-batch holds row 4 alone. Rank 0 trains it; rank 1 runs a copy
    of it with no target token (every rank runs the step), and the global counts are row 4's alone."""
    data = rows(5)
    ranks = [BatchStream(data, micro_batch=2, seed=0, shuffle=False, rank=r, world=2) for r in range(2)]
    assert ranks[1].batches_per_epoch == 2 and ranks[1].left_in_epoch() == 2
    for s in ranks:
        s.next()
    assert ranks[1].left_in_epoch() == 1
    last = [s.next() for s in ranks]
    alone = collate([data[4]])
    assert torch.equal(last[0]["input_ids"], alone["input_ids"]) and torch.equal(last[0]["labels"], alone["labels"])
    assert torch.equal(last[1]["input_ids"], alone["input_ids"]) and last[1]["num_target_tokens"] == 0
    assert (last[1]["labels"] == -100).all() and last[1]["idle"] and last[1]["num_tokens"] == 0
    assert "idle" not in last[0]  # forward_backward multiplies an idle micro-batch's loss by 0
    for b in last:
        assert b["global_target_tokens"] == alone["num_target_tokens"] and b["global_tokens"] == alone["num_tokens"]
    assert ranks[1].left_in_epoch() == 2  # the epoch is used up: the next one's
    ranks[1].next()
    assert ranks[1].epoch == 1 and ranks[1].index == 4


def test_nproc_relaunches_under_torchrun():
    argv = ["train", "cfg.yaml", "--nproc", "2", "--set", "a=1", "--nproc=3"]
    assert strip_nproc(argv) == ["train", "cfg.yaml", "--set", "a=1"]
    cmd = torchrun_command(4, argv)
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m"]
    assert cmd[6:] == ["novatune", "train", "cfg.yaml", "--set", "a=1"]


def test_config_parallel_section_and_qlora_refused():
    from novatune.train.config import ConfigError, load

    assert load(None).parallel.strategy == "none"
    assert load(None, ["parallel.strategy=fsdp2"]).parallel.reshard_after_forward is None  # by world size
    with pytest.raises(ConfigError, match="parallel.strategy"):
        load(None, ["parallel.strategy=fsdp"])
    with pytest.raises(ConfigError, match="qlora is not supported"):
        load(None, ["parallel.strategy=fsdp2", "method.type=qlora"])
    with pytest.raises(ConfigError, match="parallel.layers_per_unit.*must be >= 1"):  # before any model is built
        load(None, ["parallel.strategy=fsdp2", "parallel.layers_per_unit=0"])


def test_nproc_without_a_strategy_names_the_fix(capsys):
    from novatune.commands.cli import main

    assert main(["train", "--nproc", "2", "--output-dir", "/nonexistent/x"]) == 2
    assert "parallel.strategy=fsdp2" in capsys.readouterr().err


def test_strategy_none_under_a_multi_process_torchrun_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="parallel.strategy is none"):
        pdist.setup("none", "cpu")


TINY = ["train.max_steps=3", "train.micro_batch=2", "train.grad_accum=2", "data.max_length=128",
        "data.sources.0.limit=40", "model.arch_overrides.num_hidden_layers=2"]


def step_twice(strategy: str, method: str, device: str = "cpu", extra: list[str] = ()):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from novatune.train.config import load_with_base
    from novatune.train.session import build

    cfg, base = load_with_base(None, TINY + [f"parallel.strategy={strategy}", f"method.type={method}",
                                             f"model.device={device}", *extra])
    session = build(cfg, base)
    try:
        assert session.hand_over == (strategy == "fsdp2"), "one rank: FSDP2's gradients are handed over"
        losses = [float(session.step(session.next_micro_batches()).loss) for _ in range(2)]
        sharded = any(isinstance(p, DTensor) for p in session.model.parameters())
        from novatune.train.sharded_checkpoint import full_state_on_rank0

        state = {k: v.clone() for k, v in full_state_on_rank0(session.model).items()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return losses, state, sharded


@pytest.mark.parametrize("method,units", [("full", []), ("lora", []),
                                          ("full", ["model.arch_overrides.num_hidden_layers=3",
                                                    "parallel.layers_per_unit=2"]),
                                          ("full", ["parallel.reshard_after_forward=true",
                                                    "parallel.gradient_sync=micro_batch"])])
def test_fsdp2_in_one_process_steps_like_the_plain_model(method, units):
    """FSDP2 over a one-member group: the patched model on gathered parameters, LoRA's frozen base sharded; the
    root as the only unit (the one-process default), units of several layers (3 layers in units of 2: one unit of
    2, one of 1), and layers resharded after each use with a reduction asked for each micro-batch (over one rank
    the gradients are still handed over once, after the step's backward) step alike."""
    ref_losses, ref_state, ref_sharded = step_twice("none", method, extra=units)
    losses, state, sharded = step_twice("fsdp2", method, extra=units)
    assert sharded and not ref_sharded
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert set(state) == set(ref_state)
    for k in state:  # fp32, same reductions (one rank): equal up to the order of a few sums
        torch.testing.assert_close(state[k], ref_state[k], rtol=1e-5, atol=1e-6)


def test_fsdp2_over_one_process_gathers_once_per_step_in_the_weights_dtype(monkeypatch):
    """A world of one: each unit's parameters are gathered once per optimizer step (kept across the micro-batches,
    resharded before the optimizer writes the shards), and the policy's reduce dtype is the parameters' own (no
    fp32 gradient copies over one rank). Set explicitly, reshard_after_forward gathers again per use."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_mod

    from novatune.parallel import wrap as pwrap
    from novatune.train.config import load_with_base
    from novatune.train.session import build

    gathers = []
    real = group_mod.FSDPParamGroup.unshard

    def unshard(group, *a, **k):  # a gather that has work to do: sharded, none pending
        if not group.is_unsharded and group._all_gather_result is None:
            gathers.append(group)
        return real(group, *a, **k)

    monkeypatch.setattr(group_mod.FSDPParamGroup, "unshard", unshard)

    def gathers_per_step(extra, dtype="fp32"):  # bf16 where the policy's dtypes are checked (slower on CPUs)
        cfg, base = load_with_base(None, TINY + ["parallel.strategy=fsdp2", f"model.dtype={dtype}"] + extra)
        session = build(cfg, base)
        try:
            session.step(session.next_micro_batches())  # warm-up: lazy init
            gathers.clear()
            session.step(session.next_micro_batches())
            sharded_after_step = all(isinstance(p, DTensor) for p in session.model.parameters())
            reduce_dtypes = {m._get_fsdp_state()._mp_policy.reduce_dtype for m in session.model.modules()
                             if hasattr(m, "_get_fsdp_state")}
            return len(gathers), sharded_after_step, len(pwrap.decoder_layers(session.model)), reduce_dtypes
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    from torch.distributed.tensor import DTensor

    kept, sharded, layers, reduce_dtypes = gathers_per_step(["parallel.layers_per_unit=1"], "bf16")
    assert reduce_dtypes == {None}, reduce_dtypes  # None: the parameters' dtype (bf16)
    assert sharded, "the step ends resharded: the optimizer updates the shards, the next gather copies them"
    assert kept == layers + 1, f"{kept} gathers for {layers} layers + the root over 2 micro-batches"
    grouped, _, _, _ = gathers_per_step(["parallel.layers_per_unit=2"])  # the 2 layers in one unit
    assert grouped == 2, f"{grouped} gathers for one unit of {layers} layers + the root"
    root, _, _, _ = gathers_per_step([])  # the default over one process: the root is the only unit
    assert root == 1, f"{root} gathers for the root unit holding the whole model"
    again, _, _, _ = gathers_per_step(["parallel.reshard_after_forward=true", "parallel.layers_per_unit=1"])
    assert again > kept  # each layer again before each backward and on each micro-batch
    assert pwrap.reshards_after_forward(None, 2) and not pwrap.reshards_after_forward(None, 1)
    assert pwrap.unit_size(None, 1, keep_gathered=True) == 0
    assert pwrap.unit_size(None, 2, keep_gathered=True) == pwrap.KEPT_GATHERED_UNIT == 4
    assert pwrap.unit_size(None, 1, keep_gathered=False) == 1 and pwrap.unit_size(3, 2, keep_gathered=False) == 3
    with pytest.raises(ValueError, match="layers_per_unit must be >= 1"):
        pwrap.unit_size(0, 1, keep_gathered=True)


def test_fsdp2_reduces_in_the_gradients_dtype_unless_fp32_is_asked_across_ranks():
    from novatune.parallel import wrap as pwrap

    assert pwrap.fsdp2_reduce_dtype("auto", 2) is None  # None: FSDP2 reduces in its compute dtype, bf16
    assert pwrap.fsdp2_reduce_dtype("fp32", 2) is torch.float32
    assert pwrap.fsdp2_reduce_dtype("fp32", 1) is None  # one rank: nothing is reduced, nothing to widen
    mixed = frozenset({torch.bfloat16, torch.float32})  # fp32 adapters train: their gradients stay fp32
    assert pwrap.fsdp2_reduce_dtype("auto", 2, mixed) is torch.float32
    model = torch.nn.Sequential(torch.nn.Linear(2, 2).to(torch.bfloat16), torch.nn.Linear(2, 2))
    model[0].requires_grad_(False)
    assert pwrap.trained_dtypes(model) == {torch.float32}
    with pytest.raises(ValueError, match="reduce_dtype must be auto or fp32"):
        pwrap.fsdp2_reduce_dtype("bf16", 2)
    from novatune.train.config import ConfigError, load

    with pytest.raises(ConfigError, match="parallel.reduce_dtype"):
        load(None, ["parallel.strategy=fsdp2", "parallel.reduce_dtype=fp16"])
    with pytest.raises(ConfigError, match="parallel.reduce_dtype.*applies to fsdp2"):  # DDP would ignore it
        load(None, ["parallel.strategy=ddp", "parallel.reduce_dtype=fp32"])


def test_fsdp2_over_one_process_hands_the_gradients_to_the_shards_without_a_reduction(monkeypatch):
    """A world of one: FSDP2 reduces nothing (its reduction over one rank is two copies and a host sync per unit);
    after the step's last backward every gradient accumulated on a gathered parameter becomes its shard's gradient
    over the same storage. Gradients, the next step's loss and the weights are bit for bit those of FSDP2's own
    path (2 micro-batches accumulated: the same adds in the same order, then copies, exact in any dtype)."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_mod
    from torch.distributed.tensor import DTensor

    from novatune.parallel import wrap as pwrap
    from novatune.train.config import load_with_base
    from novatune.train.session import build

    reductions = []
    real_reduce = group_mod.foreach_reduce

    def counted(*a, **k):
        reductions.append(1)
        return real_reduce(*a, **k)

    monkeypatch.setattr(group_mod, "foreach_reduce", counted)

    def two_steps(hand_over: bool):
        cfg, base = load_with_base(None, TINY + ["parallel.strategy=fsdp2"])
        session = build(cfg, base)
        try:
            assert session.hand_over, "one rank, no CPU offload: the hand-over is chosen"
            session.hand_over = hand_over
            reductions.clear()
            session.forward_backward(session.next_micro_batches())
            params = [p for p in session.model.parameters() if p.requires_grad]
            assert all(isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in params)
            grads = [p.grad.to_local().clone() for p in params]
            counted_reductions = len(reductions)
            if hand_over:
                _hand_over_keeps_the_storage_and_adds_to_a_kept_gradient(session)
            session.apply_update()
            loss = float(session.step(session.next_micro_batches()).loss)
            weights = [p.detach().to_local().clone() for p in params]
            return grads, counted_reductions, loss, weights
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    ref_grads, ref_reduced, ref_loss, ref_weights = two_steps(hand_over=False)
    grads, n_reduced, loss, weights = two_steps(hand_over=True)
    assert ref_reduced > 0 and n_reduced == 0
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)
    assert loss == ref_loss
    for w, r in zip(weights, ref_weights):
        assert torch.equal(w, r)
    assert pwrap.fsdp_units(torch.nn.Linear(2, 2)) == []
    assert not pwrap.hands_over_gradients([], "fsdp2", 1)  # nothing FSDP2 wrapped
    assert not pwrap.hands_over_gradients(["any"], "ddp", 1) and not pwrap.hands_over_gradients(["any"], "fsdp2", 2)


def _hand_over_keeps_the_storage_and_adds_to_a_kept_gradient(session) -> None:
    """The handed-over gradient is the gathered parameter's gradient tensor itself (no copy); where the shard
    still holds a gradient (zero_grad skipped), the new one is added to it, as autograd accumulates. Leaves the
    shard's gradient as it found it."""
    from novatune.parallel import wrap as pwrap

    records = pwrap.fsdp_param_records(pwrap.fsdp_units(session.model))
    record = next(r for r in records if r.sharded_param.grad is not None)
    kept = record.sharded_param.grad
    first = kept.to_local().clone()
    gathered_grad = torch.full_like(first, 0.5)
    record._unsharded_param.grad = gathered_grad
    assert pwrap.hand_over_gradients(records) == 1
    assert record._unsharded_param.grad is None
    assert torch.equal(record.sharded_param.grad.to_local(), first + 0.5)
    record.sharded_param.grad = None
    record._unsharded_param.grad = gathered_grad
    pwrap.hand_over_gradients(records)
    assert record.sharded_param.grad.to_local().data_ptr() == gathered_grad.data_ptr()
    kept.to_local().copy_(first)
    record.sharded_param.grad = kept


def test_gradients_the_hand_over_cannot_find_stop_the_step(monkeypatch):
    """FSDP2 is told not to reduce over one rank: if the hand-over finds no gradient (a torch whose FSDP2 keeps them
    elsewhere), the step raises, naming the setting that avoids it, instead of stepping with no gradients."""
    import torch.distributed as dist

    from novatune.parallel import wrap as pwrap
    from novatune.train.config import load_with_base
    from novatune.train.session import build

    cfg, base = load_with_base(None, TINY + ["parallel.strategy=fsdp2"])
    session = build(cfg, base)
    try:
        monkeypatch.setattr(pwrap, "hand_over_gradients", lambda records: 0)
        with pytest.raises(RuntimeError, match="parallel.strategy: none"):
            session.forward_backward(session.next_micro_batches())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_wrapper_keeps_the_patched_layers_eager_with_its_reason():
    """FSDP2 re-allocates the gathered layers each step and, over one rank, hooks only the root: the layers' own
    check cannot see it, so the run tells the graph runner (patch/graph_install.py keep_layers_eager)."""
    from novatune.patch.graph_install import keep_layers_eager
    from novatune.patch.graphs import LayerGraphRunner

    class State:
        graphs = None

    layers = [torch.nn.Linear(2, 2)]
    stack = torch.nn.Module()
    stack.layers = torch.nn.ModuleList(layers)
    stack._novatune_state = State()
    stack._novatune_state.graphs = LayerGraphRunner(layers, stack._novatune_state, full_training=False)
    assert stack._novatune_state.graphs._check_layers() != "why"
    assert keep_layers_eager(stack, "why") == 1
    assert stack._novatune_state.graphs._check_layers() == "why"
    assert keep_layers_eager(torch.nn.Linear(2, 2), "why") == 0


def test_a_wrapped_models_document_offsets_go_as_a_host_object():
    """DDP and FSDP2 move every tensor argument of a forward to the GPU (from the host: a blocking copy) before the
    patched attention reads the offsets back: for them the offsets go as HostOffsets, which both pass through,
    and which give the PackedBatch the CPU cu_seq_lens_q gave."""
    from novatune.attention.packed import PackedBatch
    from novatune.data.collate import collate
    from novatune.patch.host_offsets import HOST_OFFSETS_KWARG, HostOffsets
    from novatune.train.session import call_inputs

    rows = [[([5, 6, 7], [False, True, True]), ([8, 9], [False, True])], [([1, 2, 3, 4, 5], [False] + [True] * 4)]]
    mb = collate(rows, pad_id=0, pad_to=5)
    plain = call_inputs(mb, torch.device("cpu"), "host")
    wrapped = call_inputs(mb, torch.device("cpu"), "host", wrapped=True)
    offsets = wrapped[HOST_OFFSETS_KWARG]
    assert isinstance(offsets, HostOffsets) and not any(k.startswith(("cu_seq_lens", "max_length")) for k in wrapped)
    assert {k for k in plain if not k.startswith(("cu_seq_lens", "max_length"))} == set(wrapped) - {HOST_OFFSETS_KWARG}
    from_host = offsets.packed(2, 5, torch.device("cpu"))
    from_tensor = PackedBatch.from_kwargs(batch=2, device="cpu", cu_seq_lens_q=plain["cu_seq_lens_q"],
                                          max_length_q=plain["max_length_q"])
    assert torch.equal(from_host.cu_seqlens_cpu, from_tensor.cu_seqlens_cpu)
    assert (from_host.batch, from_host.seq_len, from_host.max_seqlen) == \
        (from_tensor.batch, from_tensor.seq_len, from_tensor.max_seqlen)
    assert call_inputs(mb, torch.device("cpu"), None, wrapped=True).keys() == {"input_ids", "position_ids", "labels"}


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["none", "fsdp2"])
def test_a_micro_batch_forward_and_backward_never_wait_for_the_gpu(strategy):
    """Plain and FSDP2 over one GPU: after a warm-up step, a step's forward and backward queue their work without
    one host sync (torch's sync debug mode raises on a blocking copy or a synchronize), so the host runs ahead."""
    import torch.distributed as dist

    from novatune.train.config import load_with_base
    from novatune.train.session import build

    cfg, base = load_with_base(None, TINY + [f"parallel.strategy={strategy}", "model.device=cuda"])
    session = build(cfg, base)
    try:
        assert session.packed_kwargs == "host" and session.hand_over == (strategy == "fsdp2")
        session.step(session.next_micro_batches())
        batches = session.batches(1)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            session.forward_backward(batches[0])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.gpu
def test_fsdp2_on_one_gpu_steps_like_the_plain_model():
    """bf16 on CUDA (nccl, one rank; gradients accumulated in bf16 as the plain path accumulates them, then handed
    to the shards).
    The kernels' run-to-run differences (attention's backward is not deterministic) can still flip the sign of a
    gradient element near zero, and AdamW (|update| <= ~lr per step: m / sqrt(v) is about +-1 in the first steps)
    then moves that weight the other way. Bound per element: 2 x 1.5 x lr per step plus one bf16 ulp
    of the weight; and all but 0.1% of the weights match to 1e-2 relative (the kernels' run-to-run differences)."""
    from novatune.train.config import load_with_base

    lr = load_with_base(None, TINY)[0].train.lr
    ref_losses, ref_state, _ = step_twice("none", "full", "cuda")
    losses, state, sharded = step_twice("fsdp2", "full", "cuda")
    assert sharded
    assert losses == pytest.approx(ref_losses, rel=1e-3)
    for k in state:
        got, ref = state[k].float(), ref_state[k].float()
        diff = (got - ref).abs()
        bound = 2 * 2 * 1.5 * lr + ref.abs() * 2.0 ** -7
        assert bool((diff <= bound).all()), f"{k}: {float((diff - bound).max()):.3g} past the Adam-flip bound"
        close = diff <= 1e-3 + 1e-2 * ref.abs()
        assert float(close.float().mean()) >= 0.999, f"{k}: {int((~close).sum())} of {close.numel()} weights differ"


class _FakeRank(pdist.Dist):
    """A rank of a two-process run whose broadcast hands out what rank 0 would send (no process group)."""

    sent: list | None = None

    def broadcast(self, value):
        if self.main:
            self.sent = value
            return value
        assert value is None, "a non-main rank contributes nothing to a broadcast from rank 0"
        return ["dcp/__0_0.distcp does not match its checksum"]


@pytest.mark.parametrize("rank", [0, 1])
def test_sharded_resume_is_verified_by_rank_0_only(rank, tmp_path, monkeypatch):
    """Resuming a DCP checkpoint: rank 0 hashes the folder and broadcasts its verdict; another rank hashes
    nothing and raises the same damage."""
    from novatune.train import checkpoint as ckpt
    from novatune.train import sharded_checkpoint

    hashed = []
    monkeypatch.setattr(ckpt, "verify", lambda path: hashed.append(path) or ["manifest.json is missing"])
    d = _FakeRank(rank=rank, world=2, strategy="fsdp2")
    with pytest.raises(ckpt.CheckpointError, match="is damaged"):
        sharded_checkpoint.load(tmp_path, None, None, None, d)
    assert hashed == ([tmp_path] if rank == 0 else [])
    assert d.sent == (["manifest.json is missing"] if rank == 0 else None)


def test_sharded_save_hashes_each_file_once_spread_over_the_ranks(tmp_path):
    """Saving a DCP checkpoint: every rank hashes its share of the files (not rank 0 all of them); the shares
    cover every file exactly once, with the checksums a one-rank hash gives, and about the same bytes per rank."""
    from novatune.train import checkpoint as ckpt
    from novatune.train.sharded_checkpoint import hash_share

    (tmp_path / "dcp").mkdir()
    sizes = {"dcp/.metadata": 300, "dcp/__0_0.distcp": 5000, "dcp/__1_0.distcp": 4900, "dcp/__2_0.distcp": 5100,
             "rng_0.pt": 40, "rng_1.pt": 40, "rng_2.pt": 40}
    for i, (name, n) in enumerate(sizes.items()):
        (tmp_path / name).write_bytes(bytes([i]) * n)
    algo = ckpt.default_hash()
    shares = [hash_share(tmp_path, pdist.Dist(rank=r, world=3, strategy="fsdp2"), algo) for r in range(3)]
    assert sum(len(s) for s in shares) == len(sizes)                      # disjoint ...
    merged = {n: e for s in shares for n, e in s.items()}
    assert set(merged) == set(sizes)                                      # ... and complete
    assert merged == hash_share(tmp_path, pdist.Dist(), algo)             # the checksums of one rank hashing all
    loads = [sum(e["bytes"] for e in s.values()) for s in shares]
    assert max(loads) - min(loads) <= max(sizes.values())                 # spread, not all on rank 0


@pytest.mark.parametrize("max_norm", [0.05, 1e6])  # clipped, and left as they are
def test_sharded_gradients_are_clipped_by_the_whole_models_norm(max_norm):
    """FSDP2's gradients (DTensors sharded along dim 0) are clipped on their local tensors: the norm and the clipped
    values equal torch's clip_grad_norm_ on the same gradients unsharded (one-member group here; the 2-process runs
    in test_torchrun.py clip with the all-reduced norm)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from novatune.parallel import wrap as pwrap

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3, bias=False))
    sharded = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3, bias=False))
    sharded.load_state_dict(plain.state_dict())
    d = pdist.setup("fsdp2", "cpu")
    try:
        fully_shard(sharded[0])
        fully_shard(sharded)
        x = torch.randn(4, 7)
        for m in (plain, sharded):
            m(x).square().sum().backward()
        want = torch.nn.utils.clip_grad_norm_(list(plain.parameters()), max_norm)
        got = pwrap.clip_grad_norm(list(sharded.parameters()), max_norm)
        assert not isinstance(got, torch.distributed.tensor.DTensor)
        torch.testing.assert_close(got, want)
        for p, q in zip(plain.parameters(), sharded.parameters()):
            torch.testing.assert_close(q.grad.full_tensor(), p.grad)
    finally:
        if d.active:
            dist.destroy_process_group()


def test_replicated_gradients_take_dtensors_own_norm():
    """Gradients that are not sharded along one mesh dimension (a replicated DTensor) are clipped through DTensor's
    own norm: the same norm and clipped values as the plain tensors'."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    from novatune.parallel import wrap as pwrap

    torch.manual_seed(0)
    grads = [torch.randn(5, 3), torch.randn(4)]
    d = pdist.setup("fsdp2", "cpu")
    try:
        mesh = init_device_mesh("cpu", (1,))
        params = []
        for g in grads:
            p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(g), mesh, [Replicate()]))
            p.grad = distribute_tensor(g.clone(), mesh, [Replicate()])
            params.append(p)
        plain = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(plain, grads):
            p.grad = g.clone()
        want = torch.nn.utils.clip_grad_norm_(plain, 0.5)
        got = pwrap.clip_grad_norm(params, 0.5)
        assert not isinstance(got, DTensor)
        torch.testing.assert_close(got, want)
        for p, q in zip(plain, params):
            torch.testing.assert_close(q.grad.full_tensor(), p.grad)
    finally:
        if d.active:
            dist.destroy_process_group()
