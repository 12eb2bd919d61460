"""Same-run A/B of reducers against an earlier git revision of sparsync (``sparsync bench revision``).

What: every rank imports the current package and the package of revision ``rev`` side by side,
builds each reducer twice over the same process group (the old one through the old ``TorchComm``),
and calls the two alternately with the same gradient (the order swapped every step, a barrier before
each call, the residual reset before each call as ``sparsync bench reducers --residual reset``
does). One row per reducer: the median over steps of the max over ranks for the old and the
current code, and their ratio.

Why: a figure measured on another machine - a table of our code and of the authors' code,
measured side by side there - cannot be compared with one measured here (machines of one kind
differ by up to 2x, more under other jobs' load). The revision that produced the other machine's
figure can be run here, beside the current code: the ratio ``current / old`` of one run carries
over, so ``ratio * (our figure then)`` is what the current code would have measured beside the
authors' code then. That is an inference (it assumes the speed-up does not depend on the machine),
and ``docs/benchmarks.md`` says so wherever it is used.

How the old package is loaded: ``git archive <rev> src/sparsync`` of the repository this package
lives in, extracted under a temporary directory with the package renamed (:data:`OLD_PACKAGE`).
The package imports itself relatively; the few absolute self-imports (``import sparsync as ss``,
``from sparsync.x import y``, ``import sparsync``) are renamed with it (:func:`rename_imports`), any
other form is refused with the file named (it would silently load the current package instead).
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import time
from pathlib import Path

#: the name the old revision's package is imported under (next to ``sparsync`` itself)
OLD_PACKAGE = "sparsync_rev"


def _renamed(node, where: str) -> str:
    """The statement ``node`` (an import) with ``sparsync`` replaced by :data:`OLD_PACKAGE`."""
    import ast

    if isinstance(node, ast.ImportFrom):
        names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)
        return f"from {OLD_PACKAGE}{node.module[len('sparsync'):]} import {names}"
    parts = []
    for a in node.names:
        if a.name == "sparsync":
            parts.append(f"import {OLD_PACKAGE} as {a.asname or 'sparsync'}")
        elif a.name.startswith("sparsync.") and a.asname:
            parts.append(f"import {OLD_PACKAGE}{a.name[len('sparsync'):]} as {a.asname}")
        elif a.name.startswith("sparsync."):
            raise ValueError(f"{where}: cannot rename 'import {a.name}' (it binds the name sparsync to the current "
                             f"package); this revision cannot be loaded beside it")
        else:
            parts.append(f"import {a.name}" + (f" as {a.asname}" if a.asname else ""))
    return "; ".join(parts)


def rename_imports(source: str, where: str = "") -> str:
    """``source`` with every import of ``sparsync`` (found by parsing, so examples in docstrings are
    left alone) pointed at :data:`OLD_PACKAGE`, line numbers kept; ``ValueError`` naming ``where``
    for a form that cannot be renamed."""
    import ast

    def ours(name):
        return name == "sparsync" or (name or "").startswith("sparsync.")

    tree = ast.parse(source)
    nodes = [n for n in ast.walk(tree)
             if (isinstance(n, ast.ImportFrom) and n.level == 0 and ours(n.module))
             or (isinstance(n, ast.Import) and any(ours(a.name) for a in n.names))]
    data = source.encode()
    starts = [0]
    for line in data.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    for n in sorted(nodes, key=lambda n: (n.lineno, n.col_offset), reverse=True):
        a = starts[n.lineno - 1] + n.col_offset
        b = starts[n.end_lineno - 1] + n.end_col_offset
        text = _renamed(n, where) + "\n" * (n.end_lineno - n.lineno)  # keep the line numbers
        data = data[:a] + text.encode() + data[b:]
    return data.decode()


def repository_root() -> Path:
    """The git work tree this package was loaded from (``RuntimeError`` naming the problem if none)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"bench revision needs sparsync run from a git checkout (git rev-parse failed in {here}: "
                           f"{getattr(e, 'stderr', '') or e})") from None
    return Path(out.stdout.strip())


