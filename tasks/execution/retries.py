"""Which stage failures are worth a retry.

A training stage writes checkpoints as it goes, and rerunning it with the same output directory
resumes from the newest complete one, so a crash (a worker lost, out of memory, a flaky file system)
costs a retry only the steps since that checkpoint. Some failures would fail the same way again,
and retrying them only delays the report:
- a bad configuration, unusable data, a data source that cannot be read, and any other ValueError
  (the stages raise it for inputs they cannot use);
- checkpoints made with other settings (ResumeMismatchError): resuming is refused every time;
- an output directory another live process is writing (OutputLockedError): the second writer must stop
  at once, not wait for the first to finish and then write over its output;
- an output whose file system is full, read-only or not ours to write (OutputWriteError,
  rlhf_core/write_failures.py): nothing frees it in the seconds before a retry, which would only fill
  it again; the run stops with the one line naming the path, and a rerun once there is room resumes;
- a loss that became NaN or infinite, and a PPO run stopped by its collapse guard: deterministic,
  given the seed and the checkpoint a retry would resume from.
A service that stopped answering for longer than its client waits (tasks/services/service_outages.py) is not retried
either: a retry would wait the same minutes again; the run stops in one line and a rerun resumes.
A launch stopped because the stage training beside it failed (LaunchStoppedError) is not retried either:
the run is failing with the other stage's error.
A stage launched over several processes fails with RankFailedError, which names the error type of the
rank that failed first; the same rule applies to that type.
"""

from __future__ import annotations

from typing import Any

from prefect import Task
from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from rlhf_core.config import ConfigError
from rlhf_core.data.readers import DataSourceError
from rlhf_core.data.validation import DataValidationError
from rlhf_core.distributed.launcher import LaunchStoppedError, RankFailedError
from rlhf_core.output_lock import OutputLockedError
from rlhf_core.ppo.guard import CollapseError
from rlhf_core.stages.training_run import ResumeMismatchError
from rlhf_core.training.loop import NonFiniteLossError
from rlhf_core.write_failures import OutputWriteError
from tasks.services.service_outages import lost_service_line

NOT_RETRIED: tuple[type[BaseException], ...] = (
    ConfigError,
    ValueError,
    DataValidationError,
    DataSourceError,
    ResumeMismatchError,
    OutputLockedError,
    OutputWriteError,
    NonFiniteLossError,
    CollapseError,
    LaunchStoppedError,
)

STAGE_RETRIES = 2
RETRY_DELAY_SECONDS = 10


def is_retryable(task: Task[Any, Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Prefect's `retry_condition_fn`: retry unless the failure is one of NOT_RETRIED."""
    try:
        state.result()
    except NOT_RETRIED:
        return False
    except RankFailedError as error:  # a launched stage: judge the failing rank's own error
        return error.error_type not in {kind.__name__ for kind in NOT_RETRIED}
    except Exception as error:  # noqa: BLE001 - anything else may be transient: retry and resume
        return lost_service_line(error) is None
    return True
