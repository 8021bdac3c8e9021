"""The rollout engine: what samples replies from a policy, fast, behind one small interface.

- `engine`: the interface PPO samples through (`RolloutEngine`, `SamplingParams`, `Generation`) and the `hf`
  engine, Hugging Face `generate` on the policy module; `generation`: batched `generate` sampling with
  left-padded prompts and the stop tokens (evaluation's replies sample through it too).
- `lean_engine`: the lean CPU engine, a plain sampling loop over its own copy of the weights; `llama_decoder`
  (its Llama forward with a preallocated KV cache), `decode_weights` (the weights' layouts), `blocked_linear`
  and `decode_step` (its C kernels, .c beside .py), `kernel_library` (how those are built and loaded),
  `sampling` (its two exact draws) and `huge_pages` (2 MiB pages under the weights it streams).

It imports nothing of PPO: rlhf_core/ppo/ uses it, and so does rlhf_core/evaluation/. docs/rollout-engine.md says why
it is built this way and
what it measures; docs/architecture.md where this package sits.
"""
