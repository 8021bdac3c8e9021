"""The reward model's MLflow "models from code" file: stored with each logged reward model, run on loading.

MLflow keeps this file in the logged model instead of a cloudpickle of a `RewardScorer`, and
`mlflow.pyfunc.load_model` (and `mlflow models serve`) execute it rather than unpickle anything: what
loading a registered reward model runs is these lines, readable in the registry's artifacts
(`model/reward_scorer_code.py`), which only name the installed project's `RewardScorer`
(tasks/serving/reward_scorer.py). tasks/registry/registered_models.py logs it; nothing imports it.
"""

from mlflow.models import set_model

from tasks.serving.reward_scorer import RewardScorer

set_model(RewardScorer())
