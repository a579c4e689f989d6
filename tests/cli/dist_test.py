"""lorapipe-cli train over several processes (c10d Gloo on 127.0.0.1) against one process.

- `--processes 2` (1F1B on cpu:2) and `--processes 4` (round-robin on cpu:4): the loss of every step,
  every validation, the before/after samples and the saved adapter equal the one-process run of the
  same project; with 1F1B rank 0 reads only the weights of its own stages; rank 0's step events
  carry every device's arena peak (the other ranks send theirs).
- A rank SIGKILLed mid-run: rank 0 exits within the timeout with an error naming the rank, the run is
  recorded as failed, no process of the run is left, and `resume` continues it from its last
  checkpoint to the very adapter of the uninterrupted run; `resume --processes 1` continues it in
  one process to the same adapter (within the tolerance of one process against two). The error
  says what the dead rank did last (its step and last completed instruction).
- Ranks started by hand (`--rank`, `--rendezvous`) with projects that differ only in the learning rate
  are refused on both sides.
- `--steps 0` over 2 processes completes at once (every rank takes part in the step-0 checkpoint).
- data.on_disk over 2 local processes: each rank keeps its own token cache; losses equal one process's.
- distributed.processes beyond the device count is refused naming the field; rank 0 started by hand
  on port 0 (which nobody would be told) too.
- A local rank that dies before the rendezvous fails the run at once, naming it.
- Ranks started by hand: `resume RUN --rendezvous` on rank 0 with a fresh rank 1 that has no
  checkpoint (two machines) continues to the uninterrupted run's adapter.
- Ctrl-C (SIGINT to the process group) stops every rank at one step with a checkpoint (exit 130, run
  interrupted); resume reaches the uninterrupted run's adapter.
Every command runs under a timeout; every process this test starts is killed at its end.
"""
import argparse
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time

from safetensors.torch import load_file

from rank_kill import exit_after_kill, rank_processes, train_and_kill_rank1

RESULTS = []
STARTED = []


def check(name, ok, detail=""):
    RESULTS.append(ok)
    print(f"{'PASS' if ok else 'FAIL'} {name}{(': ' + detail) if detail and not ok else ''}", flush=True)


def run(cli, *args, env, timeout=300):
    p = subprocess.run([cli, *args], capture_output=True, text=True, timeout=timeout, env=env)
    return p.returncode, p.stderr


def steps_of(stderr):
    return [json.loads(l)["loss"] for l in stderr.splitlines() if l.startswith('{"event":"step"')]


def adapter(out):
    return load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))


