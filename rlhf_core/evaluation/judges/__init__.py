"""Judges of a pair of replies: the reward model and an LLM behind an OpenAI-compatible API."""
