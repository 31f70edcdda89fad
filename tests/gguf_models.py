"""Tiny GGUF files for tests: random blocks of every type the kernels take (GGUF's reference
dequantization defines what they hold), written as small Llama, Qwen2 and Qwen3 models with a
byte-level tokenizer, so GGUF targets are tested without downloading anything."""

from __future__ import annotations

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T

BLOCK = {t: gguf.GGML_QUANT_SIZES[t] for t in T}  # type -> (values, bytes) per block
# where each block type keeps its fp16 scales (random bytes there could be huge or NaN)
HALVES = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q2_K: [80, 82],
          T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
QUANTIZED = tuple(HALVES)
PACKED = (T.Q4_0, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)  # csrc/kquants.cpp's layout


def random_blocks(kind: T, rows: int, cols: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """Random GGUF blocks of a [rows, cols] matrix ([rows, blocks, bytes] uint8): random codes,
    scales and mins, fp16 scales of about ``scale``."""
    rng = np.random.default_rng(seed)
    values, size = BLOCK[kind]
    raw = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    for at in HALVES[kind]:
        halves = (rng.standard_normal((rows, cols // values)) * scale).astype(np.float16)
        raw[..., at:at + 2] = halves.view(np.uint8).reshape(rows, cols // values, 2)
    return raw


def random_tensor(kind: T, rows: int, cols: int, seed: int, scale: float) -> np.ndarray:
    if kind in QUANTIZED:
        return random_blocks(kind, rows, cols, seed, scale)
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * scale * 8
    return w.astype({T.F32: np.float32, T.F16: np.float16}[kind]) if kind != T.BF16 else gguf.quants.quantize(w, T.BF16)


def reference(raw: np.ndarray, kind: T) -> np.ndarray:
    """GGUF's own float32 values of a matrix's blocks."""
    if kind in (T.F32, T.F16):
        return raw.astype(np.float32)
    return gguf.quants.dequantize(raw.reshape(raw.shape[0], -1), kind).astype(np.float32)


def _byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: one token per byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    order = sorted(zip(bs, cs))
    return [chr(c) for _, c in order]


# the matrices of a layer, and the block type each gets in ``write_model`` (a mix as a Q4_K_M
# file has: q/k and v in different types, 32-value and 256-value blocks side by side)
MIXED = {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q5_0, "ffn_gate": T.Q4_K,
         "ffn_up": T.Q4_K, "ffn_down": T.Q6_K}


def write_model(path: str, arch: str = "qwen2", types: dict | None = None, head: T | None = T.Q8_0,
                embed: T = T.Q4_K, layers: int = 2, hidden: int = 256, inter: int = 512, heads: int = 4,
                kv_heads: int = 2, head_dim: int | None = None, vocab: int = 272, seed: int = 0,
                context: int = 4096, extra: dict | None = None) -> str:
    """A small model in a GGUF file: ``types`` per matrix (default ``MIXED``), ``head`` the output
    matrix's type (None: tied to the embedding), random F32 norms (and Qwen2's biases, Qwen3's q/k
    norms), a byte-level BPE tokenizer with a ChatML template; ``extra`` adds tensors (name -> array)."""
    types = dict(MIXED, **(types or {}))
    head_dim = head_dim or hidden // heads
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "qwen3" or head_dim != hidden // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    tokens = _byte_tokens() + ["he"] + [f"<|extra_{i}|>" for i in range(vocab - 259)] + ["<|im_start|>", "<|im_end|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [3] * (vocab - 257))
    w.add_token_merges(["h e"])
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    counter = iter(range(1, 1 << 20))

    def tensor(name: str, kind: T, rows: int, cols: int, scale: float = 0.002):
        data = random_tensor(kind, rows, cols, seed * 1000 + next(counter), scale)
        data = data.reshape(rows, -1)  # a row's blocks as bytes
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)

    def vector(name: str, n: int, mean: float = 1.0):
        w.add_tensor(name, (mean + 0.1 * rng.standard_normal(n)).astype(np.float32))

    tensor("token_embd.weight", embed, vocab, hidden, 0.01)
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", hidden)
        vector(p + "ffn_norm.weight", hidden)
        for name, rows, cols in (("attn_q", q_rows, hidden), ("attn_k", kv_rows, hidden), ("attn_v", kv_rows, hidden),
                                 ("attn_output", hidden, q_rows), ("ffn_gate", inter, hidden),
                                 ("ffn_up", inter, hidden), ("ffn_down", hidden, inter)):
            tensor(p + name + ".weight", types[name], rows, cols)
        if arch == "qwen2":
            for name, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
                vector(p + name + ".bias", rows, 0.0)
        if arch == "qwen3":
            vector(p + "attn_q_norm.weight", head_dim)
            vector(p + "attn_k_norm.weight", head_dim)
    vector("output_norm.weight", hidden)
    if head is not None:
        tensor("output.weight", head, vocab, hidden, 0.01)
    for name, data in (extra or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
