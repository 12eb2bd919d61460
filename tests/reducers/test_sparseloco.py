"""SparseLoCo's exchange (``sparseloco``): decayed error feedback, chunked top-k, low-bit values with a
per-tensor table, an all-gather of fixed-size messages; and its pieces against references."""

import pytest
import torch

import sparsync as ss
from sparsync import native
from diloco_helpers import run_steps
from sparsync.reducers.memory import ErrorFeedback
from sparsync.reducers.sparseloco import SparseLoCoReducer, selected_count
from sparsync.select.chunked import chunked_topk, short_chunk_k
from sparsync.select.quantise import RANGE_SIGMAS, _pack_matrix, _unpack_matrix, pack_bits, quantise, unpack_bits

N = 1050  # ten chunks of 100 and a short one of 50


def _dyadic(gen, n):
    return torch.randint(-64, 65, (n,), generator=gen).to(torch.float32) / 64


def _brute_chunked(x, chunk, k):
    out = []
    for start in range(0, x.numel(), chunk):
        part = x[start:start + chunk].abs().tolist()
        kk = k if len(part) == chunk else short_chunk_k(k, chunk, len(part))
        order = sorted(range(len(part)), key=lambda i: (-part[i], i))  # larger first, then the lower index
        out += sorted(start + i for i in order[:kk])
    return torch.tensor(out, dtype=torch.int64)


@pytest.fixture(params=["c", "torch"])
def kernels(request):
    """Each selection test on both paths: the C kernels (when built) and the torch kernels."""
    if request.param == "torch":
        with native.switched_off():
            yield request.param
    else:
        if not native.enabled():
            pytest.skip(f"C kernels not built: {native.info()['why']}")
        yield request.param


@pytest.mark.parametrize("n,chunk,k", [(1050, 100, 5), (1000, 100, 7), (37, 8, 3), (5, 8, 2), (4096, 4096, 64),
                                       (300, 100, 100), (4133, 4096, 64)])
def test_chunked_topk_equals_a_brute_force_reference_with_ties_and_a_short_chunk(n, chunk, k, kernels):
    g = torch.Generator().manual_seed(n + k)
    x = torch.randint(-4, 5, (n,), generator=g).to(torch.float32)  # few distinct magnitudes: ties everywhere
    got = chunked_topk(x, chunk, k)
    assert torch.equal(got, _brute_chunked(x, chunk, k))
    y = torch.randn(n, generator=g)
    y[min(chunk, n) - 1], y[chunk % n] = 50.0, -50.0  # the largest entries on a chunk boundary
    assert torch.equal(chunked_topk(y, chunk, k), _brute_chunked(y, chunk, k))


def test_chunked_topk_mixes_chunks_with_and_without_surplus_ties(kernels):
    """All-zero chunks, chunks tied at the k-th magnitude and continuous chunks in one call (only the
    tied ones take the prefix-count path): the brute-force reference, chunk by chunk."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1050, generator=g)
    x[100:200] = 0.0  # every entry tied
    x[300:400] = torch.randint(-2, 3, (100,), generator=g).to(torch.float32)  # many tied at the k-th
    x[500:600] = 3.0
    x[517], x[599] = 5.0, -5.0  # two above, the rest tied: the lowest columns win
    x[1000:] = 0.0  # the short last chunk, all tied
    x[700:800] = -x[700:800].abs()  # signed zeros and a sign that must not matter
    x[700], x[701] = -0.0, 0.0
    x[800:900] = torch.tensor(1.0).nextafter(torch.tensor(2.0)) * torch.randint(1, 3, (100,), generator=g)
    for k in (1, 5, 37, 99, 100):
        assert torch.equal(chunked_topk(x, 100, k), _brute_chunked(x, 100, k))


def test_chunked_topk_where_the_next_chunks_scale_falls_rises_or_meets_the_guess(kernels):
    """The C kernel selects from the entries at or above 0.75 x the previous chunk's k-th magnitude when
    there are at least k of them (else it scans the whole chunk): scales that fall 10x (too few: the full
    scan), rise 10x (most of the chunk) and entries exactly at the guess, tied."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(800, generator=g)
    x[100:200] *= 0.1
    x[200:300] *= 10.0
    k = 5
    t = float(x[200:300].abs().sort(descending=True).values[k - 1])
    x[300:400] = torch.randn(100, generator=g) * 1e-3
    x[300:400:7] = torch.tensor(t, dtype=torch.float32) * torch.tensor(0.75, dtype=torch.float32)  # at the guess
    x[345] = 2 * t  # one above, the rest of the k tied at the guess: the lowest indices win
    x[400:500] = x[300:400].flip(0)
    for kk in (1, k, 17):
        assert torch.equal(chunked_topk(x, 100, kk), _brute_chunked(x, 100, kk))


