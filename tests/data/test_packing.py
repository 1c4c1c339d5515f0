"""Packing (best-fit decreasing, over-long handling, efficiency), the collator's boundaries, the resumable stream,
and the property everything rests on: packed documents never see each other."""
from __future__ import annotations

import random

import pytest
import torch

from novatune.data.collate import collate, model_inputs
from novatune.data.dataset import BatchStream
from novatune.data.packing import best_fit_decreasing, pack


def _docs(lengths, seed=0):
    rng = random.Random(seed)
    return [([rng.randrange(3, 500) for _ in range(n)], [True] * n) for n in lengths]


def test_best_fit_decreasing_known_case():
    bins = best_fit_decreasing([5, 4, 3, 3, 2, 2, 1], 10)
    assert sorted(sorted(b) for b in bins) == [[0, 1, 6], [2, 3, 4, 5]]  # 5+4+1 and 3+3+2+2: both full


def test_bfd_places_every_item_once_within_capacity():
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(2000)]
    bins = best_fit_decreasing(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(2000))
    assert all(sum(lengths[i] for i in b) <= 100 for b in bins)
    assert len(bins) <= sum(lengths) / 100 * 1.05 + 2  # BFD on uniform sizes is close to the lower bound


def test_pack_efficiency_and_overlong_counts():
    lengths = [30, 50, 70, 130, 250, 1, 20]  # 130 and 250 are over-long for 100; 1 has nothing to train
    rows, st = pack(_docs(lengths), 100, packing=True, overlong="split")
    assert st.split == 2 and st.empty == 1 and st.dropped == 0 and st.longest == 250
    assert st.docs == 4 + 2 + 3 and st.tokens == sum(lengths) - 1
    assert st.rows == len(rows) == 6 and st.efficiency == pytest.approx(550 / 600)
    assert "split" in st.summary() and "efficiency" in st.summary()
    rows, st = pack(_docs(lengths), 100, packing=True, overlong="drop")
    assert st.dropped == 2 and st.tokens == 170 and st.rows == 2
    rows, st = pack(_docs(lengths), 100, packing=True, overlong="truncate")
    assert st.truncated == 2 and st.tokens == 370
    rows, st = pack(_docs(lengths), 100, packing=False, overlong="split")
    assert st.rows == st.docs == 9


def test_pack_masks_follow_pieces():
    ids = list(range(10, 30))
    mask = [False] * 12 + [True] * 8
    rows, st = pack([(ids, mask)], 10, overlong="split")
    assert st.split == 1 and st.empty == 1  # the first 10-token piece has no target: skipped
    assert rows == [[(ids[10:], mask[10:])]]


def test_collate_boundaries():
    a, b, c = ([1, 2, 3], [True] * 3), ([4, 5], [True, True]), ([6, 7, 8, 9], [True, False, True, True])
    batch = collate([[a, b], [c]], pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    # -100 on every document's first token (no loss across documents), masked tokens and padding
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, 5], [-100, -100, 8, 9, -100]]
    assert batch["cu_seqlens"].tolist() == [0, 3, 5, 9, 10] and batch["cu_seqlens"].device.type == "cpu"
    assert batch["cu_seqlens"].dtype == torch.int32 and batch["max_seqlen"] == 4
    assert batch["num_target_tokens"] == 5 and batch["num_tokens"] == 9
    assert batch["attn_keys"] == (9 + 4 + 16) / 2
    kw = model_inputs(batch, "cpu", "host")
    assert kw["cu_seq_lens_q"] is batch["cu_seqlens"] and kw["max_length_q"] == 4
    assert "cu_seq_lens_q" not in model_inputs(batch, "cpu", None)