def max_rel(a, b):
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)).item() for k in b)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def project(tmp, data, name, devices, schedule, extra=None):
    p = {"schema_version": 2, "name": name,
         "model": {"path": os.path.join(data, "models/stories260K/hf"), "dtype": "float32"},
         "data": {"train": os.path.join(data, "text/tinyshakespeare.txt"), "seq_len": 64, "val_fraction": 0.05},
         "lora": {"r": 4, "alpha": 8, "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
         "optimizer": {"lr": 0.003, "warmup_steps": 2, "grad_clip": 1.0},
         "parallel": {"devices": devices, "schedule": schedule, "micro_batches": 4},
         "distributed": {"timeout_s": 20},
         "run": {"steps": 12, "batch_size": 8, "eval_interval": 0, "eval_batches": 4, "sample_tokens": 0, "checkpoint_interval": 4,
                 "threads": 1}}
    for k, v in (extra or {}).items():
        p[k].update(v)
    path = os.path.join(tmp, name + ".json")
    with open(path, "w") as f:
        json.dump(p, f, indent=1)
    return path


def events(stderr, kind):
    return [json.loads(l) for l in stderr.splitlines() if l.startswith('{"event":"%s"' % kind)]


def same_as_one_process(cli, env, tmp, data, devices, schedule, processes):
    label = f"{processes} processes, {schedule} on {devices}"
    # Validation every 4 steps and the before/after samples run on the pipeline too (over the
    # processes: each rank holds only its stages' weights).
    proj = project(tmp, data, f"p{processes}-{schedule}", devices, schedule,
                   {"run": {"eval_interval": 4, "sample_tokens": 12, "sample_prompt": "Once upon a time", "save_merged": True}})
    rc1, err1 = run(cli, "train", proj, "--output", os.path.join(tmp, f"one-{processes}"), "--json", env=env)
    rcn, errn = run(cli, "train", proj, "--output", os.path.join(tmp, f"many-{processes}"), "--processes", str(processes), "--json", env=env)
    check(f"{label}: both runs complete", rc1 == 0 and rcn == 0, f"rc {rc1}/{rcn}: {err1[-300:]} {errn[-600:]}")
    if rc1 != 0 or rcn != 0:
        return
    a, b = steps_of(err1), steps_of(errn)
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b)) if a and len(a) == len(b) else float("inf")
    check(f"{label}: the loss of every step equals one process's (worst {worst:.1e})", len(a) == 12 and worst < 1e-6, f"{a} vs {b}")
    rel = max_rel(adapter(os.path.join(tmp, f"many-{processes}")), adapter(os.path.join(tmp, f"one-{processes}")))
    check(f"{label}: the adapter equals one process's (max rel {rel:.1e})", rel < 1e-4)
    # Rank 0 merges the layers it never loaded by reading them from the model a layer at a time.
    merged = lambda out: load_file(os.path.join(out, "merged", "model.safetensors"))
    mrel = max_rel(merged(os.path.join(tmp, f"many-{processes}")), merged(os.path.join(tmp, f"one-{processes}")))
    check(f"{label}: the merged export equals one process's (max rel {mrel:.1e})", mrel < 1e-4)
    # Other ranks send their metrics to rank 0: every device's arena peak is in rank 0's step events
    # (devices of other processes were 0 before), close to the one-process run's.
    p1 = [e["device_peak_bytes"] for e in events(err1, "step")]
    pn = [e["device_peak_bytes"] for e in events(errn, "step")]
    check(f"{label}: rank 0's step events carry every device's peak",
          len(pn) == 12 and all(len(x) == len(p1[0]) and all(v > 0 for v in x) for x in pn) and
          all(abs(a - b) <= 0.1 * a for a, b in zip(p1[-1], pn[-1])), f"{p1[-1] if p1 else None} vs {pn[-1] if pn else None}")
    ev1, evn = [e["val_loss"] for e in events(err1, "eval")], [e["val_loss"] for e in events(errn, "eval")]
    vworst = max(abs(x - y) / abs(x) for x, y in zip(ev1, evn)) if ev1 and len(ev1) == len(evn) else float("inf")
    check(f"{label}: every validation equals one process's (worst {vworst:.1e})", len(ev1) == 4 and vworst < 1e-6, f"{ev1} vs {evn}")
    s1, sn = [e["text"] for e in events(err1, "sample")], [e["text"] for e in events(errn, "sample")]
    check(f"{label}: the before/after samples equal one process's", len(s1) == 2 and s1 == sn and all(s1), f"{s1} vs {sn}")
    loads = [e["message"] for e in events(errn, "log") if e["message"].startswith("rank 0 loads ")]
    n = int(loads[0].split()[3]) if loads else -1
    # 1F1B: rank 0 runs the first stages only; round-robin over 4: the stages its device's micro-batches
    # pass through, 4 of 5 layers (its other weights are meta tensors: a read would fail the run).
    check(f"{label}: rank 0 reads only the weights of its stages ({loads[0] if loads else 'no report'})", 0 < n < 5, f"{loads}")
    print(f"  {label}: losses within {worst:.1e}, validation within {vworst:.1e}, adapter within {rel:.1e}", flush=True)


