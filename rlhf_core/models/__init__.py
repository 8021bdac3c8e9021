"""Models: loading, the packaged SmolLM2, the tiny test model, chat formatting, scalar heads, saving."""
