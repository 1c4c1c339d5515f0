"""proof/checks.py on a tiny Qwen3 patched by novatune (CPU, fp32, the ops' PyTorch references): packing
contamination and gradient-accumulation invariance pass for the real patch and catch the planted faults."""
from __future__ import annotations

import os
import sys

import pytest
import torch

import novatune
from novatune.proof import checks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "patch"))
sys.path.insert(0, os.path.dirname(__file__))
from faults import cross_documents, per_microbatch_loss  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

VOCAB = 257


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch, reference_backend):
    # the interpreter would take minutes at these sizes; the kernels are checked against the references elsewhere
    reference_backend()


def _rows(seed=0):
    """Rows of documents ((ids, mask) pairs) like the packer makes: 4 rows of 3-5 documents, 60-64 tokens."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for r in range(4):
        lens = [int(x) for x in torch.randint(8, 20, (3 + r % 3,), generator=g)]
        rows.append([(torch.randint(0, VOCAB, (n,), generator=g).tolist(), [True] * n) for n in lens])
    return rows


def _patched():
    model = tiny_model("qwen3").train()
    report = novatune.patch(model)
    assert report.replaced("attention")
    return model, report


def test_contamination_clean_for_novatune_and_stock():
    model, report = _patched()
    row = checks.pick_row(_rows())
    assert len(row) >= 3
    nova = checks.contamination(model, row, VOCAB, torch.device("cpu"), "host")
    report.revert()
    stock = checks.contamination(model, row, VOCAB, torch.device("cpu"), None)
    res = checks.contamination_check({"novatune": nova, "stock": stock}, "float32")
    assert res["passed"], res["message"]
    assert [r["perturbed_doc"] for r in nova] == [0, len(row) - 1]
    for r in nova + stock:
        assert r["max_leak"] == 0.0 and r["own_change"] > 0.1  # bit-identical elsewhere, a real change in place
    assert model.training  # the check restores the mode


def test_contamination_catches_attention_across_documents(monkeypatch):
    cross_documents(monkeypatch)
    model, _ = _patched()
    rows = checks.contamination(model, checks.pick_row(_rows()), VOCAB, torch.device("cpu"), "host")
    res = checks.contamination_check({"novatune": rows}, "float32")
    assert not res["passed"] and "attention crosses document boundaries" in res["message"]
    first, last = rows
    assert first["leak_rel"] > 1e-3  # perturbing the first document leaks into every later one
    assert last["max_leak"] == 0.0  # causal: the last document reaches no other


def test_pick_row_composes_a_packed_row_when_rows_hold_one_document():
    single = [[doc] for row in _rows() for doc in row]
    row = checks.pick_row(single)
    assert len(row) == 3 and all(len(ids) >= 2 for ids, _ in row)


@pytest.mark.parametrize("faulty", [False, True], ids=["correct", "per_microbatch_loss"])
def test_grad_accum_invariance(monkeypatch, faulty):
    if faulty:
        per_microbatch_loss(monkeypatch)
    model, report = _patched()
    full, short = checks.ga_rows(_rows(), max_length=64)
    nova = checks.grad_accum_error(model, full, short, torch.device("cpu"), "host")
    assert nova["tokens"][0] > 2 * nova["tokens"][1] > 0  # deliberately unequal micro-batches
    report.revert()
    stock = checks.grad_accum_error(model, full, short, torch.device("cpu"), None)
    assert stock["grad_rel_err"] < 1e-5
    res = checks.grad_accum_check(nova, stock, "float32")
    assert res["passed"] != faulty, res["message"]
    if faulty:
        assert nova["grad_rel_err"] > 0.1 and "num_items_in_batch" in res["message"]


def test_ga_rows_find_the_targets_behind_a_long_masked_prompt():
    """Documents whose masked prompt is longer than a quarter row (the demo's chat turns at max_length 128): the
    short micro-batch takes a window that reaches the first target instead of a prefix with none."""
    rows = [[(list(range(40)), [False] * 30 + [True] * 10)] * 2 for _ in range(3)]
    full, short = checks.ga_rows(rows, max_length=64)
    assert short and all(any(mask[1:]) for _, mask in short)
    assert sum(len(ids) for ids, _ in short) <= 16
    from novatune.data.sources import DataError

    with pytest.raises(DataError, match="no row of the data has a document with a training target"):
        checks.ga_rows([[(list(range(40)), [False] * 40)] for _ in range(3)], max_length=64)
