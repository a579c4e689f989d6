"""lorapipe-cli end to end: the command-line contract, bad input, and a short real fine-tune.

Every bad input must give exit status 1 and a clear one-line `error: ...` on stderr (no crash,
no backtrace). Prints one line per check and a closing 'N passed, M failed' line.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

RESULTS = []


def check(name, ok, detail=""):
    RESULTS.append(ok)
    print(f"{'PASS' if ok else 'FAIL'} {name}{(': ' + detail) if detail and not ok else ''}", flush=True)


def run(cli, *args, stdin=None, env=None):
    p = subprocess.run([cli, *args], input=stdin, capture_output=True, text=True, timeout=600, env=env)
    return p.returncode, p.stdout, p.stderr


def expect_clean_error(cli, name, args, needle, stdin=None, env=None):
    rc, out, err = run(cli, *args, stdin=stdin, env=env)
    lines = [l for l in err.strip().splitlines() if l]
    ok = rc == 1 and len(lines) >= 1 and lines[0].startswith("error:") and needle in err and "Traceback" not in err
    ok = ok and (name.startswith("multi") or len(lines) == 1)
    check(f"bad input: {name}", ok, f"rc={rc} stderr={err.strip()[:300]!r}")


def table_rows(db):
    """Every row of every table of the run database, to see that a refused command changed nothing stored."""
    import sqlite3
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
        return {name: sorted(con.execute(f'SELECT * FROM "{name}"').fetchall(), key=repr) for name in tables}
    finally:
        con.close()


def run_store_checks(cli, stories, corpus, t):
    """Run database, runs list/show/compare, eval, resume and their bad inputs (LORAPIPE_DB is set)."""
    db = os.environ["LORAPIPE_DB"]
    rc, out, err = run(cli, "runs", "list", "--json")
    runs = json.loads(out) if rc == 0 else []
    by_steps = {r["total_steps"]: r for r in runs}
    check("runs list --json records every CLI run", rc == 0 and len(runs) >= 4 and 30 in by_steps and 4 in by_steps
          and by_steps[30]["status"] == "completed" and by_steps[30]["summary"]["steps"] == 30
          and by_steps[30]["hardware"]["cores"] >= 1 and "libtorch" in by_steps[30]["versions"], out[:400] + err)
    if 30 not in by_steps or 4 not in by_steps:
        return
    a, b = str(by_steps[30]["id"]), str(by_steps[4]["id"])
    rc, out, err = run(cli, "runs", "compare", a, b)
    check("runs compare: config diff and metric summaries", rc == 0 and "parallel.schedule" in out and '"round-robin"' in out
          and "run.steps" in out and "final_val_loss" in out and "mean_tokens_per_s" in out, out + err)
    rc, out, err = run(cli, "runs", "compare", a, b, "--json")
    cmp = json.loads(out) if rc == 0 else {}
    check("runs compare --json", rc == 0 and cmp["config_diff"]["parallel.devices"] == {"a": "cpu", "b": "cpu:2"}
          and cmp["summary"]["a"]["steps"] == 30 and cmp["summary"]["b"]["steps"] == 4
          and cmp["summary"]["b"]["bubble_ratio"] is not None and cmp["summary"]["a"]["final_val_loss"] > 0
          and cmp["loss_curves"]["common_steps"] == 4 and cmp["environment_diff"] == {}, out[:600] + err)
    rc, out, err = run(cli, "runs", "show", a)
    check("runs show", rc == 0 and "completed" in out and "config hash" in out and "checkpoint   step 30" in out, out + err)
    rc, out, err = run(cli, "eval", "--run", a, "--json")
    ev = json.loads(out) if rc == 0 else {}
    rc2, out2, _ = run(cli, "runs", "show", a, "--json")
    shown = json.loads(out2) if rc2 == 0 else {}
    check("eval --run: perplexity recorded in the run", rc == 0 and 1 < ev["perplexity"] < 512 and ev["tokens"] > 0
          and any(e["split"] == "eval" and abs(e["loss"] - ev["loss"]) < 1e-12 for e in shown.get("evaluations", [])), out + err)
    small = os.path.join(t, "small.txt")
    open(small, "w").write(open(corpus).read()[:20000])
    rc, out, err = run(cli, "eval", os.path.join(t, "p.json"), "--data", small, "--json")
    base = json.loads(out) if rc == 0 else {}
    rc, out, err = run(cli, "eval", os.path.join(t, "p.json"), "--data", small, "--adapter", os.path.join(t, "run1", "adapter"), "--json")
    tuned = json.loads(out) if rc == 0 else {}
    check("eval --data: the fine-tuned adapter lowers perplexity", rc == 0 and tuned["perplexity"] < base["perplexity"],
          f"{base} vs {tuned} {err}")

    peft = os.path.join(t, "exported_peft")
    rc, _, err = run(cli, "export", "--run", a, "--format", "peft", "--output", peft)
    check("export --run --format peft", rc == 0 and open(os.path.join(peft, "adapter_model.safetensors"), "rb").read()
          == open(os.path.join(t, "run1", "adapter", "adapter_model.safetensors"), "rb").read(), err)
    pe = json.load(open(os.path.join(t, "p.json")))
    pe["run"].update({"epochs": 0.01, "threads": 2, "sample_tokens": 0, "eval_batches": 1, "output_dir": os.path.join(t, "epochs")})
    json.dump(pe, open(os.path.join(t, "epochs.json"), "w"))
    rc, _, err = run(cli, "train", os.path.join(t, "epochs.json"), "--json")
    ev = [json.loads(l) for l in err.splitlines() if l.startswith("{")]
    started = next((e for e in ev if e["event"] == "run_started"), {})
    want = -(-started.get("train_sequences", 0) // 800) if started else -1  # ceil(0.01 x sequences / (8 x 1))
    steps = [e for e in ev if e["event"] == "step"]
    latest = json.loads(run(cli, "runs", "list", "--json", "--limit", "1")[1])[0]
    check("run.epochs sets the step count", rc == 0 and started.get("total_steps") == want == len(steps) and latest["total_steps"] == want,
          f"{started} want {want}, {len(steps)} steps, db {latest.get('total_steps')}")

    # Resume: a run killed inside a checkpoint write, its newest checkpoint then corrupted.
    p_kill = os.path.join(t, "kill.json")
    pk = json.load(open(os.path.join(t, "p.json")))
    pk["run"].update({"steps": 12, "checkpoint_interval": 2, "keep_checkpoints": 3, "threads": 2, "sample_tokens": 0,
                      "output_dir": os.path.join(t, "killed")})
    json.dump(pk, open(p_kill, "w"))
    rc, _, err = run(cli, "train", p_kill, env={**os.environ, "LORAPIPE_KILL_AT": "checkpoint:rename:4"})
    rc_l, out, _ = run(cli, "runs", "list", "--json")
    killed = json.loads(out)[0]
    check("a SIGKILLed run shows as crashed", rc == -9 and killed["status"] == "crashed" and killed["total_steps"] == 12, str(killed)[:300])
    rid = str(killed["id"])
    root = os.path.join(t, "killed", "checkpoints", f"run-{rid}")
    steps = sorted(n for n in os.listdir(root) if n.startswith("step-"))
    newest = os.path.join(root, steps[-1], "optimizer.safetensors")
    blob = bytearray(open(newest, "rb").read())
    blob[-5] ^= 0xFF
    open(newest, "wb").write(bytes(blob))
    expect_clean_error(cli, "multi: corrupted checkpoint", ["resume", rid], "optimizer.safetensors does not match its sha256")
    check("a refused resume changes nothing", open(newest, "rb").read() == bytes(blob)
          and sorted(n for n in os.listdir(root) if n.startswith("step-")) == steps)
    older = str(int(steps[-2][5:]))
    rc, _, err = run(cli, "resume", rid, "--checkpoint", older)
    rc2, out2, _ = run(cli, "runs", "show", rid, "--json")
    shown = json.loads(out2) if rc2 == 0 else {}
    check("resume --checkpoint from an older checkpoint completes", rc == 0 and shown["status"] == "completed"
          and [m["step"] for m in shown["metrics"]] == list(range(1, 13)) and shown["resumed"] == 1, err[-500:])
    expect_clean_error(cli, "resume of an unknown run", ["resume", "999"], "no run 999")

    # Bad input that must not lose what is stored.
    before = run(cli, "runs", "list", "--json")[1]
    rows_before = table_rows(db)
    ro = os.path.join(t, "readonly")
    os.makedirs(ro)
    made_ro = False
    if os.geteuid() != 0:
        os.chmod(ro, 0o555)
        made_ro = True
    else:
        made_ro = subprocess.run(["chattr", "+i", ro], capture_output=True).returncode == 0
    if made_ro:
        expect_clean_error(cli, "read-only output dir", ["train", p_kill, "--output", ro], "run.output_dir")
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", ro])
    else:
        print("SKIP bad input: read-only output dir (no way to make a read-only folder here)")
    import sqlite3
    holder = sqlite3.connect(db, timeout=0)
    holder.execute("BEGIN EXCLUSIVE")
    expect_clean_error(cli, "database locked by another process", ["train", p_kill], "locked by another process")
    holder.rollback()
    holder.close()
    check("nothing stored is lost by refused commands", run(cli, "runs", "list", "--json")[1] == before
          and table_rows(db) == rows_before, f"{table_rows(db)} vs {rows_before}")
    con = sqlite3.connect(db)
    check("run database integrity_check", con.execute("PRAGMA integrity_check").fetchone()[0] == "ok")
    con.close()
    pi = json.load(open(p_kill))
    pi["parallel"] = {"devices": "cpu:2", "schedule": "single"}
    pi["optimizer"] = {"asynchronous": True}
    pi["lora"] = {"r": 99}
    json.dump(pi, open(p_kill, "w"))
    expect_clean_error(cli, "multi: impossible combinations", ["validate", p_kill], "lora.r: must be <= hidden_size (64)")
    rc, _, err = run(cli, "validate", p_kill)
    check("every impossible combination is named", "parallel.schedule: single runs on one device" in err
          and "optimizer.asynchronous: needs a pipeline schedule" in err, err)
    old = {"schema_version": 1, "model": {"path": os.path.join(stories, "hf")}, "data": {"train": corpus},
           "parallel": {"devices": "cpu:2", "schedule": "1f1b", "async_optimizer": True}, "run": {"batch_size": 8}}
    json.dump(old, open(os.path.join(t, "v1.json"), "w"))
    rc, _, err = run(cli, "validate", os.path.join(t, "v1.json"))
    rc2, out2, _ = run(cli, "init")
    check("schema_version 1 projects are migrated; init writes 2", rc == 0 and json.loads(out2)["schema_version"] == 2
          and json.loads(out2)["optimizer"]["asynchronous"] is False, err)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--data", required=True)
    a = ap.parse_args()
    cli, data = os.path.abspath(a.cli), os.path.abspath(a.data)
    stories = os.path.join(data, "models", "stories260K")
    ref = json.load(open(os.path.join(stories, "reference.json")))
    golden = ref["greedy_40_text"][len(ref["prompt"]):]

    for src in ("hf", "llama2c/stories260K.bin"):
        rc, out, err = run(cli, "generate", "--model", os.path.join(stories, src), "--prompt", ref["prompt"],
                           "--max-new-tokens", "40", "--temperature", "0")
        check(f"generate greedy golden ({src})", rc == 0 and out.rstrip("\n") == golden, repr(out))
    rc, out, _ = run(cli, "generate", "--model", os.path.join(stories, "hf"), "--prompt", "Once upon a time",
                     "--max-new-tokens", "30", "--temperature", "0.9", "--top-p", "0.9", "--seed", "5")
    rc2, out2, _ = run(cli, "generate", "--model", os.path.join(stories, "hf"), "--prompt", "Once upon a time",
                       "--max-new-tokens", "30", "--temperature", "0.9", "--top-p", "0.9", "--seed", "5")
    rc3, out3, _ = run(cli, "generate", "--model", os.path.join(stories, "hf"), "--prompt", "Once upon a time",
                       "--max-new-tokens", "30", "--temperature", "0.9", "--top-p", "0.9", "--seed", "6")
    check("sampling is seeded", rc == rc2 == rc3 == 0 and out == out2 and out != out3 and len(out) > 10)
    rc, out, _ = run(cli, "tokenize", "--tokenizer", os.path.join(stories, "hf"), stdin="Once upon a time")
    check("tokenize (no BOS/EOS)", rc == 0 and out.split() == ["403", "407", "261", "378"], out)

    with tempfile.TemporaryDirectory() as t:
        os.environ["LORAPIPE_DB"] = os.path.join(t, "runs.db")  # never the user's database
        # Malformed model folders.
        def model_copy(name):
            d = os.path.join(t, name)
            shutil.copytree(os.path.join(stories, "hf"), d)
            return d
        d = model_copy("truncated")
        raw = open(os.path.join(d, "model.safetensors"), "rb").read()
        open(os.path.join(d, "model.safetensors"), "wb").write(raw[: len(raw) // 3])
        expect_clean_error(cli, "truncated safetensors", ["generate", "--model", d, "--prompt", "x", "--max-new-tokens", "2"], "truncated")
        d = model_copy("garbled")
        open(os.path.join(d, "model.safetensors"), "wb").write(raw[:8] + b"\x00garbage{" + raw[17:])
        expect_clean_error(cli, "garbled safetensors header", ["generate", "--model", d, "--prompt", "x", "--max-new-tokens", "2"], "model.safetensors")
        d = model_copy("badconfig")
        cfg = json.load(open(os.path.join(d, "config.json")))
        del cfg["num_hidden_layers"]
        json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
        expect_clean_error(cli, "wrong config.json", ["generate", "--model", d, "--prompt", "x", "--max-new-tokens", "2"], "num_hidden_layers")
        d = model_copy("notok")
        os.remove(os.path.join(d, "tokenizer.model"))
        expect_clean_error(cli, "missing tokenizer", ["generate", "--model", d, "--prompt", "x", "--max-new-tokens", "2"], "no tokenizer found")
        expect_clean_error(cli, "missing adapter", ["generate", "--model", os.path.join(stories, "hf"), "--adapter", os.path.join(t, "nope"), "--prompt", "x", "--max-new-tokens", "2"], "adapter_config.json")

        empty = os.path.join(t, "empty.txt")
        open(empty, "w").write("\n\n   \n")
        proj = {"schema_version": 2, "model": {"path": os.path.join(stories, "hf")}, "data": {"train": empty, "seq_len": 64},
                "run": {"steps": 2, "output_dir": os.path.join(t, "out_empty"), "threads": 2}}
        p_empty = os.path.join(t, "empty.json")
        json.dump(proj, open(p_empty, "w"))
        expect_clean_error(cli, "empty corpus", ["train", p_empty], "corpus is empty")
        p_bad = os.path.join(t, "bad.json")
        open(p_bad, "w").write('{"model": {"path": 3}, "lora": {"r": 8,}}')
        expect_clean_error(cli, "malformed project JSON", ["train", p_bad], "malformed JSON")
        open(p_bad, "w").write('{"model": {"path": 3}, "lora": {"rank": 8}}')
        expect_clean_error(cli, "multi: wrong types and unknown fields", ["validate", p_bad], "lora.rank: unknown field")
        expect_clean_error(cli, "missing project file", ["train", os.path.join(t, "none.json")], "file not found")

        # A short real fine-tune through the CLI, then generate with the adapter it wrote.
        corpus = os.path.join(data, "text", "tinyshakespeare.txt")
        rc, _, err = run(cli, "init", os.path.join(t, "p.json"), "--model", os.path.join(stories, "hf"), "--data", corpus)
        rc_v, _, err_v = run(cli, "validate", os.path.join(t, "p.json"))
        check("init + validate", rc == 0 and rc_v == 0, err + err_v)
        out_dir = os.path.join(t, "run1")
        rc, _, err = run(cli, "train", os.path.join(t, "p.json"), "--steps", "30", "--output", out_dir, "--json", "--threads", "2")
        events = [json.loads(l) for l in err.splitlines() if l.startswith("{")]
        kinds = [e["event"] for e in events if e["event"] != "phase"]  # phases (loading, tokenising) come first
        steps = [e for e in events if e["event"] == "step"]
        evals = [e for e in events if e["event"] == "eval"]
        ok = (rc == 0 and kinds[0] == "run_started" and kinds[-1] == "run_finished" and len(steps) == 30
              and all(s["tokens_per_s"] > 0 for s in steps) and len(evals) >= 2 and evals[-1]["val_loss"] < evals[0]["val_loss"]
              and os.path.exists(os.path.join(out_dir, "adapter", "adapter_model.safetensors")))
        check("train --steps --output --json", ok, err[-500:])
        rc, out, err = run(cli, "generate", "--model", os.path.join(stories, "hf"), "--adapter", os.path.join(out_dir, "adapter"),
                           "--prompt", "Once upon a time", "--max-new-tokens", "20")
        check("generate with the trained adapter", rc == 0 and len(out.strip()) > 0 and out.rstrip("\n") != golden[: len(out.rstrip())], err)
        # plan: the schedule program for a pipeline project, simulated.
        pp = json.load(open(os.path.join(t, "p.json")))
        pp["parallel"] = {"devices": "cpu:3", "schedule": "1f1b", "micro_batches": 4}
        json.dump(pp, open(os.path.join(t, "pp.json"), "w"))
        rc, plan_out, err = run(cli, "plan", os.path.join(t, "pp.json"), "--json")
        plan = json.loads(plan_out) if rc == 0 else {}
        check("plan --json", rc == 0 and plan["devices"] == 3 and plan["stages"] == 3 and 0 < plan["bubble_ratio"] < 1
              and len(plan["peak_bytes"]) == 3 and "0F0" in plan["program"], err)
        # The memory plan (weight arena per device: 1F1B keeps one stage resident) and a transport per link.
        arenas, links = plan.get("weight_arenas", []), plan.get("transports", [])
        check("plan --json: weight arenas and per-link transports",
              len(arenas) == 3 and all(a["bytes"] > 0 and a["stages_at_once"] == 1 for a in arenas)
              and sorted((l["from"], l["to"]) for l in links) == [(0, 1), (1, 0), (1, 2), (2, 1)]
              and all(l["kind"] == "host-staged" and l["reason"] for l in links), json.dumps(plan.get("transports")))
        pp["parallel"]["transport"] = "peer"
        json.dump(pp, open(os.path.join(t, "pp.json"), "w"))
        rc, plan_out, err = run(cli, "plan", os.path.join(t, "pp.json"))
        check("plan: links with the peer transport", rc == 0 and "link cpu:0 -> cpu:1: peer" in plan_out
              and "weight arena" in plan_out, plan_out[-600:] + err)
        pp["parallel"]["transport"] = "nccl"
        json.dump(pp, open(os.path.join(t, "pp.json"), "w"))
        expect_clean_error(cli, "nccl transport on CPU virtual devices", ["plan", os.path.join(t, "pp.json")], "parallel.transport: nccl")
        pp["parallel"]["transport"] = "pigeon"
        json.dump(pp, open(os.path.join(t, "pp.json"), "w"))
        expect_clean_error(cli, "multi: unknown transport", ["validate", os.path.join(t, "pp.json")], "parallel.transport")
        del pp["parallel"]["transport"]
        pp["parallel"]["schedule"] = "zigzag"
        json.dump(pp, open(os.path.join(t, "pp.json"), "w"))
        expect_clean_error(cli, "multi: unknown schedule", ["plan", os.path.join(t, "pp.json")], "parallel.schedule")
        rc, _, err = run(cli, "train", os.path.join(t, "p.json"), "--steps", "4", "--output", os.path.join(t, "run2"),
                         "--devices", "cpu:2", "--schedule", "round-robin", "--threads", "2")
        check("train --devices cpu:2 --schedule round-robin", rc == 0 and "pipeline: round-robin on cpu:2" in err
              and "transports: cpu:0 -> cpu:1 host-staged" in err and "memory plan: weight arenas cpu:0" in err, err[-600:])
        # parallel.schedule auto (the default): plan lists what the planner weighed, --devices alone trains,
        # and the run records the concrete schedule it chose.
        rc, plan_out, err = run(cli, "plan", os.path.join(t, "p.json"), "--devices", "cpu:2", "--json")
        plan = json.loads(plan_out) if rc == 0 else {}
        cands = plan.get("candidates", [])
        feasible = [c for c in cands if c["ok"]]
        check("plan --devices cpu:2: schedule auto weighs every schedule and takes the fastest",
              rc == 0 and plan["requested_schedule"] == "auto" and len(cands) >= 4 and feasible and cands[0]["ok"]
              and cands[0]["step_seconds"] == min(c["step_seconds"] for c in feasible)
              and plan["schedule"] == cands[0]["schedule"] and plan["micro_batches"] == cands[0]["micro_batches"]
              and {c["schedule"] for c in cands} == {"gpipe", "1f1b", "interleaved", "round-robin"}, plan_out[-800:] + err)
        rc, _, err = run(cli, "train", os.path.join(t, "p.json"), "--steps", "2", "--output", os.path.join(t, "run_auto"),
                         "--devices", "cpu:2", "--threads", "2")
        rec = json.load(open(os.path.join(t, "run_auto", "project.json"))) if rc == 0 else {}
        chosen = rec.get("parallel", {}).get("schedule")
        check("train --devices cpu:2 with schedule auto trains the planner's choice",
              rc == 0 and chosen == cands[0]["schedule"] and rec["parallel"]["micro_batches"] == cands[0]["micro_batches"]
              and f"pipeline: {chosen} on cpu:2" in err, err[-600:])
        # A device at half speed: the planner gives it fewer layers, and the trainer runs that partition.
        hp = json.load(open(os.path.join(t, "p.json")))
        hp["parallel"].update({"devices": "cpu:2", "schedule": "1f1b", "device_speeds": "1,0.5"})
        json.dump(hp, open(os.path.join(t, "hp.json"), "w"))
        rc, plan_out, err = run(cli, "plan", os.path.join(t, "hp.json"), "--json")
        part = json.loads(plan_out).get("partition", {}) if rc == 0 else {}
        check("plan with device_speeds 1,0.5 balances the layers toward the fast device",
              rc == 0 and part.get("how") == "balanced" and part["layers"][0] > part["layers"][1]
              and part["step_seconds"] < part["even_step_seconds"], plan_out[-800:] + err)
        rc, _, err = run(cli, "train", os.path.join(t, "hp.json"), "--steps", "2", "--output", os.path.join(t, "run_het"), "--threads", "2")
        check("train with device_speeds runs the balanced partition",
              rc == 0 and f"2 stages of {','.join(map(str, part.get('layers', [])))} layers" in err, err[-600:])
        # Round-robin with slow copies: the planner gives it backward stages of its own (fewer
        # gradients handed over); the trainer runs them and the run records them.
        rp = json.load(open(os.path.join(t, "p.json")))
        rp["parallel"].update({"devices": "cpu:2", "schedule": "round-robin"})
        rp.setdefault("offload", {})["copy_gbps"] = 0.05
        json.dump(rp, open(os.path.join(t, "rr.json"), "w"))
        rc, plan_out, err = run(cli, "plan", os.path.join(t, "rr.json"), "--json")
        part = json.loads(plan_out).get("partition", {}) if rc == 0 else {}
        back = ",".join(map(str, part.get("backward_layers", [])))
        rc2, _, err2 = run(cli, "train", os.path.join(t, "rr.json"), "--steps", "2", "--output", os.path.join(t, "run_rr"), "--threads", "2")
        rec = json.load(open(os.path.join(t, "run_rr", "project.json"))) if rc2 == 0 else {}
        check("round-robin: plan chooses its backward stages (slow copies), train runs and records them",
              rc == 0 and part.get("backward_how") == "balanced" and back != "" and rc2 == 0
              and f"{','.join(map(str, part['layers']))} forward + {back} backward layers" in err2
              and rec["parallel"]["backward_partition"] == back, plan_out[-600:] + err2[-600:])
        # offload.auto: plan says which offload settings it chose; the run records them, concrete.
        op = json.load(open(os.path.join(t, "p.json")))
        op["parallel"].update({"devices": "cpu:2", "schedule": "1f1b"})
        op.setdefault("offload", {}).update({"auto": True, "copy_gbps": 0.05})
        json.dump(op, open(os.path.join(t, "oa.json"), "w"))
        rc, plan_out, err = run(cli, "plan", os.path.join(t, "oa.json"), "--json")
        off = json.loads(plan_out).get("offload", {}) if rc == 0 else {}
        rc_t, plan_txt, _ = run(cli, "plan", os.path.join(t, "oa.json"))
        rc2, _, err2 = run(cli, "train", os.path.join(t, "oa.json"), "--steps", "1", "--output", os.path.join(t, "run_oa"), "--threads", "2")
        rec = json.load(open(os.path.join(t, "run_oa", "project.json"))) if rc2 == 0 else {}
        check("offload.auto: plan shows the offload settings it chose, the run records them with offload.auto off",
              rc == 0 and off.get("auto") is True and len(off.get("changes", [])) > 0 and rc_t == 0
              and "offload auto chose" in plan_txt and rc2 == 0 and rec["offload"].get("auto") is False
              and rec["offload"]["stream_weights"] == off["stream_weights"] and rec["offload"]["recompute"] == off["recompute"],
              plan_out[-600:] + plan_txt[-400:] + err2[-600:])
        # The device probe: measured once, then reused from the cache (keyed by the devices' fingerprint).
        penv = dict(os.environ, XDG_CACHE_HOME=os.path.join(t, "cache"))
        rc, out1, err1 = run(cli, "plan", os.path.join(t, "hp.json"), "--probe", "--json", env=penv)
        rc2, out2, err2 = run(cli, "plan", os.path.join(t, "hp.json"), "--probe", "--json", env=penv)
        p1 = json.loads(out1).get("probe", {}) if rc == 0 else {}
        p2 = json.loads(out2).get("probe", {}) if rc2 == 0 else {}
        check("plan --probe measures both devices, then reuses the cached probe",
              len(p1.get("devices", [])) == 2 and not p1.get("from_cache") and p2.get("from_cache")
              and all(d["h2d_bytes_per_s"] > 0 and d["d2h_concurrent_bytes_per_s"] > 0 and not d["error"] for d in p1["devices"])
              and p1["devices"][1]["speed"] == 0.5 and p2["fingerprint"] == p1["fingerprint"]
              and os.path.exists(p2.get("cache_file", "")), (out1 + err1 + err2)[-800:])
        # What-if questions, the largest fit, and --write (plan_questions.h).
        wi = dict(hp)
        wi["parallel"] = dict(hp["parallel"], schedule="auto", partition="auto")
        wi["offload"] = dict(hp.get("offload", {}), device_memory_mb=4)
        json.dump(wi, open(os.path.join(t, "wi.json"), "w"), indent=1)
        rc, wo, err = run(cli, "plan", os.path.join(t, "wi.json"), "--json", "--what-if", f"seq_len={wi['data']['seq_len'] // 2}",
                           "--what-if", "devices=+2 p2p=off", "--what-if", "seq_len=lots")
        wj = json.loads(wo) if rc == 0 else {}
        answers = wj.get("what_if", [])
        fit = wj.get("largest_fit", {})
        ok = rc == 0 and len(answers) == 3 and all(f["after"]["fits"] and f["after"]["step_seconds"] < f["before"]["step_seconds"]
                                                    for f in wj.get("faster_offload_settings", [None]))
        if ok:
            a, b, c = answers
            base_seq = wi["data"]["seq_len"]
            ok = (a["changes"] == [{"field": "data.seq_len", "before": str(base_seq), "after": str(base_seq // 2)}] and not a["error"]
                  and a["after"]["step_seconds"] < a["before"]["step_seconds"]
                  and b["after"]["devices"] == "cpu:4" and len(b["after"]["peak_bytes"]) == 4
                  and {"field": "parallel.transport", "before": "auto", "after": "host"} in b["changes"]
                  and {"field": "parallel.device_speeds", "before": "1,0.5", "after": "1,0.5,1,1"} in b["changes"]
                  and "data.seq_len" in c["error"] and "after" not in c)
        if ok:  # the answer is the plan of the changed project
            half = dict(wi, data=dict(wi["data"], seq_len=base_seq // 2))
            json.dump(half, open(os.path.join(t, "half.json"), "w"))
            rc2, o2, _ = run(cli, "plan", os.path.join(t, "half.json"), "--json")
            hj = json.loads(o2) if rc2 == 0 else {}
            ok = (hj.get("step_seconds") == a["after"]["step_seconds"] and hj.get("peak_bytes") == a["after"]["peak_bytes"]
                  and hj.get("schedule") == a["after"]["schedule"])
        check("plan --what-if: seq_len (equal to planning the changed project), two devices added with p2p off, a bad value named",
              ok, json.dumps(answers)[:1500] + err[-300:])
        ok = fit.get("bounded") and fit.get("max_seq_len", 0) > 0 and fit.get("max_rows_per_micro_batch", 0) > 0
        if ok:  # the largest fit fits, one more does not (the schedule and partition it was found with held)
            fixed = dict(wi)
            fixed["parallel"] = dict(wi["parallel"], schedule=wj["schedule"], micro_batches=wj["micro_batches"],
                                     partition=",".join(map(str, wj["partition"]["layers"])))
            if wj["schedule"] == "round-robin":  # its backward stages held too
                fixed["parallel"]["backward_partition"] = ",".join(map(str, wj["partition"]["backward_layers"])) or "per-layer"
            for seq, want in ((fit["max_seq_len"], ""), (fit["max_seq_len"] + 1, "offload.device_memory_mb")):
                fixed["data"] = dict(wi["data"], seq_len=seq)
                json.dump(fixed, open(os.path.join(t, "fx.json"), "w"))
                rc2, o2, e2 = run(cli, "plan", os.path.join(t, "fx.json"), "--json")
                refusal = json.loads(o2)["memory"]["refusal"] if rc2 == 0 else "error " + e2
                ok = ok and (refusal.startswith(want) if want else refusal == "")
        check("plan: the largest sequence length that fits 4 MiB devices fits, one token more is refused", ok,
              json.dumps(fit) + (wo + err)[-400:])
        before = open(os.path.join(t, "wi.json")).read()
        rc, wo, err = run(cli, "plan", os.path.join(t, "wi.json"), "--write")
        written = json.load(open(os.path.join(t, "wi.json")))
        check("plan --write stores the chosen schedule, micro-batches and layers, other fields kept",
              rc == 0 and written["parallel"]["schedule"] in ("gpipe", "1f1b", "interleaved", "round-robin")
              and written["parallel"]["partition"] != "auto" and written["data"] == wi["data"] and written["lora"] == wi["lora"]
              and list(written.keys()) == list(wi.keys()) and f"schedule {written['parallel']['schedule']}" in err, err[-600:])
        rc, out2, _ = run(cli, "plan", os.path.join(t, "wi.json"), "--json")
        check("plan of the written project makes the same plan", rc == 0 and json.loads(out2)["program"] == wj["program"], out2[-300:])
        tight = dict(written)
        tight["offload"] = dict(written["offload"], device_memory_mb=1)
        json.dump(tight, open(os.path.join(t, "wi.json"), "w"))
        before = open(os.path.join(t, "wi.json")).read()
        rc, _, err = run(cli, "plan", os.path.join(t, "wi.json"), "--write")
        check("plan --write refuses a plan that does not fit and leaves the file alone",
              rc != 0 and "does not fit" in err and open(os.path.join(t, "wi.json")).read() == before, err[-400:])
        # The layer profile: measured once (cached under XDG_CACHE_HOME), then every plan of the project charges it.
        rc, o1, e1 = run(cli, "plan", os.path.join(t, "hp.json"), "--profile", "--json", env=penv)
        rc2, o2, e2 = run(cli, "plan", os.path.join(t, "hp.json"), "--json", env=penv)
        rc3, o3, e3 = run(cli, "plan", os.path.join(t, "hp.json"), "--json", env=dict(penv, XDG_CACHE_HOME=os.path.join(t, "nocache")))
        j1 = json.loads(o1) if rc == 0 else {}
        j2 = json.loads(o2) if rc2 == 0 else {}
        j3 = json.loads(o3) if rc3 == 0 else {}
        lp = j1.get("layer_profile", {})
        check("plan --profile measures the layers and later plans use the cached profile",
              lp.get("from_cache") is False and len(lp.get("compute", {}).get("layer_backward_s", [])) == 5
              and all(x > 0 for x in lp["compute"]["layer_backward_s"]) and "layer profile" in j1.get("compute", "")
              and "layer profile" in j2.get("compute", "") and j2.get("step_seconds") == j1.get("step_seconds")
              and "FLOPs" in j3.get("compute", "") and os.path.exists(lp.get("cache_file", "")), (o1 + e1 + e2 + e3)[-800:])
        tps = j3.get("tokens_per_second", 0)
        check("plan --json: tokens/s is the batch's tokens over the predicted step",
              j3 and abs(tps * j3["step_seconds"] - hp["run"]["batch_size"] * hp["data"]["seq_len"]) < 1e-6 * tps + 1e-9, o3[-300:])
        hp["parallel"]["partition"] = "2,2,1"
        json.dump(hp, open(os.path.join(t, "hp.json"), "w"))
        expect_clean_error(cli, "partition with the wrong stage count", ["plan", os.path.join(t, "hp.json")],
                           "parallel.partition: '2,2,1' has 3 stages; 1f1b on 2 device(s) needs 2")
        hp["parallel"]["partition"] = "4,x"
        json.dump(hp, open(os.path.join(t, "hp.json"), "w"))
        expect_clean_error(cli, "multi: malformed partition", ["validate", os.path.join(t, "hp.json")], "parallel.partition: '4,x'")
        rc, _, err = run(cli, "train", os.path.join(t, "p.json"), "--steps", "2", "--output", os.path.join(t, "run3"),
                         "--devices", "cpu:2", "--schedule", "1f1b", "--transport", "peer", "--threads", "2")
        check("train --transport peer (logged per link)", rc == 0 and "cpu:0 -> cpu:1 peer" in err and "cpu:1 -> cpu:0 peer" in err, err[-600:])
        merged = os.path.join(t, "merged")
        rc, _, err = run(cli, "export", "--model", os.path.join(stories, "hf"), "--adapter", os.path.join(out_dir, "adapter"), "--output", merged)
        rc2, out2, _ = run(cli, "generate", "--model", merged, "--prompt", "Once upon a time", "--max-new-tokens", "20")
        check("export merged == base + adapter", rc == 0 and rc2 == 0 and out2 == out, f"{out!r} vs {out2!r}")

        # Real-world inputs: tokenizer.json picked from a folder, instruction data, data inspect.
        qwen = os.path.join(data, "tokenizers", "qwen3")
        golden_q = [json.loads(l) for l in open(os.path.join(qwen, "golden.jsonl"))]
        ok = True
        for row in golden_q[:12]:
            rc, out, err = run(cli, "tokenize", "--tokenizer", qwen, "--json", stdin=row["text"])
            ok = ok and rc == 0 and json.loads(out) == row["ids"]
        check("tokenize with tokenizer.json (Qwen3 golden ids)", ok, err)
        quiz = os.path.join(data, "instruct", "quiz_alpaca.jsonl")
        proj = {"schema_version": 2, "model": {"path": os.path.join(stories, "hf")}, "data": {"train": quiz, "seq_len": 128},
                "run": {"steps": 3, "output_dir": os.path.join(t, "out_quiz"), "threads": 2, "sample_tokens": 0, "eval_batches": 2}}
        p_quiz = os.path.join(t, "quiz.json")
        json.dump(proj, open(p_quiz, "w"))
        rc, out, err = run(cli, "data", "inspect", p_quiz, "--examples", "2")
        check("data inspect (alpaca, masked tokens marked)", rc == 0 and "alpaca format, detected" in out and "Assistant:[[" in out
              and "trained on" in out, out[-600:] + err)
        rc, out, err = run(cli, "data", "inspect", p_quiz, "--json")
        stats = json.loads(out) if rc == 0 else {}
        check("data inspect --json", stats.get("examples") == 600 and 0 < stats.get("trained_tokens", 0) < stats.get("tokens", 0), out[:300] + err)
        rc, _, err = run(cli, "train", p_quiz)
        check("train on alpaca JSONL (masked)", rc == 0 and "alpaca format, 600 examples" in err, err[-400:])
        bad_jsonl = os.path.join(t, "bad.jsonl")
        open(bad_jsonl, "w").write('{"instruction": "a", "output": "b"}\n{"instruction": 3, "output": "b"}\n')
        proj["data"]["train"] = bad_jsonl
        json.dump(proj, open(p_quiz, "w"))
        expect_clean_error(cli, "malformed JSONL record names its line", ["data", "inspect", p_quiz], "bad.jsonl:2: \"instruction\" must be a string")
        proj["data"]["on_error"] = "skip"
        json.dump(proj, open(p_quiz, "w"))
        rc, out, err = run(cli, "data", "inspect", p_quiz)
        check("on_error=skip counts the bad record", rc == 0 and "1 skipped as malformed" in out, out + err)
        proj["data"]["chat_template"] = os.path.join(t, "broken.jinja")
        open(proj["data"]["chat_template"], "w").write("{% for m in messages %}{{ m.content }")
        json.dump(proj, open(p_quiz, "w"))
        expect_clean_error(cli, "broken chat template", ["data", "inspect", p_quiz], "data.chat_template")
        proj["data"]["format"] = "csv"
        json.dump(proj, open(p_quiz, "w"))
        expect_clean_error(cli, "multi: unknown data.format", ["validate", p_quiz], "data.format: must be")
        # --chat renders the prompt as a user turn through the chat template (the built-in one: this model has
        # none): the same continuation as the rendered text given by hand, another one than the bare question.
        question = "What is the capital of France?"
        gen = ["generate", "--model", os.path.join(stories, "hf"), "--max-new-tokens", "16", "--temperature", "0"]
        rc, chat_out, err = run(cli, *gen, "--chat", "--system", "Answer briefly.", "--prompt", question)
        rc2, by_hand, _ = run(cli, *gen, "--prompt", f"Answer briefly.\n\nUser: {question}\nAssistant:")
        rc3, bare, _ = run(cli, *gen, "--prompt", question)
        check("generate --chat renders system and user turns through the chat template",
              rc == rc2 == rc3 == 0 and chat_out.strip() != "" and chat_out == by_hand and chat_out != bare,
              f"chat={chat_out!r} by hand={by_hand!r} bare={bare!r} {err[-300:]}")
        run_store_checks(cli, stories, corpus, t)

    n_fail = RESULTS.count(False)
    print(f"{len(RESULTS) - n_fail} passed, {n_fail} failed")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
