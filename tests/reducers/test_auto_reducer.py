"""``reducer="auto"`` on real thread ranks: the same decision on every rank from different local timings,
no gradient lost across a switch (conservation), bitwise resume across a decision change, a link change
(injected measured times) changes the decision, bad options refused in one line, and SparseDDP /
``sparsync train --reducer auto`` end to end with the decisions in last_stats and metrics.jsonl."""

import json

import pytest
import torch

import sparsync as ss
from sparsync.reducers.auto import AutoReducer, conserving, parse_candidate, penalty_factor
from sparsync.reducers.registry import make_reducer
from sparsync.threadcomm import ThreadWorld

ATOL = 1e-5


def _grad(rank, step, n):
    g = torch.Generator().manual_seed(1000 * step + 17 * rank)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))


def _inject(per_call, window=None):
    """A ``timings`` hook: per call ``per_call(rank, step, candidate) -> (wire_s, total_s)``; the
    window's gap from ``window(rank, step)``; probe times untouched."""
    def hook(r, ev):
        if ev["event"] == "call":
            w, t = per_call(r.comm.rank, r.step, ev["candidate"])
            if t is None:  # exactly what the model predicts for this candidate's wire: no deviation
                t = _model(r) + 1e-4
            return {**ev, "total_s": t}
        if ev["event"] == "window" and window is not None:
            return {**ev, "gap_s": window(r.comm.rank, r.step)}
        return ev
    return hook


def _model(r):
    """The active candidate's modelled wire time (alpha * rounds + beta * bytes on auto's link)."""
    return r.link.wire(r.candidates[r.active], r.numel, r.candidate_options)


def _run(comm, n, steps, per_call, window=None, **opts):
    opts.setdefault("warmup", 1)  # the decision steps these tests expect (the run's first call skipped)
    r = make_reducer("auto", comm, **opts)
    r.timings = _inject(per_call, window)
    rows = []
    for t in range(steps):
        g = _grad(comm.rank, t, n)
        before = r.residual
        before = None if before is None else before.clone()  # a reducer may reuse its residual's memory
        out = r.reduce(g)
        after = r.residual
        rows.append({"g": g, "before": before, "out": out.clone(), "after": None if after is None else after.clone(),
                     "choice": r.choice, "auto": r.stats["auto"]})
    return rows, r.decisions


def test_same_decision_on_every_rank_from_different_local_timings():
    # every rank measures something else; rank 2 sees a much slower wire on dense. The decisions
    # come from the maximum over ranks, so every rank switches at the same step to the same candidate.
    def per_call(rank, step, cand):
        slow = 0.5 if (rank == 2 and cand.startswith("dense")) else 0.001 * (rank + 1)
        return slow, slow + 0.002 * rank
    P, n, steps = 4, 4000, 16
    res = ss.run_local(_run, P, n, steps, per_call, lambda rank, step: 0.01 * rank, backend="thread",
                       candidates="dense,micro:0.05,micro:0.02:fp16", link={"flat": (1e-7, 1e-10)},
                       check_every=3)
    decisions = [d for _, d in res]
    assert all(d == decisions[0] for d in decisions), decisions
    assert decisions[0][0]["chosen"] == "dense"  # the declared fast link
    assert any(d["switched"] and d["chosen"] != "dense" for d in decisions[0][1:]), decisions[0]
    for t in range(steps):
        assert len({rows[t]["choice"] for rows, _ in res}) == 1
        full = [rows[t]["auto"].get("decision") for rows, _ in res]
        assert all(f == full[0] for f in full)  # predictions, scores, kept mass: the same numbers
        for rows, _ in res:
            assert torch.equal(rows[t]["out"], res[0][0][t]["out"])


#: declared links for n = 20000 floats on 4 ranks: bandwidth-bound (1 us per byte: dense's 120 kB cost
#: 0.12 s, a 5 % micro call ~0.03 s) and fast (0.1 ns per byte: every wire under 0.1 ms)
SLOW = {"flat": (1e-6, 1e-6)}
FAST = {"flat": (1e-6, 1e-10)}
N = 20000


@pytest.mark.parametrize("first,then,link", [("micro:0.05", "dense", SLOW), ("dense", "topka:0.05", FAST),
                                             ("micro:0.02", "micro:0.1", SLOW)])
