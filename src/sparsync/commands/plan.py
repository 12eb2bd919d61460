"""``sparsync plan``: the merge plan for a model, the predicted iteration time of every strategy, and
a ranking of reducers for that model on a network.

Profiles the model's backward pass on this machine (per-tensor times in gradient-ready order, as
MG-WFBP does, docs/engine.md), builds each reducer's cost model ``t(M) = a + b*M`` and predicts one
iteration for every merge strategy (``wfbp``, ``single``, ``buckets:<MB>``, ``mgwfbp``,
``optimal``).

The model: a built-in name (``--list``) or your own, ``--model pkg.module:factory`` (imported from
the current directory like ``python -m``): ``factory()`` returns an ``nn.Module``, or a pair
``(module, example_input)``. Without an example input, ``--input-shape`` gives one sample's shape
(``--input-vocab N``: integer token ids below N); a model whose first layer is ``nn.Linear`` or
``nn.Embedding`` needs neither.

The cost model: by default the reducer's alpha-beta formula (its registered ``predicted_cost``)
for ``--workers`` ranks at ``--bandwidth`` with ``--latency`` per message — communication only,
no selection time; ``--measure loopback|RATE`` times every reducer instead on ``--workers`` real
gloo ranks (over loopback or the emulated cluster, root only), which includes the sparse reducers'
selection on this CPU; ``--a``/``--b`` give it directly. ``R^2`` is the fit quality of ``a + b*M``
to the formula or to the measurements.

``--reducers a,b,c`` prints one row per reducer, fastest first: best merge plan, predicted
iteration, non-overlapped communication, bytes received per rank per step (formula), cost model and
R^2; a note names the reducers within 1 ms or 1 % of the fastest (a tie: their order means nothing)
and those without a formula (ranked with the dense all-reduce's). A prediction of one step, not of
time to accuracy: a sparse reducer may need more steps (docs/choosing.md).
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from . import DENSITY, DURATION, NAMES, NETWORK, RATE, WORKERS, UsageError, doc_text


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="merge plan + predicted iteration time per strategy; rank reducers",
                              description=doc_text(__doc__.split("\n", 1)[1].strip()))
    p.add_argument("--model", default="digits-mlp", help="a built-in model (see --list) or pkg.module:factory")
    p.add_argument("--input-shape", default=None,
                   help="one sample's shape for --model pkg.module:factory, e.g. 3,32,32")
    p.add_argument("--input-vocab", type=WORKERS, default=None,
                   help="integer inputs below N (token ids) instead of floats")
    p.add_argument("--list", action="store_true", help="list the built-in models and exit")
    p.add_argument("--workers", type=WORKERS, default=4, help="number of data-parallel ranks")
    p.add_argument("--bandwidth", type=RATE, default="1gbit", help="per-host link rate, e.g. 1gbit, 10gbit, 125MB/s")
    p.add_argument("--latency", type=DURATION, default="50us", help="per-message latency alpha, e.g. 50us")
    p.add_argument("--reducer", default="dense", help="reducer whose plans are shown (one)")
    p.add_argument("--reducers", type=NAMES, default=None, help="comma list of reducers to rank for this model")
    p.add_argument("--density", type=DENSITY, default=0.01, help="density of the sparse reducers")
    p.add_argument("--measure", type=NETWORK, default=None, metavar="NETWORK",
                   help="time the reducers on --workers real ranks over 'loopback' or an emulated RATE (root)")
    p.add_argument("--a", type=float, help="cost model intercept in seconds (overrides the formula)")
    p.add_argument("--b", type=float, help="cost model slope in seconds per byte (overrides the formula)")
    p.add_argument("--merge", default="optimal", help="strategy whose groups are printed")
    p.add_argument("--buckets-mb", type=float, default=25.0, help="bucket size of the buckets strategy, MiB")
    p.add_argument("--batch-size", type=WORKERS, default=64, help="per-worker batch size of the profiled steps")
    p.add_argument("--steps", type=WORKERS, default=10, help="profiled backward passes (after 3 warm-up)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_run)


# ---------------------------------------------------------------------------- the model
def load_model(spec: str, batch_size: int, input_shape: str | None = None, vocab: int | None = None):
    """``(module, one() -> scalar loss)`` for a built-in name or ``pkg.module:factory``."""
    import torch

    from ..bench.engine import MODELS, build

    if ":" not in spec:
        if spec not in MODELS:
            raise UsageError(f"unknown model {spec!r}; valid: {', '.join(sorted(MODELS))}, or pkg.module:factory")
        model, batch, loss_fn = build(spec, batch_size)
        step = {"i": 0}

        def one():
            x, y = batch(step["i"], 0, 1)
            step["i"] += 1
            return loss_fn(model(x), y)

        return model, one
    mod_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: the user's package in the current directory
    try:
        obj = importlib.import_module(mod_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"--model {spec}: cannot load it ({type(e).__name__}: {e})") from None
    def one():
        out = model(*example) if isinstance(example, (tuple, list)) else model(example)
        if isinstance(out, (tuple, list)):
            out = out[0]
        if isinstance(out, dict):
            out = next(iter(out.values()))
        return out.float().pow(2).mean()  # any scalar: the profile needs backward's timing, not a loss

    # seeded init, example input and lazy materialisation; fork_rng gives the caller its RNG state back
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        made = obj if isinstance(obj, torch.nn.Module) else obj()
        model, example = made if isinstance(made, tuple) else (made, None)
        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"--model {spec}: expected an nn.Module or (nn.Module, example input), got "
                             f"{type(model).__name__}")
        if example is None:
            example = _example_input(model, spec, batch_size, input_shape, vocab)
        try:
            with torch.no_grad():
                one()  # materialises lazy modules (nn.LazyLinear ...) and checks the input fits
        except (RuntimeError, TypeError, ValueError) as e:
            raise UsageError(f"--model {spec}: a forward pass on the example input failed "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); check --input-shape") from None
    return model, one


def _example_input(model, spec, batch_size, input_shape, vocab):
    import torch

    if input_shape:
        try:
            shape = tuple(int(x) for x in input_shape.replace("x", ",").split(",") if x.strip())
        except ValueError:
            raise UsageError(f"--input-shape {input_shape!r}: expected comma-separated integers, "
                             "e.g. 3,32,32") from None
        if vocab:
            return torch.randint(0, vocab, (batch_size, *shape))
        return torch.randn(batch_size, *shape)
    first = next((m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding,
                                                                torch.nn.EmbeddingBag))), None)
    if isinstance(first, torch.nn.Linear):
        return torch.randn(batch_size, first.in_features)
    if first is not None:
        return torch.randint(0, first.num_embeddings, (batch_size, 8))
    raise UsageError(f"--model {spec}: cannot guess its input; give --input-shape (one sample, e.g. 3,32,32) or "
                     "return (module, example_input) from the factory")


# ---------------------------------------------------------------------------- cost models
def _measure_worker(comm, reducers, density, max_bytes):
    import torch

    from ..schedule.costmodel import CostModel

    torch.set_num_threads(1)
    return {r: CostModel.measure(comm, r, density if r != "dense" else 1.0, max_bytes=max_bytes, reps=3).to_dict()
            for r in reducers}


def _measured(reducers, workers, network, density, max_bytes):
    from ..schedule.costmodel import CostModel

    if network == "loopback":
        from ..launch import run_local

        res = run_local(_measure_worker, workers, reducers, density, max_bytes, backend="gloo", timeout=600)
    else:
        from ..cluster import run_emulated
        from ..train.loop import NetworkUnavailable, check_network

        try:
            check_network(network)
        except NetworkUnavailable as e:
            raise UsageError(str(e)) from None
        res = run_emulated(_measure_worker, workers, reducers, density, max_bytes, bandwidth=network, timeout=600)
    return {r: CostModel.from_dict(d) for r, d in res[0].items()}


def _bytes_per_step(reducer: str, P: int, numel: int, density: float) -> float | None:
    """Bytes received per rank per step by the reducer's formula, for the whole gradient."""
    from ..reducers.registry import load_all

    k = numel if reducer == "dense" else min(numel, max(1, round(density * numel)))
    try:
        cost = load_all()[reducer].predicted_cost(P, numel, k)
    except (ValueError, ZeroDivisionError):  # e.g. a method defined for powers of two only
        return None
    if not cost or cost.get("bytes_received") is None:
        return None
    v = cost["bytes_received"]
    return float((v[0] + v[1]) / 2 if isinstance(v, (tuple, list)) else v)


