"""Which stage of a pipeline run an error came from, carried on the error itself.

`rlhf run` reports a failed run in one line (rlhf_cli/main.py), and a line that says "data validation
failed" without the stage leaves the user to find it in the log. The error that leaves the flow is the
stage's own (Prefect re-raises it unchanged, and its type decides the exit status), so the stage rides
on it as an attribute rather than as a wrapping exception. The innermost mark wins: a stage beside the
main line marks its error with its own name before the main line raises it (flows/stage_branch.py), and
the flow marks whatever else with the stages running when it failed (flows/pipeline.py).
"""

from __future__ import annotations

FAILED_STAGE_ATTRIBUTE = "rlhf_failed_stage"


def mark_failed_stage(error: BaseException, stage: str) -> None:
    """Record that `error` failed `stage`, unless a stage was recorded on it already."""
    if failed_stage(error) is None:
        setattr(error, FAILED_STAGE_ATTRIBUTE, stage)


def failed_stage(error: BaseException) -> str | None:
    """The stage `error` failed, if one was recorded."""
    stage = getattr(error, FAILED_STAGE_ATTRIBUTE, None)
    return stage if isinstance(stage, str) else None
