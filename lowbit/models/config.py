"""ModelConfig: the shape of a LLaMA-style dense or MoE decoder, validated where it is built.

Sizes come from one of three places:
- `ModelConfig(dim=..., n_layers=..., n_heads=..., ...)`: every field spelled out;
- `ModelConfig.from_size(n_layers, dim, **overrides)`: two knobs, the rest follows LLaMA's
  conventions (64-dim heads, SwiGLU hidden size ~8/3 * dim);
- `ModelConfig.preset(name, **overrides)`: the named sizes in PRESETS ("tiny" for CI,
  "small", "100m", "1b", and the MoE "moe-120m"). Add `n_experts=8` (say) to any dense one for an
  MoE model.

Defaults that depend on other fields (head_dim, n_kv_heads, ffn_dim, moe_ffn_dim) are resolved in
`__post_init__`, so a built config holds concrete numbers and round-trips through
`dataclasses.asdict`. When you `dataclasses.replace` `dim`, pass `ffn_dim=None`,
`head_dim=None` (and `moe_ffn_dim=None`) too, or the old sizes are kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lowbit.config import require


def _round_up(x: float, multiple: int) -> int:
    return int(math.ceil(x / multiple) * multiple)


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    """Number of token ids; must match the tokenizer (lowbit.data's BPE default is 4096)."""
    dim: int = 256
    """Width of the residual stream (Hugging Face: hidden_size)."""
    n_layers: int = 4
    """Number of decoder layers (Hugging Face: num_hidden_layers)."""
    n_heads: int = 4
    """Attention (query) heads."""
    head_dim: int | None = None
    """Channels per attention head, an even number (RoPE rotates pairs). None: dim / n_heads
    (which must then divide); Qwen3 sets it on its own (e.g. 128 heads of 16 on a 1024 width)."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; must divide n_heads. None: n_heads (MHA)."""
    ffn_dim: int | None = None
    """Hidden size of the dense SwiGLU MLP. None: 8/3 * dim rounded up to a multiple of 64,
    which keeps the MLP's parameter count at the classic 4 * dim two-matrix MLP's."""
    max_seq_len: int = 1024
    """Longest sequence the model accepts; the RoPE tables are built for this many positions."""
    rope_theta: float = 10000.0
    """RoPE base (LLaMA 2: 1e4; Qwen3 and LLaMA 3: 1e6 / 5e5 for long contexts)."""
    norm_eps: float = 1e-5
    """Epsilon inside RMSNorm's square root."""
    qk_norm: bool = False
    """RMSNorm on each query and key head before RoPE (Qwen3's q_norm / k_norm); False: LLaMA."""
    qkv_bias: bool = False
    """Biases on q_proj, k_proj, v_proj (Qwen2; LLaMA's and Qwen3's attention_bias)."""
    o_bias: bool = False
    """A bias on o_proj (LLaMA's and Qwen3's attention_bias; not Qwen2)."""
    mlp_bias: bool = False
    """Biases on the dense MLP's gate_proj, up_proj, down_proj (LLaMA's mlp_bias)."""
    rope_scaling: dict | None = None
    """None: plain RoPE. {"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"}: LLaMA 3.1's frequency rescaling
    (Hugging Face's rope_parameters of that type)."""
    dropout: float = 0.0
    """Dropout on attention probabilities and on each residual branch's output, in training only."""
    n_experts: int = 0
    """Experts per MoE layer; 0 builds a dense model. With n_experts > 0 every layer is MoE."""
    experts_per_token: int = 2
    """Experts each token is routed to (top-k); only used when n_experts > 0."""
    moe_ffn_dim: int | None = None
    """Hidden size of each expert's SwiGLU (Hugging Face: moe_intermediate_size). None:
    ffn_dim / experts_per_token rounded up to a multiple of 32, so a token's active MLP
    compute roughly matches the dense model's."""
    moe_norm_topk: bool = True
    """Renormalize the k routing weights of a token to sum to 1 (Qwen3-MoE's norm_topk_prob,
    Mixtral); False keeps the softmax probabilities as they are."""
    moe_aux_loss_coef: float = 0.01
    """Weight of the Switch Transformer load-balancing loss (averaged over MoE layers) in the
    training loss; 0 turns balancing off (aux_loss is still reported)."""
    tie_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection (lm_head)."""
    init_std: float = 0.02
    """Standard deviation of the normal weight init; residual output projections (o_proj,
    down_proj) use init_std / sqrt(2 * n_layers) so the residual stream's variance does not
    grow with depth (GPT-2)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0,
                     f"{name} must be a positive integer (got {value!r})")
        if self.head_dim is None:
            require(self.dim % self.n_heads == 0,
                     f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}); "
                     f"choose n_heads among the divisors of dim, e.g. dim // 64 for 64-dim heads")
            require((self.dim // self.n_heads) % 2 == 0,
                     f"head_dim = dim / n_heads = {self.dim // self.n_heads} must be even, since "
                     f"RoPE rotates pairs of channels; change dim or n_heads")
            self.head_dim = self.dim // self.n_heads
        require(isinstance(self.head_dim, int) and self.head_dim > 0 and self.head_dim % 2 == 0,
                 f"head_dim must be a positive even integer (got {self.head_dim!r}), since RoPE "
                 f"rotates pairs of channels")
        require(self.rope_scaling is None or self.rope_scaling.get("rope_type") == "llama3",
                 f"rope_scaling {self.rope_scaling!r} is not supported; lowbit implements plain "
                 f"RoPE (None) and rope_type 'llama3'")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        require(isinstance(self.n_kv_heads, int) and self.n_kv_heads > 0
                 and self.n_heads % self.n_kv_heads == 0,
                 f"n_kv_heads ({self.n_kv_heads}) must be a positive divisor of n_heads "
                 f"({self.n_heads}); each key/value head serves n_heads / n_kv_heads query heads")
        if self.ffn_dim is None:
            self.ffn_dim = _round_up(8 * self.dim / 3, 64)
        require(isinstance(self.ffn_dim, int) and self.ffn_dim > 0,
                 f"ffn_dim must be a positive integer (got {self.ffn_dim!r}); None picks ~8/3 * dim")
        require(self.rope_theta > 0, f"rope_theta must be > 0 (got {self.rope_theta})")
        require(self.norm_eps > 0, f"norm_eps must be > 0 (got {self.norm_eps})")
        require(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1) (got {self.dropout})")
        require(self.init_std > 0, f"init_std must be > 0 (got {self.init_std})")
        require(isinstance(self.n_experts, int) and self.n_experts >= 0,
                 f"n_experts must be an integer >= 0 (got {self.n_experts!r}); 0 builds a dense model")
        require(self.moe_aux_loss_coef >= 0,
                 f"moe_aux_loss_coef must be >= 0 (got {self.moe_aux_loss_coef}); 0 disables balancing")
        if self.n_experts > 0:
            require(isinstance(self.experts_per_token, int)
                     and 1 <= self.experts_per_token <= self.n_experts,
                     f"experts_per_token ({self.experts_per_token}) must be between 1 and "
                     f"n_experts ({self.n_experts}); lower it or add experts")
            if self.moe_ffn_dim is None:
                self.moe_ffn_dim = _round_up(self.ffn_dim / self.experts_per_token, 32)
            require(isinstance(self.moe_ffn_dim, int) and self.moe_ffn_dim > 0,
                     f"moe_ffn_dim must be a positive integer (got {self.moe_ffn_dim!r}); "
                     f"None picks ffn_dim / experts_per_token")

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def num_parameters(self, active: bool = False) -> int:
        """Parameters of the model this config builds, counted from the shapes (no model built).

        active=True counts only the experts_per_token experts a token passes through in each
        MoE layer (the number that sets per-token compute); for dense models both agree.
        """
        C, hd = self.dim, self.head_dim
        attention = C * self.n_heads * hd + 2 * C * self.n_kv_heads * hd + self.n_heads * hd * C
        if self.qk_norm:
            attention += 2 * hd
        attention += (self.n_heads + 2 * self.n_kv_heads) * hd * self.qkv_bias + C * self.o_bias
        if self.is_moe:
            experts = self.experts_per_token if active else self.n_experts
            mlp = self.n_experts * C + experts * 3 * C * self.moe_ffn_dim  # router + experts
        else:
            mlp = 3 * C * self.ffn_dim + (2 * self.ffn_dim + C) * self.mlp_bias
        layer = attention + mlp + 2 * C  # + input_layernorm, post_attention_layernorm
        embeddings = self.vocab_size * C * (1 if self.tie_embeddings else 2)
        return embeddings + self.n_layers * layer + C  # + final norm

    @classmethod
    def from_size(cls, n_layers: int, dim: int, **overrides) -> ModelConfig:
        """A LLaMA-shaped config from depth and width: 64-dim heads (at least one head),
        SwiGLU ~8/3 * dim. Any other field can be passed as an override."""
        overrides.setdefault("n_heads", max(1, dim // 64))
        return cls(n_layers=n_layers, dim=dim, **overrides)

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        """A named size from PRESETS, e.g. preset("small", vocab_size=256, n_experts=8)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)} "
                             f"(or build ModelConfig.from_size(n_layers, dim))")
        return cls.from_size(**{**PRESETS[name], **overrides})


# Total parameters at the default vocab_size=4096, dense, untied (tests/test_models.py checks
# the ranges): tiny 1.12M, small 10.2M, 100m 91.2M, 1b 0.945B. Embeddings are a large share of
# the smaller ones: with the 256-symbol byte tokenizer, tiny has 0.38M.
PRESETS: dict[str, dict] = {
    "tiny": dict(n_layers=3, dim=96, n_heads=3),  # CI and CPU smoke runs; 32-dim heads
    "small": dict(n_layers=6, dim=320),  # 5 heads of 64
    "100m": dict(n_layers=12, dim=768),  # GPT-2 small's shape with LLaMA's blocks
    "1b": dict(n_layers=20, dim=2048, n_heads=16, n_kv_heads=8, max_seq_len=2048),  # 128-dim heads, GQA
    # Qwen3-MoE-shaped: 32 experts of width 512, top-4 (122M active of 651M), 128-dim heads,
    # GQA, q/k norms: the grouped expert GEMMs' benchmark shape
    "moe-120m": dict(n_layers=12, dim=1024, n_heads=8, head_dim=128, n_kv_heads=4,
                     n_experts=32, experts_per_token=4, moe_ffn_dim=512, qk_norm=True,
                     max_seq_len=2048),
}