def _run(args) -> int:
    import torch

    from ..bench.engine import MODELS
    from ..schedule.profiler import profile_module

    if args.list:
        print("\n".join(sorted(MODELS)))
        return 0
    reducers = _check_args(args)
    torch.set_num_threads(1)
    model, one = load_model(args.model, args.batch_size, args.input_shape, args.input_vocab)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise UsageError(f"--model {args.model}: no trainable parameters")
    prof, t_f = profile_module(model, one, steps=args.steps, warmup=3)
    sizes = [params[i][1].numel() * params[i][1].element_size() for i in prof.order]
    numel = sum(p.numel() for _, p in params)
    ranking = _rank(args, reducers, prof.t_b, sizes, numel, t_f)
    network = f"measured on {args.workers} ranks over {args.measure}" if args.measure else \
        f"{args.workers} workers, {args.bandwidth}, {args.latency * 1e6:g} us per message"
    focus = next((x for x in ranking if x["reducer"] == args.reducer), ranking[0])
    chosen = focus["rows"][args.merge]["groups"]
    named_groups = [[params[prof.order[k]][0] for k in range(i, j)] for i, j in chosen]
    if args.json:
        tied = _tied_with_fastest(ranking) if len(ranking) > 1 else []
        print(json.dumps({
            "model": args.model, "workers": args.workers, "network": network, "forward_s": t_f,
            "tensors": len(params), "bytes": sum(sizes), "numel": numel,
            "ranking": [{"reducer": x["reducer"], "density": x["density"], "best_merge": x["best_merge"],
                         "iteration_s": x["rows"][x["best_merge"]]["iteration_s"],
                         "non_overlapped_s": x["rows"][x["best_merge"]]["non_overlapped_s"],
                         "bytes_received": x["bytes_received"], "cost_model": x["cost_model"].to_dict(),
                         "tied_with_fastest": x["reducer"] in tied,
                         "strategies": _strategies_json(x["rows"])} for x in ranking],
            "cost_model": focus["cost_model"].to_dict(), "strategies": _strategies_json(focus["rows"]),
            "merge": args.merge, "reducer": focus["reducer"], "groups": named_groups}, indent=1))
        return 0
    print(f"model {args.model}: {len(params)} tensors, {numel:,} parameters, {sum(sizes) / 2**20:.2f} MiB of "
          f"gradients; forward {t_f * 1e3:.2f} ms, backward {sum(prof.t_b) * 1e3:.2f} ms (profiled here, median of "
          f"{args.steps})")
    print(f"network: {network}")
    _print_text(args, ranking, focus, sizes, named_groups)
    return 0


