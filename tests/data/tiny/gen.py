"""Tiny random Llama-family checkpoints with an independent float64 numpy reference forward.

Run: pip install numpy safetensors && python3 tests/data/tiny/gen.py
Writes, for each model, a Hugging Face directory (config.json + safetensors) and
`reference.safetensors` holding `ids` (int64 [T]) and `logits` (float64 [T, vocab]) computed here
with transformers' Llama/Qwen2 semantics (rotate-half RoPE, GQA via repeat_kv, RMSNorm, SwiGLU).

- qwen2: Q/K/V biases, untied LM head, weights split over two shards with an index.
- llama3: tied embeddings, Llama 3.1 RoPE scaling (transformers `_compute_llama3_parameters`).
"""
import json
import os

import numpy as np
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))


def rope_inv_freq(cfg):
    d = cfg["head_dim"]
    inv = 1.0 / (cfg["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.get("rope_scaling")
    if rs and rs["rope_type"] == "llama3":
        factor, lo, hi, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / lo, old / hi
        wavelen = 2 * np.pi / inv
        inv_l = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, inv_l)
    return inv


def rmsnorm(x, w, eps):
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], -1)


def forward(cfg, W, ids):
    T = len(ids)
    H, KV, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    x = W["model.embed_tokens.weight"][ids]
    inv = rope_inv_freq(cfg)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    emb = np.concatenate([ang, ang], -1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rmsnorm(x, W[p + "input_layernorm.weight"], eps)
        proj = {}
        for n in "qkv":
            y = h @ W[p + f"self_attn.{n}_proj.weight"].T
            if cfg.get("attention_bias") or cfg["model_type"] == "qwen2":
                y = y + W[p + f"self_attn.{n}_proj.bias"]
            proj[n] = y
        q = proj["q"].reshape(T, H, D)
        k = proj["k"].reshape(T, KV, D)
        v = proj["v"].reshape(T, KV, D)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = H // KV
        k = np.repeat(k, rep, axis=1)  # repeat_kv: head h uses kv head h // rep
        v = np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(D) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        a = np.einsum("hts,shd->thd", s, v).reshape(T, H * D)
        x = x + a @ W[p + "self_attn.o_proj.weight"].T
        h = rmsnorm(x, W[p + "post_attention_layernorm.weight"], eps)
        g = h @ W[p + "mlp.gate_proj.weight"].T
        u = h @ W[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ W[p + "mlp.down_proj.weight"].T
    x = rmsnorm(x, W["model.norm.weight"], eps)
    head = W["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else W["lm_head.weight"]
    return x @ head.T


def make(name, cfg, seed, shards):
    rng = np.random.default_rng(seed)
    Hs, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    W = {"model.embed_tokens.weight": rng.normal(0, 0.5, (V, Hs))}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        W[p + "input_layernorm.weight"] = 1 + rng.normal(0, 0.1, Hs)
        W[p + "post_attention_layernorm.weight"] = 1 + rng.normal(0, 0.1, Hs)
        for n, rows in (("q", q), ("k", kv), ("v", kv)):
            W[p + f"self_attn.{n}_proj.weight"] = rng.normal(0, 0.25, (rows, Hs))
            if cfg["model_type"] == "qwen2":
                W[p + f"self_attn.{n}_proj.bias"] = rng.normal(0, 0.5, rows)
        W[p + "self_attn.o_proj.weight"] = rng.normal(0, 0.25, (Hs, q))
        W[p + "mlp.gate_proj.weight"] = rng.normal(0, 0.25, (I, Hs))
        W[p + "mlp.up_proj.weight"] = rng.normal(0, 0.25, (I, Hs))
        W[p + "mlp.down_proj.weight"] = rng.normal(0, 0.25, (Hs, I))
    W["model.norm.weight"] = 1 + rng.normal(0, 0.1, Hs)
    if not cfg["tie_word_embeddings"]:
        W["lm_head.weight"] = rng.normal(0, 0.5, (V, Hs))
    # Stored as float32; the reference runs in float64 on exactly the stored values.
    W = {k: v.astype(np.float32) for k, v in W.items()}
    out = os.path.join(HERE, name)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    names = sorted(W)
    if shards == 1:
        save_file(W, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    else:
        parts = [names[i::shards] for i in range(shards)]
        weight_map = {}
        for j, part in enumerate(parts):
            fname = f"model-{j + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: W[k] for k in part}, os.path.join(out, fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in part})
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    ids = rng.integers(0, cfg["vocab_size"], 12)
    W64 = {k: v.astype(np.float64) for k, v in W.items()}
    logits = forward(cfg, W64, ids)
    save_file({"ids": ids.astype(np.int64), "logits": logits}, os.path.join(out, "reference.safetensors"))


base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
            max_position_embeddings=64)
make("qwen2", dict(base, model_type="qwen2", architectures=["Qwen2ForCausalLM"], rope_theta=1000000.0,
                   tie_word_embeddings=False), seed=1, shards=2)
make("llama3", dict(base, model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=10000.0,
                    tie_word_embeddings=True,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=16)), seed=2, shards=1)