def test_conservation_across_a_switch(first, then, link):
    # the declared link picks `first`; from step 4 it measures 2 s per call: two windows later auto
    # re-decides, and the old candidate's residual goes into the new one - nothing lost
    def per_call(rank, step, cand):
        return (2.0, 2.0) if step >= 4 and cand == parse_candidate(first).spec else (None, None)
    P, steps = 4, 12
    res = ss.run_local(_run, P, N, steps, per_call, backend="thread", candidates=[first, then], link=link,
                       check_every=2, margin=0.0)
    chosen = [rows[t]["choice"] for t in range(steps) for rows, _ in res[:1]]
    assert chosen[0] == parse_candidate(first).spec and parse_candidate(then).spec in chosen, chosen
    for t in range(steps):
        out = res[0][0][t]["out"]
        lhs = sum(rows[t]["g"].double() + (0 if rows[t]["before"] is None else rows[t]["before"].double())
                  for rows, _ in res)
        rhs = out.double() + sum(0 if rows[t]["after"] is None else rows[t]["after"].double() for rows, _ in res)
        assert torch.allclose(lhs, rhs, rtol=0, atol=ATOL * P * 4), (t, (lhs - rhs).abs().max())
    switch = chosen.index(parse_candidate(then).spec)
    carried = [rows[switch]["before"] for rows, _ in res]
    assert first == "dense" or all(c is not None and c.abs().sum() > 0 for c in carried)  # a residual moved


def _resume(comm, n, steps, cut, per_call):
    opts = dict(candidates="dense,micro:0.05,micro:0.02", link=SLOW, check_every=2, margin=0.0)
    a = make_reducer("auto", comm, **opts)
    a.timings = _inject(per_call, lambda rank, step: 0.01)
    outs, choices = [], []
    for t in range(steps):
        outs.append(a.reduce(_grad(comm.rank, t, n)).clone())
        choices.append(a.choice)
        if t == cut:
            state = a.state_dict()
    b = make_reducer("auto", comm, **opts)
    b.timings = _inject(per_call, lambda rank, step: 0.01)
    b.load_state_dict(state)
    for t in range(cut + 1, steps):
        assert torch.equal(b.reduce(_grad(comm.rank, t, n)), outs[t]), f"step {t} differs after resume"
        assert b.choice == choices[t]
    return choices, a.decisions == b.decisions


def test_bitwise_resume_across_a_decision_change():
    def per_call(rank, step, cand):  # from step 5 a sparse call takes 2 s (every micro shares its CPU time)
        return (2.0, 2.0) if (step >= 5 and cand.startswith("micro")) else (None, None)
    res = ss.run_local(_resume, 4, N, 14, 3, per_call, backend="thread")
    choices, same = res[0]
    assert all(r == res[0] for r in res) and same
    assert choices[3].startswith("micro") and choices[-1] == "dense", choices  # changed after the checkpoint


def test_a_lasting_slow_down_changes_the_decision_at_its_second_window():
    # dense on a fast declared link; from step 6 a dense call takes 0.4 s, 1000x its time: the window
    # of calls 6-7 (checked at step 8) is the first off, the window of calls 8-9 the second - auto
    # re-decides at step 10, for the sparse candidate (a declared link is never re-checked)
    def per_call(rank, step, cand):
        return (0.4, 0.41) if step >= 6 else (2e-5, 5e-5)
    res = ss.run_local(_run, 4, N, 14, per_call, lambda rank, step: 0.05, backend="thread",
                       candidates="dense,micro:0.02", link=FAST, check_every=2)
    rows, decisions = res[0]
    assert rows[0]["choice"] == "dense"
    changed = [d for d in decisions if d["switched"] and d["chosen"] == "micro:0.02"]
    assert changed and changed[0]["step"] == 10, decisions
    assert "declared link" in changed[0]["reason"]


