"""A run's target and its final numbers: :func:`target_of` (which metric, which value, which way),
:func:`summarize` (``summary.json``: medians and means of the steady steps, time and steps to target
interpolated between evaluations by :func:`sparsync.train.stats.crossing`, and for ``reducer="auto"``
its decisions, for ``sync_every=auto`` where the period changed)."""

from __future__ import annotations

from .runs import TrainConfig
from .validation import NOCOMM

__all__ = ["summarize", "target_of"]


def target_of(cfg: TrainConfig) -> tuple[str, float, bool]:
    """``(metric, target, higher is better)`` of a run: held-out accuracy against
    ``target_accuracy`` unless the configuration names another metric (``target_metric``, with its
    value in ``target_value``; e.g. a held-out loss, reached going down)."""
    from .stats import HIGHER_IS_BETTER

    metric = getattr(cfg, "target_metric", None) or ("loss" if cfg.target_loss is not None else "accuracy")
    value = getattr(cfg, "target_value", None)
    if value is None and metric == "loss":
        value = cfg.target_loss
    target = float(value if value is not None and metric != "accuracy" else cfg.target_accuracy)
    return metric, target, HIGHER_IS_BETTER.get(metric, True)


def _reached(cfg: TrainConfig, ev: dict) -> bool:
    metric, target, higher = target_of(cfg)
    v = ev.get(metric)
    return v is not None and (v >= target if higher else v <= target)



def summarize(cfg: TrainConfig, rows: list[dict], evals: list[dict], time_to_target, train_time, numel,
              n_heldout: int | None = None) -> dict:
    """Final numbers of a run (summary.json). Time and steps to target are interpolated between
    the evaluations on either side of the crossing (:func:`sparsync.train.stats.crossing`);
    ``time_to_target_eval_s`` is the first evaluation's own time."""
    import statistics as stt

    from .stats import crossing

    steady = rows[min(len(rows) - 1, 3):] if rows else []  # drop warm-up steps from the averages

    def med(key):
        vals = [r[key] for r in steady if r.get(key) is not None]
        return stt.median(vals) if vals else None

    def mean(key):
        vals = [r[key] for r in steady if r.get(key) is not None]
        return stt.mean(vals) if vals else None

    final = evals[-1] if evals else {}
    metric, target, higher = target_of(cfg)
    cross = crossing(evals, target, metric, higher)
    if cross is None and time_to_target is not None:  # evaluations of a resumed run's old checkpoint
        cross = {"time_s": time_to_target, "steps": None, "eval_time_s": time_to_target, "eval_steps": None}
    return {
        "name": cfg.name, "label": cfg.label(), "workload": cfg.workload,
        # a DiLoCo row is not the per-step reducer's row (tables find dense SparseDDP by "dense")
        "reducer": f"diloco-{cfg.reducer}" if cfg.local_steps.get("sync_every") else cfg.reducer,
        "density": None if cfg.reducer in ("dense", "auto", NOCOMM) or cfg.is_torch_ddp else cfg.density,
        "merge": cfg.merge,
        "convergence": dict(cfg.convergence), "local_steps": dict(cfg.local_steps),
        "workers": cfg.workers, "network": cfg.network, "steps": cfg.steps, "numel": numel,
        "final_accuracy": final.get("accuracy"), "final_test_loss": final.get("loss"),
        "best_accuracy": max((e["accuracy"] for e in evals), default=None),
        "target_accuracy": cfg.target_accuracy, "target_loss": cfg.target_loss, "target_metric": metric,
        "target_value": target, "final_perplexity": final.get("perplexity"),
        "time_to_target_s": cross and cross["time_s"], "steps_to_target": cross and cross["steps"],
        "time_to_target_eval_s": cross and cross["eval_time_s"], "eval_every": cfg.eval_every,
        "n_heldout": n_heldout, "seed": cfg.seed,
        "train_time_s": train_time,
        "median_step_s": med("step_s"), "median_compute_s": med("compute_s"), "median_select_s": med("select_s"),
        "median_comm_s": med("comm_s"), "median_wait_s": med("wait_s"),
        "mean_step_s": mean("step_s"), "mean_select_s": mean("select_s"),
        "median_bytes_sent": med("bytes_sent"), "mean_bytes_sent": mean("bytes_sent"), "median_density": med("density"),
        "final_train_loss": stt.mean([r["loss"] for r in rows[-10:]]) if rows else None,
        "evals": evals,
        **_auto_summary(rows),
    }


def _auto_summary(rows: list[dict]) -> dict:
    """reducer="auto": every decision of the run (step, group, reason, chosen) and the last choice."""
    decisions = [{"step": r["step"], "group": d.get("group"), "reason": d.get("reason"), "chosen": d.get("chosen"),
                  "switched": d.get("switched")} for r in rows for d in r.get("auto_decisions") or []]
    last = next((r["auto_choice"] for r in reversed(rows) if r.get("auto_choice")), None)
    out = {"auto_decisions": decisions, "auto_final_choice": last} if (decisions or last) else {}
    periods = [(r["step"], r["sync_every"]) for r in rows if r.get("sync_every") is not None]
    changes = [{"step": s, "sync_every": h} for i, (s, h) in enumerate(periods) if i == 0 or h != periods[i - 1][1]]
    if len(changes) > 1:  # DiLoCo with sync_every="auto": where the period changed
        out["sync_every_changes"] = changes
    return out
