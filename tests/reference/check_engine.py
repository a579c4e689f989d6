"""Numerics check: the C++ engine against the independent PyTorch oracle (oracle_llama.py).

For stories260K (fp32 and bf16 folders) and a synthetic untied, non-GQA config, on fixed tokens:
logits, loss and LoRA gradients must match; one AdamW step must match torch.optim.AdamW; and the
adapter the engine saves, loaded here as W + (alpha/r)·B·A, must give the engine's logits.
Prints every maxdiff. Exit status 1 on any mismatch.
"""
import argparse
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle_llama import OracleLlama, load_adapter, write_random_adapter, write_synthetic_model, peft_name  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LOGIT_TOL = 1e-4
GRAD_REL_TOL = 1e-5


def run_case(name, model_dir, refdump, work, targets, r=4, alpha=8.0, lr=1e-2, wd=0.1):
    torch.manual_seed(0)
    oracle = OracleLlama(model_dir, torch.float32)
    V = oracle.cfg["vocab_size"]
    adir = os.path.join(work, name + "_adapter")
    write_random_adapter(adir, oracle, r, alpha, targets, seed=7)
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, V, (2, 17), generator=g)
    tpath = os.path.join(work, name + "_tokens.safetensors")
    save_file({"tokens": tokens}, tpath)
    out = os.path.join(work, name + "_engine.safetensors")
    adir_out = os.path.join(work, name + "_adapter_after")
    subprocess.run([refdump, "--model", model_dir, "--adapter", adir, "--tokens", tpath, "--out", out,
                    "--adapter-out", adir_out, "--lr", str(lr), "--weight-decay", str(wd)], check=True)
    eng = load_file(out)

    x, y = tokens[:, :-1], tokens[:, 1:]
    lora = load_adapter(adir, requires_grad=True)
    logits = oracle.logits(x, lora)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
    loss.backward()
    ok = True
    d_logits = (eng["logits"] - logits.detach()).abs().max().item()
    d_loss = abs(eng["loss"].item() - loss.item())
    print(f"[{name}] logits maxdiff {d_logits:.3e} (tol {LOGIT_TOL:g}), loss {loss.item():.6f} maxdiff {d_loss:.3e}")
    ok &= d_logits <= LOGIT_TOL and d_loss <= LOGIT_TOL
    worst = 0.0
    params, grads = [], []
    for (l, module), (A, B) in sorted(lora["pairs"].items()):
        for ab, p in (("A", A), ("B", B)):
            ge = eng["grad." + peft_name(l, module, ab)]
            rel = ((ge - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-30)).item()
            worst = max(worst, rel)
            params.append(p)
    print(f"[{name}] LoRA grads: {len(params)} tensors, max relative diff {worst:.3e} (tol {GRAD_REL_TOL:g})")
    ok &= worst <= GRAD_REL_TOL

    # One AdamW step with torch's own optimizer on the engine's gradients (Adam's first step is
    # ~lr·sign(g), so it would amplify fp32 noise in near-zero gradients); compare to the saved adapter.
    for (l, module), (A, B) in lora["pairs"].items():
        A.grad = eng["grad." + peft_name(l, module, "A")].clone()
        B.grad = eng["grad." + peft_name(l, module, "B")].clone()
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    opt.step()
    saved = load_adapter(adir_out)
    d_param = 0.0
    for key, (A, B) in lora["pairs"].items():
        As, Bs = saved["pairs"][key]
        d_param = max(d_param, (As - A.detach()).abs().max().item(), (Bs - B.detach()).abs().max().item())
    print(f"[{name}] AdamW step vs torch.optim.AdamW: max param diff {d_param:.3e}")
    ok &= d_param <= 1e-6

    # The saved adapter, merged as W + (alpha/r)·B·A, reproduces the engine's logits after the step.
    merged = oracle.merged(saved)
    with torch.no_grad():
        d_after = (merged.logits(x) - eng["logits_after"]).abs().max().item()
    print(f"[{name}] saved adapter merged W+(alpha/r)BA vs engine logits: maxdiff {d_after:.3e}")
    ok &= d_after <= LOGIT_TOL
    print(f"[{name}] {'PASS' if ok else 'FAIL'}")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--refdump", required=True)
    ap.add_argument("--data", required=True)
    a = ap.parse_args()
    torch.set_num_threads(2)
    results = []
    with tempfile.TemporaryDirectory() as work:
        m = os.path.join(a.data, "models", "stories260K")
        results.append(run_case("stories260K-fp32", os.path.join(m, "hf"), a.refdump, work, ALL))
        results.append(run_case("stories260K-bf16", os.path.join(m, "hf-bf16"), a.refdump, work, ["q_proj", "v_proj", "down_proj"], r=8, alpha=16))
        syn = os.path.join(work, "synthetic")
        write_synthetic_model(syn, {"hidden_size": 48, "intermediate_size": 112, "num_hidden_layers": 3,
                                    "num_attention_heads": 6, "num_key_value_heads": 6, "vocab_size": 300,
                                    "tie_word_embeddings": False}, seed=3)
        results.append(run_case("synthetic-untied-mha", syn, a.refdump, work, ALL, r=2, alpha=4))
    n_fail = results.count(False)
    print(f"{len(results) - n_fail} passed, {n_fail} failed")
    return 0 if n_fail == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