def test_penalty_and_candidates():
    assert penalty_factor(1.0) == 1.0 and penalty_factor(0.5, 0.1) == pytest.approx(1.1)
    assert penalty_factor(0.2) > penalty_factor(0.4) > 1
    assert parse_candidate("micro:0.02:fp16").spec == "micro:0.02:fp16"
    assert parse_candidate("hier:micro:0.01").outer == "micro"
    assert parse_candidate("dense:fp16").value_dtype == "fp16"
    comm = ThreadWorld(4).comms()[0]
    r = make_reducer("auto", comm)
    assert [c.spec for c in r.candidates][:3] == ["dense", "dense:fp16", "micro:0.01"]
    assert not r.conserving and "conserving" not in vars(r)  # the class's fact, not overwritten
    assert not all(conserving(c) for c in r.candidates)  # dense fp16 sums rounded values
    assert not any(c.reducer == "hier" for c in r.candidates)  # one site
    h = make_reducer("auto", comm, sites="2x2")
    assert any(c.spec == "hier:micro:0.01:fp16" for c in h.candidates)
    assert make_reducer("auto", comm, candidates="dense,micro:0.01").conserving  # the rule on its candidates
    assert not make_reducer("auto", comm, candidates="dense").indexed_output and r.indexed_output
    r = make_reducer("auto", comm, values="fp32", densities="0.02/0.1")  # CLI spellings
    assert [c.spec for c in r.candidates] == ["dense", "micro:0.02", "micro:0.1"] and r.conserving


@pytest.mark.parametrize("opts,match", [
    ({"candidates": "dense,nosuch:0.01"}, "unknown reducer 'nosuch'"),
    ({"candidates": "micro:2"}, "neither a density"),
    ({"candidates": "hier:0.01"}, "needs its outer"),
    ({"candidates": "hier:micro:0.01"}, "several sites"),
    ({"candidates": "gtopk:0.01:fp16"}, "cannot send fp16"),
    ({"decide_every": 0}, "decide_every"),
    ({"densities": "0.01/x"}, "densities"),
    ({"values": "fp8"}, "values"),
    ({"probe": False}, "probe=False needs link"),
    ({"deviation": 1.0}, "deviation"),
    ({"value_dtype": "fp16"}, "chooses the value precision"),
    ({"link": {"intra": (1, 1)}}, "'flat'"),
])
def test_bad_options_are_refused_in_one_line(opts, match):
    with pytest.raises(ValueError, match=match):
        make_reducer("auto", ThreadWorld(4).comms()[0], **opts)


def test_dense_fp16_is_the_fp16_hook():
    def f(comm):
        r = make_reducer("dense", comm, value_dtype="fp16")
        return r.reduce(_grad(comm.rank, 0, 1000)), r.stats["bytes_received"], r.conserving
    res = ss.run_local(f, 4, backend="thread")
    ref = sum(_grad(r, 0, 1000).half().float() for r in range(4))
    assert all(torch.equal(o, res[0][0]) for o, _, _ in res)
    assert torch.allclose(res[0][0], ref, rtol=2e-3, atol=2e-2)
    assert res[0][1] == 2 * 3 * 1000 * 2 // 4 and res[0][2] is False


