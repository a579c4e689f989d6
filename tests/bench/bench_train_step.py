"""Side-by-side LoRA training-step benchmark: lorapipe (C++) vs PyTorch eager (the oracle model).

Writes a synthetic ~110M-parameter Llama (random weights, HF layout) once, then runs the same step
(same batch, sequence length, LoRA rank and targets, AdamW, clipping, thread count) in both and
prints tokens/s and the ratio. Two PyTorch peers: the oracle as written (explicit attention matrix)
and the same model with F.scaled_dot_product_attention (the kernel lorapipe uses).

  python tests/bench/bench_train_step.py --bench build/tests/lorapipe_bench_train [--threads 2]
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "reference"))
from oracle_llama import OracleLlama, write_synthetic_model  # noqa: E402

CONFIG = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
          "num_key_value_heads": 12, "vocab_size": 32000, "tie_word_embeddings": True}


class SdpaOracle(OracleLlama):
    """The oracle with torch's fused attention kernel instead of the written-out softmax(QKᵀ)V."""

    def attend(self, q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def torch_step_rate(model_dir, batch, seq, rank, steps, warmup, sdpa):
    m = (SdpaOracle if sdpa else OracleLlama)(model_dir)
    g = torch.Generator().manual_seed(1)
    pairs = {}
    for l in range(m.L):
        for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"):
            out, inp = m.w[f"model.layers.{l}.{module}.weight"].shape
            A = ((torch.rand(rank, inp, generator=g) - 0.5) * (2 / math.sqrt(inp))).requires_grad_(True)
            B = torch.zeros(out, rank, requires_grad=True)
            pairs[(l, module)] = (A, B)
    lora = {"pairs": pairs, "scale": 2.0}
    params = [t for ab in pairs.values() for t in ab]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    tokens = torch.randint(0, m.cfg["vocab_size"], (batch, seq + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    total = 0.0
    for s in range(warmup + steps):
        t0 = time.perf_counter()
        logits = m.logits(x, lora)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        if s >= warmup:
            total += time.perf_counter() - t0
    return batch * seq * steps / total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True, help="path to lorapipe_bench_train")
    ap.add_argument("--model-dir", default=os.path.join(os.getcwd(), "bench-synthetic-110M"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--small-model", default=os.path.join(here, "..", "..", "..", "shared", "data", "models", "stories260K", "hf"),
                    help="a small real model for a second row, where per-op overhead matters ('' to skip)")
    a = ap.parse_args()
    if not os.path.exists(os.path.join(a.model_dir, "model.safetensors")):
        print(f"writing synthetic model to {a.model_dir}", file=sys.stderr)
        write_synthetic_model(a.model_dir, CONFIG, seed=0)
    torch.set_num_threads(a.threads)
    rows = [(a.model_dir, a.batch, a.seq, a.steps, a.warmup)]
    if a.small_model and os.path.exists(os.path.join(a.small_model, "config.json")):
        rows.append((os.path.abspath(a.small_model), 8, 128, 30, 5))
    for model_dir, batch, seq, steps, warmup in rows:
        common = ["--batch", str(batch), "--seq", str(seq), "--rank", str(a.rank), "--steps", str(steps),
                  "--warmup", str(warmup), "--threads", str(a.threads)]
        out = subprocess.run([a.bench, "--model", model_dir, *common], check=True, capture_output=True, text=True).stdout
        lp = json.loads(out.strip().splitlines()[-1])
        eager = torch_step_rate(model_dir, batch, seq, a.rank, steps, warmup, sdpa=False)
        sdpa = torch_step_rate(model_dir, batch, seq, a.rank, steps, warmup, sdpa=True)
        print(f"LoRA training step, {os.path.basename(model_dir.rstrip('/'))} ({lp['params'] / 1e6:.2f}M params), fp32, "
              f"batch {batch} x seq {seq}, rank {a.rank} on q,k,v,o, AdamW, {a.threads} threads, torch {torch.__version__}")
        print(f"  lorapipe (C++/LibTorch)         {lp['tokens_per_s']:10.1f} tokens/s")
        print(f"  PyTorch eager, oracle model     {eager:10.1f} tokens/s   ratio lorapipe/eager {lp['tokens_per_s'] / eager:.3f}")
        print(f"  PyTorch eager, oracle with SDPA {sdpa:10.1f} tokens/s   ratio lorapipe/eager-sdpa {lp['tokens_per_s'] / sdpa:.3f}")


if __name__ == "__main__":
    main()
