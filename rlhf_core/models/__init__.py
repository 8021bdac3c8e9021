"""Models: loading, the packaged SmolLM2, the tiny test model, chat formatting, scalar heads, LoRA, which
parameters train (`freezing`), saving."""