def killed_rank_resumes(cli, env, tmp, data, resume_processes=None):
    """resume_processes: resume over that many processes instead of the recorded 2 (same adapter
    within the one-process tolerance); else the very adapter of the uninterrupted run."""
    proj = project(tmp, data, "kill", "cpu:2", "1f1b", {"distributed": {"processes": 2, "timeout_s": 20}})
    out_ref, out = os.path.join(tmp, "kill-ref"), os.path.join(tmp, f"kill-run-{resume_processes}")
    if not os.path.exists(os.path.join(out_ref, "adapter")):
        rc, err = run(cli, "train", proj, "--output", out_ref, "--json", env=env)
        check("kill: the uninterrupted 2-process run completes", rc == 0, err[-500:])
    log = os.path.join(tmp, f"kill-{resume_processes}.log")
    marker = os.path.join(out, "rank-project.json")
    p, killed = train_and_kill_rank1([cli, "train", proj, "--output", out, "--json"], env, log, marker, 7, STARTED)
    check("kill: rank 1 was killed after step 7", killed is not None)
    rc, took, last = exit_after_kill(p, killed, log, 20 + 30)
    check(f"kill: rank 0 exits with an error naming rank 1 ({took:.1f} s after the kill, within the 20 s timeout)",
          rc == 1 and "rank 1" in last and last.startswith("error:") and took < 20, f"rc={rc} last={last[:300]!r}")
    # ... and what rank 1 did last: the step (or checkpoint) it was in and its device's last instruction.
    check("kill: the error says what rank 1 did last", re.search(r"rank 1 last reported: (training step \d+ of 12|checkpoint at step \d+)", last)
          is not None, f"last={last[:400]!r}")
    print(f"  kill: {last[:400]}", flush=True)
    time.sleep(0.5)
    left = rank_processes(marker)
    check("kill: no process of the run is left", not left, f"{left}")
    db = env["LORAPIPE_DB"]
    with sqlite3.connect(db) as c:
        run_id, status = c.execute("SELECT id, status FROM runs ORDER BY id DESC LIMIT 1").fetchone()
    check("kill: the run is recorded as failed", status == "failed", status)
    more = ["--processes", str(resume_processes)] if resume_processes else []
    rc, err = run(cli, "resume", str(run_id), "--json", *more, env=env)
    label = f"kill: resume over {resume_processes or 2} processes"
    check(f"{label} completes the run", rc == 0, err[-600:])
    if rc == 0:
        with sqlite3.connect(db) as c:
            status = c.execute("SELECT status FROM runs WHERE id = ?", (run_id,)).fetchone()[0]
        rel = max_rel(adapter(out), adapter(out_ref))
        # The same processes: bit for bit. Another count: the gradient norm's sum is ordered otherwise.
        ok = rel == 0.0 if not resume_processes else rel < 1e-4
        check(f"{label}: the adapter is the uninterrupted run's (max rel {rel:.1e}), run completed", ok and status == "completed",
              f"{rel} {status}")
        if resume_processes:
            resumed = "rank 0 loads" in err if resume_processes > 1 else "rank 0 loads" not in err
            check(f"{label}: it ran over {resume_processes} process(es)", resumed, err[-300:])


def ctrl_c_stops_every_rank(cli, env, tmp, data):
    # Ctrl-C in a terminal: SIGINT to the whole process group. Every rank stops at the same step,
    # rank 0 checkpoints it and exits 130, and resume finishes with the uninterrupted run's adapter.
    proj = project(tmp, data, "kill", "cpu:2", "1f1b", {"distributed": {"processes": 2, "timeout_s": 20}})
    out, out_ref = os.path.join(tmp, "ctrl-c"), os.path.join(tmp, "kill-ref")
    log = os.path.join(tmp, "ctrl-c.log")
    with open(log, "w") as f:
        p = subprocess.Popen([cli, "train", proj, "--output", out, "--json"], stderr=f, env=env, start_new_session=True)
    STARTED.append(p)
    t_end, sent = time.time() + 120, False
    while time.time() < t_end and p.poll() is None:
        with open(log) as f:
            if '"step":5,' in f.read():
                os.killpg(p.pid, signal.SIGINT)
                sent = True
                break
        time.sleep(0.05)
    try:
        rc = p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = None
    with open(log) as f:
        err = f.read()
    check("ctrl-c: every rank stops, rank 0 exits 130 with a checkpoint", sent and rc == 130 and "interrupted at step" in err,
          f"rc={rc} {err[-400:]!r}")
    time.sleep(0.5)
    check("ctrl-c: no process of the run is left", not rank_processes(os.path.join(out, "rank-project.json")))
    with sqlite3.connect(env["LORAPIPE_DB"]) as c:
        run_id, status = c.execute("SELECT id, status FROM runs ORDER BY id DESC LIMIT 1").fetchone()
    check("ctrl-c: the run is recorded as interrupted", status == "interrupted", status)
    rc, err = run(cli, "resume", str(run_id), "--json", env=env)
    rel = max_rel(adapter(out), adapter(out_ref)) if rc == 0 else float("inf")
    check(f"ctrl-c: resume finishes with the uninterrupted run's adapter (max rel {rel:.1e})", rc == 0 and rel == 0.0, err[-400:])