def test_the_c_and_torch_chunked_topk_agree_on_gradient_like_data():
    """The radix select against the torch form at SparseLoCo's shape, over scales from subnormal to large."""
    if not native.enabled():
        pytest.skip(f"C kernels not built: {native.info()['why']}")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20 * 4096 + 777, generator=g) * torch.logspace(-40, 30, 20 * 4096 + 777).float()
    x[4096:8192] = torch.randn(4096, generator=g) * 1e-42  # subnormals
    got = chunked_topk(x, 4096, 64)
    with native.switched_off():
        assert torch.equal(got, chunked_topk(x, 4096, 64))


def test_bit_packing_round_trip():
    """Every width, grouped (lcm(width, 8) <= 56) or through the bit matrix: the same bytes as the bit
    matrix's LSB-first stream, ceil(m width / 8) of them, and back; counts that end mid-group."""
    g = torch.Generator().manual_seed(0)
    for width in list(range(1, 33)) + [40, 48]:
        for m in (0, 1, 5, 101):
            v = torch.randint(0, 1 << width, (m,), generator=g)
            b = pack_bits(v, width)
            assert b.dtype == torch.uint8 and b.numel() == -(-m * width // 8)
            assert torch.equal(b, _pack_matrix(v, width)), (width, m)
            assert torch.equal(unpack_bits(b, width, m), v) and torch.equal(_unpack_matrix(b, width, m), v)
    two = pack_bits(torch.tensor([0xABC, 0x123]), 12)  # two 12-bit indices in 3 bytes, low bits first
    assert two.tolist() == [0xBC, 0x3A, 0x12]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantiser_decodes_each_value_inside_its_own_bin(bits):
    v = torch.randn(2000, generator=torch.Generator().manual_seed(bits)) * 3
    codes, table = quantise(v, bits)
    dec = table[codes]
    nb, lim = 1 << bits, RANGE_SIGMAS * float(v.square().mean().sqrt())
    again = torch.floor((dec + lim) * (nb / (2 * lim))).clamp(0, nb - 1).long()
    assert torch.equal(again, codes)  # the decode lies in the value's bin
    for c in codes.unique():  # and is the mean of that bin's values
        assert torch.allclose(table[c], v[codes == c].mean(), rtol=1e-5, atol=1e-6)
    assert float((v - dec).square().mean()) < float(v.square().mean())


def test_decayed_error_feedback_law_holds_exactly():
    """sent + new residual == decay x old residual + input, bit for bit (dyadic values, decay 1/2)."""
    m = ErrorFeedback(decay=0.5)
    g = torch.Generator().manual_seed(1)
    m.keep(_dyadic(g, 64))
    old, x = m.residual.clone(), _dyadic(g, 64)
    acc = m.add(x)
    idx = torch.tensor([1, 5, 9])
    vals, sent = m.take(acc, idx)
    total = m.residual.clone()
    total[idx] += sent
    assert torch.equal(total, 0.5 * old + x)
    with pytest.raises(ValueError, match="ef_decay"):
        ErrorFeedback(decay=0.0)


def _steps(comm, opts, steps=3, dyadic=False):
    r = ss.make_reducer("sparseloco", comm, density=0.05, chunk=100, **opts)
    g = torch.Generator().manual_seed(10 + comm.rank)
    rows = []
    for _ in range(steps):
        x = _dyadic(g, N) if dyadic else torch.randn(N, generator=g)
        before = None if r.residual is None else r.residual.clone()
        out = r.reduce(x.clone())
        rows.append((x, before, out.clone(), r.residual.clone(), dict(r.stats)))
    return rows


@pytest.mark.parametrize("bits,decay", [(2, 0.95), (4, 1.0), (8, 0.9), (16, 0.95), (32, 0.5)])
def test_consistent_and_conserving_with_decay(bits, decay):
    P = 4
    res = ss.run_local(_steps, P, {"value_bits": bits, "ef_decay": decay}, 3, bits == 32, backend="thread")
    for s in range(3):
        out = res[0][s][2]
        assert all(torch.equal(res[w][s][2], out) for w in range(P))  # bitwise on every rank
        fed = sum(res[w][s][0] + (0 if res[w][s][1] is None else decay * res[w][s][1]) for w in range(P))
        kept = sum(res[w][s][3] for w in range(P))
        if bits == 32:  # dyadic values, decay 1/2: every operation exact
            assert torch.equal(fed, out + kept)
        else:  # the table's means are not exact: fp32 rounding only
            assert torch.allclose(fed, out + kept, rtol=0, atol=1e-5), float((fed - out - kept).abs().max())
        assert res[0][s][4]["selected"] == selected_count(N, 100, 5) == 52


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_c_and_torch_kernels_give_the_same_bits(bits):
    """The C selection and decode-and-add (:func:`sparsync.native.chunked_topk`, ``add_packed``) against
    the torch kernels: outputs and residuals bit for bit, three steps on 3 thread ranks."""
    if not native.enabled():
        pytest.skip(f"C kernels not built: {native.info()['why']}")
    fast = ss.run_local(_steps, 3, {"value_bits": bits}, 3, backend="thread")
    with native.switched_off():
        slow = ss.run_local(_steps, 3, {"value_bits": bits}, 3, backend="thread")
    for w in range(3):
        for a, b in zip(fast[w], slow[w]):
            assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])


