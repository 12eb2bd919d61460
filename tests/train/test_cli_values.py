"""Every CLI value is checked before a run directory is created or a rank starts: one line, exit
code 2 (``sparsync train``, ``sparsync compare``, ``sparsync train-linear``); local ranks are
bounded by what the machine can hold (file descriptors, processes, memory, cores)."""

import re

import pytest

from sparsync.cli import main
from sparsync.launch import check_local_workers, local_worker_limit

SMALL = ["train", "--thread", "--workload", "digits-mlp", "--workers", "2", "--reducer", "micro", "--no-progress",
         "--steps", "2"]
LOOP = [a for a in SMALL if a != "--thread"]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


CASES = [
    (LOOP + ["--bandwidth", "1e30gbit"], r"bandwidth must be at most 1000gbit for an emulated link"),
    (LOOP + ["--bandwidth", "1bit"], r"bandwidth must be at least 8kbit, got '1bit'"),
    (SMALL + ["--seed", str(2**70)], r"--seed must be an integer in \[0, 2147483647\]"),
    (SMALL + ["--seed", "-1"], r"--seed must be an integer in \[0, 2147483647\]"),
    (SMALL + ["--workload-option", "width=-5"], r"--workload-option width must be at least 1, got -5"),
    (SMALL + ["--workload-option", "width=0"], r"--workload-option width must be at least 1, got 0"),
    (SMALL + ["--workload-option", "width=abc"], r"--workload-option width='abc': expected an integer"),
    (SMALL + ["--workload-option", "width=2.5"], r"--workload-option width=2.5: expected an integer"),
    (SMALL + ["--workload-option", "width=1e9"], r"not even one rank fits here, by the available memory .*"
                                                 r"1,000,000,076,000,000,010 parameters"),
    (SMALL + ["--ddp-option", "nonfinite=bogus"], r"--ddp-option: nonfinite must be .*got 'bogus'"),
    (SMALL + ["--batch-size", "1e9"], r"by the available memory .* a batch of 1000000000: lower --batch-size"),
    (SMALL + ["--checkpoint-every", "-1"], r"--checkpoint-every must be an integer >= 0, got '-1'"),
    (SMALL + ["--keep-checkpoints", "-1"], r"--keep-checkpoints must be an integer >= 0"),
    (SMALL + ["--timeout", "inf"], r"--timeout must be a finite number"),
    (SMALL + ["--time-limit", "0"], r"--time-limit must be a finite number in \(0,"),
    (SMALL + ["--lr", "nan"], r"--lr must be a finite number"),
    (LOOP + ["--workers", "1e12"], r"--workers 1000000000000: at most \d+ local ranks fit here, by "),
]


@pytest.mark.parametrize("argv,pattern", CASES, ids=[" ".join(c[0][len(SMALL) - 2:]) for c in CASES])
def test_train_values_are_one_line_exit_2_and_nothing_is_created(tmp_path, capsys, argv, pattern):
    runs = tmp_path / "runs"
    assert main([*argv, "--runs-dir", str(runs)]) == 2
    line = _one_line(capsys)
    assert line.startswith("sparsync train: error: ") and re.search(pattern, line), line
    assert not runs.exists()  # checked before the run directory (or its parent) is created


def test_compare_checks_values_before_its_directory(tmp_path, capsys):
    argv = ["compare", "--thread", "--workload", "digits-mlp", "--workers", "2", "--configs", "micro:0.05",
            "--no-baselines", "--no-progress", "--steps", "2", "--runs-dir", str(tmp_path / "runs")]
    for extra, pattern in ((["--workload-option", "width=-5"], "width must be at least 1"),
                           (["--ddp-option", "nonfinite=bogus"], "nonfinite must be"),
                           (["--seed", "99999999999"], "--seed must be an integer")):
        assert main([*argv, *extra]) == 2
        assert re.search(pattern, _one_line(capsys))
    assert not (tmp_path / "runs").exists()