def hand_started_resume_without_checkpoint(cli, env, tmp, data):
    # Two machines, simulated: ranks started by hand with their own output folders. Rank 1 is killed
    # after step 7; rank 0 resumes with `resume RUN --rendezvous` and rank 1 is started again by hand
    # with no checkpoint on its side: rank 0 hands it the state, and the run ends with the adapter of
    # the uninterrupted run.
    proj = project(tmp, data, "kill", "cpu:2", "1f1b", {"distributed": {"processes": 2, "timeout_s": 20}})
    out0, out1 = os.path.join(tmp, "hand-0"), os.path.join(tmp, "hand-1")
    port = free_port()
    log = os.path.join(tmp, "hand.log")
    with open(log, "w") as f:
        r0 = subprocess.Popen([cli, "train", proj, "--output", out0, "--rank", "0", "--rendezvous", f"127.0.0.1:{port}", "--json"],
                              stderr=f, env=env)
    STARTED.append(r0)
    time.sleep(0.5)
    r1 = subprocess.Popen([cli, "train", proj, "--output", out1, "--rank", "1", "--rendezvous", f"127.0.0.1:{port}"],
                          stderr=subprocess.DEVNULL, env=env)
    STARTED.append(r1)
    t_end = time.time() + 120
    while time.time() < t_end and r0.poll() is None:
        with open(log) as f:
            if '"step":7,' in f.read():
                r1.kill()
                break
        time.sleep(0.05)
    try:
        rc = r0.wait(timeout=60)
    except subprocess.TimeoutExpired:
        r0.kill()
        rc = None
    r1.wait()
    check("hand-started: rank 0 fails when rank 1 is killed", rc == 1)
    with sqlite3.connect(env["LORAPIPE_DB"]) as c:
        run_id = c.execute("SELECT id FROM runs ORDER BY id DESC LIMIT 1").fetchone()[0]
    port = free_port()
    r0 = subprocess.Popen([cli, "resume", str(run_id), "--rendezvous", f"127.0.0.1:{port}", "--json"], stderr=subprocess.PIPE, text=True,
                          env=env)
    STARTED.append(r0)
    time.sleep(0.5)
    fresh = os.path.join(tmp, "hand-1-again")  # nothing of the first attempt on rank 1's side
    r1 = subprocess.Popen([cli, "train", proj, "--output", fresh, "--rank", "1", "--rendezvous", f"127.0.0.1:{port}"],
                          stderr=subprocess.PIPE, text=True, env=env)
    STARTED.append(r1)
    try:
        e0 = r0.communicate(timeout=120)[1]
        e1 = r1.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        r0.kill(), r1.kill()
        e0 = e1 = "timed out"
    check("hand-started: resume on rank 0 and a fresh rank 1 complete", r0.returncode == 0 and r1.returncode == 0, f"{e0[-400:]} | {e1[-400:]}")
    if r0.returncode == 0:
        rel = max_rel(adapter(out0), adapter(os.path.join(tmp, "kill-ref")))
        check(f"hand-started: the resumed adapter is the uninterrupted run's (max rel {rel:.1e})", rel == 0.0)
    check("hand-started: rank 1 had no checkpoint of its own", not os.path.exists(os.path.join(fresh, "checkpoints")))


def rank_dead_before_rendezvous(cli, env, tmp, data):
    # Rank 1 SIGKILLs itself as it starts: rank 0 fails at once naming it, not after timeout_s.
    proj = project(tmp, data, "nostart", "cpu:2", "1f1b", {"distributed": {"processes": 2, "timeout_s": 60}})
    t0 = time.time()
    rc, err = run(cli, "train", proj, "--output", os.path.join(tmp, "nostart"), env=dict(env, LORAPIPE_KILL_AT="rank:start:1"), timeout=120)
    took = time.time() - t0
    last = err.strip().splitlines()[-1] if err.strip() else ""
    check(f"a rank dead before the rendezvous fails the run at once, naming it ({took:.1f} s, timeout 60 s)",
          rc == 1 and "rank 1 exited with signal 9 before joining" in err and took < 30, f"rc={rc} {last[:300]!r}")


def zero_steps(cli, env, tmp, data):
    # --steps 0: every rank takes part in the step-0 checkpoint together (rank 0 gathers the stages'
    # state; a rank that skipped it left rank 0 gathering from a process gone), the run completes at once.
    proj = project(tmp, data, "zero", "cpu:2", "1f1b")
    t0 = time.time()
    rc, err = run(cli, "train", proj, "--output", os.path.join(tmp, "zero"), "--processes", "2", "--steps", "0", env=env, timeout=120)
    took = time.time() - t0
    check(f"--steps 0 over 2 processes completes at once ({took:.1f} s, timeout 20 s)",
          rc == 0 and "checkpoint" in err and took < 15, f"rc={rc} {err[-400:]!r}")


