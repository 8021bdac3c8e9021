"""The PPO run behind an evaluated policy, as a section of the evaluation report.

A judge's verdict on held-out prompts says whether the policy is better; the PPO stage's own figures say
how it got there: which validated policy was handed on and by what rule, its paired reward gain on the
held-out PPO validation prompts with the interval, its KL to the reference, whether the collapse guard
stopped the run, and how well the critic predicted returns once pretrained. When model A is a PPO stage
output (it holds `selection.json`), `ppo_evidence_markdown` renders them; its monitor plots (the paper's
Figure 4 and the validation gain) are linked from their `plots/` directory.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_core.layout import METRICS_FILE, PLOTS_DIR, SELECTION_FILE


def ppo_evidence_markdown(policy_dir: Path) -> str | None:
    """The report section for a PPO output directory, or None when `policy_dir` is not one."""
    policy_dir = Path(policy_dir)
    if not (policy_dir / SELECTION_FILE).is_file() or not (policy_dir / METRICS_FILE).is_file():
        return None
    selection = json.loads((policy_dir / SELECTION_FILE).read_text(encoding="utf-8"))
    metrics = json.loads((policy_dir / METRICS_FILE).read_text(encoding="utf-8"))
    gain = selection["gain_over_initial"]
    lines = [
        "## The PPO run behind model A",
        "",
        f"- handed on: the policy of iteration {selection['chosen_step']} of {int(metrics['steps_completed'])} "
        f"({selection['reason']})",
        f"- reward-model reward on {gain['prompts']} held-out PPO validation prompts, minus the SFT policy's "
        f"(paired): {gain['mean']:+.4g} (95% interval {gain['low']:+.4g} to {gain['high']:+.4g})",
        f"- per-token KL (k3) to the reference: {metrics['val/kl_best']:.4g}",
        f"- collapse guard: {_guard_line(metrics)}",
        f"- critic pretraining: {int(metrics['critic_pretrain_steps'])} iterations; value explained variance "
        f"{_optional(metrics, 'critic/explained_variance_initial')} at the first, "
        f"{_optional(metrics, 'critic/explained_variance_pretrained')} as the policy started to move",
    ]
    plots = sorted((policy_dir / PLOTS_DIR).glob("*.png"))
    if plots:
        lines.append("- monitor plots: " + ", ".join(f"[{path.stem}]({path})" for path in plots))
    return "\n".join(lines) + "\n"


GUARD_BOUND_NAMES = {
    "guard_kl_bound": "KL bound",
    "guard_length_band": "length band",
    "guard_perplexity_bound": "perplexity bound",
}


def _guard_line(metrics: dict[str, float]) -> str:
    if metrics.get("guard_enabled") == 0.0:
        return "was disabled (every ppo.guard bound null): nothing watched this run for collapse"
    off = [name for key, name in GUARD_BOUND_NAMES.items() if metrics.get(key) == 0.0]
    bounds = f" ({', '.join(off)} off)" if off else ""
    if metrics.get("guard_stopped"):
        return f"stopped the run at iteration {int(metrics['guard_stop_step'])}{bounds}"
    return f"did not fire{bounds}"


def _optional(metrics: dict[str, float], name: str) -> str:
    return f"{metrics[name]:.3g}" if name in metrics else "n/a"