def _sgd(fwd, model, rank, steps, after=lambda: None):
    """``steps`` SGD steps of ``fwd`` on per-rank random batches (20 features, 4 classes)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for t in range(steps):
        g = torch.Generator().manual_seed(100 * t + rank)
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(fwd(x), y).backward()
        opt.step()
        after()


def _ddp(comm, steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = ss.SparseDDP(model, comm, reducer="auto", merge="wfbp",
                       reducer_options={"candidates": "dense/micro:0.05", "check_every": 2})
    stats = []
    _sgd(ddp, model, comm.rank, steps, lambda: stats.append(ddp.last_stats["auto"]))
    state = ddp.sparsync_state_dict()
    ddp.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), stats, state


def test_sparse_ddp_reports_each_groups_choice_and_keeps_ranks_identical():
    res = ss.run_local(_ddp, 3, 6, backend="thread")
    params, stats, state = res[0]
    assert all(torch.equal(p, params) for p, _, _ in res)
    assert len(stats[0]) >= 2 and [a["group"] for a in stats[0]] == sorted(a["group"] for a in stats[0])
    assert all("decision" in a and a["decision"]["reason"] == "start" for a in stats[0])
    assert all(a["choice"] in ("dense", "micro:0.05") for st in stats for a in st)
    assert all(s["extra"]["active"] is not None for s in state["reducers"])


def test_train_cli_auto_end_to_end(tmp_path):
    from sparsync.cli import main

    rc = main(["train", "--thread", "--workers", "2", "--reducer", "auto", "--steps", "6", "--eval-every", "3",
               "--runs-dir", str(tmp_path), "--name", "a", "--no-progress", "--option", "check_every=2"])
    assert rc in (0, None)
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert all(r.get("auto_choice") for r in rows)
    assert rows[0]["auto_decisions"][0]["reason"] == "start"
    assert set(rows[0]["auto_decisions"][0]["predicted_ms"]) >= {"dense", "dense:fp16", "micro:0.01:fp16"}
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["auto_decisions"][0]["step"] == 0 and summary["auto_final_choice"] == rows[-1]["auto_choice"]


def test_train_cli_refuses_a_bad_auto_option(tmp_path, capsys):
    from sparsync.cli import main

    rc = main(["train", "--thread", "--workers", "2", "--reducer", "auto", "--steps", "2", "--runs-dir",
               str(tmp_path), "--name", "b", "--no-progress", "--option", "candidates=dense/bogus:0.01"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "unknown reducer 'bogus'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()


def test_auto_is_a_registered_reducer_module():
    assert isinstance(make_reducer("auto", ThreadWorld(2).comms()[0]), AutoReducer)


def test_probed_link_drop_is_named_and_changes_the_decision():
    # no declared link: the probe runs (thread ranks), its times injected from a ring model whose
    # bandwidth drops 20x at step 6 - per rank a little different; every call of the active candidate
    # costs what the model says. auto re-probes when the call times deviate and names the link change.
    P, n = 4, N

    def ring(rank, step, nbytes, rounds):
        beta = (1e-7 if step < 6 else 2e-6) * (1 + 0.1 * rank)  # 10 MB/s, then 0.5 MB/s
        return 1e-4 * rounds + beta * nbytes

    def hook(r, ev):
        rank, step = r.comm.rank, r.step
        if ev["event"] == "probe":
            p = r.comm.world_size if ev["level"] == "flat" else 2
            return {**ev, "time_s": ring(rank, step, 2 * (p - 1) * 4 * ev["numel"] / p, 2 * (p - 1))}
        if ev["event"] == "call":
            c = r._cand.stats  # this call's ledger
            w = ring(rank, step, c["bytes_received"], c["rounds"])
            return {**ev, "wire_s": w, "total_s": w + 1e-4}
        if ev["event"] == "window":
            return {**ev, "gap_s": 0.01}
        return ev

    def run(comm):
        r = make_reducer("auto", comm, candidates="dense,micro:0.02", check_every=2, penalty=1.0, warmup=1,
                           margin=0.0)
        r.timings = hook
        for t in range(14):
            r.reduce(_grad(comm.rank, t, n))
        return r.decisions

    res = ss.run_local(run, P, backend="thread")
    assert all(d == res[0] for d in res)
    assert [d for d in res[0] if d["step"] < 6][-1]["chosen"] == "dense", res[0]  # once a gap was measured
    later = [d for d in res[0] if d["step"] >= 6 and d["chosen"] == "micro:0.02" and d["switched"]]
    # the first window off is probed at once: decided at the first check after the drop (step 8)
    assert later and later[0]["step"] == 8 and "link changed" in later[0]["reason"], res[0]


def _hook_run(comm, steps):
    from torch import nn

    torch.manual_seed(1)
    m = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)))
    hook = ss.ddp_hook("auto", module=m, candidates="dense/micro:0.05", check_every=2)
    m.register_comm_hook(None, hook)
    _sgd(m, m, comm.rank, steps)
    choices = [r.choice for _, r in sorted(hook.reducers.items())]
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]), choices


def test_ddp_hook_auto_keeps_ranks_identical():
    res = ss.run_local(_hook_run, 2, 5, backend="gloo")
    assert torch.equal(res[0][0], res[1][0]) and res[0][1] == res[1][1]
    assert res[0][1] and all(c in ("dense", "micro:0.05") for c in res[0][1])


def test_sites_bring_hier_in_and_it_conserves():
    # two sites of two ranks, a fast link inside a site and a slow one between: the hierarchical
    # exchange is predicted cheaper than flat micro; switching from flat micro into it carries the residual
    link = {"flat": (1e-6, 1e-6), "intra": (1e-6, 1e-10), "inter": (1e-6, 1e-6)}

    def per_call(rank, step, cand):
        return None, None
    P, steps = 4, 6
    res = ss.run_local(_run, P, N, steps, per_call, backend="thread", sites="2x2", link=link, check_every=2,
                       candidates="micro:0.05/hier:micro:0.05", margin=0.0)
    rows, decisions = res[0]
    assert rows[0]["choice"] == "hier:micro:0.05", decisions
    assert set(rows[0]["auto"]["decision"]["predicted_ms"]) == {"micro:0.05", "hier:micro:0.05"}
    for t in range(steps):
        assert all(torch.equal(r[t]["out"], rows[t]["out"]) for r, _ in res)
        lhs = sum(r[t]["g"].double() + (0 if r[t]["before"] is None else r[t]["before"].double()) for r, _ in res)
        rhs = rows[t]["out"].double() + sum(r[t]["after"].double() for r, _ in res)
        assert torch.allclose(lhs, rhs, rtol=0, atol=ATOL * P * 4)


def test_watch_is_refused_in_one_line():
    # the per-call watch was removed (its all-gather per call cost more than it saved): 0 is accepted
    comm = ThreadWorld(4).comms()[0]
    make_reducer("auto", comm, watch=0)
    for bad in (3, 1.0, -2, True, "3"):
        with pytest.raises(ValueError, match="watch was removed"):
            make_reducer("auto", comm, watch=bad)


def _scaled(factor):
    """Each call's wire is the declared link's at the start, and its total ``factor(step)`` times
    that wire + 0.1 ms (fixed per candidate: the refits do not feed back into the times)."""
    first: dict = {}

    def hook(r, ev):
        if ev["event"] == "call":
            w = first.setdefault(ev["candidate"], _model(r))
            return {**ev, "total_s": factor(r.step) * (w + 1e-4)}
        return ev
    return hook


def _run_hook(comm, n, steps, hook, **opts):
    opts.setdefault("warmup", 1)
    r = make_reducer("auto", comm, **opts)
    r.timings = hook
    for t in range(steps):
        r.reduce(_grad(comm.rank, t, n))
    return r.decisions


def test_one_window_off_is_not_a_change_two_in_a_row_the_same_way_are():
    # rule 5 (check_every=2: a window is two calls; the first window, at step 2, is the first decision
    # after the start). Every call of the windows checked at steps 10 / 12 is scaled, so each window
    # is that factor off the candidate's time - 3x is x2.3 with the slack, far beyond deviation 1.5:
    # one window off, then one on time: no decision; off, then off the other way: none; off twice
    # the same way: a decision at the second (step 12), not at the first
    def decided(f10, f12):
        res = ss.run_local(_run_hook, 4, N, 14, _scaled(lambda s: f10 if s in (8, 9) else f12 if s in (10, 11)
                                                        else 1.0), backend="thread",
                           candidates="dense,micro:0.02", link=SLOW, check_every=2)
        assert all(d == res[0] for d in res)
        assert [d["step"] for d in res[0][:2]] == [0, 2], res[0]
        return [d for d in res[0] if d["step"] > 2]
    assert decided(3.0, 1.0) == [] and decided(3.0, 1 / 3) == [] and decided(1 / 3, 1.0) == []
    later = decided(3.0, 3.0)
    assert [d["step"] for d in later] == [12] and "(x2.3" in later[0]["reason"], later
    assert [d["step"] for d in decided(1 / 3, 1 / 3)] == [12]


def test_auto_under_adam_keeps_to_exact_exchanges(tmp_path):
    from sparsync.autotune.candidates import for_adaptive_optimizer
    from sparsync.cli import main

    assert for_adaptive_optimizer({})["candidates"] == ["dense", "dense:fp16"]
    assert for_adaptive_optimizer({"values": "fp32"})["candidates"] == ["dense"]
    assert for_adaptive_optimizer({"densities": "0.2"}) == {"densities": "0.2"}  # the user chose
    # the trainer applies it under adamw: every decision is dense or dense fp16
    argv = ["train", "--thread", "--workload", "digits-mlp", "--workload-option", "width=64", "--workers", "2",
            "--reducer", "auto", "--optimizer", "adamw", "--lr", "0.001", "--steps", "12", "--eval-every", "6",
            "--runs-dir", str(tmp_path), "--name", "a", "--no-progress", "--option", "check_every=2"]
    assert main(argv) == 0
    import json
    choices = {json.loads(ln).get("auto_choice") for ln in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()}
    choices.discard(None)
    assert choices and choices <= {"dense", "dense:fp16"}, choices


def _cpu(r, cand):
    """The CPU part of a candidate's modelled time per call (rule 1), in seconds."""
    return r._time(cand, N) - r.link.wire(cand, N, r.candidate_options)


