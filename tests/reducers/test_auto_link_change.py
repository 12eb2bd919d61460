"""``reducer="auto"`` names a link change only when the probe says so: a re-probe is compared with the
last probe, not with a bandwidth refitted from a call's wire time (which, on shared cores, holds the
call's waiting for slower ranks). Real thread ranks, the probe and call times injected."""

import torch

import sparsync as ss
from sparsync.reducers.registry import make_reducer

N, P, STEPS = 20000, 4, 14
BETA = 1e-7  # the link every probe reads: 10 MB/s, the same all run long


def _ring(nbytes, rounds, beta=BETA):
    return 1e-4 * rounds + beta * nbytes


def _probe(r, ev, beta=BETA):
    """A probe's all-reduce of ``ev["numel"]`` values on a ring with inverse bandwidth ``beta``."""
    p = r.comm.world_size if ev["level"] == "flat" else 2
    return {**ev, "time_s": _ring(2 * (p - 1) * 4 * ev["numel"] / p, 2 * (p - 1), beta)}


def _hook(r, ev):
    """Probes read the same link all run long. Calls: until step 4 their wire time is the model's;
    from step 4 they wait 4x that on the wire at the same total (skew between ranks: 50 ms of CPU
    either way); from step 8 a CPU spike doubles the total."""
    step = r.step
    if ev["event"] == "probe":
        return _probe(r, ev)
    if ev["event"] == "call":
        c = r._cand.stats
        model = _ring(c["bytes_received"], c["rounds"])
        total = 0.05 + model
        wire = model if step < 4 else 4 * model
        return {**ev, "wire_s": wire, "total_s": total if step < 8 else 2 * total}
    if ev["event"] == "window":
        return {**ev, "gap_s": 0.01}
    return ev


def _run(comm, hook=_hook, steps=STEPS, check_every=2, penalty=1.0):
    r = make_reducer("auto", comm, candidates="dense,micro:0.02", check_every=check_every, penalty=penalty)
    r.timings = hook
    g = torch.Generator().manual_seed(comm.rank)
    for _ in range(steps):
        r.reduce(torch.randn(N, generator=g))
    return r.decisions, dict(r.link.levels)


def test_a_cpu_spike_after_a_wire_refit_is_not_called_a_link_change():
    res = ss.run_local(_run, P, backend="thread")
    decisions, link = res[0]
    assert all(d == decisions for d, _ in res)
    assert decisions[0]["chosen"] == "dense", decisions  # the link is fast enough for dense at this size
    spike = [d for d in decisions if d["step"] >= 8 and d["reason"].startswith("measured")]
    assert spike, decisions  # the doubled total deviates from the prediction: a re-decision
    assert all("the link did not" in d["reason"] and "link changed" not in d["reason"] for d in spike), spike
    # the re-probe read the link it always reads (the refit from the waiting wire had moved beta ~4x)
    assert abs(link["flat"][1] / BETA - 1) < 0.2, link


def test_a_calls_waiting_wire_time_does_not_move_the_probed_link():
    # steps 4-7: the calls' wire time is 4x the link's (waiting for slower ranks), their total as
    # predicted: the link stays what the probe read (refitted from those wire times, every candidate
    # crossing it would look 4x slower than it is)
    res = ss.run_local(_run, P, _hook, 8, backend="thread")
    for decisions, link in res:
        assert abs(link["flat"][1] / BETA - 1) < 0.2, (link, decisions)


def _run_counting(comm):
    """:func:`_run`, recording every probe all-reduce as (step, values)."""
    seen = []

    def hook(r, ev):
        if ev["event"] == "probe":
            seen.append((r.step, ev["numel"]))
        return _hook(r, ev)
    decisions, _ = _run(comm, hook)
    return decisions, seen


def test_a_window_off_on_an_unchanged_link_is_rechecked_not_probed_again():
    # the CPU spike from step 8 puts windows off their prediction: each time the probe's bandwidth
    # call is timed once again (one call, the size the start's probe ended at), the link has not
    # moved, and no full probe (its 256-value latency calls, its growing sizes) runs
    res = ss.run_local(_run_counting, P, backend="thread")
    decisions, seen = res[0]
    assert all(d == decisions for d, _ in res)
    start = [v for s, v in seen if s == 0]
    later = [v for s, v in seen if s > 0]
    assert start[0] == 256 and len(start) >= 3, seen  # the start's full probe
    assert later and set(later) == {start[-1]}, seen  # re-checks only: the probe's bandwidth size, once each
    assert any(d["step"] >= 8 and "the link did not" in d["reason"] for d in decisions), decisions


