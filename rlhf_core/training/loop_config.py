"""The settings of the shared training loop (rlhf_core/training/loop.py).

Its own module so that the loop and the update implementations it chooses between (training/update.py,
training/deepspeed_update.py) can all read it without importing each other.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from rlhf_core.training.schedules import ScheduleName


class LoopConfig(BaseModel):
    """Everything the loop itself needs, as a library API; batch shape lives in the `BatchPlan`.

    Not a second copy of the user's settings: its defaults are neutral (no warmup, no decay, no periodic
    checkpoints or validation) so a caller states what it wants, and it holds what no user sets (the
    schedule kind, Adam's betas and eps, progress bars). The pipeline's defaults and their meanings
    live only in rlhf_core/config/training.py; `stages.training_run.loop_config` maps a stage section
    onto this.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    epochs: float = Field(1.0, gt=0, description="Passes over the plan (fractions allowed).")
    max_steps: int | None = Field(None, gt=0, description="Caps the optimizer steps if set.")
    lr: float = Field(gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decay; never on biases and norm weights.")
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0)
    schedule: ScheduleName = "warmup_cosine"
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="Share of all steps spent warming up.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="End of the cosine, as a share of lr.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Global norm clipping; None is off.")
    checkpoint_every: int | None = Field(None, ge=1, description="None: only the final checkpoint.")
    keep_checkpoints: int | None = Field(2, ge=1, description="Newest checkpoints kept; None keeps all.")
    eval_every: int | None = Field(None, ge=1, description="Steps between periodic validations.")
    eval_batches: int | None = Field(None, ge=1, description="Batches per periodic validation.")
    seed: int = 0
    bf16: bool = Field(False, description="bf16 autocast on CUDA; ignored on CPU.")
    progress_bar: bool = True