def test_unmeasured_sparse_reducers_take_the_measured_ones_slow_down():
    # a loaded machine measured on micro (3x its CPU prior) makes the unmeasured topka prior 3x too, so
    # it does not look cheap only because it has not run; dense's prior stays
    from sparsync.autotune.link import CPU_PRIOR_OTHER, CPU_PRIOR_S

    comm = ThreadWorld(4).comms()[0]
    r = make_reducer("auto", comm, candidates="dense,micro:0.02,topka:0.02", link=SLOW)
    top, dense = parse_candidate("topka:0.02"), parse_candidate("dense")
    r.cpu = {"micro": 3 * CPU_PRIOR_S["micro"]}
    assert _cpu(r, top) == pytest.approx(3 * CPU_PRIOR_OTHER * N)
    assert _cpu(r, dense) == pytest.approx(CPU_PRIOR_S["dense"] * N)
    r.cpu = {}
    assert _cpu(r, top) == pytest.approx(CPU_PRIOR_OTHER * N)


def test_cpu_time_is_filed_per_value_precision_and_measured_windows_replace_the_model():
    # dense in fp16 measured slow (gloo sums half values in software): that is dense fp16's, and it
    # must not make dense fp32 - which has not run - look slow; before any measurement dense fp16
    # carries the software-sum prior on a CPU group. A candidate with measured windows: their median.
    from sparsync.autotune.link import CPU_PRIOR_S, HALF_SUM_PRIOR_S

    comm = ThreadWorld(4).comms()[0]
    r = make_reducer("auto", comm, candidates="dense,dense:fp16,micro:0.02,micro:0.02:fp16", link=SLOW)
    d32, d16 = parse_candidate("dense"), parse_candidate("dense:fp16")
    m32 = parse_candidate("micro:0.02")
    assert _cpu(r, d16) == pytest.approx((CPU_PRIOR_S["dense"] + HALF_SUM_PRIOR_S) * N)
    assert _cpu(r, d32) == pytest.approx(CPU_PRIOR_S["dense"] * N)
    r.cpu = {"dense:fp16": 50e-9, "micro:fp16": 20e-9}
    assert _cpu(r, d16) == pytest.approx(50e-9 * N) and _cpu(r, d32) == pytest.approx(CPU_PRIOR_S["dense"] * N)
    assert _cpu(r, m32) == pytest.approx(20e-9 * N)  # the machine factor: 20/5 x prior
    r.measured = {"micro:0.02": [0.3, 0.1, 0.2, 10.0]}
    assert r._time(m32, N) == pytest.approx(0.25)  # the median: one slow window moves it little


