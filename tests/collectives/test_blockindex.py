"""16-bit block offsets for sorted indices (sparsync.blockindex) and micro's use of them."""

import pytest
import torch

import sparsync as ss
from sparsync import native
from sparsync.blockindex import block16_bytes, block16_pays, block_count, decode_block16, encode_block16
from sparsync.reducers.micro import MicroReducer


@pytest.mark.parametrize("length,count,start", [(200_000, 3000, 0), (200_000, 5, 12345), (65_536, 65_536, 7),
                                                (65_537, 2, 0), (1_000_000, 40_000, 3_000_000_000), (10, 0, 4)])
def test_roundtrip_exact(length, count, start, kernel):
    g = torch.Generator().manual_seed(length + count)
    rel = torch.randperm(length, generator=g)[:count].sort().values
    if count >= 2:  # the range's ends, so the largest offsets and the last block are used
        rel[0], rel[-1] = 0, length - 1
    idx = rel + start
    nb = block_count(length)
    msg = encode_block16(idx, start, nb)
    assert msg.dtype == torch.int16 and msg.numel() * 2 == block16_bytes(count, nb)
    padded = torch.cat([msg, torch.full((5,), -7, dtype=torch.int16)])  # padding after the message is ignored
    got = decode_block16(padded, start, nb, count)
    assert got.dtype == torch.int64 and torch.equal(got, idx)


def test_gaps_longer_than_a_block_and_empty_blocks(kernel):
    idx = torch.tensor([3, 70_000, 70_001, 400_000, 589_823])  # blocks 0, 1, 1, 6, 8; blocks 2-5 and 7 empty
    nb = block_count(589_824)
    assert nb == 9
    assert torch.equal(decode_block16(encode_block16(idx, 0, nb), 0, nb, 5), idx)


@pytest.mark.skipif(not native.enabled(), reason="C kernels not built")
def test_c_decoder_refuses_counts_that_do_not_add_up():
    idx = torch.tensor([3, 70_000, 70_001])
    msg = encode_block16(idx, 0, 2)
    with pytest.raises(ValueError, match="add up to 3, expected 2"):
        decode_block16(msg, 0, 2, 2)
    with pytest.raises(ValueError, match="shorter than"):
        decode_block16(msg[:5], 0, 2, 3)


def test_block_count_and_the_break_even():
    assert [block_count(n) for n in (0, 1, 65_536, 65_537, 1_087_491)] == [1, 1, 1, 2, 17]
    nb = 17  # n = 4.35M over 4 ranks
    assert not block16_pays(34, nb) and block16_pays(35, nb)  # 2 (34 + 35) = 138 vs 35 * 4 = 140
    assert block16_pays(12, nb, index_bytes=8) and not block16_pays(11, nb, index_bytes=8) and not block16_pays(0, 1)


def _micro_run(comm, indices, n, steps, value_dtype="fp32"):
    r = ss.make_reducer("micro", comm, density=0.02, indices=indices, value_dtype=value_dtype)
    g = torch.Generator().manual_seed(100 + comm.rank)
    rows = []
    for _ in range(steps):
        out = r.reduce(torch.randn(n, generator=g) * torch.linspace(0.1, 3.0, n))
        rows.append((out, r.residual.clone(), dict(r.stats)))
    return rows


@pytest.mark.parametrize("P", [2, 3, 4])
def test_micro_block16_is_bitwise_the_plain_result_with_fewer_bytes(P):
    """The codec only changes the wire: outputs and residuals are bitwise those of plain int32
    indices, and the ledger matches the formula (2 (2 nb + m) bytes per peer instead of 4 m)."""
    n, steps = 300_001, 3  # partitions of 100-150k entries: 2-3 blocks each
    block = ss.run_local(_micro_run, P, "block16", n, steps)
    plain = ss.run_local(_micro_run, P, "plain", n, steps)
    k = round(0.02 * n)
    for s in range(steps):
        counts = [block[r][s][2]["local_selected"] for r in range(P)]
        for r in range(P):
            assert torch.equal(block[r][s][0], plain[r][s][0]) and torch.equal(block[r][s][1], plain[r][s][1])
            pb = MicroReducer.predicted_cost(P, n, k, counts=counts, rank=r, data_window=s < 2, indices="block16")
            pp = MicroReducer.predicted_cost(P, n, k, counts=counts, rank=r, data_window=s < 2, indices="plain")
            assert block[r][s][2]["bytes_received"] == pb["bytes_received"]
            assert plain[r][s][2]["bytes_received"] == pp["bytes_received"]
            nb, m = block_count(-(-n // P)), max(counts)
            assert pp["bytes_received"] - pb["bytes_received"] == (P - 1) * (4 * m - block16_bytes(m, nb)) > 0


def test_micro_indices_option_checked():
    comm = ss.threadcomm.ThreadWorld(1).comms()[0]
    with pytest.raises(ValueError, match="indices must be 'auto', 'block16' or 'plain'"):
        ss.make_reducer("micro", comm, indices="delta")
    # auto: block16 exactly where the values travel in half precision
    assert ss.make_reducer("micro", comm).indices == "plain"
    assert ss.make_reducer("micro", comm, value_dtype="bf16").indices == "block16"
    assert ss.make_reducer("micro", comm, value_dtype="fp16", indices="plain").indices == "plain"
