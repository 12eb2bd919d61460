"""``sparsync train-linear``: data-parallel SGD for logistic regression / linear SVM / linear
regression on sparse data.

SparCML's MPI-SGD (docs/linear.md): each step's gradient is naturally sparse (only the features
present in the batch) and is summed losslessly by a sparse all-reduce. Prints loss and
accuracy per epoch and the compute/communication time split (the first worker's wall time).

    sparsync train-linear --data synthetic --model logreg --workers 4 --algorithm auto
    sparsync train-linear --data url.svm --model svm --workers 8 --algorithm ssar_split_allgather \
        --bandwidth 1gbit
    sparsync train-linear --workers 4 --algorithm ps-async --servers 1 --staleness 2
"""

from __future__ import annotations

import time


def register(subparsers) -> None:
    from . import COUNT, NETWORK, WORKERS, deprecated_alias, doc_text
    from .train import SECONDS_MAX, SEED, _float_in

    positive = _float_in(0, float("inf"), "--lr")

    p = subparsers.add_parser(
        "train-linear", help="SGD for sparse linear models (logreg/svm/linreg) with a sparse all-reduce",
        description=doc_text("\n\n".join(__doc__.split("\n\n")[1:3])))
    p.add_argument("--data", default="synthetic", help="svmlight/libsvm FILE, or 'synthetic'")
    p.add_argument("--model", choices=("logreg", "svm", "linreg"), default="logreg",
                   help="logistic regression, linear SVM, or linear regression (squared loss; a FILE's "
                        "labels are then real-valued targets)")
    p.add_argument("--workers", type=WORKERS, default=4, help="number of ranks P")
    p.add_argument("--algorithm", default="auto",
                   help="sparse all-reduce (auto, ssar_rec_dbl, ssar_split_allgather, dsar_split_allgather, "
                        "dsar_early_switch, allgather, torch_sparse), 'ps' (synchronous parameter server, see "
                        "--servers), 'ps-async' (asynchronous parameter server, see --staleness) or 'dense' "
                        "(default auto)")
    p.add_argument("--servers", type=WORKERS, default=1,
                   help="--algorithm ps/ps-async: server ranks holding shards (ps: among the workers; "
                        "ps-async: dedicated, the other --workers - --servers ranks compute)")
    p.add_argument("--staleness", type=int, default=0,
                   help="--algorithm ps-async: a worker may be this many steps ahead of the slowest one "
                        "(0 = synchronous; default 0)")
    p.add_argument("--ps-timeout", type=float, default=60.0,
                   help="--algorithm ps-async: seconds any parameter-server receive may wait (default 60)")
    p.add_argument("--straggler-ms", type=float, default=0.0,
                   help="emulate a heterogeneous cluster: at every step one worker, drawn at random (seeded), "
                        "sleeps this many ms after computing its gradient (default 0)")
    p.add_argument("--backend", choices=("thread", "gloo"), default="gloo",
                   help="ranks as threads or gloo processes (default gloo; --bandwidth implies gloo)")
    p.add_argument("--bandwidth", type=NETWORK, default=None,
                   help="run on the emulated cluster with this per-link rate, e.g. 1gbit (needs root)")
    p.add_argument("--epochs", type=WORKERS, default=5, help="passes over the data")
    p.add_argument("--batch-size", type=WORKERS, default=250,
                   help="samples per worker per step (global = batch size * P)")
    deprecated_alias(p, "--batch", "--batch-size", "batch_size", WORKERS)
    p.add_argument("--global-batch", type=WORKERS, default=None, help="global batch (overrides --batch-size)")
    p.add_argument("--lr", type=positive, default=10.0, help="learning rate on the batch-mean gradient")
    p.add_argument("--l2", type=_float_in(0, float("inf"), "--l2", lo_open=False), default=0.0,
                   help="L2 regularisation (dense shrink every step)")
    p.add_argument("--test-fraction", type=_float_in(0, 1, "--test-fraction", lo_open=False), default=0.2,
                   help="held-out fraction (default 0.2)")
    p.add_argument("--seed", type=SEED, default=0, help="seed of the synthetic data and the train/test split")
    p.add_argument("--zero-based", action="store_true", help="FILE uses 0-based feature indices")
    p.add_argument("--n-features", type=WORKERS, default=None, help="declared dimension of FILE")
    p.add_argument("--samples", type=COUNT, default=20000, help="synthetic: samples")
    p.add_argument("--features", type=COUNT, default=1_000_000, help="synthetic: dimension")
    p.add_argument("--nnz", type=COUNT, default=30, help="synthetic: feature draws per sample")
    p.add_argument("--timeout", type=_float_in(0, SECONDS_MAX, "--timeout"), default=3600.0,
                   help="stall timeout: seconds a collective may wait (default 3600)")
    p.set_defaults(func=run)


