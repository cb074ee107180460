"""The model shapes the harness builds (random weights, no download): the published configs
of Llama-3.1-8B and Qwen3-8B, and a tiny Llama for CPU tests. Plain data; `harness` turns a
spec into a transformers model. Never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    """A model shape: the transformers architecture (`family`: `llama` or `qwen3`) and the
    keyword arguments of its config class."""

    name: str
    family: str
    config: dict[str, Any] = field(default_factory=dict)
    dtype_bytes: int = 2

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def kv_heads(self) -> int:
        return int(self.config["num_key_value_heads"])

    @property
    def head_dim(self) -> int:
        c = self.config
        return int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, in bytes."""
        return self.num_layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    def kv_bytes_per_block(self, block_tokens: int) -> int:
        """One block's K and V over all layers, in bytes (what one saved block weighs)."""
        return self.kv_bytes_per_token * block_tokens

    @property
    def approx_params(self) -> int:
        """Parameters, approximately (embeddings, attention, MLP; norms left out)."""
        c = self.config
        h, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
        q = c["num_attention_heads"] * self.head_dim
        kv = self.kv_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
        emb = vocab * h * (1 if c.get("tie_word_embeddings") else 2)
        return self.num_layers * per_layer + emb


LLAMA_31_8B = ModelSpec(
    "llama-3.1-8b",
    "llama",
    dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
)

QWEN3_8B = ModelSpec(
    "qwen3-8b",
    "qwen3",
    dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
)

#: A Llama of the same structure, small enough for CPU tests (2 layers, 2 KV heads of 16).
TINY = ModelSpec(
    "tiny",
    "llama",
    dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    ),
)

MODELS = {m.name: m for m in (LLAMA_31_8B, QWEN3_8B, TINY)}


def get(name: str) -> ModelSpec:
    """The spec called `name`. Raises `KeyError` naming the known ones."""
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None