def test_the_first_calls_of_a_run_are_not_measurements():
    # the run's first `warmup` calls are 20x slower (a machine warming up): with warmup=3 the first
    # window holds none of them and auto keeps its start candidate; with warmup=1 it measures them
    # and re-decides on them
    def factor(step):
        return 20.0 if step < 3 else 1.0
    for warmup, redecides in ((3, False), (1, True)):
        res = ss.run_local(_run_hook, 4, N, 12, _scaled(factor), backend="thread",
                           candidates="dense,micro:0.02", link=SLOW, check_every=5, warmup=warmup)
        early = [d for d in res[0] if 0 < d["step"] <= 5]
        assert all(d == res[0] for d in res)
        assert bool(early and "vs predicted" in early[0]["reason"]) == redecides, res[0]
        # the first window after the start needs check_every - 1 measured calls: with warmup=3 the
        # one at step 5 holds two (calls 3, 4) and is not read; the one at step 10 holds seven
        assert [d["step"] for d in res[0]][:2] == ([0, 5] if warmup == 1 else [0, 10]), res[0]


def test_probe_grows_until_bytes_dominate_and_ranks_send_the_same_sizes():
    # a slow link: the first bandwidth size already takes far more than the latency call - at least
    # PROBE_SURE_S, or confirmed on twice the size -, and the probe stops there; a fast one
    # (latency-bound at that size): it grows 8x at a time up to min(n, cap). One rank sees a slower
    # link than the others: the growth follows the maximum over ranks, so all ranks send the same
    # sizes (a rank that grew alone would deadlock the others' all-reduce). A rank descheduled for
    # 10 ms at the first bandwidth size does not stop a fast link's probe there (it would read 50x too
    # slow a link).
    from sparsync.autotune.link import PROBE_MAX, PROBE_START, PROBE_SURE_S

    n = 4 * PROBE_MAX

    def run(comm, beta, spread=30, hiccup=0.0, count=False):
        sizes, calls = [], []
        if count:  # each timed all-reduce follows a barrier
            barrier = comm.barrier
            comm.barrier = lambda *a, **k: (calls.append(1), barrier(*a, **k))[1]

        def hook(r, ev):
            if ev["event"] == "probe":
                sizes.append(ev["numel"])
                b = beta * (spread if r.comm.rank == 1 else 1)
                late = hiccup if r.comm.rank == 2 and ev["numel"] == PROBE_START else 0.0
                return {**ev, "time_s": 1e-3 + b * 6 * ev["numel"] + late}
            return ev

        r = make_reducer("auto", comm, candidates="dense,micro:0.02")
        r.timings = hook
        r.link.probe(n)
        return (sizes, len(calls)) if count else (sizes, r.link.levels["flat"][1], *r.link.checks["flat"][:2])

    slow = ss.run_local(run, 4, 1e-7, backend="thread")  # rank 1's call: 0.3 s
    assert all(s == [256, PROBE_START] for s, *_ in slow), slow
    short = ss.run_local(run, 4, 7e-8, 1, backend="thread")  # 8 ms: bandwidth-bound, but short
    assert 4e-3 < 1e-3 + 7e-8 * 6 * PROBE_START < PROBE_SURE_S
    assert all(s == [256, PROBE_START, 2 * PROBE_START] and abs(b / 7e-8 - 1) < 0.01 for s, b, *_ in short), short
    late = ss.run_local(run, 4, 1e-10, 1, 0.01, backend="thread")
    assert all(s == late[0][0] and s[-1] > 2 * PROBE_START for s, *_ in late), late
    assert all(abs(b / 1e-10 - 1) < 0.5 for _, b, *_ in late), late
    # 64 KB in 3.5 ms (latency-bound): 8x that size is expected to take 28 ms, so it is timed once
    # (twice for the rest); it takes 21 ms >= PROBE_SURE_S, bandwidth-bound: the probe stops there
    once = ss.run_local(run, 4, 2.5e-8, 1, 0.0, True, backend="thread")
    assert all(s == ([256, PROBE_START, 8 * PROBE_START], 5) for s in once), once
    fast = ss.run_local(run, 4, 1e-12, backend="thread")
    assert all(s == fast[0][0] for s, *_ in fast) and fast[0][0][-1] == PROBE_MAX, fast
    mixed = ss.run_local(run, 4, 2e-10, backend="thread")  # rank 1 alone would stop at 8x START
    assert all(s == mixed[0][0] for s, *_ in mixed), mixed
    # what a re-check times: the bandwidth call's size halved until the probe puts it at most
    # RECHECK_S (10 ms) - 16 Ki values where even that takes longer (slow: 0.3 s) or where twice it
    # would (short: 8 / 16 ms); the cap where that takes 1.4 ms (fast) - and the time put there
    assert [r[2] for r in slow + short + fast] == [PROBE_START] * 8 + [PROBE_MAX] * 4
    assert [round(1e3 * r[3], 1) for r in short] == [7.9] * 4, short


