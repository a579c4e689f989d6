#!/usr/bin/env python3
"""LoRA fine-tune with a large vocabulary, side by side: lorapipe vs Hugging Face transformers + PEFT.

A synthetic Llama (random weights, transformers' LlamaConfig: dim 128, 2 layers) with the Qwen3
vocabulary (151,936) and tokenizer, instruction data (quiz_chat.jsonl through Qwen3's chat template,
loss on assistant turns only), seq 1024 x batch 4, LoRA r 8 on q,k,v,o, AdamW, 2 threads. Each side
runs in its own process; tokens/s is the median of the steps after the first, peak RSS from wait4().
lorapipe computes the head and the loss on the labelled positions only, in chunks; transformers
computes the full [4096, 151936] logits.

  .venv/bin/python tests/bench/bench_head.py --cli build/app/lorapipe-cli --data ../shared/data [--steps 6] [--dtype float32]
"""
import argparse, json, os, shutil, statistics, subprocess, sys, tempfile, time

ap = argparse.ArgumentParser()
ap.add_argument("--cli", required=True)
ap.add_argument("--data", required=True)
ap.add_argument("--steps", type=int, default=6)
ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
ap.add_argument("--seq", type=int, default=1024)
ap.add_argument("--batch", type=int, default=4)
ap.add_argument("--hf-child", help=argparse.SUPPRESS)
args = ap.parse_args()


def hf_side(model_dir):
    """transformers + PEFT on batches packed like lorapipe's: conversations back to back, loss on assistant turns."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from peft import LoraConfig, get_peft_model
    torch.set_num_threads(2)
    torch.manual_seed(0)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids, labels = [], []
    for line in open(os.path.join(args.data, "instruct/quiz_chat.jsonl")):
        msgs = json.loads(line)["messages"]
        enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]
        full = enc(tok.apply_chat_template(msgs, tokenize=False))
        prefix = enc(tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True))
        ids += full
        labels += [-100] * len(prefix) + full[len(prefix):]
    n = args.seq * args.batch
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                             lora_dropout=0.0, task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    times = []
    for step in range(args.steps):
        s = (step * n) % (len(ids) - n)
        x = torch.tensor(ids[s:s + n]).view(args.batch, args.seq)
        y = torch.tensor(labels[s:s + n]).view(args.batch, args.seq)
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        print(f"hf step {step} loss {loss.item():.4f} {times[-1]:.2f}s", file=sys.stderr, flush=True)
    trained = sum(1 for l in labels if l != -100) / len(labels)
    print(json.dumps({"tokens_per_s": n / statistics.median(times[1:]), "trained_fraction": trained}))


def main():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    tmp = tempfile.mkdtemp(prefix="lorapipe_bench_head_")
    try:
        model_dir = os.path.join(tmp, "model")
        cfg = LlamaConfig(vocab_size=151936, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=args.seq,
                          tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).to({"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]).save_pretrained(model_dir)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(args.data, "tokenizers/qwen3", f), model_dir)
        project = {"schema_version": 1, "model": {"path": model_dir, "dtype": args.dtype},
                   "data": {"train": os.path.join(args.data, "instruct/quiz_chat.jsonl"), "format": "chat",
                            "seq_len": args.seq, "val_fraction": 0},
                   "lora": {"r": 8, "alpha": 16, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]},
                   "run": {"steps": args.steps, "batch_size": args.batch, "threads": 2, "eval_interval": 0,
                           "sample_tokens": 0, "output_dir": os.path.join(tmp, "out")}}
        pfile = os.path.join(tmp, "p.json")
        json.dump(project, open(pfile, "w"))
        results = {}
        # lorapipe, its own process
        p = subprocess.Popen([args.cli, "train", pfile, "--json", "--db", os.path.join(tmp, "runs.db")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        err = p.stderr.read()
        _, status, ru = os.wait4(p.pid, 0)
        if status != 0:
            sys.exit("lorapipe failed:\n" + err[-2000:])
        rates = [e["tokens_per_s"] for e in map(json.loads, (l for l in err.splitlines() if l.startswith("{")))
                 if e.get("event") == "step" and "tokens_per_s" in e]
        results["lorapipe"] = (statistics.median(rates[1:]), ru.ru_maxrss / 1024)
        # transformers + PEFT, its own process
        p = subprocess.Popen([sys.executable, __file__, "--cli", args.cli, "--data", args.data, "--steps", str(args.steps),
                              "--dtype", args.dtype, "--seq", str(args.seq), "--batch", str(args.batch), "--hf-child", model_dir],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out = p.stdout.read()
        err = p.stderr.read()
        _, status, ru = os.wait4(p.pid, 0)  # this child's own peak RSS
        if status != 0:
            sys.exit("transformers failed:\n" + err[-2000:])
        hf = json.loads(out.strip().splitlines()[-1])
        results["hf"] = (hf["tokens_per_s"], ru.ru_maxrss / 1024)
        (lt, lm), (ht, hm) = results["lorapipe"], results["hf"]
        print(f"{args.dtype}, vocab 151936, seq {args.seq} x batch {args.batch}, chat data (loss on assistant turns, "
              f"{100 * hf['trained_fraction']:.0f}% of positions):")
        print(f"  lorapipe            {lt:9.0f} tokens/s   peak RSS {lm:7.0f} MB")
        print(f"  transformers + PEFT {ht:9.0f} tokens/s   peak RSS {hm:7.0f} MB")
        print(f"  ratio lorapipe/HF   {lt / ht:9.2f}x tokens/s  {lm / hm:5.2f}x peak RSS")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if args.hf_child:
    hf_side(args.hf_child)
else:
    main()
