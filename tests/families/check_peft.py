#!/usr/bin/env python3
"""Loads what lorapipe wrote for every family (family_tests) back into real PEFT and transformers:
the trained adapter on the transformers base model, and the merged export as a plain model; both
must reproduce lorapipe's logits (max |diff| <= 1e-4, fp32). Then `lorapipe-cli generate --json`
must print transformers' greedy ids (golden.json) token by token.

    check_peft.py <families-dir> --cli build/app/lorapipe-cli
"""
import argparse, json, os, subprocess, sys

import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from peft import PeftModel

ap = argparse.ArgumentParser()
ap.add_argument("dir")
ap.add_argument("--cli", required=True)
args = ap.parse_args()

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()
failures = []
families = sorted(d for d in os.listdir(args.dir) if os.path.isfile(os.path.join(args.dir, d, "golden.json")))
for fam in families:
    d = os.path.join(args.dir, fam)
    golden = load_file(os.path.join(d, "golden.safetensors"))
    meta = json.load(open(os.path.join(d, "golden.json")))
    tokens = golden["tokens"]
    if not os.path.isfile(os.path.join(d, "trained", "logits.safetensors")):
        failures.append(f"{fam}: family_tests left no trained adapter")
        continue
    want = load_file(os.path.join(d, "trained", "logits.safetensors"))["logits"]
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(os.path.join(d, "model"), dtype=torch.float32).eval()
        peft_model = PeftModel.from_pretrained(base, os.path.join(d, "trained", "adapter")).eval()
        d_peft = (peft_model(tokens).logits.float() - want).abs().max().item()
        merged = AutoModelForCausalLM.from_pretrained(os.path.join(d, "trained", "merged"), dtype=torch.float32).eval()
        d_merged = (merged(tokens).logits.float() - want).abs().max().item()
    # greedy ids through the command line (the fixture's prompt ids; EOS is not printed)
    out = subprocess.run([args.cli, "generate", "--model", os.path.join(d, "model"), "--prompt-ids",
                          ",".join(map(str, meta["prompt"])), "--max-new-tokens", str(len(meta["greedy"])), "--json"],
                         capture_output=True, text=True, timeout=120)
    greedy = meta["greedy"][:meta["greedy"].index(2)] if 2 in meta["greedy"] else meta["greedy"]  # the CLI stops at EOS
    ids = json.loads(out.stdout)["ids"] if out.returncode == 0 else None
    print(f"{fam:14s} PEFT adapter max|diff| {d_peft:.2e}  merged export {d_merged:.2e}  "
          f"CLI greedy {'equal' if ids == greedy else 'DIFFERENT'} ({len(greedy)} tokens)", flush=True)
    if d_peft > 1e-4: failures.append(f"{fam}: PEFT logits differ by {d_peft:.2e}")
    if d_merged > 1e-4: failures.append(f"{fam}: merged export logits differ by {d_merged:.2e}")
    if ids != greedy: failures.append(f"{fam}: CLI greedy ids {ids} != {greedy} ({out.stderr.strip()[-300:]})")
if len(families) < 10: failures.append(f"only {len(families)} families found in {args.dir}")
for f in failures: print("FAIL", f)
sys.exit(1 if failures else 0)
