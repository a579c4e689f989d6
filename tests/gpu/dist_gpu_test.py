"""One pipeline over two processes on GPUs (ctest label `gpu`; exit 77 = skipped without a GPU).

- One GPU: `train --devices cuda:0,0 --processes 2` (activations and gradients device -> host ->
  Gloo -> host -> device) gives the loss of every step of the one-process run on cuda:0,0.
- Two GPUs or more: `--devices cuda:0,1 --transport nccl --processes 2` (one NCCL communicator per
  link direction spanning the two processes, its id passed through the rendezvous store) gives the
  loss of every step of the one-process NCCL run.
Every command runs under a timeout; the local ranks die with their parent.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

RESULTS = []


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


def compare(cli, env, tmp, data, devices, transport):
    label = f"{devices}, transport {transport}"
    proj = os.path.join(tmp, f"p-{transport}.json")
    with open(proj, "w") as f:
        json.dump({"schema_version": 2, "name": "dist-gpu",
                   "model": {"path": os.path.join(data, "models/stories260K/hf"), "dtype": "float32"},
                   "data": {"train": os.path.join(data, "text/tinyshakespeare.txt"), "seq_len": 64, "val_fraction": 0.05},
                   "lora": {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]},
                   "optimizer": {"lr": 0.003, "warmup_steps": 2, "grad_clip": 1.0},
                   "parallel": {"devices": devices, "schedule": "1f1b", "micro_batches": 4, "transport": transport},
                   "distributed": {"timeout_s": 60},
                   "run": {"steps": 10, "batch_size": 8, "eval_interval": 5, "eval_batches": 2, "sample_tokens": 8,
                           "checkpoint_interval": 0}}, f)
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
    args = ap.parse_args()
    n = gpu_count()
    if n == 0:
        print("no GPU: skipped")
        return 77
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, LORAPIPE_DB=os.path.join(tmp, "runs.db"), XDG_CACHE_HOME=os.path.join(tmp, "cache"))
        compare(args.cli, env, tmp, args.data, "cuda:0,0", "host")
        if n >= 2:
            compare(args.cli, env, tmp, args.data, "cuda:0,1", "nccl")
        else:
            print("one GPU: NCCL between processes needs two (NCCL refuses two ranks on one GPU)")
    print(f"{RESULTS.count(True)} passed, {RESULTS.count(False)} failed")
    return 0 if all(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
