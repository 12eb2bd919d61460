"""Local steps in ``sparsync train`` / ``compare``: configuration checks and the objects the loop uses.

Two kinds of run (``TrainConfig.local_steps``, compare syntax in :mod:`sparsync.commands.compare`):

* ``reducer="ddp-localsgd<H>"``: torch's post-local SGD (:mod:`.postlocal`), options ``warmup``
  (synchronous steps before local SGD starts; default :data:`DEFAULT_WARMUP`);
* any registered reducer with ``local_steps={"sync_every": H, ...}``: :class:`~.diloco.DiLoCo`
  with that reducer for the pseudo-gradient, options ``outer`` (the outer optimizer, :data:`OUTER_KINDS`:
  ``nesterov``, the default, ``sgd`` or ``adam``), ``outer_lr`` / ``outer_momentum`` (defaults by the
  run's optimizer and reducer, :func:`~.outer.default_outer`: 0.7 / 0.9 for SGD, 1 / 0 for Adam and AdamW,
  the world size / 0 for ``sparseloco`` under Adam and AdamW; ``adam``
  needs ``outer_lr``), ``overlap`` (inner steps the exchange runs beside, :mod:`.overlap`) and the run's
  reducer options; ``sync_every="auto"`` chooses H as it goes (:mod:`.period`, options ``period_cost``
  and ``max_period``).

The training loop keeps its shape: it calls ``opt.zero_grad()``, ``fwd(x)``, ``backward()``,
``opt.step()``; for DiLoCo ``opt.step()`` is ``DiLoCo.step`` (so the outer synchronisation is timed in
the step where it happens), ``opt.state_dict()`` the inner optimizer's, and the engine (checkpointed
as the run's sparsync state, ``last_stats`` read per step) the :class:`~.diloco.DiLoCo` object.
"""

from __future__ import annotations

from .outer import default_outer
from .overlap import check_overlap
from .postlocal import bytes_per_rank, parse_period

__all__ = ["DEFAULT_WARMUP", "DILOCO_KEYS", "LOCAL_KEYS", "OUTER_KINDS", "check", "is_diloco", "is_local",
           "outer_optimizer", "step_bytes", "wrap"]

#: synchronous (all-reduce) steps before torch's post-local SGD starts its local steps
DEFAULT_WARMUP = 1
#: DiLoCo's keys of ``local_steps`` and their defaults (None: required)
DILOCO_KEYS = {"sync_every": None, "outer_lr": 0.7, "outer_momentum": 0.9}
#: DiLoCo's keys for ``sync_every="auto"`` only (:mod:`.period`)
PERIOD_KEYS = ("period_cost", "max_period")
#: the outer optimizers a row may name (``outer=``; not written to the configuration unless given)
OUTER_KINDS = ("nesterov", "sgd", "adam")
#: every key a compare configuration may give for local steps
LOCAL_KEYS = (*DILOCO_KEYS, *PERIOD_KEYS, "outer", "overlap", "warmup")


def outer_optimizer(kind: str, params, lr: float, momentum: float):
    """The outer optimizer ``outer=kind`` names, over ``params``: ``nesterov`` DiLoCo's
    ``SGD(lr, momentum, nesterov=momentum > 0)``; ``sgd`` heavy-ball ``SGD(lr, momentum)``;
    ``adam`` ``Adam(lr, betas=(momentum, 0.999))``."""
    import torch

    if kind == "nesterov":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, betas=(momentum, 0.999))
    raise ValueError(f"outer must be one of {', '.join(OUTER_KINDS)}, got {kind!r}")


def is_diloco(cfg) -> bool:
    return bool(cfg.local_steps) and parse_period(cfg.reducer) is None


def is_local(cfg) -> bool:
    return is_diloco(cfg) or parse_period(cfg.reducer) is not None


