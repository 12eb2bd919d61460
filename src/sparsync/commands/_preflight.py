"""Every check of a training run that can fail before a rank starts or a directory is created
(:func:`preflight`, used by ``sparsync train`` and ``sparsync compare``): the workload's options
(:func:`check_workload_options`), the reducer's and SparseDDP's options by building them once, and
whether this machine can hold the ranks (:func:`rank_memory_estimate`, :func:`check_resources`).
A failure is one line (:class:`~sparsync.commands.UsageError`).

Every import is inside a function: building the parsers (``sparsync --help``) imports no torch.
"""

from __future__ import annotations

__all__ = ["check_resources", "check_site_env", "check_sites", "check_workload_options", "preflight",
           "rank_memory_estimate"]


def _build_reducer_once(cfg) -> None:
    """Construct the run's reducer on rank 0 of a thread world of the run's size, so that option
    *values* (and world-size requirements, e.g. gtopk's power of two) fail here, in one line, instead
    of in every rank after the start. Reducer constructors only validate and store (no collective,
    no gradient-sized allocation: every registered reducer is built this way in tests). Worlds beyond
    the thread cluster's size are not built (the option names were checked already)."""
    from ..reducers.registry import make_reducer
    from ..threadcomm import MAX_THREAD_RANKS, ThreadWorld

    if 1 <= cfg.workers <= MAX_THREAD_RANKS:
        make_reducer(cfg.reducer, ThreadWorld(cfg.workers).comms()[0], density=cfg.density, **cfg.reducer_options)


def check_workload_options(workload: str, options: dict) -> dict:
    """The workload options with their values checked against the factory's defaults: an integer
    option takes an integer (``1e3`` too), at least 1 (at least 0 where its default is 0: a seed); a
    boolean one true/false/1/0; a float one a finite number. UsageError (one line) otherwise."""
    import inspect
    import math

    from ..train.workloads import WORKLOADS
    from . import UsageError

    params = inspect.signature(WORKLOADS[workload]).parameters
    bad = sorted(set(options) - set(params))
    if bad:
        raise UsageError(f"workload {workload!r} has no option {', '.join(bad)}; "
                         f"valid: {', '.join(params) or '(none)'}")
    out = {}
    for k, v in options.items():
        d = params[k].default
        if isinstance(d, bool):
            if v not in (True, False, 0, 1):
                raise UsageError(f"--workload-option {k}={v!r}: expected true or false")
        elif isinstance(d, int):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v):
                raise UsageError(f"--workload-option {k}={v!r}: expected an integer")
            lo = 0 if d == 0 else 1
            if v < lo:
                raise UsageError(f"--workload-option {k} must be at least {lo}, got {v!r}")
            v = int(v)
        elif isinstance(d, float) and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise UsageError(f"--workload-option {k}={v!r}: expected a finite number")
        out[k] = v
    return out


def rank_memory_estimate(wl, batch_size: int, seed: int = 0) -> tuple[int, int]:
    """``(bytes, parameters)``: what one rank of this workload holds beyond the interpreter, from
    the model built on the ``meta`` device (shapes only, nothing allocated): 7 float32 words per
    parameter (parameter, gradient, two optimizer moments, the reducer's accumulator and residual,
    the engine's flat gradient), the activations a forward pass of ``batch_size`` samples keeps for
    backward (counted with forward hooks on the meta model) three times (outputs, their gradients,
    temporaries), and the batch itself twice. An estimate to refuse what cannot fit, not a budget."""
    import torch

    try:
        with torch.device("meta"):
            model = wl.build()
    except Exception:  # noqa: BLE001 - a model that cannot be built on meta: no estimate (the ranks will say)
        return 0, 0
    params = sum(p.numel() for p in model.parameters())
    x, _ = wl.batch(0, 0, 1, 1, seed)
    acts = [0]

    def count(_m, _i, out):
        if isinstance(out, torch.Tensor):
            acts[0] += out.numel() * out.element_size()

    hooks = [m.register_forward_hook(count) for m in model.modules() if not list(m.children())]
    try:
        model(torch.empty((batch_size, *x.shape[1:]), dtype=x.dtype, device="meta"))
    except Exception:  # noqa: BLE001 - an op without a meta kernel: no activation estimate
        acts[0] = 0
    finally:
        for h in hooks:
            h.remove()
    batch = batch_size * (x[0].numel() * x.element_size() + 8)
    return 28 * params + 3 * acts[0] + 2 * batch, params


