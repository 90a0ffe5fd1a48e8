"""``TinyLMConfig``: the attention config (:class:`DSV4Config`) plus the few LM-level keys.

The LM keys ride in the same HF-style ``config.json`` (``DSV4Config.from_dict`` ignores them), so
``load_checkpoint`` reads the attention layers of a tiny-LM folder like any DSV4 checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4.config import ConfigError, DSV4Config, read_config_json
from dsv4.tinylm.task import TaskSpec
from dsv4.tinylm.tokenizer import CharTokenizer

ARCHITECTURE = "DeepseekV4TinyLM"

# Every layer type (SWA-only, C4A, C128A) with a window of 16: the operands of the task sit beyond
# the window, so the ratio-4 layers must find them through the indexer's top-8 picks.
_TINY_ARITH: dict[str, Any] = {
    "hidden_size": 256, "num_hidden_layers": 4, "num_nextn_predict_layers": 0,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 128, "qk_rope_head_dim": 64,
    "q_lora_rank": 128, "o_lora_rank": 128, "o_groups": 2, "sliding_window": 16,
    "compress_ratios": [0, 4, 128, 4], "index_n_heads": 4, "index_head_dim": 128,
    "index_topk": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 512,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
    "intermediate_size": 512,
}


@dataclass(frozen=True)
class TinyLMConfig:
    attn: DSV4Config
    intermediate_size: int
    tokenizer: CharTokenizer = field(default_factory=CharTokenizer)
    task: TaskSpec = field(default_factory=TaskSpec)
    """The problems the model was trained on (its held-out set is drawn from the same ranges)."""

    def __post_init__(self) -> None:
        if self.intermediate_size <= 0:
            raise ConfigError(f"intermediate_size={self.intermediate_size}: must be positive")
        if self.attn.vocab_size != len(self.tokenizer):
            raise ConfigError(f"vocab_size={self.attn.vocab_size} does not match the tokenizer's "
                              f"{len(self.tokenizer)} tokens")

    @property
    def hidden_size(self) -> int:
        return self.attn.hidden_size

    @property
    def num_layers(self) -> int:
        return self.attn.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self.attn.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.attn.max_position_embeddings

    @classmethod
    def preset(cls, name: str = "tiny-arith", **attn_overrides: Any) -> TinyLMConfig:
        if name != "tiny-arith":
            raise ConfigError(f"unknown tiny-LM preset {name!r}; valid: ['tiny-arith']")
        tok = CharTokenizer()
        d = {**_TINY_ARITH, "vocab_size": len(tok)}
        return cls.from_dict(d, **attn_overrides)

    @classmethod
    def from_dict(cls, d: dict[str, Any], **attn_overrides: Any) -> TinyLMConfig:
        if "intermediate_size" not in d:
            raise ConfigError("config is missing 'intermediate_size' (not a tiny-LM config?)")
        tok = CharTokenizer.from_dict(d.get("tokenizer"))
        task = d.get("task") or {}
        try:
            spec = TaskSpec(int(task.get("max_operand", 99)),
                            tuple(task.get("filler1", (4, 90))),  # type: ignore[arg-type]
                            tuple(task.get("filler2", (20, 90))))  # type: ignore[arg-type]
        except (TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"task={task!r}: expected max_operand, filler1, filler2") from e
        d = {"vocab_size": len(tok), **d}
        return cls(DSV4Config.from_dict(d, **attn_overrides), int(d["intermediate_size"]), tok,
                   spec)

    @classmethod
    def from_pretrained(cls, folder: str | Path, **attn_overrides: Any) -> TinyLMConfig:
        return cls.from_dict(read_config_json(folder), **attn_overrides)

    def to_dict(self) -> dict[str, Any]:
        d = self.attn.to_dict()
        d.pop("simulate_quant", None)  # runtime options, not model keys
        d.pop("multi_stream_token_threshold", None)
        d.update({"architectures": [ARCHITECTURE], "intermediate_size": self.intermediate_size,
                  "tokenizer": self.tokenizer.to_dict(),
                  "task": {"max_operand": self.task.max_operand,
                           "filler1": list(self.task.filler1),
                           "filler2": list(self.task.filler2)}})
        return d