def extract_revision(rev: str, dest: Path) -> Path:
    """``src/sparsync`` of revision ``rev``, extracted as ``dest/OLD_PACKAGE`` (imports renamed);
    returns ``dest`` (the directory to put on ``sys.path``). ``ValueError`` for an unknown revision or
    an import that cannot be renamed."""
    root = repository_root()
    proc = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", rev, "src/sparsync"],
                          capture_output=True)
    if proc.returncode != 0:
        raise ValueError(f"git archive {rev} src/sparsync failed: {proc.stderr.decode(errors='replace').strip()}")
    dest = Path(dest)
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
        for m in tar.getmembers():
            if not m.isfile() or not m.name.startswith("src/sparsync/"):
                continue
            rel = Path(m.name).relative_to("src/sparsync")
            text = tar.extractfile(m).read()
            if m.name.endswith(".py"):
                text = rename_imports(text.decode(), f"revision {rev}: {m.name}").encode()
            target = dest / OLD_PACKAGE / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(text)
    if not (dest / OLD_PACKAGE / "__init__.py").exists():
        raise ValueError(f"revision {rev} has no src/sparsync package")
    return dest


def _worker(comm, path, names, numel, density, steps, warmup, pattern, seed):
    """One rank: both versions of every reducer, alternated call by call (see the module docstring)."""
    import importlib

    import torch

    from ..recycle import fill_zero
    from ..reducers.registry import make_reducer
    from .reducers import FIXED_THRESHOLD, bench_grads, tuned_threshold

    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    old_registry = importlib.import_module(f"{OLD_PACKAGE}.reducers.registry")
    old_comm = importlib.import_module(f"{OLD_PACKAGE}.torchcomm").TorchComm(device=comm.device)
    grads = bench_grads(pattern, comm.rank, numel, seed, steps + warmup, comm.device)
    out = {}
    for name in names:
        opts = {}
        if name in FIXED_THRESHOLD:  # the same tuned threshold for both versions
            opts["threshold"] = tuned_threshold(comm, grads[0], density)
        reducers = {"old": old_registry.make_reducer(name, old_comm, density=density, **opts),
                    "new": make_reducer(name, comm, density=density, **opts)}
        times = {"old": [], "new": []}
        last = {}
        for step in range(warmup + steps):
            g = grads[step % len(grads)]
            for ver in ("old", "new") if step % 2 == 0 else ("new", "old"):
                r = reducers[ver]
                if r.residual is not None:
                    fill_zero(r.residual)
                last[ver] = None  # dropped before the call, as a training loop does
                comm.barrier()
                t0 = time.perf_counter()
                res = r.reduce(g)
                if comm.device.type == "cuda":
                    torch.cuda.synchronize(comm.device)
                wall = time.perf_counter() - t0
                comm.barrier()  # no rank's next reset overlaps a slower rank's timed call (reducers._timed_steps)
                last[ver] = res
                if step >= warmup:
                    times[ver].append(wall)
        a, b = last["old"], last["new"]
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
        out[name] = {"times": times, "same_result": bool(same)}
        del reducers, last
    return out


def run_revision_ab(rev: str, reducers, world_size: int = 4, numel: int = 10_000_000, density: float = 0.01,
                    steps: int = 12, warmup: int = 3, network: str = "loopback", pattern: str = "heavy_tail",
                    seed: int = 0, timeout: float = 1200.0, fallback_loopback: bool = False) -> list[dict]:
    """One row per reducer: ``old_s`` / ``new_s`` (median over steps of the max over ranks), ``ratio``
    (new / old) and ``same_result`` (the last call's outputs bitwise equal: expected only where the
    reducer's algorithm did not change between the revisions)."""
    import tempfile

    from ..cluster import network_label, open_network
    from ..launch import run_local
    from .reducers import expand_reducers

    names = expand_reducers(reducers)
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    with tempfile.TemporaryDirectory(prefix="sparsync-rev-") as tmp:
        path = extract_revision(rev, Path(tmp))
        with open_network(network, world_size, fallback_loopback) as net:
            label = network_label(network, net)
            per_rank = run_local(_worker, world_size, str(path), names, int(numel), float(density), int(steps),
                                 int(warmup), pattern, seed, backend="gloo", timeout=timeout,
                                 placement=net.placement)
    rows = []
    for name in names:
        med = {}
        for ver in ("old", "new"):
            per_step = sorted(max(per_rank[r][name]["times"][ver][i] for r in range(world_size)) for i in range(steps))
            med[ver] = per_step[steps // 2]
        rows.append({"network": label, "world_size": world_size, "numel": int(numel), "density": float(density),
                     "pattern": pattern, "reducer": name, "revision": rev, "old_s": med["old"], "new_s": med["new"],
                     "ratio": med["new"] / med["old"],
                     "same_result": all(per_rank[r][name]["same_result"] for r in range(world_size))})
    return rows