def check_resources(cfg, wl) -> None:
    """Refuse (ValueError, one line) a run this machine cannot hold: the ranks it runs here (all of
    them on a local network, this process under torchrun) against memory, and local process ranks
    against file descriptors, processes and cores (:func:`sparsync.launch.check_local_workers`)."""
    from ..launch import RANK_MEMORY, check_local_workers, format_bytes

    per, params = rank_memory_estimate(wl, cfg.batch_size, cfg.seed)
    hint = (f"a rank holds ~{format_bytes(per)} for the model ({params:,} parameters) and a batch of "
            f"{cfg.batch_size}: lower --batch-size, the model's size (--workload-option) or --workers")
    if cfg.network == "torchrun":
        check_local_workers(1, RANK_MEMORY + per, what="this torchrun worker", processes=False, hint=hint)
    else:
        check_local_workers(cfg.workers, RANK_MEMORY + per, processes=cfg.network != "thread", hint=hint)


def check_sites(cfg) -> list[list[int]] | None:
    """The site layout the run's reducer will use, checked against the run's world size here instead of
    inside every rank (one line, :class:`~sparsync.commands.UsageError`). A reducer that takes ``sites``
    (the hierarchical and auto reducers) reads it from its ``sites`` option, else from what its ranks'
    environment says (:func:`sparsync.sites.site_layout`: ``SPARSYNC_SITES`` - which a ``--topology``
    network sets to its own layout - or torchrun's nodes). ``SPARSYNC_SITES`` is checked for every
    run it reaches: a layout that does not fit the world is a mistake whoever reads it. Returns the
    layout (None: nothing says)."""
    import inspect
    import os

    from ..reducers.registry import load_all
    from ..sites import SITES_ENV, Topology, format_layout, is_topology_spec, parse_layout, site_layout
    from . import UsageError

    P = cfg.workers
    env = dict(os.environ)
    if cfg.network == "torchrun":  # torchrun decides the world size
        P = int(env.get("WORLD_SIZE") or P)
    if is_topology_spec(cfg.network):  # the placement gives every rank the topology's own layout
        env[SITES_ENV] = format_layout(Topology.from_spec(cfg.network).layout)
    cls = load_all().get(cfg.reducer)
    takes = cls is not None and "sites" in inspect.signature(cls.__init__).parameters
    opt = cfg.reducer_options.get("sites") if takes else None
    where = (f"--option sites={opt!r}" if opt is not None else
             f"{SITES_ENV}={env[SITES_ENV]!r}" if env.get(SITES_ENV) else "torchrun's node layout")
    try:
        if takes:
            return site_layout(P, opt, env=env)
        return parse_layout(env[SITES_ENV], P) if env.get(SITES_ENV) else None
    except ValueError as e:
        raise UsageError(f"{where}: {e} (world size {P})") from None


def check_site_env(world_sizes, networks=("loopback",)) -> None:
    """``SPARSYNC_SITES`` (when set) checked against every world size a command starts ranks at, as
    :func:`check_sites` checks it for a training run: a layout that does not fit fails here, in one line
    (:class:`~sparsync.commands.UsageError`), before the first of several runs - not inside a rank of
    a later one. Not read where every network is a topology (the placement gives each rank the
    topology's own layout)."""
    import os

    from ..sites import SITES_ENV, is_topology_spec, parse_layout
    from . import UsageError

    spec = os.environ.get(SITES_ENV)
    if not spec or all(is_topology_spec(n) for n in networks):
        return
    for P in world_sizes:
        try:
            parse_layout(spec, P)
        except ValueError as e:
            raise UsageError(f"{SITES_ENV}={spec!r}: {e} (world size {P})") from None


