"""``sparsync plan``: the merge plan for a model, and the predicted iteration time of every strategy.

Profiles the model's backward pass on this machine (per-tensor times in gradient-ready order,
``spec/mgwfbp.md`` §5.1), builds the cost model ``a + b*bytes`` of the chosen reducer from its
alpha-beta formula for ``--workers`` ranks at ``--bandwidth`` with per-message ``--latency`` (or
takes ``--a``/``--b`` directly), then prints, for ``wfbp``, ``single``, ``buckets:<MB>``,
``mgwfbp`` (Algorithm 1) and ``optimal`` (exact DP): the number of groups, predicted iteration time
and predicted non-overlapped communication, and the groups of the ``--merge`` strategy.
"""

from __future__ import annotations

import json


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="merge plan + predicted iteration time per strategy for a model",
                              description=__doc__.split("\n\n")[1] if "\n\n" in __doc__ else __doc__)
    p.add_argument("--model", default="digits-mlp", help="model name (see --list)")
    p.add_argument("--list", action="store_true", help="list the models and exit")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--bandwidth", default="1gbit", help="per-host link, e.g. 1gbit, 10gbit, 125MB")
    p.add_argument("--latency", default="50us", help="per-message latency alpha, e.g. 50us")
    p.add_argument("--reducer", default="dense")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--a", type=float, help="cost model intercept in seconds (overrides the formula)")
    p.add_argument("--b", type=float, help="cost model slope in seconds per byte (overrides the formula)")
    p.add_argument("--merge", default="optimal", help="strategy whose groups are printed")
    p.add_argument("--buckets-mb", type=float, default=25.0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="profiled backward passes (after 3 warm-up)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_run)


def _run(args) -> int:
    import torch

    from ..bench.engine import MODELS, build
    from ..schedule.costmodel import CostModel, parse_seconds
    from ..schedule.merge import evaluate, make_plan, parse_strategy
    from ..schedule.profiler import profile_module

    if args.list:
        print("\n".join(sorted(MODELS)))
        return 0
    if args.model not in MODELS:
        print(f"unknown model {args.model!r}; valid: {', '.join(sorted(MODELS))}")
        return 2
    if args.workers < 1:
        print("--workers must be >= 1")
        return 2
    try:
        parse_strategy(args.merge)
        if (args.a is None) != (args.b is None):
            raise ValueError("give both --a and --b, or neither")
        if args.a is not None:
            cm = CostModel(args.a, args.b, None, "given")
        else:
            cm = CostModel.from_formula(args.reducer, args.workers, parse_seconds(args.latency), args.bandwidth,
                                        density=args.density if args.reducer != "dense" else 1.0)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    torch.set_num_threads(1)
    model, batch, loss_fn = build(args.model, args.batch_size)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    step = {"i": 0}

    def one():
        x, y = batch(step["i"], 0, args.workers)
        step["i"] += 1
        return loss_fn(model(x), y)

    prof, t_f = profile_module(model, one, steps=args.steps, warmup=3)
    sizes = [params[i][1].numel() * params[i][1].element_size() for i in prof.order]
    strategies = ["wfbp", "single", f"buckets:{args.buckets_mb:g}", "mgwfbp", "optimal"]
    if args.merge not in strategies:
        strategies.append(args.merge)
    rows = {}
    for s in strategies:
        groups = make_plan(s, prof.t_b, sizes, cm.a, cm.b)
        ev = evaluate(groups, prof.t_b, sizes, cm.a, cm.b, t_f)
        rows[s] = {"groups": groups, **{k: ev[k] for k in ("iteration_s", "non_overlapped_s", "backward_s")}}
    chosen = rows[args.merge]["groups"]
    named_groups = [[params[prof.order[k]][0] for k in range(i, j)] for i, j in chosen]
    if args.json:
        print(json.dumps({"model": args.model, "workers": args.workers, "cost_model": cm.to_dict(),
                          "forward_s": t_f, "tensors": len(params), "bytes": sum(sizes),
                          "strategies": {s: {k: v for k, v in r.items() if k != "groups"}
                                         | {"n_groups": len(r["groups"])} for s, r in rows.items()},
                          "merge": args.merge, "groups": named_groups}, indent=1))
        return 0
    print(f"model {args.model}: {len(params)} tensors, {sum(sizes) / 2**20:.2f} MiB of gradients; "
          f"forward {t_f * 1e3:.2f} ms, backward {sum(prof.t_b) * 1e3:.2f} ms (profiled here, median of {args.steps})")
    print(f"cost model ({args.reducer}, {args.workers} workers): {cm}")
    print()
    print(f"{'strategy':<14}{'groups':>8}{'iteration (ms)':>17}{'non-overlapped comm (ms)':>27}")
    for s, r in rows.items():
        print(f"{s:<14}{len(r['groups']):>8}{r['iteration_s'] * 1e3:>17.2f}{r['non_overlapped_s'] * 1e3:>27.2f}")
    print()
    print(f"groups of {args.merge} (communication order = gradient-ready order):")
    for g, names in enumerate(named_groups):
        nb = sum(sizes[k] for k in range(chosen[g][0], chosen[g][1]))
        shown = names if len(names) <= 4 else names[:2] + [f"... {len(names) - 3} more ..."] + names[-1:]
        print(f"  {g:>3}: {len(names):>3} tensors {nb / 1024:>10.1f} KiB  {', '.join(shown)}")
    return 0
