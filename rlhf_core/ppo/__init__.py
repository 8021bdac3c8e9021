"""PPO-max (Zheng et al., 2023, section 5): its math, the phases of an iteration and the trainer that runs them.

- The math, small pure functions of tensors: `rewards`, `advantages`, `kl`, `losses`, `masked`, `normalizers`,
  composed by `recipe` (Figure 5's switches) into an `experience.Experience`.
- An iteration's phases: `experience_maker` (sample through the rollout engine, then the no-grad scoring
  passes of `scoring`, sharing the frozen lower blocks through `shared_trunk` and `sequences`), `update` (the
  mini-batch epochs, `ptx`, and the refusal of a non-finite loss or gradient norm), `learner` and
  `deepspeed_learner` (clipping and the optimizer step behind one `Learner` interface).
- `critic`: the critic's initialisation (`ppo.critic_init`) and the critic-only iterations that open a run.
- Watching and choosing: `monitors`, `diagnostics`, `guard` (the collapse guard), `validation` and `selection`
  (which policy is handed on), `plots` (Figure 4).
- `trainer` composes them into a resumable run.

The replies themselves are sampled by the rollout engine, a package of its own (rlhf_core/rollout/).
docs/stages-ppo.md describes the stage; docs/architecture.md where this package sits.
"""
