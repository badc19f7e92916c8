"""Data parallelism through torchrun (engine/distributed.py): two CPU processes with
the gloo backend train exactly what one process trains with the same global batch,
and a checkpoint resumes on a different number of processes."""
import json
import socket
import sys

import pytest

from conftest import run_script


def losses(run_dir):
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def args(corpus, out, name, *extra):
    return ["--config", "tiny", f"--data.path={corpus}", f"--data.cache_dir={out / 'cache'}",
            f"--train.out_dir={out / 'runs'}", f"--train.run_name={name}", "--train.grad_accum=4",
            "--train.max_iters=10", "--train.eval_interval=5", *extra]


def torchrun(n, *train_args):
    return ["-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), "train.py", *train_args]


@pytest.mark.skipif(sys.platform == "win32", reason="gloo over TCP on localhost")
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_match_one_and_resume_on_one(corpus, tmp_path, parallel):
    run_script("train.py", *args(corpus, tmp_path, "single"))
    proc = run_script(*torchrun(2, *args(corpus, tmp_path, "double"), f"--train.parallel={parallel}"),
                      timeout=300)
    assert "2 processes" in proc.stdout
    assert proc.stdout.count("step      5: val loss") == 1          # printed by one process
    single, double = losses(tmp_path / "runs" / "single"), losses(tmp_path / "runs" / "double")
    assert sorted(single) == sorted(double) == list(range(1, 11))
    for step in single:
        assert double[step] == pytest.approx(single[step], rel=1e-5, abs=1e-6), step
    # Only the main process wrote: one metrics line per step, one set of checkpoints.
    assert len([l for l in (tmp_path / "runs" / "double" / "metrics.jsonl").read_text().splitlines()
                if '"loss"' in l]) == 10
    # The two-process checkpoint continues in one process, as the single run does.
    for name in ("single", "double"):
        run_script("train.py", "--resume", tmp_path / "runs" / name, "--train.max_iters=14")
    single, double = losses(tmp_path / "runs" / "single"), losses(tmp_path / "runs" / "double")
    for step in range(11, 15):
        assert double[step] == pytest.approx(single[step], rel=1e-4), step
    # ... and a one-process checkpoint continues on two processes (each cuts its shard
    # of the weights and optimizer state out of the full tensors under fsdp).
    run_script(*torchrun(2, "--resume", tmp_path / "runs" / "single", "--train.max_iters=17",
                         f"--train.parallel={parallel}"), timeout=300)
    run_script("train.py", "--resume", tmp_path / "runs" / "double", "--train.max_iters=17")
    single, double = losses(tmp_path / "runs" / "single"), losses(tmp_path / "runs" / "double")
    for step in range(15, 18):
        assert single[step] == pytest.approx(double[step], rel=1e-4), step


def test_grad_accum_must_split_evenly(corpus, tmp_path):
    proc = run_script(*torchrun(2, *args(corpus, tmp_path, "odd", "--train.grad_accum=3")),
                      check=False, timeout=300)
    assert proc.returncode != 0 and "multiple of the 2 processes" in proc.stderr


def test_a_time_limit_is_refused_under_torchrun(corpus, tmp_path):
    proc = run_script(*torchrun(2, *args(corpus, tmp_path, "timed"), "--train.time_limit=30"),
                      check=False, timeout=300)
    assert proc.returncode != 0 and "train.time_limit is for one process" in proc.stderr
