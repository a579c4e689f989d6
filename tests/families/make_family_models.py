#!/usr/bin/env python3
"""Tiny random models of every supported family, made with transformers' own classes, and the golden
numbers lorapipe is compared against (tests/families/test_families.cpp).

Run at test time into the build folder (never committed):
    .venv/bin/python tests/families/make_family_models.py <shared/data> <out-dir>

For each family <out>/<name>/ holds
  model/              config.json + model.safetensors (save_pretrained), the stories260K SentencePiece
                      tokenizer and a tokenizer_config.json with the family's chat template
  adapter/            a PEFT LoRA adapter (real PEFT, non-zero B) on the family's module names
  golden.safetensors  tokens i64 [2,T], labels i64 [2,T] (already shifted: labels[i] is the target of
                      position i, -100 = ignored), base logits f32 [2,T,V], adapter logits, and the
                      gradient of the mean loss w.r.t. every LoRA tensor (PEFT names)
  golden.json         loss with the adapter, prompt ids and the greedy continuation (base model, KV cache)
"""
import json, os, shutil, sys

import torch
import transformers
from safetensors.torch import save_file
from peft import LoraConfig, get_peft_model

shared, out = sys.argv[1], sys.argv[2]
only = set(sys.argv[3:])
here = os.path.dirname(os.path.abspath(__file__))
chat_dir = os.path.join(here, "..", "fixtures", "chat")
tok_src = os.path.join(shared, "models/stories260K/hf/tokenizer.model")

V, T, NEW = 512, 40, 32
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
base = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            initializer_range=0.1)  # larger than the default 0.02: soft-capping and norms are not near-linear
qwen_template = json.load(open(os.path.join(shared, "tokenizers/qwen3/tokenizer_config.json")))["chat_template"]
gemma_template = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
                  "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim "
                  "+ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
phi3_template = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")


def tmpl(name):
    return open(os.path.join(chat_dir, name)).read()


# name: (config class, model class, config kwargs, LoRA targets, chat template)
families = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(head_dim=24, tie_word_embeddings=False,
                    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0, original_max_position_embeddings=16)),
               ATTN + MLP, tmpl("llama31.jinja")),
    "llama_linear": ("LlamaConfig", "LlamaForCausalLM",
                     dict(num_hidden_layers=2, rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0)),
                     ATTN, tmpl("llama3.jinja")),
    "llama_dynamic": ("LlamaConfig", "LlamaForCausalLM",
                      dict(num_hidden_layers=2, max_position_embeddings=24,
                           rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)),
                      ATTN, tmpl("llama3.jinja")),
    "llama_yarn": ("LlamaConfig", "LlamaForCausalLM",
                   dict(num_hidden_layers=2, attention_bias=True, mlp_bias=True,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                             original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0)),
                   ATTN + MLP, tmpl("llama3.jinja")),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1000000.0), ATTN + MLP,
              qwen_template),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False), ATTN + MLP, qwen_template),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=12, head_dim=16), ATTN + MLP,
                tmpl("mistral.jinja")),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, tie_word_embeddings=False),
             ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], phi3_template),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=32, sliding_window=12, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                    final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh"),
               ATTN + MLP, gemma_template),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=32, sliding_window=12, query_pre_attn_scalar=32, sliding_window_pattern=2,
                    rope_parameters={"full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=2.0),
                                     "sliding_attention": dict(rope_type="default", rope_theta=10000.0)}),
               ATTN + MLP, gemma_template),
}


def make(name, spec):
    cfg_cls, model_cls, kw, targets, template = spec
    d = os.path.join(out, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    torch.manual_seed(1234)
    cfg = getattr(transformers, cfg_cls)(**{**base, **kw})
    model = getattr(transformers, model_cls)(cfg).float().eval()
    with torch.no_grad():  # norms away from their init so a missing (1 + w) or weight shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if "gemma" in name else 1.0))
            elif "bias" in n:
                p.copy_(torch.randn_like(p) * 0.1)
    mdir = os.path.join(d, "model")
    model.save_pretrained(mdir, safe_serialization=True)
    shutil.copy(tok_src, os.path.join(mdir, "tokenizer.model"))
    json.dump({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
               "chat_template": template}, open(os.path.join(mdir, "tokenizer_config.json"), "w"), indent=1)

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(3, V, (2, T), generator=g)
    labels = torch.cat([tokens[:, 1:], torch.full((2, 1), -100)], 1)
    labels[0, :10] = -100  # a masked prompt
    with torch.no_grad():
        base_logits = model(tokens).logits.float()

    lcfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, lcfg)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    peft_model.save_pretrained(os.path.join(d, "adapter"))
    logits = peft_model(tokens).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    # Greedy last: dynamic RoPE keeps state across calls (the longest sequence seen), and generation
    # from a short prompt resets it, as a fresh run would.
    prompt = tokens[:1, :12]
    model.generation_config.eos_token_id = None  # all 32 tokens, EOS or not (lorapipe: stop_id -1)
    with torch.no_grad(), peft_model.disable_adapter():
        cont = model.generate(prompt, max_new_tokens=NEW, do_sample=False, use_cache=True,
                              pad_token_id=0)[0, prompt.shape[1]:].tolist()
    tensors = {"tokens": tokens, "labels": labels, "base_logits": base_logits.contiguous(),
               "adapter_logits": logits.detach().contiguous()}
    for n, p in peft_model.named_parameters():
        if p.requires_grad:
            tensors["grad:" + n.replace(".default", "")] = p.grad.detach().contiguous()
    save_file(tensors, os.path.join(d, "golden.safetensors"))
    json.dump({"loss": loss.item(), "prompt": prompt[0].tolist(), "greedy": cont, "targets": targets,
               "transformers": transformers.__version__},
              open(os.path.join(d, "golden.json"), "w"))
    print(f"{name}: loss {loss.item():.5f}, {len(cont)} greedy tokens", flush=True)


for name, spec in families.items():
    if not only or name in only:
        make(name, spec)
