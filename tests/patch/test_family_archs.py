"""The four named family architectures `novatune bench` measures (gemma-2-2b, gemma-3-4b, phi-4-mini, olmo-2-7b:
novatune/train/arch.py), cut to toy size with every quirk of the real config kept: the stock model with the bench's
stock attention (hf_default: sdpa, eager for Gemma 2) keeps packed documents apart (its packed-row loss equals its
loss one document at a time, so the stock row trains the right function), novatune.patch replaces the whole model
(nothing skipped, so the bench's novatune row is novatune's), and the patched packed-row loss and gradients equal
the stock model run one document at a time (documents longer than the sliding windows).

Tolerance: fp32 end to end, as tests/patch/test_gemma.py (kernels through the Triton interpreter and HF differ in
summation order and in the soft-cap's tanh; 2e-5 relative over two layers and the backward).
"""
import pytest
from tiny_models import TINY_ARCH, packed_batch, packed_loss_and_grads, stock_per_document, tiny_arch

import novatune
from novatune.measure.numerics import assert_close

TOL = 2e-5
ROWS = [[5, 17, 1, 9], [32]]


@pytest.mark.parametrize("arch", sorted(TINY_ARCH))
def test_named_architecture_is_patched_whole_and_equals_stock_per_document(arch):
    ids, pos, lab = packed_batch(ROWS)
    model = tiny_arch(arch).train()
    loss_ref, grads_ref = stock_per_document(model, ids, pos, lab)
    stock_packed, _ = packed_loss_and_grads(model, ids, pos, lab)
    assert_close(stock_packed, loss_ref, TOL, "stock packed loss")
    report = novatune.patch(model)
    assert not report.skipped(), str(report)
    assert len(report.replaced("attention")) == 2 and len(report.replaced("mlp")) == 2, str(report)
    loss, grads = packed_loss_and_grads(model, ids, pos, lab)
    assert report.calls["cross_entropy"] == 1
    assert_close(loss, loss_ref, TOL, "loss")
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        assert_close(grads[name], grads_ref[name], TOL, name)
