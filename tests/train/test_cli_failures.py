"""Runtime errors at the CLI's top level: one line naming the problem, exit
code 2 for what the user can fix, 1 for a failed run; a stopped rank is named, not the rank that
timed out."""

import os
import re
import signal

import pytest
import torch

import sparsync as ss
from sparsync.cli import main
from sparsync.launch import RankFailed

SMALL = ["train", "--thread", "--workload", "digits-mlp", "--workload-option", "width=16", "--workers", "2",
         "--reducer", "micro", "--no-progress", "--steps", "2"]


def _one_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_runs_dir_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main([*SMALL, "--runs-dir", str(f), "--name", "x"]) == 2
    line = _one_line(capsys)
    assert line.startswith("sparsync train: error: ") and "Not a directory" in line and str(f) in line


def test_run_dir_that_is_a_file(tmp_path, capsys):
    (tmp_path / "x").write_text("x")
    assert main([*SMALL, "--runs-dir", str(tmp_path), "--name", "x"]) == 2
    assert "is not a directory" in _one_line(capsys)


def test_batch_size_zero(tmp_path, capsys):
    assert main([*SMALL, "--batch-size", "0", "--runs-dir", str(tmp_path)]) == 2
    assert re.search(r"--batch-size.*positive integer, got '?0", _one_line(capsys))


def test_nan_in_a_rank_is_one_line_exit_1(tmp_path, capsys):
    # a learning rate that overflows: the run fails (exit 1), the message names the rank
    rc = main([*SMALL, "--lr", "1e30", "--steps", "6", "--runs-dir", str(tmp_path)])
    assert rc == 1
    line = _one_line(capsys)
    assert "rank " in line and ("non-finite" in line or "loss became" in line), line


def _signal_worker(comm, sig):
    """Rank 1 sends itself ``sig`` at its 6th all-reduce; the others keep reducing."""
    for i in range(100_000):
        if comm.rank == 1 and i == 5:
            os.kill(os.getpid(), sig)
        comm.allreduce(torch.ones(4))


@pytest.mark.gloo
def test_sigstopped_rank_is_named_not_the_one_that_timed_out():
    with pytest.raises(RankFailed, match=r"rank 1 of 3 stopped responding \(process stopped by SIGSTOP"):
        ss.run_local(_signal_worker, 3, signal.SIGSTOP, backend="gloo", timeout=4)


def test_torchrun_survivor_names_the_lost_rank():
    import socket
    import subprocess
    import sys

    from sparsync.launch import lost_peer_error

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    peers = [(host, os.getpid()), (host, os.getpid()), (host, dead.pid), ("other-node", 1)]
    gloo = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:23259. This is typically ...")
    e = lost_peer_error(gloo, peers, 0)
    assert isinstance(e, RankFailed)
    assert str(e).startswith(f"rank 0: lost rank 2 (pid {dead.pid} on {host}): its process is gone")
    alive_peers = [(host, os.getpid()), ("other-node", 1), ("other-node", 2)]
    e = lost_peer_error(gloo, alive_peers, 0)
    assert "one of ranks [1, 2] on other hosts" in str(e)
    other = ValueError("not a connection problem")
    assert lost_peer_error(other, peers, 0) is other


@pytest.mark.gloo
def test_killed_rank_is_named_not_the_peer_that_lost_its_connection():
    for _ in range(3):  # whichever the launcher hears first: the EOF of rank 1 or rank 0's gloo error
        with pytest.raises(RankFailed, match=r"^rank 1 of 3 died without reporting \(killed by SIGKILL\)"):
            ss.run_local(_signal_worker, 3, signal.SIGKILL, backend="gloo", timeout=30)