@pytest.mark.parametrize("bits", [2, 4, 8, 16, 32])
def test_ledger_counts_the_packed_message(bits):
    res = ss.run_local(_steps, 3, {"value_bits": bits}, 1, backend="thread")
    want = SparseLoCoReducer.predicted_cost(3, N, chunk=100, value_bits=bits, density=0.05)
    st = res[0][0][4]
    assert st["bytes_received"] == want["bytes_received"] and st["rounds"] == want["rounds"] == 2
    index_bytes, value_bytes = -(-52 * 7 // 8), (52 * bits // 8 if bits >= 16 else -(-52 * bits // 8) + (4 << bits))
    assert want["bytes_received"] == 2 * (index_bytes + value_bytes)


def _topka_vs(comm):
    g = torch.Generator().manual_seed(comm.rank)
    a = ss.make_reducer("sparseloco", comm, density=0.02, chunk=N, value_bits=32, ef_decay=1.0)
    b = ss.make_reducer("topka", comm, density=21 / N)
    return [(a.reduce(x.clone()), b.reduce(x.clone())) for x in [torch.randn(N, generator=g) for _ in range(3)]]


def test_one_chunk_fp32_no_decay_is_topka():
    for outs in ss.run_local(_topka_vs, 3, backend="thread"):
        for a, b in outs:
            assert torch.equal(a, b)


def _gloo_ranks(comm):
    return [row[2] for row in _steps(comm, {"value_bits": 2}, 3)]


@pytest.mark.gloo
def test_ranks_bitwise_equal_on_gloo():
    res = ss.run_local(_gloo_ranks, 3, backend="gloo", timeout=60)
    for s in range(3):
        assert all(torch.equal(r[s], res[0][s]) for r in res)


def _resume(comm):
    g = torch.Generator().manual_seed(comm.rank)
    xs = [torch.randn(N, generator=g) for _ in range(6)]
    straight = ss.make_reducer("sparseloco", comm, density=0.05, chunk=100)
    outs = [straight.reduce(x.clone()) for x in xs]
    first = ss.make_reducer("sparseloco", comm, density=0.05, chunk=100)
    for x in xs[:3]:
        first.reduce(x.clone())
    second = ss.make_reducer("sparseloco", comm, density=0.05, chunk=100)
    second.load_state_dict(first.state_dict())
    return all(torch.equal(second.reduce(x.clone()), o) for x, o in zip(xs[3:], outs[3:]))


def test_mid_run_resume_is_bitwise():
    assert all(ss.run_local(_resume, 3, backend="thread"))


@pytest.mark.parametrize("opts,msg", [({"value_bits": 3}, "value_bits"), ({"ef_decay": 0}, "ef_decay"),
                                      ({"ef_decay": 1.5}, "ef_decay"), ({"chunk": 1}, "chunk"),
                                      ({"chunk": 10, "density": 0.01}, "at least one")])
def test_bad_options_are_one_line_errors(opts, msg):
    def make(comm):
        return ss.make_reducer("sparseloco", comm, **{"density": 0.05, **opts})

    with pytest.raises(ValueError, match=msg) as e:
        ss.run_local(make, 1, backend="thread")
    assert "\n" not in str(e.value).split("\n")[0] and len(str(e.value).splitlines()[0]) < 200


def _diloco(comm, reducer, opts):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    init = torch.Generator().manual_seed(0)  # (thread ranks share torch's global generator)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=init))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = ss.DiLoCo(model, comm, opt, sync_every=1, reducer=reducer, outer_optimizer=torch.optim.SGD(
        model.parameters(), lr=1.0), **opts)
    return run_steps(model, opt, dl, comm.rank)


