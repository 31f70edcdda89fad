"""What a target model is: its shape and limits read from a Hugging Face config (``TargetConfig``)
and its rotary position tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import JakiroError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class TargetConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_context: int
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    name: str = ""

    def check_length(self, max_len: int) -> None:
        """Refuse a cache for more tokens than this model's context."""
        if max_len > self.max_context:
            raise JakiroError(f"requested {max_len} tokens but the model's context length is {self.max_context}")

    def check_aux_layers(self, aux_layers: tuple[int, ...]) -> None:
        """Refuse mid-layer streams that are not after increasing counts of this model's layers."""
        layers = self.num_layers
        if list(aux_layers) != sorted(set(aux_layers)) or any(not 0 < a < layers for a in aux_layers):
            raise JakiroError(f"mid-layer features must come after increasing layer counts in 1..{layers - 1} "
                              f"(this target has {layers} decoder layers), got {list(aux_layers)}")

    @classmethod
    def from_hf(cls, hf_config, name: str = "") -> "TargetConfig":
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise JakiroError(
                f"unsupported architecture {model_type!r}: supported model types are "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        max_context = hf_config.max_position_embeddings
        window = getattr(hf_config, "sliding_window", None)
        if model_type == "mistral" and window:
            max_context = min(max_context, window)  # beyond the window Mistral attends differently
        return cls(
            model_type=model_type,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=hf_config.vocab_size,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_context=max_context,
            qkv_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            name=name,
        )


def rope_tables(hf_config, head_dim: int, max_positions: int,
                freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim] in the Hugging Face (rotate-half) layout;
    ``freq_factors`` (a GGUF file's ``rope_freqs``, Llama 3's long-context scaling): each
    frequency divided by its factor, as llama.cpp applies them."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise JakiroError(f"unsupported RoPE type {rope_type!r}")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    if freq_factors is not None:
        inv_freq = inv_freq.float() / freq_factors.float()
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).contiguous(), (emb.sin() * scaling).contiguous()
