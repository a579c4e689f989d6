#!/usr/bin/env python3
"""Kill test for checkpoints, resume and the run database (ctest entry `kill_tests`).

A LoRA run of stories260K on CPU is SIGKILLed again and again -- at random times and, through the
LORAPIPE_KILL_AT hook, exactly inside a checkpoint write (after a file, after the manifest, just before
the commit rename) and inside a database transaction (just before COMMIT) -- and resumed each time with
`lorapipe-cli resume`. One attempt is stopped with SIGINT (Ctrl-C; SIGTERM in the second scenario) instead. After every kill:
PRAGMA integrity_check is "ok" and every committed checkpoint folder matches its manifest (no
half-written checkpoint). At the end the final LoRA weights are byte-identical to an uninterrupted run
with the same seed, and so are the logged loss curve (loss, lr, grad norm per step) and the
validation losses. Scenarios: single device with LoRA dropout (counter-based masks), and a 1F1B
pipeline on two CPU virtual devices (per-stage AdamW state restored).

usage: kill_test.py --cli build/app/lorapipe-cli --data ../shared/data [--seed N] [--timers N]
"""
import argparse
import hashlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time

FAILURES = []


def check(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail and not ok else ""), flush=True)
    if not ok:
        FAILURES.append(name)


def verify_checkpoints(root):
    """Every committed step-* folder has a manifest whose sizes and sha256 match; returns problems."""
    problems = []
    if not os.path.isdir(root):
        return problems
    for name in sorted(os.listdir(root)):
        if not name.startswith("step-"):
            continue  # .tmp-* / .trash-*: leftovers of a killed write, never read
        d = os.path.join(root, name)
        try:
            man = json.load(open(os.path.join(d, "manifest.json")))
        except Exception as e:  # noqa: BLE001
            problems.append(f"{name}: manifest unreadable ({e})")
            continue
        files = set(os.listdir(d)) - {"manifest.json"}
        if files != set(man["files"]):
            problems.append(f"{name}: files {sorted(files)} != manifest {sorted(man['files'])}")
        for f, meta in man["files"].items():
            p = os.path.join(d, f)
            if not os.path.exists(p):
                problems.append(f"{name}/{f} missing")
                continue
            blob = open(p, "rb").read()
            if len(blob) != meta["bytes"] or hashlib.sha256(blob).hexdigest() != meta["sha256"]:
                problems.append(f"{name}/{f} does not match the manifest")
    return problems


def db_state(db, run):
    con = sqlite3.connect(db)
    try:
        integrity = con.execute("PRAGMA integrity_check").fetchone()[0]
        metrics = con.execute("SELECT step, loss, lr, grad_norm FROM metrics WHERE run_id=? ORDER BY step", (run,)).fetchall()
        evals = con.execute("SELECT step, loss, tokens FROM evaluations WHERE run_id=? AND split='val' ORDER BY step",
                            (run,)).fetchall()
        row = con.execute("SELECT status, resumed_count FROM runs WHERE id=?", (run,)).fetchone()
    finally:
        con.close()
    return integrity, metrics, evals, row


