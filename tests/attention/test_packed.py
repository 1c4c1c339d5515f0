"""PackedBatch: document boundaries from position_ids / cu_seqlens / HF kwargs, lazily built doc ids and BlockMask."""
import pytest
import torch

from novatune.attention import PackedBatch


def positions(rows):
    """rows: list of lists of document lengths -> (batch, seq) position_ids restarting at 0 per document."""
    return torch.tensor([[p for n in row for p in range(n)] for row in rows])


def test_from_position_ids_several_rows():
    # row 0: docs 3, 1, 1 (length-1 docs), 5; row 1: one doc filling the row; row 2: docs 6, 4
    pb = PackedBatch.from_position_ids(positions([[3, 1, 1, 5], [10], [6, 4]]))
    assert (pb.batch, pb.seq_len, pb.total_tokens) == (3, 10, 30)
    assert pb.lengths == [3, 1, 1, 5, 10, 6, 4]
    assert pb.cu_seqlens.dtype == torch.int32
    assert pb.cu_seqlens.tolist() == [0, 3, 4, 5, 10, 20, 26, 30]
    assert pb.num_docs == 7 and pb.max_seqlen == 10 and isinstance(pb.max_seqlen, int)
    assert not pb.one_doc_per_row
    assert pb.device == torch.device("cpu")


def test_one_doc_per_row_flag_and_all_length_one_docs():
    assert PackedBatch.from_position_ids(positions([[8], [8]])).one_doc_per_row
    pb = PackedBatch.from_position_ids(torch.zeros(2, 4, dtype=torch.long))  # every token its own document
    assert pb.lengths == [1] * 8 and pb.max_seqlen == 1 and not pb.one_doc_per_row


def test_positions_not_restarting_at_zero():
    # Documented rule: a document starts at each row start, where position == 0, or where it does not increase by 1.
    pb = PackedBatch.from_position_ids([[5, 6, 7, 0, 1], [0, 1, 2, 10, 11]])
    assert pb.lengths == [3, 2, 3, 2]
    # a row that is the middle of a longer document (no 0 at all) is one document
    assert PackedBatch.from_position_ids([[100, 101, 102, 103]]).lengths == [4]
    # repeated position (not +1) starts a new document even without a 0
    assert PackedBatch.from_position_ids([[0, 1, 1, 2]]).lengths == [2, 2]


def test_1d_and_list_inputs_and_bad_shapes():
    assert PackedBatch.from_position_ids([0, 1, 0, 1, 2]).lengths == [2, 3]
    assert PackedBatch.from_position_ids(torch.tensor([0, 1, 0])).batch == 1
    with pytest.raises(ValueError, match="3-D"):
        PackedBatch.from_position_ids(torch.zeros(3, 1, 4, dtype=torch.long))


def test_from_cu_seqlens():
    pb = PackedBatch.from_cu_seqlens(torch.tensor([0, 4, 5, 12], dtype=torch.int32), max_seqlen=7)
    assert (pb.batch, pb.seq_len, pb.lengths, pb.max_seqlen) == (1, 12, [4, 1, 7], 7)
    pb2 = PackedBatch.from_cu_seqlens([0, 2, 6, 8, 12], batch=2)
    assert pb2.seq_len == 6 and not pb2.one_doc_per_row
    assert PackedBatch.from_cu_seqlens([0, 6, 12], batch=2).one_doc_per_row
    with pytest.raises(ValueError, match="smaller than the longest"):
        PackedBatch.from_cu_seqlens([0, 4, 12], max_seqlen=4)
    with pytest.raises(ValueError, match="strictly increasing"):
        PackedBatch.from_cu_seqlens([0, 4, 4, 12])
    with pytest.raises(ValueError, match="every row must start"):
        PackedBatch.from_cu_seqlens([0, 4, 12], batch=2)  # the 2nd document would span both rows
    with pytest.raises(ValueError, match="start at 0"):
        PackedBatch.from_cu_seqlens([1, 4, 12])


