"""``ef_decay`` in every buffer form of :class:`ErrorFeedback` and on ``micro`` / ``block_allgather`` /
``blocksparse`` (the decayed law exactly), and the ``value_bits`` / ``ef_decay`` options of ``topka``,
``block_allgather`` and ``micro``: today's bits when left at their defaults, SparseLoCo's exchange at one
chunk when set, conservation up to fp32 rounding, the ledger against its formula, every rank alike."""

import pytest
import torch

import sparsync as ss
from diloco_helpers import run_steps
from sparsync.reducers.memory import ErrorFeedback, sum_checked
from sparsync.reducers.blocksparse import BlockAllgatherReducer
from sparsync.reducers.micro import MicroReducer
from sparsync.reducers.topka import TopkAReducer
from sparsync.select.quantise import bits_for, decode_message, encode_message, payload_bytes

N = 1000


def _dyadic(gen, n):
    return torch.randint(-64, 65, (n,), generator=gen).to(torch.float32) / 64


def _raise(values, residual):
    raise FloatingPointError("bad")


FORMS = {"fresh": dict(in_place=False, on_nonfinite=_raise), "fresh unchecked": dict(in_place=False),
         "checked in place": dict(in_place=True, on_nonfinite=_raise), "in place": dict(in_place=True)}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("decay", [1.0, 0.5, 0.95])
def test_every_buffer_form_adds_the_decayed_residual_in_one_rounding(form, decay):
    g = torch.Generator().manual_seed(3)
    m = ErrorFeedback(decay=decay, **FORMS[form])
    m.keep(torch.randn(N, generator=g))
    for _ in range(3):
        old, x = m.residual.clone(), torch.randn(N, generator=g)
        want = old + x if decay == 1.0 else torch.add(x, old, alpha=decay)
        acc = m.add(x)
        assert torch.equal(acc, want), form
        if decay == 0.5:  # dyadic: the decayed sum is exact
            m2 = ErrorFeedback(decay=0.5, **FORMS[form])
            m2.keep(_dyadic(g, N))
            o2, x2 = m2.residual.clone(), _dyadic(g, N)
            assert torch.equal(m2.add(x2), 0.5 * o2 + x2)
        idx = torch.arange(0, N, 7)
        vals, sent = m.take(acc, idx)
        back = m.residual.clone()
        back[idx] += sent
        assert torch.equal(back, want)  # sent + new residual == decay x old residual + input
    padded = ErrorFeedback(decay=decay, **FORMS[form])  # SparDL's zero-padded form
    padded.keep(old)
    a = padded.add(x, padded=N + 24)
    assert torch.equal(a[:N], old + x if decay == 1.0 else torch.add(x, old, alpha=decay)) and not a[N:].any()


def test_decay_one_keeps_the_native_kernel_bits_and_decay_keeps_the_check():
    g = torch.Generator().manual_seed(4)
    r, x = torch.randn(N, generator=g), torch.randn(N, generator=g)
    assert torch.equal(sum_checked(torch.empty(N), x, r, _raise), x + r)
    assert torch.equal(sum_checked(torch.empty(N), x, r, _raise, 0.9), torch.add(x, r, alpha=0.9))
    m = ErrorFeedback(decay=0.9, in_place=True, on_nonfinite=_raise)
    m.keep(r.clone())
    bad = x.clone()
    bad[5] = float("nan")
    with pytest.raises(FloatingPointError):
        m.add(bad)
    assert torch.equal(m.residual, r)  # unchanged: nothing absorbed


def test_a_decayed_memory_offers_no_fold_target():
    m = ErrorFeedback(decay=0.9, in_place=True)
    m.keep(torch.zeros(N))
    assert m.fold_target(N, torch.float32, torch.device("cpu")) is None
    m.decay = 1.0
    assert m.fold_target(N, torch.float32, torch.device("cpu")) is m.residual


@pytest.mark.parametrize("bits", [2, 4, 8, 16, 32])
def test_message_codec_round_trip_and_size(bits):
    g = torch.Generator().manual_seed(bits)
    where = torch.randint(0, N, (77,), generator=g)
    vals = torch.randn(77, generator=g)
    msg, dec = encode_message(where, bits_for(N), vals, bits)
    assert msg.dtype == torch.uint8 and msg.numel() == payload_bytes(77, bits_for(N), bits)
    w, v = decode_message(msg, 77, bits_for(N), bits)
    assert torch.equal(w, where) and torch.equal(v, dec)
    if bits == 32:
        assert torch.equal(dec, vals)
    blocks = torch.randn(77 * 5, generator=g)  # five values per position (a block's)
    msg, dec = encode_message(where, bits_for(N), blocks, bits)
    assert msg.numel() == payload_bytes(77, bits_for(N), bits, per=5)
    w, v = decode_message(msg, 77, bits_for(N), bits, per=5)
    assert torch.equal(w, where) and torch.equal(v, dec.to(torch.float32))