def test_diloco_h1_dense_no_decay_fp32_is_synchronous_sgd():
    """Through DiLoCo with H = 1, outer SGD lr 1, every entry sent (density 1) in fp32 without decay:
    the same parameters as the dense all-reduce (synchronous SGD), up to float rounding."""
    a = ss.run_local(_diloco, 3, "sparseloco", {"density": 1.0, "chunk": 64, "value_bits": 32, "ef_decay": 1.0},
                     backend="thread")
    b = ss.run_local(_diloco, 3, "dense", {}, backend="thread")
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b))
    c = ss.run_local(_diloco, 3, "sparseloco", {"density": 0.0156, "value_bits": 2}, backend="thread")
    assert all(torch.equal(c[0], x) for x in c)  # the one-line spelling runs, every rank alike


def _one_step(comm, dtype, bits, big):
    r = ss.make_reducer("sparseloco", comm, density=0.05, chunk=100, value_bits=bits, ef_decay=1.0)
    x = torch.randn(N, generator=torch.Generator().manual_seed(3))
    x[7] = big
    x = x.to(dtype)
    return x, r.reduce(x.clone()).clone(), r.residual.clone()


def test_fp16_values_saturate_and_the_rest_stays_in_the_residual():
    """value_bits=16: an entry beyond fp16's range travels as +-65504 and the residual keeps the rest
    (finite: the next step's input check would otherwise refuse the memory)."""
    x, out, res = ss.run_local(_one_step, 1, torch.float32, 16, 1e5, backend="thread")[0]
    assert out[7] == 65504.0 and res[7] == 1e5 - 65504.0 and bool(torch.isfinite(res).all())
    assert torch.equal(out + res, x)  # 16 bits on one rank: every operation exact


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_gradient_is_sent_what_its_residual_subtracts(dtype):
    """With a half-precision gradient the table travels rounded to its dtype, so the receivers add the
    decode the sender subtracted; conservation is then up to the residual's half-precision rounding."""
    x, out, res = ss.run_local(_one_step, 1, dtype, 2, 4.0, backend="thread")[0]
    sent = out != 0
    assert torch.equal(out[sent].to(dtype).float(), out[sent])  # representable in the gradient's dtype
    err = (x.float() - out - res.float()).abs()
    assert bool((err <= res.float().abs() * 2.0 ** -7 + 1e-30).all())  # within the residual's rounding


def test_bench_select_chunked_part_reports_both_paths_with_the_same_bits(capsys):
    from sparsync.cli import main

    assert main(["bench-select", "--parts", "chunked", "--sizes", "10000", "--densities", "0.015625",
                 "--repeat", "1"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row.startswith("| 1e+04 | 64 |") and row.endswith("| True |"), row