def test_from_kwargs():
    pos = positions([[3, 5], [8]])
    assert PackedBatch.from_kwargs() is None
    assert PackedBatch.from_kwargs(input_ids=torch.zeros(2, 8, dtype=torch.long)) is None
    pb = PackedBatch.from_kwargs(position_ids=pos, attention_mask=torch.ones(2, 8, dtype=torch.long))
    assert pb.lengths == [3, 5, 8]
    # TRL flattening collator: cu_seq_lens_q / max_length_q win over position_ids (already computed)
    cu = torch.tensor([0, 3, 8, 16], dtype=torch.int32)
    pb = PackedBatch.from_kwargs(position_ids=pos.reshape(1, -1), cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(),
                                 max_length_q=8, max_length_k=8)
    assert (pb.batch, pb.lengths) == (1, [3, 5, 8])
    with pytest.raises(ValueError, match="cu_seq_lens_k differs"):
        PackedBatch.from_kwargs(cu_seq_lens_q=cu, cu_seq_lens_k=torch.tensor([0, 8, 16]), max_length_q=8)


def test_from_kwargs_padding():
    pad = torch.ones(2, 8, dtype=torch.long)
    pad[1, 6:] = 0
    with pytest.raises(ValueError, match="padding"):  # padding inside packed rows
        PackedBatch.from_kwargs(position_ids=positions([[3, 5], [8]]), attention_mask=pad)
    # plain padding, one document per row: not ours, stock attention handles it
    assert PackedBatch.from_kwargs(position_ids=positions([[8], [8]]), attention_mask=pad) is None
    # padded rows whose padding has position ids of its own (0 after each row's end): plain padding too
    pad0 = torch.ones(2, 8, dtype=torch.long)
    pad0[0, 6:] = 0
    assert PackedBatch.from_kwargs(position_ids=positions([[6, 1, 1], [8]]), attention_mask=pad0) is None
    # ... but a reset among the unmasked tokens is a second document: packed rows with padding
    with pytest.raises(ValueError, match="padding"):
        PackedBatch.from_kwargs(position_ids=positions([[2, 4, 1, 1], [8]]), attention_mask=pad0)
    with pytest.raises(TypeError, match="2-D"):
        PackedBatch.from_kwargs(position_ids=positions([[8]]), attention_mask=torch.ones(1, 1, 8, 8))


def test_doc_ids_padded():
    pb = PackedBatch.from_position_ids(positions([[2, 3], [5]]))
    assert pb.doc_ids().tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 2, 2]
    assert pb.doc_ids(pad_to=12).tolist()[10:] == [3, 3]
    assert pb.doc_ids() is pb.doc_ids()  # cached


@pytest.mark.parametrize("block", [16, 32])
def test_block_mask_equals_create_block_mask(block):
    """The BlockMask built from the document layout equals create_block_mask's (dense, partial and full tiles)."""
    from torch.nn.attention.flex_attention import create_block_mask

    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        b, s = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 150, (1,), generator=g))
        rows = []
        for _r in range(b):
            row = []
            while sum(row) < s:
                row.append(min(int(torch.randint(1, 70, (1,), generator=g)), s - sum(row)))
            rows.append(row)
        pb = PackedBatch.from_position_ids(positions(rows))
        bm = pb.block_mask(block)
        doc = pb.doc_ids()

        def mask_mod(b_, h, q, kv, doc=doc):
            return (doc[q] == doc[kv]) & (q >= kv)

        ref = create_block_mask(mask_mod, None, None, pb.total_tokens, pb.total_tokens, device="cpu",
                                BLOCK_SIZE=block)
        assert torch.equal(bm.to_dense(), ref.to_dense()), rows
        assert torch.equal(bm.kv_num_blocks, ref.kv_num_blocks), rows
        assert torch.equal(bm.full_kv_num_blocks, ref.full_kv_num_blocks), rows
        assert pb.block_mask(block) is bm  # cached: built once per batch


def test_graph_static_batch_refuses_host_side_work():
    # a CUDA-graph static batch keeps its offsets in a device buffer only: host-side work says so, by name
    pb = PackedBatch.graph_static(torch.tensor([0, 3, 8, 8], dtype=torch.int32), 8, batch=1, seq_len=8)
    for host_side_work in (pb.host_lengths, pb.host_offsets, pb.doc_ids, pb.block_mask):
        with pytest.raises(ValueError, match="graph_static"):
            host_side_work()