def test_collate_pads_to_a_fixed_length_as_an_untrained_segment():
    """pad_to gives every batch one shape: the padding is one more segment of its own (never attended from a
    document), labelled -100 and left out of the token counts, so the loss and its normalisation are unchanged."""
    a, b, c = ([1, 2, 3], [True] * 3), ([4, 5], [True, True]), ([6, 7, 8, 9], [True, False, True, True])
    short, fixed = collate([[a, b], [c]], pad_id=0), collate([[a, b], [c]], pad_id=0, pad_to=8)
    assert fixed["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0], [6, 7, 8, 9, 0, 0, 0, 0]]
    assert fixed["labels"][:, :5].tolist() == short["labels"].tolist() and (fixed["labels"][:, 5:] == -100).all()
    assert fixed["cu_seqlens"].tolist() == [0, 3, 5, 8, 12, 16]
    for key in ("num_target_tokens", "num_tokens", "attn_keys"):
        assert fixed[key] == short[key], key
    assert collate([[a, b], [c]], pad_id=0, pad_to=2)["input_ids"].shape == (2, 5)  # never cuts a row


def test_stream_is_seeded_and_resumable():
    rows = [[d] for d in _docs([5] * 10)]
    s1 = BatchStream(rows, micro_batch=3, seed=7)
    seen = [s1.next()["input_ids"] for _ in range(9)]  # crosses two epoch boundaries
    s2 = BatchStream(rows, micro_batch=3, seed=7)
    for _ in range(4):
        s2.next()
    state = s2.state_dict()
    s3 = BatchStream(rows, micro_batch=3, seed=7)
    s3.load_state_dict(state)
    assert all(torch.equal(s3.next()["input_ids"], x) for x in seen[4:])
    assert BatchStream(rows, 3, seed=8)._order != s1._make_order(0)  # another seed, another order


def _tiny_qwen3(vocab=300, patched=False):
    from transformers import AutoModelForCausalLM

    from novatune.train.arch import arch_config

    cfg = arch_config("qwen3-tiny", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16), vocab)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    if patched:
        from novatune.patch.apply import patch as patch_fn

        patch_fn(model)
    return model


@pytest.mark.parametrize("patched", [False, True], ids=["stock", "patched"])
def test_packed_documents_never_see_each_other(patched):
    """Perturbation: change every token of the middle document; the other documents' logits stay identical."""
    model = _tiny_qwen3(patched=patched)
    docs = _docs([7, 11, 5], seed=1)
    docs = [([t % 300 for t in ids], m) for ids, m in docs]
    other = [([(t * 7 + 3) % 300 for t in docs[1][0]], docs[1][1])]
    b0 = collate([docs])
    b1 = collate([[docs[0], other[0], docs[2]]])
    with torch.no_grad():
        # exactly the trainer's call: position_ids per document, host cu_seqlens, use_cache=False
        out0 = model(**model_inputs(b0, "cpu", "host" if patched else None), use_cache=False).logits
        out1 = model(**model_inputs(b1, "cpu", "host" if patched else None), use_cache=False).logits
    first, middle, last = slice(0, 7), slice(7, 18), slice(18, 23)
    torch.testing.assert_close(out0[0, first], out1[0, first], rtol=0, atol=1e-5)
    torch.testing.assert_close(out0[0, last], out1[0, last], rtol=0, atol=1e-5)
    assert (out0[0, middle] - out1[0, middle]).abs().max() > 1e-2  # the perturbation did reach its own document
    # the last document alone, at positions 0..4, gives the same logits as inside the packed row
    alone = collate([[docs[2]]])
    with torch.no_grad():
        out2 = model(**model_inputs(alone, "cpu", "host" if patched else None), use_cache=False).logits
    torch.testing.assert_close(out2[0], out0[0, last], rtol=0, atol=1e-5)


def test_greedy_packing_fills_rows_in_order_and_cuts_at_row_ends():
    """strategy "greedy" (TRL's wrapped packing, the reference benchmark's rows): documents in order, each row
    filled to max_length, a document that does not fit continues in the next row as its own document."""
    docs = [(list(range(100 * i, 100 * i + n)), [1] * n) for i, n in enumerate([5, 9, 4, 7, 1, 6])]
    rows, stats = pack(docs, 10, strategy="greedy")
    # row 1: 5 + 5 of the 9; row 2: its 4 + 4 + 2 of the 7; row 3: 5 of the 7, (the 1-token doc carries no loss),
    # 5 of the 6; its last token alone would carry no loss either
    assert [[d[0] for d in r] for r in rows] == [
        [[0, 1, 2, 3, 4], [100, 101, 102, 103, 104]],
        [[105, 106, 107, 108], [200, 201, 202, 203], [300, 301]],
        [[302, 303, 304, 305, 306], [500, 501, 502, 503, 504]]]
    assert stats.row_end_cuts == 3 and stats.rows == 3 and stats.efficiency == 1.0
    # none of them was longer than a row: the summary names them as row-end cuts, not over-long splits
    assert stats.split == 0 and "over-long" not in stats.summary() and "3 documents cut at a row end" in \
        stats.summary()