def _check_ps(args) -> None:
    from . import UsageError
    from .train import SECONDS_MAX

    if args.algorithm == "ps" and not 1 <= args.servers <= args.workers:
        raise UsageError(f"--servers must be in [1, --workers], got {args.servers}")
    if args.algorithm != "ps-async":
        return
    if not 1 <= args.servers < args.workers:
        raise UsageError(f"--algorithm ps-async: --servers must be in [1, --workers - 1] (dedicated server "
                         f"ranks, at least one worker left), got --servers {args.servers} --workers {args.workers}")
    if args.staleness < 0:
        raise UsageError(f"--staleness must be >= 0, got {args.staleness}")
    if not 0 < args.ps_timeout <= SECONDS_MAX:  # nan and inf too
        raise UsageError(f"--ps-timeout must be > 0 seconds, got {args.ps_timeout}")
    if args.backend == "thread" and not args.bandwidth:
        raise UsageError("--algorithm ps-async runs on torch.distributed point-to-point: use --backend gloo")


#: float32 words a rank holds per feature: weights, the dense gradient / sum buffer, the model's
#: copy for evaluation, a spare (an estimate to refuse what cannot fit, not a budget)
_WORDS_PER_FEATURE = 4


def _check_fits(args, n_features: int, processes: bool) -> None:
    """UsageError (one line) when ``--workers`` ranks of an ``n_features`` model cannot run here."""
    from ..launch import RANK_MEMORY, check_local_workers, format_bytes
    from . import UsageError

    per = 4 * _WORDS_PER_FEATURE * int(n_features)
    try:
        check_local_workers(args.workers, RANK_MEMORY + per, processes=processes,
                            hint=f"a rank holds ~{format_bytes(per)} for {n_features:,} features (the largest "
                                 "feature index + 1, or --n-features / --features): fewer features or --workers")
    except ValueError as e:
        raise UsageError(str(e)) from None


def _check_values(name: str, ds) -> None:
    """Every feature value and target must be finite in the training dtype (float32): a value beyond
    its range (3.4e38) would become Inf and train to NaN. UsageError naming the first such sample."""
    import torch

    from . import UsageError

    for what, t, rows in (("feature value", ds.values, ds.indptr), ("label", ds.labels, None)):
        bad = (~torch.isfinite(t)).nonzero()
        if bad.numel():
            pos = int(bad[0])
            row = pos if rows is None else int(torch.searchsorted(rows, torch.tensor(pos), right=True)) - 1
            raise UsageError(f"{name}: sample {row + 1} has a {what} beyond float32's range (|x| > 3.4e38); "
                             "rescale the data")


def _worker(comm, train_ds, test_ds, kw):
    from sparsync.linear.sgd import train

    out = train(comm, train_ds, test_ds=test_ds, **kw)
    return out["history"]