def _pair(comm, a_opts, b_name, b_opts, steps=3, dtype=torch.float32):
    g = torch.Generator().manual_seed(comm.rank)
    a = ss.make_reducer("topka", comm, density=0.03, **a_opts)
    b = ss.make_reducer(b_name, comm, density=0.03, **b_opts)
    rows = []
    for _ in range(steps):
        x = torch.randn(N, generator=g).to(dtype)
        rows.append((a.reduce(x.clone()).clone(), b.reduce(x.clone()).clone(), a.residual.clone(), b.residual.clone()))
    return rows, a.conserving, dict(a.stats)


@pytest.mark.parametrize("a_opts,b_opts", [({"value_bits": 32, "ef_decay": 1.0}, {}),
                                           ({"value_bits": 16}, {"value_dtype": "fp16"}),
                                           ({"value_bits": 16, "value_dtype": "bf16"}, {"value_dtype": "fp16"}),
                                           ({"value_bits": 32, "value_dtype": "fp16"}, {})])
def test_topka_at_16_and_32_bits_is_todays_topka_bit_for_bit(a_opts, b_opts):
    for rows, conserving, _ in ss.run_local(_pair, 3, a_opts, "topka", b_opts, backend="thread"):
        assert conserving
        for a, b, ra, rb in rows:
            assert torch.equal(a, b) and torch.equal(ra, rb)


@pytest.mark.parametrize("bits,decay", [(2, 0.95), (4, 1.0), (8, 0.9), (32, 0.9)])
def test_topka_with_value_bits_and_decay_is_sparseloco_at_one_chunk(bits, decay):
    opts = {"value_bits": bits, "ef_decay": decay}
    for rows, conserving, _ in ss.run_local(_pair, 3, opts, "sparseloco", {**opts, "chunk": N}, backend="thread"):
        assert not conserving
        for a, b, ra, rb in rows:
            assert torch.equal(a, b) and torch.equal(ra, rb)


def _steps(comm, opts, steps=3):
    r = ss.make_reducer("topka", comm, density=0.03, **opts)
    g = torch.Generator().manual_seed(20 + comm.rank)
    rows = []
    for _ in range(steps):
        x = torch.randn(N, generator=g)
        before = None if r.residual is None else r.residual.clone()
        out = r.reduce(x.clone()).clone()
        rows.append((x, before, out, r.residual.clone(), dict(r.stats)))
    return rows


def _assert_alike_and_conserving(rows, decay):
    """``rows[w]``: rank ``w``'s ``(input, residual before, output, residual after, ...)`` of one step: the
    output alike on every rank, and ``sum_r (decay * before_r + input_r) == out + sum_r after_r`` up to fp32
    rounding."""
    out = rows[0][2]
    assert all(torch.equal(r[2], out) for r in rows)
    fed = sum(r[0] + (0 if r[1] is None else decay * r[1]) for r in rows)
    kept = sum(r[3] for r in rows)
    assert torch.allclose(fed, out + kept, rtol=0, atol=1e-5), float((fed - out - kept).abs().max())