def on_disk_data(cli, env, tmp, data):
    # data.on_disk: local ranks share rank 0's output folder, each keeps its own token cache (a shared
    # one is truncated and removed under another rank's mapping); the losses equal one process's.
    extra = {"data": {"train": os.path.join(data, "instruct/quiz_alpaca.jsonl"), "on_disk": True, "seq_len": 128},
             "run": {"steps": 4, "checkpoint_interval": 0}}
    proj = project(tmp, data, "ondisk", "cpu:2", "1f1b", extra)
    rc1, err1 = run(cli, "train", proj, "--output", os.path.join(tmp, "ondisk-1"), "--json", env=env)
    rc2, err2 = run(cli, "train", proj, "--output", os.path.join(tmp, "ondisk-2"), "--processes", "2", "--json", env=env)
    a, b = steps_of(err1), steps_of(err2)
    check("data.on_disk over 2 processes: the losses equal one process's", rc1 == 0 and rc2 == 0 and len(a) == 4 and
          all(abs(x - y) <= 1e-6 * abs(x) for x, y in zip(a, b)) and len(b) == 4, f"rc {rc1}/{rc2} {a} vs {b} {err2[-300:]}")
    check("data.on_disk over 2 processes: rank 1 kept its cache apart", os.path.isdir(os.path.join(tmp, "ondisk-2", "rank-1", "data-cache")))


def mismatched_ranks_refused(cli, env, tmp, data):
    a = project(tmp, data, "rank-a", "cpu:2", "1f1b", {"distributed": {"processes": 2, "timeout_s": 20}})
    os.makedirs(os.path.join(tmp, "other"), exist_ok=True)  # the same name: only the learning rate differs
    b = project(os.path.join(tmp, "other"), data, "rank-a", "cpu:2", "1f1b",
                {"distributed": {"processes": 2, "timeout_s": 20}, "optimizer": {"lr": 0.001}})
    port = free_port()
    r0 = subprocess.Popen([cli, "train", a, "--output", os.path.join(tmp, "ra"), "--rank", "0", "--rendezvous", f"127.0.0.1:{port}"],
                          stderr=subprocess.PIPE, text=True, env=env)
    STARTED.append(r0)
    time.sleep(1.0)
    r1 = subprocess.Popen([cli, "train", b, "--output", os.path.join(tmp, "rb"), "--rank", "1", "--rendezvous", f"127.0.0.1:{port}"],
                          stderr=subprocess.PIPE, text=True, env=env)
    STARTED.append(r1)
    try:
        e1 = r1.communicate(timeout=60)[1]
        e0 = r0.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        r0.kill(), r1.kill()
        e0 = e1 = "timed out"
    needle = "rank 1 runs another project than rank 0"
    check("hand-started ranks with different projects: rank 0 refuses naming rank 1", r0.returncode == 1 and needle in e0, e0[-400:])
    check("hand-started ranks with different projects: rank 1 refuses too", r1.returncode == 1 and needle in e1, e1[-400:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--data", required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, LORAPIPE_DB=os.path.join(tmp, "runs.db"), XDG_CACHE_HOME=os.path.join(tmp, "cache"))
        try:
            same_as_one_process(args.cli, env, tmp, args.data, "cpu:2", "1f1b", 2)
            same_as_one_process(args.cli, env, tmp, args.data, "cpu:4", "round-robin", 4)
            killed_rank_resumes(args.cli, env, tmp, args.data)
            killed_rank_resumes(args.cli, env, tmp, args.data, resume_processes=1)
            ctrl_c_stops_every_rank(args.cli, env, tmp, args.data)
            hand_started_resume_without_checkpoint(args.cli, env, tmp, args.data)
            mismatched_ranks_refused(args.cli, env, tmp, args.data)
            zero_steps(args.cli, env, tmp, args.data)
            on_disk_data(args.cli, env, tmp, args.data)
            rank_dead_before_rendezvous(args.cli, env, tmp, args.data)
            proj = project(tmp, args.data, "bad", "cpu:2", "1f1b")
            rc, err = run(args.cli, "train", proj, "--processes", "3", env=env)
            check("3 processes on 2 devices: refused naming distributed.processes", rc == 1 and "distributed.processes" in err, err[-300:])
            rc, err = run(args.cli, "train", proj, "--processes", "2", "--rank", "0", "--rendezvous", "127.0.0.1:0", env=env)
            check("rank 0 by hand on port 0: refused naming distributed.rendezvous, no run recorded",
                  rc == 1 and "distributed.rendezvous" in err and "recorded" not in err, err[-300:])
        finally:
            for p in STARTED:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    print(f"{RESULTS.count(True)} passed, {RESULTS.count(False)} failed")
    return 0 if all(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