def test_sparseddp_gets_the_sparse_candidates_indexed_result():
    # auto running micro hands SparseDDP micro's IndexedSum (only the non-zeros are written into .grad,
    # no dense pass), and the averaged gradient is the same bits as micro's alone
    from torch import nn

    def run(comm, reducer, opts):
        m = nn.Sequential(nn.Linear(30, 400), nn.ReLU(), nn.Linear(400, 5))
        g = torch.Generator().manual_seed(0)  # thread ranks share torch's global generator: a local one
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        ddp = ss.SparseDDP(m, comm, reducer=reducer, density=0.05, reducer_options=opts)
        seen = []
        for t in range(3):
            x = torch.randn(16, 30, generator=torch.Generator().manual_seed(10 * t + comm.rank))
            ddp(x).square().mean().backward()
            seen.append(torch.cat([p.grad.reshape(-1).clone() for p in m.parameters()]))
            m.zero_grad(set_to_none=True)
        return ddp.reducers[0].indexed_output, seen

    auto = ss.run_local(run, 2, "auto", {"candidates": "micro:0.05", "link": SLOW}, backend="thread")
    alone = ss.run_local(run, 2, "micro", {}, backend="thread")
    assert auto[0][0] is True
    for (_, a), (_, b) in zip(auto, alone):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
