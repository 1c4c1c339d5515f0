"""ShardLocalAdamW (novatune/parallel/optim.py): torch.optim.AdamW over FSDP2's DTensor parameters with the update
run on the local shards. In a one-member process group (the 2-process runs in test_torchrun.py build it through
the trainer) it must leave the same weights and the same optimizer state as torch.optim.AdamW over the same
DTensors, bit for bit: the same functional AdamW runs on the same local tensors, only the dispatch differs."""
import copy

import pytest
import torch

from novatune.parallel import dist as pdist
from novatune.parallel.optim import ShardLocalAdamW


def _model(dtype):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3, bias=False), torch.nn.Linear(3, 2))
    m[2].weight.requires_grad_(False)  # a frozen weight: no gradient, no state
    return m.to(dtype)


@pytest.fixture
def group():
    import torch.distributed as dist

    d = pdist.setup("fsdp2", "cpu")
    yield
    if d.active:
        dist.destroy_process_group()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_weights_and_state_as_torch_adamw_over_dtensors(group, fused, dtype):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    models = [_model(dtype) for _ in range(2)]
    opts = []
    for m, cls in zip(models, (torch.optim.AdamW, ShardLocalAdamW)):
        fully_shard(m[0])
        fully_shard(m)
        decay = [p for p in m.parameters() if p.requires_grad and p.ndim == 2]
        rest = [p for p in m.parameters() if p.requires_grad and p.ndim < 2]
        opts.append(cls([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                        lr=3e-2, betas=(0.9, 0.95), eps=1e-8, fused=fused))
    for _ in range(3):
        x = torch.randn(4, 7, dtype=dtype)  # fresh inputs each step
        for m, opt in zip(models, opts):
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    ref, got = opts
    assert isinstance(next(models[1].parameters()), DTensor)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor())
    assert not torch.equal(models[1][0].weight.full_tensor(), _model(dtype)[0].weight)  # the weights moved
    a, b = ref.state_dict(), got.state_dict()
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    assert len(b["state"]) == 4  # the frozen weight has none
    for i, st in a["state"].items():
        assert st.keys() == b["state"][i].keys()
        for k, v in st.items():
            w = b["state"][i][k]
            assert type(w) is type(v) and w.dtype == v.dtype and w.device == v.device, k
            assert torch.equal(w.full_tensor() if isinstance(w, DTensor) else w,
                               v.full_tensor() if isinstance(v, DTensor) else v), k


def test_state_round_trips_through_dcp_state_dicts(group):
    """torch.distributed.checkpoint's get/set_optimizer_state_dict (what the sharded checkpoint saves) carry the
    state into a fresh ShardLocalAdamW, which then steps as the original does."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    models = [_model(torch.float32) for _ in range(2)]
    for m in models:
        fully_shard(m)
    opts = [ShardLocalAdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in models]
    x = torch.randn(4, 7)
    models[0](x).sum().backward()
    opts[0].step()
    opts[0].zero_grad(set_to_none=True)
    models[1].load_state_dict(models[0].state_dict())
    # a copy: in one process the loaded state would share the saved tensors, which the first optimizer then updates
    set_optimizer_state_dict(models[1], opts[1], copy.deepcopy(get_optimizer_state_dict(models[0], opts[0])))
    for m, opt in zip(models, opts):
        m(x * 2).sum().backward()
        opt.step()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor())


def test_variants_it_does_not_run_are_refused():
    p, q = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="amsgrad"):
        ShardLocalAdamW([p], amsgrad=True)
    with pytest.raises(ValueError, match="maximize"):  # in a parameter group
        ShardLocalAdamW([{"params": [p]}, {"params": [q], "maximize": True}])
    saved = torch.optim.AdamW([p], amsgrad=True).state_dict()  # a state dict of an amsgrad run
    opt = ShardLocalAdamW([p])
    opt.load_state_dict(saved)
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="amsgrad"):
        opt.step()


def test_a_closure_runs_with_gradients_and_its_loss_comes_back():
    p = torch.nn.Parameter(torch.ones(3))
    opt = ShardLocalAdamW([p], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p * 2).sum()
        loss.backward()
        return loss

    assert float(opt.step(closure).detach()) == 6.0 and bool((p < 1).all())


@pytest.mark.parametrize("bad", [False, True])
def test_a_grad_scaler_unscales_and_skips_as_with_torch_adamw(group, bad):
    """Fused AdamW takes GradScaler's scale and inf flag instead of being unscaled first (torch's contract for
    fused optimizers): the same weights as torch.optim.AdamW, and a step with an inf gradient skipped."""
    from torch.distributed.fsdp import fully_shard

    models = [_model(torch.float32) for _ in range(2)]
    opts, scalers = [], []
    for m, cls in zip(models, (torch.optim.AdamW, ShardLocalAdamW)):
        fully_shard(m)
        opts.append(cls([p for p in m.parameters() if p.requires_grad], lr=1e-2, fused=True))
        scalers.append(torch.amp.GradScaler("cpu", init_scale=2.0 ** 16))
    start = [p.full_tensor().clone() for p in models[1].parameters()]
    x = torch.randn(4, 7)
    for m, opt, scaler in zip(models, opts, scalers):
        loss = m(x).sum() * (float("inf") if bad else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    for p, q, s in zip(models[0].parameters(), models[1].parameters(), start):
        assert torch.equal(p.full_tensor(), q.full_tensor())
        assert torch.equal(q.full_tensor(), s) == (bad or not q.requires_grad)


def test_the_trainer_picks_it_for_sharded_parameters_only(group):
    from torch.distributed.fsdp import fully_shard

    from novatune.train.config import TrainConfig
    from novatune.train.optim import build_optimizer

    plain, sharded = _model(torch.float32), _model(torch.float32)
    fully_shard(sharded)
    cpu = torch.device("cpu")
    assert type(build_optimizer(plain, TrainConfig(), cpu)) is torch.optim.AdamW
    assert type(build_optimizer(sharded, TrainConfig(), cpu)) is ShardLocalAdamW
