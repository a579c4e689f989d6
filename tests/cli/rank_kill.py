"""Shared by the multi-process tests (tests/cli/dist_test.py, tests/gpu/dist_gpu_test.py): start a
`train` over several local processes and SIGKILL its rank 1 once a given step is logged, and find
the processes of a run by the rank project file on their command line."""
import os
import signal
import subprocess
import time


def rank_processes(marker):
    p = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    return [int(x) for x in p.stdout.split()]


def train_and_kill_rank1(cmd, env, log, marker, after_step, started, within_s=120):
    """Runs cmd (stderr to the file `log`), appended to `started` for the caller's cleanup; once
    '"step":after_step,' is in the log, SIGKILLs the process whose command line holds
    `marker --rank 1`. Returns (the process, time.time() of the kill or None if it never came)."""
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stderr=f, env=env)
    started.append(p)
    t_end = time.time() + within_s
    while time.time() < t_end and p.poll() is None:
        with open(log) as f:
            if f'"step":{after_step},' in f.read():
                pids = rank_processes(marker + " --rank 1")
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    return p, time.time()
                return p, None
        time.sleep(0.05)
    return p, None


def exit_after_kill(p, killed, log, limit_s):
    """Waits up to limit_s for the run to end (killed if it does not). Returns (exit code or None,
    seconds from the kill to now, the log's last line)."""
    try:
        rc = p.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = None
    took = time.time() - killed if killed else float("inf")
    with open(log) as f:
        err = f.read()
    return rc, took, err.strip().splitlines()[-1] if err.strip() else ""