def test_worker_bound_names_what_binds():
    bound, why = local_worker_limit()
    assert bound >= 1 and any(w in why for w in ("memory", "open-file", "process", "pids", "cores"))
    check_local_workers(1)
    with pytest.raises(ValueError, match=rf"--workers {bound + 1}: at most {bound} local ranks fit here"):
        check_local_workers(bound + 1)
    with pytest.raises(ValueError, match="not even one rank fits here, by the available memory"):
        check_local_workers(1, per_rank_memory=1 << 62)


def test_run_local_refuses_too_many_processes_before_forking_anything():
    import glob
    import os
    import tempfile

    import sparsync as ss
    from sparsync.launch import STORE_PREFIX

    bound, _ = local_worker_limit()
    with pytest.raises(ValueError, match=r"local ranks fit here"):
        ss.run_local(lambda c: None, bound + 1, backend="gloo")
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"{STORE_PREFIX}{os.getpid()}-*"))  # no store leaked


# ---------------------------------------------------------------------- train-linear
LIN = ["train-linear", "--backend", "thread", "--workers", "2", "--epochs", "1", "--samples", "400",
       "--features", "1000", "--nnz", "5"]


@pytest.mark.parametrize("extra,pattern", [
    (["--lr", "nan"], r"--lr must be a finite number"),
    (["--lr", "-1"], r"--lr must be a finite number in \(0, inf\], got '-1'"),
    (["--l2", "nan"], r"--l2 must be a finite number in \[0, inf\]"),
    (["--global-batch", "0"], r"--global-batch: expected a positive integer, got '0'"),
    (["--seed", str(2**40)], r"--seed must be an integer in \[0, 2147483647\]"),
    (["--test-fraction", "1.5"], r"--test-fraction must be a finite number in \[0, 1\]"),
    (["--features", "1e12"], r"not even one rank fits here, by the available memory .*1,000,000,000,000 features"),
])
def test_train_linear_values(capsys, extra, pattern):
    assert main([*LIN, *extra]) == 2
    line = _one_line(capsys)
    assert line.startswith("sparsync train-linear: error: ") and re.search(pattern, line), line


@pytest.mark.parametrize("text,pattern", [
    ("1 1:0.5 2:1e39\n-1 3:1\n", r"sample 1 has a feature value beyond float32's range"),
    ("1 1:0.5\n-1 1000000000000:1\n", r"not even one rank fits here, by the available memory .*1,000,000,000,000 "
                                      r"features \(the largest feature index"),
    ("1 1:0.5\n-1 x:1\n", r"data.svm:2: feature 'x:1' is not of the form index:value"),
    ("1 2:0.5 1:1\n-1 3:1\n", r"data.svm:1: feature index 1 is not larger than the previous one"),
])
def test_train_linear_file_errors_are_the_usual_one_line_exit_2(tmp_path, capsys, text, pattern):
    f = tmp_path / "data.svm"
    f.write_text(text)
    assert main(["train-linear", "--backend", "thread", "--workers", "2", "--epochs", "1", "--test-fraction", "0",
                 "--data", str(f)]) == 2
    line = _one_line(capsys)
    assert line.startswith("sparsync train-linear: error: ") and re.search(pattern, line), line


def test_a_topology_network_passes_the_checks_before_a_run_and_its_rates_are_bounded():
    """``--topology 2x2 --intra R --inter R`` reaches the pre-run checks as ``2x2@R/R``: each level's
    rate is checked, the spec itself is not read as one rate (which refused every topology run)."""
    from sparsync.commands import UsageError
    from sparsync.commands._preflight import preflight
    from sparsync.train.config import TrainConfig

    ok = TrainConfig(workload="digits-mlp", reducer="micro", workers=4, network="2x2@10gbit/200mbit", steps=2)
    preflight(ok, network=False)
    too_fast = TrainConfig(workload="digits-mlp", reducer="micro", workers=4, network="2x2@10gbit/2000gbit",
                           steps=2)
    with pytest.raises(UsageError, match="bandwidth must be at most 1000gbit"):
        preflight(too_fast, network=False)