def _check_args(args) -> list[str]:
    """The reducers to rank, after checking every option that would otherwise fail late."""
    from ..reducers.registry import load_all
    from ..schedule.merge import parse_strategy

    reducers = args.reducers or [args.reducer]
    known = load_all()
    bad = [r for r in reducers if r not in known]
    if bad:
        raise UsageError(f"unknown reducer {', '.join(map(repr, bad))}; valid: {', '.join(sorted(known))}")
    try:
        parse_strategy(args.merge)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if (args.a is None) != (args.b is None):
        raise UsageError("give both --a and --b, or neither")
    if args.a is not None and args.measure:
        raise UsageError("--a/--b and --measure both give the cost model; pick one")
    if args.measure:
        from ._preflight import check_site_env

        check_site_env([args.workers], [args.measure])
    return reducers


def _rank(args, reducers, t_b, sizes, numel, t_f) -> list[dict]:
    """Per reducer: its cost model, every merge strategy's predicted step, the best one; fastest first."""
    from ..schedule.costmodel import CostModel
    from ..schedule.merge import evaluate, make_plan

    strategies = ["wfbp", "single", f"buckets:{args.buckets_mb:g}", "mgwfbp", "optimal"]
    if args.merge not in strategies:
        strategies.append(args.merge)

    def dens(r):
        return 1.0 if r == "dense" else args.density

    if args.a is not None:
        cms = {r: CostModel(args.a, args.b, None, "given") for r in reducers}
    elif args.measure:
        cms = _measured(reducers, args.workers, args.measure, args.density, max(sum(sizes), 1 << 12))
    else:
        cms = {r: CostModel.from_formula(r, args.workers, args.latency, args.bandwidth, density=dens(r))
               for r in reducers}
    ranking = []
    for r in reducers:
        cm = cms[r]
        rows = {}
        for s in strategies:
            groups = make_plan(s, t_b, sizes, cm.a, cm.b)
            ev = evaluate(groups, t_b, sizes, cm.a, cm.b, t_f)
            rows[s] = {"groups": groups, **{k: ev[k] for k in ("iteration_s", "non_overlapped_s", "backward_s")}}
        best = min(rows, key=lambda s: rows[s]["iteration_s"])
        ranking.append({"reducer": r, "density": dens(r), "best_merge": best, "rows": rows, "cost_model": cm,
                        "bytes_received": _bytes_per_step(r, args.workers, numel, dens(r))})
    ranking.sort(key=lambda x: x["rows"][x["best_merge"]]["iteration_s"])
    return ranking