def _drop_hook(r, ev):
    """The link (every probe and every call) is 10 MB/s until step 12, 0.5 MB/s from then on."""
    beta = BETA if r.step < 12 else 20 * BETA
    if ev["event"] == "probe":
        return _probe(r, ev, beta)
    if ev["event"] == "call":
        c = r._cand.stats
        w = _ring(c["bytes_received"], c["rounds"], beta)
        return {**ev, "wire_s": w, "total_s": w + 1e-4}
    if ev["event"] == "window":
        return {**ev, "gap_s": 0.01}
    return ev


def test_a_link_drop_is_decided_at_the_first_window_that_sees_it():
    # the first window off its prediction is re-checked at once and, its bandwidth call 20x slower,
    # probed in full: the probe sees the drop, so auto decides
    # at the first check after it (step 15, its window the calls 12-14), not one window later
    # (penalty 0.5: a Gaussian gradient spreads under error feedback - its top 2 % keep ~0.1 - and
    # micro must win on the slow link)
    res = [d for d, _ in ss.run_local(_run, P, _drop_hook, 24, 3, 0.5, backend="thread")]
    assert all(d == res[0] for d in res)
    assert [d for d in res[0] if d["step"] < 12][-1]["chosen"] == "dense", res[0]
    after = [d for d in res[0] if d["step"] >= 12]
    assert after[0]["step"] == 15 and "link changed" in after[0]["reason"], res[0]
    assert after[0]["chosen"] == "micro:0.02" and after[0]["switched"], res[0]


def _misread_start_hook(r, ev):
    """The start's probe reads a link 100x slower than it is (a rank off its core); every later
    call and probe the real one."""
    beta = 100 * BETA if r.step == 0 else BETA
    if ev["event"] == "probe":
        return _probe(r, ev, beta)
    if ev["event"] == "call":
        c = r._cand.stats
        w = _ring(c["bytes_received"], c["rounds"])
        return {**ev, "wire_s": w, "total_s": w + 1e-4}
    if ev["event"] == "window":
        return {**ev, "gap_s": 0.01}
    return ev


def test_a_start_probe_that_misread_the_link_is_caught_at_the_first_window():
    # the start's probe reads 0.1 MB/s: auto starts on micro; the first window re-checks the link
    # (one call), finds it 100x faster, probes it in full and moves to dense (penalty 1.0: micro's
    # kept mass makes dense the better choice on the real link)
    res = [d for d, _ in ss.run_local(_run, P, _misread_start_hook, 12, 5, backend="thread")]
    assert all(d == res[0] for d in res)
    assert res[0][0]["chosen"] == "micro:0.02", res[0]
    assert res[0][1]["step"] == 10 and "link changed" in res[0][1]["reason"], res[0]
    assert res[0][1]["chosen"] == "dense" and res[0][1]["switched"], res[0]


def _run_planted(comm):
    """:func:`_run` on the dropping link, with micro's time planted before the drop as 100 s per
    call (a time measured on the old link, as if micro had run then)."""
    r = make_reducer("auto", comm, candidates="dense,micro:0.02", check_every=3, penalty=0.5)
    r.timings = _drop_hook
    g = torch.Generator().manual_seed(comm.rank)
    for t in range(24):
        if t == 12:
            r.measured["micro:0.02"] = [100.0]
        r.reduce(torch.randn(N, generator=g))
    return r.decisions


def test_a_changed_link_forgets_every_candidate_s_measured_time():
    # rule 5: the times measured on the old link no longer hold - micro's planted 100 s is forgotten
    # at the drop, and micro is chosen from its model on the new link
    res = ss.run_local(_run_planted, P, backend="thread")
    assert all(d == res[0] for d in res)
    after = [d for d in res[0] if d["step"] >= 12]
    first = after[0]
    assert first["step"] == 15 and "link changed" in first["reason"] and first["chosen"] == "micro:0.02", res[0]
