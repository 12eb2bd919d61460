"""Per-step accounting of the overlap engine: ``last_stats`` and the Chrome-trace timeline.

Where does a step's synchronisation time go? The training thread runs backward (``backward_s``:
gradient of the output -> end of backward compute), then waits for the communication thread
(``wait_s``: end of backward -> every group reduced), then writes the averaged gradients
(``writeback_s``). The communication thread works group by group; each group's span is timed in
stages: ``copy`` (gradients into the group's flat buffer), ``check`` (non-finite test), ``policy``
(``before_reduce``/``after_reduce`` of a convergence policy), and the reducer call, which reports
its own ``select`` and ``comm`` time; the rest of the reducer call is ``reducer_other`` (error
feedback passes, packing, output buffers). The part of every span that lies inside the wait window
is charged to the wait proportionally, and the gaps of the wait window where no group is being
worked on are ``wait_idle_s`` (hand-off to the thread, the optional flag exchange), so

    wait_s == wait_copy_s + wait_check_s + wait_policy_s + wait_select_s + wait_comm_s
              + wait_reducer_other_s + wait_idle_s            (exactly, by construction)

and ``cpu_wait_s`` is the part of the communication thread's non-``comm`` work during which it
was not on a CPU (``time.thread_time`` vs wall time): runnable but waiting for a core (ranks share
cores) or for the GIL.
"""

from __future__ import annotations

import time

__all__ = ["GroupSpan", "StepStats"]

_STAGES = ("copy", "check", "policy", "reduce")
_REDUCER_KEYS = ("select_s", "comm_s", "bytes_sent", "bytes_received", "selected", "intra_bytes", "inter_bytes")
_LEVEL_KEYS = ("intra_bytes", "inter_bytes")  # bytes sent inside a site / between sites (hier); shown when used


class GroupSpan:
    """Timestamps of one group's work on the communication thread (``perf_counter`` seconds)."""

    __slots__ = ("g", "t_submit", "t0", "marks", "cpu0", "cpu_s", "select_s", "comm_s")

    def __init__(self, g: int, t_submit: float):
        self.g = g
        self.t_submit = t_submit
        self.t0 = time.perf_counter()
        self.cpu0 = time.thread_time()
        self.marks: list[tuple[str, float]] = []
        self.cpu_s = 0.0
        self.select_s = 0.0
        self.comm_s = 0.0

    def mark(self, stage: str) -> None:
        """End of ``stage`` (stages run in the order they are marked)."""
        self.marks.append((stage, time.perf_counter()))

    def close(self, reducer_stats: dict | None) -> None:
        self.cpu_s = time.thread_time() - self.cpu0
        if reducer_stats:
            self.select_s = float(reducer_stats.get("select_s", 0.0) or 0.0)
            self.comm_s = float(reducer_stats.get("comm_s", 0.0) or 0.0)

    @property
    def t1(self) -> float:
        return self.marks[-1][1] if self.marks else self.t0

    def parts(self) -> dict:
        """Seconds per stage, the reducer call split into select / comm / reducer_other."""
        out = dict.fromkeys(("copy", "check", "policy", "select", "comm", "reducer_other"), 0.0)
        prev = self.t0
        for stage, t in self.marks:
            d = t - prev
            prev = t
            if stage == "reduce":
                sel, com = min(self.select_s, d), min(self.comm_s, max(0.0, d - self.select_s))
                out["select"] += sel
                out["comm"] += com
                out["reducer_other"] += d - sel - com
            else:
                out[stage] += d
        return out


class StepStats:
    """Collects one step (spans, reducer counters) and turns it into ``last_stats`` + timeline slices."""

    def __init__(self):
        self.spans: list[GroupSpan] = []
        self.counters = dict.fromkeys(_REDUCER_KEYS, 0)
        self.stages: dict[str, float] = {}  # reducer-specific stage times, summed over groups
        self.copied_bytes = 0   # gradient bytes copied into the flat buffers (0 when .grad were the views)
        self.auto: list[dict] = []  # reducer="auto": each group's choice (and decision, on a step that made one)

    def add_reducer_stats(self, st: dict, g: int | None = None) -> None:
        if "auto" in st:
            self.auto.append({"group": g, **st["auto"]})
        for k in _REDUCER_KEYS:
            self.counters[k] += st.get(k, 0) or 0
        for k, v in st.items():  # a reducer's own stage times (e.g. micro's comm_values_s)
            if k.endswith("_s") and k not in _REDUCER_KEYS and k != "total_s" and isinstance(v, float):
                self.stages[k] = self.stages.get(k, 0.0) + v

    def summary(self, *, t_start, t_end, t_done, t_written) -> dict:
        c = self.counters
        out = {
            "select_s": float(c["select_s"]),
            "comm_s": float(c["comm_s"]),
            "reduce_s": sum(s.parts()["select"] + s.parts()["comm"] + s.parts()["reducer_other"]
                            for s in self.spans),
            "wait_s": t_done - t_end,
            "backward_s": t_end - t_start,
            "writeback_s": t_written - t_done,
            "bytes_sent": int(c["bytes_sent"]),
            "bytes_received": int(c["bytes_received"]),
            "selected": int(c["selected"]),
            "copied_bytes": int(self.copied_bytes),
            **{k: int(c[k]) for k in _LEVEL_KEYS if c[k]},
            **{f"reducer_{k}": v for k, v in self.stages.items()},
        }
        if self.auto:
            out["auto"] = sorted(self.auto, key=lambda a: -1 if a["group"] is None else a["group"])
        totals = dict.fromkeys(("copy", "check", "policy", "select", "comm", "reducer_other"), 0.0)
        wait = dict(totals)
        cpu_wait = 0.0
        covered = 0.0
        for s in self.spans:
            parts = s.parts()
            for k, v in parts.items():
                totals[k] += v
            wall = s.t1 - s.t0
            # time the thread was runnable but off-CPU, outside the blocking communication
            cpu_wait += max(0.0, wall - parts["comm"] - s.cpu_s)
            lo, hi = max(s.t0, t_end), min(s.t1, t_done)
            if hi > lo and wall > 0:
                f = (hi - lo) / wall
                covered += hi - lo
                for k, v in parts.items():
                    wait[k] += f * v
        out["copy_s"] = totals["copy"] + out["writeback_s"]
        out["check_s"] = totals["check"]
        out["policy_s"] = totals["policy"]
        out["reducer_other_s"] = totals["reducer_other"]
        out["cpu_wait_s"] = cpu_wait
        for k, v in wait.items():
            out[f"wait_{k}_s"] = v
        out["wait_idle_s"] = max(0.0, out["wait_s"] - covered)
        return out

    def timeline(self, tl, names, sizes, groups, order_seen, ready_t, t_start, t_end, t_done) -> None:
        prev = t_start
        for i, t in zip(order_seen, ready_t):
            tl.slice("backward", names[i], prev, t, bytes=sizes[i])
            prev = t
        for s in self.spans:
            g = groups[s.g]
            prev = s.t0
            for stage, t in s.marks:
                tl.slice("comm", f"group {s.g} {stage}", prev, t, tensors=len(g),
                         bytes=sum(sizes[i] for i in g))
                prev = t
        tl.slice("wait", "wait", t_end, t_done)
        tl.end_step()
