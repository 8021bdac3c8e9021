"""PPO-max math (Zheng et al., 2023, section 5) as small pure functions of tensors."""