#: predicted steps this close to the fastest one are reported as a tie
TIE_S, TIE_REL = 1e-3, 0.01


def _step(x) -> float:
    return x["rows"][x["best_merge"]]["iteration_s"]


def _tied_with_fastest(ranking) -> list[str]:
    """The reducers (ranking order) whose predicted step is within TIE_S or TIE_REL of the fastest."""
    best = _step(ranking[0])
    return [x["reducer"] for x in ranking if _step(x) - best <= max(TIE_S, TIE_REL * best)]


def _strategies_json(rows) -> dict:
    return {s: {k: v for k, v in r.items() if k != "groups"} | {"n_groups": len(r["groups"])}
            for s, r in rows.items()}


def _print_text(args, ranking, focus, sizes, named_groups) -> None:
    """The reducer ranking (several reducers), the focus reducer's strategies and its chosen groups."""
    if len(ranking) > 1:
        print()
        print(f"{'reducer':<16}{'density':>8}{'best plan':>13}{'step (ms)':>11}{'not hidden (ms)':>17}"
              f"{'MB/rank/step':>14}  cost model")
        for x in ranking:
            r = x["rows"][x["best_merge"]]
            mb = "–" if x["bytes_received"] is None else f"{x['bytes_received'] / 1e6:.3f}"
            print(f"{x['reducer']:<16}{x['density']:>8g}{x['best_merge']:>13}{r['iteration_s'] * 1e3:>11.2f}"
                  f"{r['non_overlapped_s'] * 1e3:>17.2f}{mb:>14}  {x['cost_model']}")
        if not args.measure and args.a is None:
            print("(formula cost models count communication only; --measure loopback|RATE includes each "
                  "reducer's selection time on this machine. One step, not time to accuracy: docs/choosing.md)")
            borrowed = [x["reducer"] for x in ranking if "no formula" in x["cost_model"].source]
            if borrowed:
                print(f"({', '.join(borrowed)}: no alpha-beta formula; ranked with the dense ring all-reduce's cost "
                      "model - --measure loopback|RATE gives a real one)")
        tied = _tied_with_fastest(ranking)
        if len(tied) > 1:
            best = _step(ranking[0])
            print(f"(tie: {', '.join(tied)} predict within {TIE_S * 1e3:g} ms or {TIE_REL:.0%} of the fastest "
                  f"({best * 1e3:.2f} ms) - communication hidden behind backward; their order means nothing)")
    print()
    print(f"cost model ({focus['reducer']}, {args.workers} workers): {focus['cost_model']}")
    print(f"{'strategy':<14}{'groups':>8}{'iteration (ms)':>17}{'non-overlapped comm (ms)':>27}")
    for s, r in focus["rows"].items():
        print(f"{s:<14}{len(r['groups']):>8}{r['iteration_s'] * 1e3:>17.2f}{r['non_overlapped_s'] * 1e3:>27.2f}")
    print()
    chosen = focus["rows"][args.merge]["groups"]
    print(f"groups of {args.merge} for {focus['reducer']} (communication order = gradient-ready order):")
    for g, names in enumerate(named_groups):
        nb = sum(sizes[k] for k in range(chosen[g][0], chosen[g][1]))
        shown = names if len(names) <= 4 else names[:2] + [f"... {len(names) - 3} more ..."] + names[-1:]
        print(f"  {g:>3}: {len(names):>3} tensors {nb / 1024:>10.1f} KiB  {', '.join(shown)}")