@pytest.mark.parametrize("bits,decay", [(2, 0.95), (4, 1.0), (8, 0.5)])
def test_topka_packed_conserves_is_the_same_on_every_rank_and_counts_its_bytes(bits, decay):
    P = 4
    res = ss.run_local(_steps, P, {"value_bits": bits, "ef_decay": decay}, backend="thread")
    k = round(0.03 * N)
    want = TopkAReducer.predicted_cost(P, N, k, value_bits=bits)
    assert want == {"rounds": P - 1, "bytes_received": (P - 1) * (-(-k * 10 // 8) + -(-k * bits // 8) + (4 << bits))}
    for s in range(3):
        _assert_alike_and_conserving([res[w][s] for w in range(P)], decay)
        st = res[0][s][4]
        assert st["selected"] == k and st["rounds"] == want["rounds"]
        assert st["bytes_received"] == want["bytes_received"] and st["bytes_sent"] == want["bytes_received"]


@pytest.mark.parametrize("opts,msg", [({"value_bits": 3}, "topka: value_bits"), ({"value_bits": True}, "value_bits"),
                                      ({"ef_decay": 0}, "topka: ef_decay"), ({"ef_decay": 1.01}, "ef_decay")])
def test_topka_bad_options_are_one_line_errors(opts, msg):
    with pytest.raises(ValueError, match=msg) as e:
        ss.run_local(lambda comm: ss.make_reducer("topka", comm, density=0.05, **opts), 1, backend="thread")
    assert len(str(e.value).splitlines()) == 1


def _blocks(comm, opts, steps=3):
    r = ss.make_reducer("block_allgather", comm, density=0.1, block_size=16, **opts)
    g = torch.Generator().manual_seed(30 + comm.rank)
    rows = []
    for _ in range(steps):
        x = torch.randn(N, generator=g)  # N = 62.5 blocks: the short last block is in play
        before = None if r.residual is None else r.residual.clone()
        rows.append((x, before, r.reduce(x.clone()).clone(), r.residual.clone(), dict(r.stats)))
    return rows, r.conserving


def test_block_allgather_at_32_bits_is_todays_bit_for_bit():
    for (a, ca), (b, cb) in zip(ss.run_local(_blocks, 3, {"value_bits": 32}, backend="thread"),
                                ss.run_local(_blocks, 3, {}, backend="thread")):
        assert ca and cb
        for ra, rb in zip(a, b):
            assert torch.equal(ra[2], rb[2]) and torch.equal(ra[3], rb[3])


@pytest.mark.parametrize("bits,decay", [(2, 0.95), (4, 1.0), (8, 0.9), (16, 1.0)])
def test_block_allgather_packed_conserves_is_the_same_on_every_rank_and_counts_its_bytes(bits, decay):
    P, bs = 3, 16
    res = ss.run_local(_blocks, P, {"value_bits": bits, "ef_decay": decay}, backend="thread")
    K = round(0.1 * -(-N // bs))
    want = BlockAllgatherReducer.predicted_cost(P, N, K * bs, block_size=bs, value_bits=bits)
    values = 2 * K * bs if bits == 16 else -(-K * bs * bits // 8) + (4 << bits)
    assert want == {"rounds": P - 1, "bytes_received": (P - 1) * (-(-K * 6 // 8) + values)}
    assert not any(c for _, c in res)
    for s in range(3):
        _assert_alike_and_conserving([res[w][0][s] for w in range(P)], decay)
        st = res[0][0][s][4]
        assert st["rounds"] == want["rounds"] and st["bytes_received"] == want["bytes_received"]


def _micro(comm, opts, steps=4):
    r = ss.make_reducer("micro", comm, density=0.02, **opts)
    g = torch.Generator().manual_seed(40 + comm.rank)
    rows = []
    for _ in range(steps):
        x = torch.randn(5 * N, generator=g)
        before = None if r.residual is None else r.residual.clone()
        rows.append((x, before, r.reduce(x.clone()).clone(), r.residual.clone(), dict(r.stats)))
    return rows, (r.conserving, r.values, r.indices)


def test_micro_at_32_bits_is_todays_bit_for_bit():
    for (a, fa), (b, fb) in zip(ss.run_local(_micro, 3, {"value_bits": 32}, backend="thread"),
                                ss.run_local(_micro, 3, {}, backend="thread")):
        assert fa == fb == (True, "owner", "plain")
        for ra, rb in zip(a, b):
            assert torch.equal(ra[2], rb[2]) and torch.equal(ra[3], rb[3])


@pytest.mark.parametrize("bits,decay", [(2, 0.95), (4, 1.0), (8, 0.9), (16, 1.0)])
def test_micro_coded_values_conserve_are_the_same_on_every_rank_and_count_their_bytes(bits, decay):
    """Below 16 bits the values travel coded on the gather path (block16 indices); 16 bits is fp16 values."""
    P = 4
    res = ss.run_local(_micro, P, {"value_bits": bits, "ef_decay": decay}, backend="thread")
    assert all(f == ((False, "gather", "block16") if bits < 16 else (True, "owner", "block16")) for _, f in res)
    for s in range(4):
        _assert_alike_and_conserving([res[w][0][s] for w in range(P)], decay)
        counts = [res[w][0][s][4]["local_selected"] for w in range(P)]
        for w in range(P):
            want = MicroReducer.predicted_cost(P, 5 * N, round(0.02 * 5 * N), counts=counts, value_bits=bits,
                                               data_window=s < 2, rank=w)
            st = res[w][0][s][4]
            assert (st["rounds"], st["bytes_received"]) == (want["rounds"], want["bytes_received"])
    if bits < 16:  # against fp32 values on the same path: the values' bytes are codes and a table per peer
        K, at = sum(counts), dict(counts=counts, values="gather", indices="block16")
        coded = MicroReducer.predicted_cost(P, 5 * N, 0, value_bits=bits, **at)["bytes_received"]
        plain = MicroReducer.predicted_cost(P, 5 * N, 0, value_bits=32, **at)["bytes_received"]
        assert coded - plain == (P - 1) * (-(-K * bits // 8) + (4 << bits) - 4 * K)


def test_micro_coded_values_need_the_gather_path():
    with pytest.raises(ValueError, match="micro: value_bits=2 needs values='gather'") as e:
        ss.run_local(lambda comm: ss.make_reducer("micro", comm, value_bits=2, values="owner"), 1, backend="thread")
    assert len(str(e.value).splitlines()) == 1


def _gloo_coded(comm, name):
    if name == "micro":
        return [row[2] for row in _micro(comm, {"value_bits": 2, "ef_decay": 0.95}, 2)[0]]
    return [row[2] for row in _blocks(comm, {"value_bits": 2, "ef_decay": 0.95}, 2)[0]]


@pytest.mark.gloo
@pytest.mark.parametrize("name", ["block_allgather", "micro"])
def test_coded_values_ranks_bitwise_equal_on_gloo(name):
    res = ss.run_local(_gloo_coded, 3, name, backend="gloo", timeout=60)
    for s in range(2):
        assert all(torch.equal(r[s], res[0][s]) for r in res)


def _diloco(comm, opts):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = ss.DiLoCo(model, comm, opt, sync_every=2, reducer="topka", density=0.1, **opts)
    return run_steps(model, opt, dl, comm.rank)


def test_diloco_topka_with_value_bits_over_its_fp16_default():
    """DiLoCo gives topka ``value_dtype="fp16"`` unless told otherwise; ``value_bits`` decides over it."""
    res = ss.run_local(_diloco, 2, {"value_bits": 2, "ef_decay": 0.95}, backend="thread")
    assert torch.equal(res[0], res[1]) and bool(torch.isfinite(res[0]).all())


def _gloo(comm):
    return [row[2] for row in _steps(comm, {"value_bits": 4, "ef_decay": 0.9}, 2)]


@pytest.mark.gloo
def test_topka_packed_ranks_bitwise_equal_on_gloo():
    res = ss.run_local(_gloo, 3, backend="gloo", timeout=60)
    for s in range(2):
        assert all(torch.equal(r[s], res[0][s]) for r in res)


def _make(comm, name, density, options):
    return ss.make_reducer(name, comm, density, **options)


def test_a_compare_config_passes_value_bits_to_every_all_gather_reducer():
    from sparsync.commands.compare import parse_configs
    from sparsync.reducers.registry import load_all

    for name in ("sparseloco", "topka", "micro", "block_allgather"):
        (c,) = parse_configs(f"{name}:0.0156,sync_every=4,value_bits=2,ef_decay=0.9", 0.01, "single")
        assert c["reducer"] == name and c["density"] == 0.0156 and c["local"] == {"sync_every": 4}
        assert c["options"] == {"value_bits": 2, "ef_decay": 0.9}
        load_all()[name].check_options(c["options"])
        r = ss.run_local(_make, 1, name, c["density"], c["options"])[0]
        assert (r.value_bits, r.ef_decay, r.memory.decay) == (2, 0.9, 0.9)


def _decayed_steps(comm, name, decay):
    r = ss.make_reducer(name, comm, density=0.05, ef_decay=decay)
    g = torch.Generator().manual_seed(20 + comm.rank)
    rows = []
    for _ in range(3):
        x = _dyadic(g, N)
        before = None if r.residual is None else r.residual.clone()
        out = r.reduce(x.clone())
        rows.append((x, before, out.clone(), r.residual.clone()))
    return rows, r.conserving


@pytest.mark.parametrize("name", ["micro", "block_allgather", "blocksparse"])
@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_ef_decay_on_the_other_all_gather_reducers_keeps_the_decayed_law_exactly(name, decay):
    """``sum_r (decay * residual_before_r + grad_r) == out + sum_r residual_after_r`` bit for bit on dyadic
    values (every operation exact), the output alike on every rank, and ``conserving`` only without decay."""
    res = ss.run_local(_decayed_steps, 3, name, decay, backend="thread")
    for s in range(3):
        out = res[0][0][s][2]
        assert all(torch.equal(res[w][0][s][2], out) for w in range(3))
        fed = sum(res[w][0][s][0] + (0 if res[w][0][s][1] is None else decay * res[w][0][s][1]) for w in range(3))
        assert torch.equal(fed, out + sum(res[w][0][s][3] for w in range(3)))
    assert all(c == (decay == 1.0) for _, c in res)
    with pytest.raises(ValueError, match=f"{name}: ef_decay") as e:
        ss.run_local(lambda comm: ss.make_reducer(name, comm, ef_decay=0.0), 1, backend="thread")
    assert len(str(e.value).splitlines()) == 1
