"""The same worker function runs under torchrun (env:// rendezvous) via ss.torchrun_main."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys, torch, sparsync as ss

    def work(comm, n):
        sv = ss.SparseVec(torch.tensor([comm.rank]), torch.tensor([1.0 + comm.rank]), n)
        return ss.sparse_allreduce(sv, comm, algorithm="allgather").to_dense().tolist()

    out = ss.torchrun_main(work, 4)
    sys.stdout.write(f"RESULT {out}" + chr(10))  # one write: torchrun runs python -u, print's pieces interleave
""")


@pytest.mark.gloo
def test_torchrun_runs_the_same_worker(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    p = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", "0", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", "127.0.0.1:0", str(script)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT")]
    assert lines == ["RESULT [1.0, 2.0, 0.0, 0.0]"] * 2