def scenario(cli, data, tmp, label, extra_project, train_args, hooks, timers, rng, steps, stop_signal=signal.SIGINT):
    work = os.path.join(tmp, label)
    os.makedirs(work)
    project = {
        "schema_version": 2, "name": f"kill-test {label}",
        "model": {"path": os.path.join(data, "models/stories260K/hf")},
        "data": {"train": os.path.join(data, "text/tinyshakespeare.txt"), "seq_len": 64, "val_fraction": 0.02},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "optimizer": {"lr": 0.003, "warmup_steps": 5},
        "run": {"steps": steps, "batch_size": 4, "eval_interval": 10, "eval_batches": 2, "threads": 2,
                "sample_tokens": 0, "checkpoint_interval": 3, "keep_checkpoints": 2},
    }
    for k, v in extra_project.items():
        project.setdefault(k, {}).update(v)
    pfile = os.path.join(work, "p.json")
    json.dump(project, open(pfile, "w"))

    # The uninterrupted reference.
    ref_db = os.path.join(work, "ref.db")
    p = subprocess.run([cli, "train", pfile, "--output", os.path.join(work, "ref"), "--db", ref_db, *train_args],
                       capture_output=True, text=True, timeout=600)
    check(f"{label}: reference run", p.returncode == 0, p.stderr[-800:])
    if p.returncode != 0:
        return
    _, ref_metrics, ref_evals, _ = db_state(ref_db, 1)
    ref_adapter = open(os.path.join(work, "ref/adapter/adapter_model.safetensors"), "rb").read()
    started = time.time()
    subprocess.run([cli, "train", pfile, "--output", os.path.join(work, "probe"), "--db", os.path.join(work, "probe.db"),
                    *train_args], capture_output=True, timeout=600)
    run_seconds = time.time() - started
    con = sqlite3.connect(os.path.join(work, "probe.db"))
    train_seconds = con.execute("SELECT max(elapsed_s) FROM metrics").fetchone()[0]
    con.close()
    startup_seconds = max(0.1, run_seconds - train_seconds)

    # The same run, killed over and over.
    db = os.path.join(work, "kill.db")
    out = os.path.join(work, "killed")
    root = os.path.join(out, "checkpoints", "run-1")
    # Exact kills first (each costs a few steps of progress), Ctrl-C, then kills at random times.
    plan = list(hooks)
    rng.shuffle(plan)
    plan = ["sigint"] + plan + ["timer"] * timers
    done_modes = []
    cmd = [cli, "train", pfile, "--output", out, "--db", db, *train_args]
    attempts = killed = 0
    states = []  # (attempt, mode, rc, integrity_check, checkpoint problems) after every process
    completed = False
    while not completed and attempts < len(plan) + 3:
        mode = plan[attempts] if attempts < len(plan) else "none"
        attempts += 1
        env = dict(os.environ)
        if ":" in mode:
            env["LORAPIPE_KILL_AT"] = mode
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if mode == "timer":
            try:
                # anywhere from loading to a third of the training (each kill loses at most that much progress)
                proc.wait(timeout=rng.uniform(0.05, startup_seconds + 0.35 * train_seconds))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
        elif mode == "sigint":  # once the next checkpoint is committed (training is underway, the handler installed)
            before = {n for n in os.listdir(root) if n.startswith("step-")} if os.path.isdir(root) else set()
            while proc.poll() is None:
                now = {n for n in os.listdir(root) if n.startswith("step-")} if os.path.isdir(root) else set()
                if now - before:
                    proc.send_signal(stop_signal)
                    break
                time.sleep(0.01)
        _, err = proc.communicate(timeout=600)
        rc = proc.returncode
        if rc == 0:
            completed = True
        elif rc in (-signal.SIGKILL, 130):
            killed += 1
            done_modes.append(mode)
            if rc == 130:
                check(f"{label}: {signal.Signals(stop_signal).name} stops after a checkpoint", "checkpoint" in err and "resume" in err, err[-500:])
                check(f"{label}: the stop reports no final validation rather than a loss of 0",
                      "(none at the stop)" in err and "-> 0.0000" not in err, err[-500:])
        else:
            check(f"{label}: attempt {attempts} ({mode}) ends by kill or success", False, f"rc={rc}\n{err[-1500:]}")
            return
        integrity, _, _, _ = db_state(db, 1)
        problems = verify_checkpoints(root)
        states.append((attempts, mode, rc, integrity, problems))
        if integrity != "ok" or problems:
            break  # a broken state: the check below reports it
        cmd = [cli, "resume", "1", "--db", db]
    missing = [m for m in hooks + ["sigint"] if m not in done_modes]
    check(f"{label}: run completed after {killed} kills in {attempts} attempts", completed and not missing,
          f"completed={completed}, planned stops that did not happen: {missing}")
    broken = [s for s in states if s[3] != "ok" or s[4]]
    check(f"{label}: database integrity and checkpoints sound after every kill", len(states) == attempts and not broken,
          f"{len(states)} states checked for {attempts} processes; broken: {broken[:3]}")
    if broken:
        return
    integrity, metrics, evals, row = db_state(db, 1)
    adapter = open(os.path.join(out, "adapter/adapter_model.safetensors"), "rb").read()
    check(f"{label}: final LoRA weights bit-identical to the uninterrupted run", adapter == ref_adapter)
    check(f"{label}: loss curve bit-identical ({len(metrics)} steps)", metrics == ref_metrics and len(metrics) == steps,
          f"{len(metrics)} rows; first difference at "
          f"{next((a, b) for a, b in zip(metrics + [None] * 99, ref_metrics) if a != b) if metrics != ref_metrics else None}")
    check(f"{label}: validation losses bit-identical", evals == ref_evals, f"{evals} vs {ref_evals}")
    exact = sum(1 for m in done_modes if ":" in m)
    check(f"{label}: run status completed, resumed {row[1]} times", row[0] == "completed" and exact <= row[1] <= attempts - 1,
          str(row))
    print(f"{label}: {killed} stops ({', '.join(done_modes)}), {attempts} processes; one uninterrupted run takes "
          f"{run_seconds:.1f} s ({startup_seconds:.1f} s loading, {train_seconds:.1f} s training)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--seed", type=int, default=int(os.environ.get("LORAPIPE_KILL_SEED", "20261202")))
    ap.add_argument("--timers", type=int, default=10, help="kills at random times per scenario (after the exact ones)")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    print(f"kill test seed {a.seed}")
    with tempfile.TemporaryDirectory() as tmp:
        hooks = ["checkpoint:file:2", "checkpoint:manifest:1", "checkpoint:rename:2", "db:commit:2", "checkpoint:rename:1",
                 "db:commit:1", "checkpoint:file:4"]
        scenario(a.cli, a.data, tmp, "single", {"lora": {"dropout": 0.1}}, [], hooks, a.timers, rng, 60)
        scenario(a.cli, a.data, tmp, "1f1b-cpu2", {"parallel": {"micro_batches": 2}}, ["--schedule", "1f1b", "--devices", "cpu:2"],
                 ["checkpoint:file:3", "checkpoint:rename:1", "db:commit:2"], max(2, a.timers // 2), rng, 36, signal.SIGTERM)
    print(f"{len(FAILURES)} failed" if FAILURES else "all passed")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
