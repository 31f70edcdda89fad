"""Draft configuration: a Llama-style one-layer config plus Jakiro's fields."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..errors import JakiroError

DRAFT_METHODS = ("eagle2", "jakiro", "eagle3")
# the layout vLLM, SGLang, SpecForge and llama.cpp load: it reads exactly three residual streams
EAGLE3_STREAMS = 3
CANDIDATE_MODES = ("decoupled", "blended")


@dataclass
class DraftConfig:
    method: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary (embedding, verification)
    rms_norm_eps: float
    max_position_embeddings: int
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    num_experts: int = 1
    experts_per_token: int = 1
    candidate_mode: str = "decoupled"
    parallel_decoding: bool = False
    draft_vocab_size: int | None = None  # None = the full target vocabulary
    target_name: str = ""
    # mid-layer inputs: the target's residual stream after these many decoder layers, mapped into
    # the first draft step's input feature (empty: the final feature alone, as EAGLE-2)
    aux_layers: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.method not in DRAFT_METHODS:
            raise JakiroError(f"unknown draft method {self.method!r} (choose from {', '.join(DRAFT_METHODS)})")
        if self.candidate_mode not in CANDIDATE_MODES:
            raise JakiroError(f"unknown candidate mode {self.candidate_mode!r} "
                              f"(choose from {', '.join(CANDIDATE_MODES)})")
        if self.method in ("eagle2", "eagle3"):
            if self.num_experts != 1 or self.experts_per_token != 1 or self.parallel_decoding:
                raise JakiroError(f"an {self.method} draft has one dense MLP: no experts, no parallel decoding")
        else:
            if self.experts_per_token < 2:
                raise JakiroError(f"jakiro needs at least 2 activated experts, got {self.experts_per_token}")
            if self.num_experts < self.experts_per_token:
                raise JakiroError(f"num_experts ({self.num_experts}) must be >= experts_per_token "
                                  f"({self.experts_per_token})")
        self.aux_layers = [int(a) for a in self.aux_layers]
        if self.aux_layers != sorted(set(self.aux_layers)) or any(a < 1 for a in self.aux_layers):
            raise JakiroError(f"aux_layers must be increasing layer counts >= 1, got {self.aux_layers}")
        if self.method == "eagle3" and len(self.aux_layers) != EAGLE3_STREAMS:
            raise JakiroError(f"an eagle3 draft reads {EAGLE3_STREAMS} residual streams of the target (--aux-layers, "
                              f"e.g. 2,L/2,L-3 for L layers), got {self.aux_layers or 'none'}")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise JakiroError(f"draft_vocab_size must be in 1..{self.vocab_size}, got {self.draft_vocab_size}")

    @classmethod
    def for_target(cls, target_config, hf_config, method: str, **overrides) -> "DraftConfig":
        """A draft shaped like the target (same width, heads and RoPE)."""
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        if not rope:
            rope = {"rope_type": "default", "rope_theta": getattr(hf_config, "rope_theta", 10000.0)}
        kwargs = dict(
            method=method,
            hidden_size=target_config.hidden_size,
            intermediate_size=target_config.intermediate_size,
            num_attention_heads=target_config.num_heads,
            num_key_value_heads=target_config.num_kv_heads,
            head_dim=target_config.head_dim,
            vocab_size=target_config.vocab_size,
            rms_norm_eps=target_config.rms_norm_eps,
            max_position_embeddings=target_config.max_context,
            rope_parameters=rope,
            target_name=target_config.name,
        )
        if method == "eagle3":
            n = target_config.num_layers
            kwargs["aux_layers"] = [2, n // 2, n - 3]  # the loaders' default streams
        if method == "jakiro":
            kwargs.update(num_experts=2, experts_per_token=2, parallel_decoding=True)
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_json_dict(self) -> dict:
        """config.json: Llama-style keys (readable by transformers) plus a ``jakiro`` block."""
        d = asdict(self)
        jakiro = {k: d.pop(k) for k in ("method", "num_experts", "experts_per_token", "candidate_mode",
                                        "parallel_decoding", "draft_vocab_size", "target_name", "aux_layers")}
        jakiro["target_hidden_size"] = self.hidden_size
        jakiro["target_vocab_size"] = self.vocab_size
        d.update(model_type="llama", architectures=["JakiroDraft"], num_hidden_layers=1,
                 hidden_act="silu", tie_word_embeddings=False, jakiro=jakiro)
        return d

    @classmethod
    def from_json_dict(cls, d: dict) -> "DraftConfig":
        if "jakiro" not in d:
            raise JakiroError("not a jakiro draft config (no 'jakiro' block in config.json)")
        j = dict(d["jakiro"])
        j.pop("target_hidden_size", None)
        j.pop("target_vocab_size", None)
        names = set(cls.__dataclass_fields__)
        kwargs = {k: v for k, v in d.items() if k in names}
        kwargs.update({k: v for k, v in j.items() if k in names})
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise JakiroError(f"incomplete draft config: {exc}") from None

    def to_llama_config(self):
        from transformers import LlamaConfig
        return LlamaConfig(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           num_hidden_layers=1, vocab_size=self.vocab_size,
                           rms_norm_eps=self.rms_norm_eps,
                           max_position_embeddings=self.max_position_embeddings,
                           rope_parameters=dict(self.rope_parameters))
