"""What ``sparsync train`` prints when a run ends, in a local launch and on rank 0 of a torchrun job."""

from __future__ import annotations

import os

__all__ = ["print_summary"]


def print_summary(s: dict, cfg) -> None:
    """The run's final numbers (``summary.json``'s) in one line, then its directory."""
    tt = s.get("time_to_target_s")
    ppl = "" if s.get("final_perplexity") is None else f" (perplexity {s['final_perplexity']:.2f})"
    print(f"{s['label']}: final accuracy {s['final_accuracy']:.4f}, final held-out loss {s['final_test_loss']:.4f}"
          f"{ppl}, time to {cfg.target_text()}: {'not reached' if tt is None else f'{tt:.2f} s'}, "
          f"train time {s['train_time_s']:.2f} s, median step {1e3 * (s['median_step_s'] or 0):.1f} ms")
    print(f"run directory: {os.path.join(cfg.runs_dir, cfg.name)}")
