"""One pipeline over two processes on GPUs (ctest label `gpu`; exit 77 = skipped without a GPU).

- One GPU: `train --devices cuda:0,0 --processes 2` (activations and gradients device -> host ->
  Gloo -> host -> device) gives the loss of every step of the one-process run on cuda:0,0.
- Two GPUs or more: `--devices cuda:0,1 --transport nccl --processes 2` (one NCCL communicator per
  link direction spanning the two processes, its id passed through the rendezvous store) gives the
  loss of every step of the one-process NCCL run.
- A rank lost mid-run (SIGKILL after step 4; NCCL between two GPUs, else the host transport on one):
  rank 0 exits with an error naming rank 1 within the distributed timeout (NCCL's communicators
  aborted, nothing left waiting on the dead peer), the run is recorded failed, no process is left.
Every command runs under a timeout; the local ranks die with their parent, and every process this
test starts is killed at its end. `--cpu` runs the cases on CPU virtual devices (the test's own check).
"""
import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cli"))
from rank_kill import exit_after_kill, rank_processes, train_and_kill_rank1  # noqa: E402

RESULTS = []
STARTED = []


def check(name, ok, detail=""):
    RESULTS.append(ok)
    print(f"{'PASS' if ok else 'FAIL'} {name}{(': ' + detail) if detail and not ok else ''}", flush=True)


def gpu_count():
    try:
        p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for l in p.stdout.splitlines() if l.startswith("GPU "))


def losses(stderr):
    return [json.loads(l)["loss"] for l in stderr.splitlines() if l.startswith('{"event":"step"')]


def project(tmp, data, name, devices, transport, timeout_s=60, steps=10):
    proj = os.path.join(tmp, f"{name}.json")
    with open(proj, "w") as f:
        json.dump({"schema_version": 2, "name": "dist-gpu",
                   "model": {"path": os.path.join(data, "models/stories260K/hf"), "dtype": "float32"},
                   "data": {"train": os.path.join(data, "text/tinyshakespeare.txt"), "seq_len": 64, "val_fraction": 0.05},
                   "lora": {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]},
                   "optimizer": {"lr": 0.003, "warmup_steps": 2, "grad_clip": 1.0},
                   "parallel": {"devices": devices, "schedule": "1f1b", "micro_batches": 4, "transport": transport},
                   "distributed": {"timeout_s": timeout_s},
                   "run": {"steps": steps, "batch_size": 8, "eval_interval": 5, "eval_batches": 2, "sample_tokens": 8,
                           "checkpoint_interval": 0}}, f)
    return proj


def killed_rank(cli, env, tmp, data, devices, transport):
    label = f"{devices}, transport {transport}: rank 1 killed"
    timeout_s = 20
    # Enough steps that the run is still going when the kill lands.
    proj = project(tmp, data, f"kill-{transport}", devices, transport, timeout_s=timeout_s, steps=200)
    out, log = os.path.join(tmp, f"kill-{transport}"), os.path.join(tmp, f"kill-{transport}.log")
    marker = os.path.join(out, "rank-project.json")
    p, killed = train_and_kill_rank1([cli, "train", proj, "--output", out, "--json", "--processes", "2"], env, log, marker, 4,
                                     STARTED, within_s=240)
    check(f"{label} after step 4", killed is not None)
    rc, took, last = exit_after_kill(p, killed, log, timeout_s + 40)
    check(f"{label}: rank 0 exits with an error naming rank 1 ({took:.1f} s after the kill, timeout {timeout_s} s)",
          rc == 1 and "rank 1" in last and last.startswith("error:") and took < timeout_s + 40, f"rc={rc} last={last[:300]!r}")
    print(f"  {label}: {last[:300]}", flush=True)
    time.sleep(0.5)
    left = rank_processes(marker)
    check(f"{label}: no process of the run is left", not left, f"{left}")
    with sqlite3.connect(env["LORAPIPE_DB"]) as c:
        status = c.execute("SELECT status FROM runs ORDER BY id DESC LIMIT 1").fetchone()[0]
    check(f"{label}: the run is recorded as failed", status == "failed", status)


def compare(cli, env, tmp, data, devices, transport):
    label = f"{devices}, transport {transport}"
    proj = project(tmp, data, f"p-{transport}", devices, transport)
    runs = []
    for processes in ("1", "2"):
        p = subprocess.run([cli, "train", proj, "--output", os.path.join(tmp, f"out-{transport}-{processes}"), "--json",
                            "--processes", processes], capture_output=True, text=True, timeout=300, env=env)
        runs.append((p.returncode, p.stderr))
    check(f"{label}: one and two processes complete", all(rc == 0 for rc, _ in runs),
          " | ".join(err[-600:] for rc, err in runs if rc != 0))
    check(f"{label}: the second run ran over two processes", "rank 0 loads" in runs[1][1] and "rank 0 loads" not in runs[0][1])
    a, b = losses(runs[0][1]), losses(runs[1][1])
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b)) if a and len(a) == len(b) else float("inf")
    check(f"{label}: two processes give one process's loss at every step (worst {worst:.1e})", len(a) == 10 and worst < 1e-5,
          f"{a} vs {b}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--cpu", action="store_true", help="run the cases on cpu:2 (checks this test itself)")
    args = ap.parse_args()
    n = gpu_count()
    if n == 0 and not args.cpu:
        print("no GPU: skipped")
        return 77
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, LORAPIPE_DB=os.path.join(tmp, "runs.db"), XDG_CACHE_HOME=os.path.join(tmp, "cache"))
        try:
            if args.cpu:
                compare(args.cli, env, tmp, args.data, "cpu:2", "host")
                killed_rank(args.cli, env, tmp, args.data, "cpu:2", "host")
            else:
                compare(args.cli, env, tmp, args.data, "cuda:0,0", "host")
                if n >= 2:
                    compare(args.cli, env, tmp, args.data, "cuda:0,1", "nccl")
                    killed_rank(args.cli, env, tmp, args.data, "cuda:0,1", "nccl")
                else:
                    print("one GPU: NCCL between processes needs two (NCCL refuses two ranks on one GPU)")
                    killed_rank(args.cli, env, tmp, args.data, "cuda:0,0", "host")
        finally:
            for p in STARTED:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    print(f"{RESULTS.count(True)} passed, {RESULTS.count(False)} failed")
    return 0 if all(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