def run(args) -> int:
    import sparsync as ss
    from sparsync.collectives.registry import load_all
    from sparsync.linear import SvmlightError, load_svmlight, make_synthetic

    from . import UsageError

    algos = set(load_all()) | {"ps", "ps-async"}
    if args.algorithm != "dense" and args.algorithm not in algos:
        raise UsageError(f"unknown --algorithm {args.algorithm!r}; valid: dense, {', '.join(sorted(algos))}")
    _check_ps(args)
    if not 0 <= args.straggler_ms < float("inf"):  # nan and inf too
        raise UsageError(f"--straggler-ms must be >= 0, got {args.straggler_ms}")
    if not 0 <= args.test_fraction < 1:
        raise UsageError(f"--test-fraction must be in [0, 1), got {args.test_fraction:g}")
    if args.bandwidth:
        from ..units import link_bandwidth
        from ..train.loop import NetworkUnavailable, check_network

        try:
            link_bandwidth(args.bandwidth)
            check_network(args.bandwidth)
        except (ValueError, NetworkUnavailable) as e:
            raise UsageError(str(e)) from None
    processes = bool(args.bandwidth) or args.backend == "gloo"
    if args.data == "synthetic":
        _check_fits(args, args.features, processes)
    t0 = time.perf_counter()
    try:
        if args.data == "synthetic":
            ds = make_synthetic(args.samples, args.features, args.nnz, seed=args.seed)
        else:
            ds = load_svmlight(args.data, n_features=args.n_features, zero_based=args.zero_based,
                               regression=args.model == "linreg")
    except (SvmlightError, OSError, ValueError) as e:
        raise UsageError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    _check_values(args.data, ds)
    _check_fits(args, ds.n_features, processes)
    train_ds, test_ds = ds.split(args.test_fraction, args.seed) if args.test_fraction > 0 else (ds, None)
    gb = args.global_batch or args.batch_size * args.workers
    print(f"data: {args.data}: {ds.n_samples} samples, {ds.n_features} features, {ds.nnz} non-zeros "
          f"({ds.nnz / max(1, ds.n_samples):.1f}/sample), loaded in {time.perf_counter() - t0:.1f} s; "
          f"train {train_ds.n_samples}, test {test_ds.n_samples if test_ds else 0}")
    net = args.bandwidth or ("loopback" if args.backend == "gloo" else "threads")
    print(f"model {args.model}, P = {args.workers}, global batch {gb}, lr {args.lr}, "
          f"algorithm {args.algorithm}, network {net}")
    kw = {"model": args.model, "epochs": args.epochs, "global_batch": gb, "lr": args.lr, "l2": args.l2,
              "algorithm": args.algorithm, "seed": args.seed, "straggler_ms": args.straggler_ms}
    if args.algorithm in ("ps", "ps-async"):
        kw["servers"] = args.servers
    if args.algorithm == "ps-async":
        kw.update(staleness=args.staleness, ps_timeout=args.ps_timeout)
    try:
        if args.bandwidth:
            from sparsync.cluster import run_emulated

            res = run_emulated(_worker, args.workers, train_ds, test_ds, kw, bandwidth=args.bandwidth,
                               timeout=args.timeout)
        else:
            res = ss.run_local(_worker, args.workers, train_ds, test_ds, kw, backend=args.backend,
                               timeout=args.timeout)
    except ValueError as e:
        if getattr(e, "rank", None) is not None:
            raise  # a rank failed: one line, exit 1 (sparsync.cli)
        raise UsageError(str(e).splitlines()[0]) from None
    hist = next(h for h in res if h)  # the first worker's (ps-async: ranks < --servers only serve)
    print(f"{'epoch':>5} {'loss':>8} {'train acc':>9} {'test acc':>8} {'compute s':>9} {'comm s':>8} "
          f"{'comm %':>6} {'MB recv':>8}")
    for h in hist:
        tot = h["compute_s"] + h["comm_s"]
        ta = f"{h['test_acc']:.4f}" if h["test_acc"] is not None else "-"
        print(f"{h['epoch']:>5} {h['loss']:>8.4f} {h['train_acc']:>9.4f} {ta:>8} {h['compute_s']:>9.3f} "
              f"{h['comm_s']:>8.3f} {100 * h['comm_s'] / max(tot, 1e-12):>5.1f}% "
              f"{h['bytes_received'] / 1e6:>8.2f}"
              + (f"  auto: {', '.join(f'{k} x{v}' for k, v in sorted(h['auto_picked'].items()))}"
                 if h.get("auto_picked") else "")
              + (f"  staleness: mean {h['lag_mean']:.2f}, max {h['lag_max']}" if "lag_max" in h else ""))
    return 0
