"""Independent PyTorch reference for lorapipe's numerics (the oracle).

A deliberately plain Llama: written from the HF modeling code's math, sharing nothing with the
C++ engine. Weights come from an HF folder via the `safetensors` package; LoRA adapters are read
from PEFT layout and applied either as separate low-rank branches (for gradients) or merged as
W + (alpha/r)·B·A (to check saved adapters).
"""
import json
import math
import os

import torch
from safetensors.torch import load_file, save_file

TARGETS = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}


def peft_name(layer, module, ab):
    return f"base_model.model.model.layers.{layer}.{module}.lora_{ab}.weight"


class OracleLlama:
    def __init__(self, model_dir, dtype=torch.float32):
        with open(os.path.join(model_dir, "config.json")) as f:
            self.cfg = json.load(f)
        raw = load_file(os.path.join(model_dir, "model.safetensors"))
        self.w = {k: v.to(dtype) for k, v in raw.items()}
        c = self.cfg
        self.L = c["num_hidden_layers"]
        self.nh = c["num_attention_heads"]
        self.nkv = c.get("num_key_value_heads", self.nh)
        self.hd = c.get("head_dim", c["hidden_size"] // self.nh)
        self.eps = c.get("rms_norm_eps", 1e-5)
        self.theta = c.get("rope_theta", 10000.0)
        self.tied = c.get("tie_word_embeddings", False)

    def rms(self, x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def rope(self, T):
        inv = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.int64).float() / self.hd))
        t = torch.arange(T, dtype=torch.int64).float()
        f = torch.outer(t, inv)
        emb = torch.cat((f, f), dim=-1)
        return emb.cos(), emb.sin()

    @staticmethod
    def rot(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    def attend(self, q, k, v, mask):
        """Causal attention written out: softmax(QKᵀ/√d + mask)·V."""
        att = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd) + mask
        return torch.softmax(att.float(), dim=-1).to(q.dtype) @ v

    def linear(self, x, layer, module, lora):
        y = x @ self.w[f"model.layers.{layer}.{module}.weight"].t()
        if lora is not None and (layer, module) in lora["pairs"]:
            A, B = lora["pairs"][(layer, module)]
            y = y + (x @ A.t() @ B.t()) * lora["scale"]
        return y

    def logits(self, tokens, lora=None):
        B, T = tokens.shape
        x = self.w["model.embed_tokens.weight"][tokens]
        cos, sin = self.rope(T)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        mask = torch.full((T, T), float("-inf")).triu(1)
        for l in range(self.L):
            p = f"model.layers.{l}."
            h = self.rms(x, self.w[p + "input_layernorm.weight"])
            q = self.linear(h, l, "self_attn.q_proj", lora).view(B, T, self.nh, self.hd).transpose(1, 2)
            k = self.linear(h, l, "self_attn.k_proj", lora).view(B, T, self.nkv, self.hd).transpose(1, 2)
            v = self.linear(h, l, "self_attn.v_proj", lora).view(B, T, self.nkv, self.hd).transpose(1, 2)
            q = q * cos + self.rot(q) * sin
            k = k * cos + self.rot(k) * sin
            rep = self.nh // self.nkv
            k = k[:, :, None].expand(B, self.nkv, rep, T, self.hd).reshape(B, self.nh, T, self.hd)
            v = v[:, :, None].expand(B, self.nkv, rep, T, self.hd).reshape(B, self.nh, T, self.hd)
            o = self.attend(q, k, v, mask).transpose(1, 2).reshape(B, T, self.nh * self.hd)
            x = x + self.linear(o, l, "self_attn.o_proj", lora)
            h = self.rms(x, self.w[p + "post_attention_layernorm.weight"])
            g = self.linear(h, l, "mlp.gate_proj", lora)
            u = self.linear(h, l, "mlp.up_proj", lora)
            x = x + self.linear(torch.nn.functional.silu(g) * u, l, "mlp.down_proj", lora)
        x = self.rms(x, self.w["model.norm.weight"])
        head = self.w["model.embed_tokens.weight"] if self.tied else self.w["lm_head.weight"]
        return x @ head.t()

    def merged(self, lora):
        """A copy of this model with W + scale·B·A folded in."""
        m = OracleLlama.__new__(OracleLlama)
        m.__dict__.update(self.__dict__)
        m.w = dict(self.w)
        for (l, module), (A, B) in lora["pairs"].items():
            key = f"model.layers.{l}.{module}.weight"
            m.w[key] = (self.w[key].float() + lora["scale"] * (B.float() @ A.float())).to(self.w[key].dtype)
        return m


def load_adapter(adapter_dir, requires_grad=False):
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM", cfg
    t = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    pairs = {}
    for name in t:
        if name.endswith(".lora_A.weight"):
            stem = name[: -len(".lora_A.weight")]
            parts = stem.split(".")
            layer = int(parts[4])
            module = ".".join(parts[5:])
            A = t[name].clone().requires_grad_(requires_grad)
            B = t[stem + ".lora_B.weight"].clone().requires_grad_(requires_grad)
            pairs[(layer, module)] = (A, B)
    return {"pairs": pairs, "scale": cfg["lora_alpha"] / cfg["r"], "cfg": cfg}


def write_random_adapter(adapter_dir, oracle, r, alpha, targets, seed):
    """A PEFT adapter with non-zero A and B (so every gradient is non-trivial)."""
    os.makedirs(adapter_dir, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for l in range(oracle.L):
        for t in targets:
            module = TARGETS[t]
            W = oracle.w[f"model.layers.{l}.{module}.weight"]
            out, inp = W.shape
            tensors[peft_name(l, module, "A")] = (torch.rand(r, inp, generator=g) - 0.5) * (2 / math.sqrt(inp))
            tensors[peft_name(l, module, "B")] = (torch.rand(out, r, generator=g) - 0.5) * 0.2
    save_file(tensors, os.path.join(adapter_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
           "target_modules": list(targets), "base_model_name_or_path": "oracle", "bias": "none"}
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def write_synthetic_model(model_dir, cfg, seed, dtype=torch.float32):
    """Random-weight HF Llama folder (used for the untied/non-GQA case and the benchmark)."""
    os.makedirs(model_dir, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    D, H, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim", D // nh)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    t = {"model.embed_tokens.weight": rnd(V, D), "model.norm.weight": (1 + rnd(D)).to(dtype)}
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        t[p + "self_attn.q_proj.weight"] = rnd(nh * hd, D)
        t[p + "self_attn.k_proj.weight"] = rnd(nkv * hd, D)
        t[p + "self_attn.v_proj.weight"] = rnd(nkv * hd, D)
        t[p + "self_attn.o_proj.weight"] = rnd(D, nh * hd)
        t[p + "mlp.gate_proj.weight"] = rnd(H, D)
        t[p + "mlp.up_proj.weight"] = rnd(H, D)
        t[p + "mlp.down_proj.weight"] = rnd(D, H)
        t[p + "input_layernorm.weight"] = (1 + rnd(D)).to(dtype)
        t[p + "post_attention_layernorm.weight"] = (1 + rnd(D)).to(dtype)
    if not cfg.get("tie_word_embeddings", False):
        t["lm_head.weight"] = rnd(V, D)
    save_file(t, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    full = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
            "torch_dtype": {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]}
    full.update(cfg)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(full, f, indent=2)
