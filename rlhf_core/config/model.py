"""`model:` the base chat model every stage starts from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf_core.config.base import Section


class TinyModelConfig(Section):
    """A randomly initialised Llama model for tests; it keeps the real SmolLM2 tokenizer."""

    num_layers: int = Field(2, ge=1, description="Transformer blocks.")
    hidden_size: int = Field(64, ge=8, description="Width of the residual stream.")
    num_heads: int = Field(4, ge=1, description="Attention heads.")
    num_kv_heads: int = Field(2, ge=1, description="Key/value heads (grouped-query attention).")
    intermediate_size: int = Field(128, ge=8, description="Width of the MLP.")
    seed: int = Field(0, description="Seed of the random initialisation.")


class ModelConfig(Section):
    """The base chat model every stage starts from."""

    kind: Literal["smollm2", "gemma3", "tiny", "pretrained"] = Field(
        "smollm2",
        description="smollm2: the packaged SmolLM2-135M-Instruct GGUF; gemma3: the packaged Gemma 3 270M GGUF "
        "(optional extra `gemma`); tiny: random (tests); pretrained: `path` is a local directory or a Hub id.",
    )
    path: str | None = Field(None, description="Directory or Hub id, with kind=pretrained.")
    cache_dir: str | None = Field(None, description="Conversion cache (default ~/.cache/rlhf-pipeline).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights dtype; a CPU trains in float32."
    )
    tiny: TinyModelConfig = Field(TinyModelConfig(), description="Shape of the random model, with kind=tiny.")

    @model_validator(mode="after")
    def _path_matches_kind(self) -> ModelConfig:
        if self.kind == "pretrained" and not self.path:
            raise ValueError("kind 'pretrained' needs model.path (a local directory or a Hub id)")
        return self


# --------------------------------------------------------------------------------------------------