def _check_ddp_option_values(cfg) -> None:
    """Build a SparseDDP of a tiny module on a one-rank thread world with the run's SparseDDP keywords
    (dense reducer: its own options are checked apart), so their values fail here, not in the ranks."""
    from torch import nn

    from ..ddp import SparseDDP
    from ..threadcomm import ThreadWorld

    ddp = SparseDDP(nn.Linear(2, 2), ThreadWorld(1).comms()[0], reducer="dense", **cfg.ddp_options)
    close = getattr(ddp, "close", None)
    if callable(close):
        close()


def preflight(cfg, network: bool = True):
    """Every check that can fail before a rank starts or a directory is created: workload and its
    options (names and values), reducer and its options (names against the reducer's signature,
    values by building it once), merge plan, SparseDDP keywords and their values, numbers, the run
    name, the emulated network's rate, memory and local ranks (:func:`check_resources`), and
    (``network=True``) whether the emulated network can run here. Raises
    :class:`~sparsync.commands.UsageError` (one line); returns the built workload (defaults filled in)."""
    import inspect

    from ..schedule.merge import parse_strategy
    from ..train.loop import NetworkUnavailable, check_network, validate
    from ..train.runs import check_run_name
    from ..train.workloads import WORKLOADS
    from . import UsageError

    try:
        if cfg.workload in WORKLOADS:
            cfg.workload_options = check_workload_options(cfg.workload, cfg.workload_options)
        if cfg.name is not None:
            check_run_name(cfg.name)
        if cfg.network not in ("loopback", "thread", "torchrun"):
            from ..units import link_bandwidth
            from ..sites import Topology, is_topology_spec

            if is_topology_spec(cfg.network):  # sites: both levels' rates, bounded as one link's
                Topology.from_spec(cfg.network)
            else:
                link_bandwidth(cfg.network)
        wl = validate(cfg)
        check_run_name(cfg.name)  # the default name too
        if not (cfg.is_torch_ddp or cfg.reducer == "nocomm"):
            check_sites(cfg)
        if cfg.is_torch_ddp or cfg.reducer == "nocomm":
            for opt, given in (("--option", cfg.reducer_options), ("--ddp-option", cfg.ddp_options)):
                if given:
                    raise UsageError(f"{opt} {', '.join(given)}: the baseline {cfg.reducer!r} takes no "
                                     "sparsync reducer / SparseDDP options")
        else:
            from ..ddp import SparseDDP
            from ..reducers.registry import load_all

            load_all()[cfg.reducer].check_options(cfg.reducer_options)
            _build_reducer_once(cfg)
            parse_strategy(cfg.merge)
            fixed = {"self", "module", "comm", "reducer", "density", "merge", "reducer_options"}
            valid = [n for n, p in inspect.signature(SparseDDP.__init__).parameters.items()
                     if n not in fixed and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
            bad = sorted(set(cfg.ddp_options) - set(valid))
            if bad:
                raise UsageError(f"--ddp-option {', '.join(bad)}: not a SparseDDP keyword; valid: {', '.join(valid)}")
            if cfg.ddp_options:
                try:
                    _check_ddp_option_values(cfg)
                except (ValueError, TypeError) as e:
                    raise UsageError(f"--ddp-option: {str(e).splitlines()[0]}") from None
        if cfg.checkpoint_every < 0:
            raise UsageError(f"--checkpoint-every must be >= 0 (0: only at the end), got {cfg.checkpoint_every}")
        check_resources(cfg, wl)
        if network:
            check_network(cfg.network)
    except UsageError:
        raise
    except (ValueError, TypeError, NetworkUnavailable) as e:
        raise UsageError(str(e).replace("\n", " ")) from None
    return wl