def check(cfg) -> None:
    """ValueError (one line) for a local-steps configuration that cannot run; fills the defaults into
    ``cfg.local_steps`` (so config.json and the label say what ran). No-op for other runs."""
    period = parse_period(cfg.reducer)
    ls = cfg.local_steps
    if period is not None:
        bad = sorted(set(ls) - {"warmup"})
        if bad:
            raise ValueError(f"{cfg.reducer!r} takes only warmup=N (torch's start_localSGD_iter), not {', '.join(bad)}")
        w = ls.setdefault("warmup", DEFAULT_WARMUP)
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"{cfg.reducer!r}: warmup must be an integer >= 0, got {w!r}")
        return
    if not ls:
        return
    bad = sorted(set(ls) - set(DILOCO_KEYS) - set(PERIOD_KEYS) - {"outer", "overlap"})
    if bad:
        raise ValueError(f"local steps (DiLoCo) have no option {', '.join(bad)}; valid: "
                         f"{', '.join((*DILOCO_KEYS, *PERIOD_KEYS, 'outer', 'overlap'))}")
    kind = ls.get("outer", "nesterov")
    if kind not in OUTER_KINDS:
        raise ValueError(f"outer must be one of {', '.join(OUTER_KINDS)}, got {kind!r}")
    if kind == "adam" and "outer_lr" not in ls:
        raise ValueError("outer=adam needs outer_lr=... (Adam's step is about outer_lr per entry, whatever the "
                         "pseudo-gradient's size: no default carries over from the SGD outer step)")
    if "sync_every" not in ls:
        raise ValueError("local steps (DiLoCo) need sync_every=H")
    if cfg.is_torch_ddp or cfg.reducer == "nocomm":
        raise ValueError(f"sync_every applies to sparsync reducers (DiLoCo), not to {cfg.reducer!r}; torch's "
                         "post-local SGD is ddp-localsgd<H>")
    if cfg.convergence:
        raise ValueError(f"convergence options ({', '.join(sorted(cfg.convergence))}) act on per-step gradients; "
                         "they do not apply to DiLoCo's pseudo-gradient")
    if cfg.ddp_options:
        raise ValueError(f"SparseDDP keywords ({', '.join(sorted(cfg.ddp_options))}) do not apply to DiLoCo "
                         "(no SparseDDP: one flat pseudo-gradient per outer step)")
    if cfg.merge != "single":
        raise ValueError(f"DiLoCo reduces one flat pseudo-gradient; merge must be 'single', got {cfg.merge!r}")
    lr0, mom0 = (None, 0.9) if kind == "adam" else default_outer(cfg.optimizer, cfg.reducer, cfg.workers)
    for k, v in {**DILOCO_KEYS, "outer_lr": lr0, "outer_momentum": mom0}.items():
        if v is not None:
            ls.setdefault(k, v)
    H = ls["sync_every"]
    if H != "auto" and (isinstance(H, bool) or not isinstance(H, int) or H < 1):
        raise ValueError(f"sync_every must be a positive integer or auto, got {H!r}")
    check_overlap(ls.get("overlap", 0), H, cfg.reducer)
    given = sorted(k for k in PERIOD_KEYS if k in ls)
    if given and H != "auto":
        raise ValueError(f"{', '.join(given)} apply to sync_every=auto only")
    c, most = ls.get("period_cost", 0.0), ls.get("max_period", 1)
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c < 1:
        raise ValueError(f"period_cost must be in [0, 1), got {c!r}")
    if isinstance(most, bool) or not isinstance(most, int) or most < 1:
        raise ValueError(f"max_period must be a positive integer, got {most!r}")
    if not (isinstance(ls["outer_lr"], (int, float)) and ls["outer_lr"] > 0):
        raise ValueError(f"outer_lr must be > 0, got {ls['outer_lr']!r}")
    if not (isinstance(ls["outer_momentum"], (int, float)) and 0 <= ls["outer_momentum"] < 1):
        raise ValueError(f"outer_momentum must be in [0, 1), got {ls['outer_momentum']!r}")


def label(cfg, base: str) -> str:
    """The row's label: ``base`` is what the label would be without local steps."""
    period = parse_period(cfg.reducer)
    if period is not None:
        return f"torch post-local SGD H={period} (warm-up {cfg.local_steps.get('warmup', DEFAULT_WARMUP)})"
    from .diloco import default_reducer_options

    ls = cfg.local_steps
    kind = "" if ls.get("outer", "nesterov") == "nesterov" else ls["outer"] + " "
    outer = f"outer {kind}{ls.get('outer_lr', 0.7):g}/{ls.get('outer_momentum', 0.9):g}"
    half = ", fp16 values" if default_reducer_options(cfg.reducer, cfg.reducer_options) != cfg.reducer_options else ""
    lag = f", overlap {ls['overlap']}" if ls.get("overlap") else ""
    return f"DiLoCo H={ls['sync_every']}{lag} {outer}{half}, {base}"


class _StepThrough:
    """The inner optimizer as the loop sees it, with ``step()`` going through DiLoCo."""

    def __init__(self, dl):
        self.dl, self.inner = dl, dl.inner_optimizer

    @property
    def param_groups(self):  # the inner optimizer's: learning-rate schedules set them
        return self.inner.param_groups

    def step(self, closure=None):
        return self.dl.step(closure)

    def zero_grad(self, set_to_none: bool = True):
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, d):
        self.inner.load_state_dict(d)


def wrap(cfg, model, comm, inner):
    """``(forward callable, engine, optimizer)`` for a local-steps run (:func:`is_local`)."""
    period = parse_period(cfg.reducer)
    if period is not None:
        from .postlocal import post_local_sgd

        ddp, opt = post_local_sgd(model, getattr(comm, "group", None), inner, period,
                                  cfg.local_steps.get("warmup", DEFAULT_WARMUP))
        return ddp, ddp, opt
    from .diloco import DiLoCo

    ls = cfg.local_steps
    lr, mom = ls.get("outer_lr", 0.7), ls.get("outer_momentum", 0.9)
    kind = ls.get("outer", "nesterov")
    outer = ({"outer_lr": lr, "outer_momentum": mom} if kind == "nesterov" else
             {"outer_optimizer": outer_optimizer(kind, [p for p in model.parameters() if p.requires_grad], lr, mom)})
    dl = DiLoCo(model, comm, inner, sync_every=ls["sync_every"], reducer=cfg.reducer, density=cfg.density,
                **outer, **{k: ls[k] for k in (*PERIOD_KEYS, "overlap") if k in ls}, **cfg.reducer_options)
    return model, dl, _StepThrough(dl)


def step_bytes(cfg, numel: int, step: int) -> int | None:
    """Bytes one rank sends at ``step`` of a ``ddp-localsgd<H>`` run; None for any other run."""
    period = parse_period(cfg.reducer)
    if period is None:
        return None
    return bytes_per_rank(step, period, cfg.local_steps.get("warmup", DEFAULT_WARMUP), numel, cfg.workers)
