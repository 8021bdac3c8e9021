"""The policy's MLflow "models from code" file: stored with each logged policy, run on loading.

MLflow keeps this file in the logged model instead of a cloudpickle of a `ChatPolicy`, and
`mlflow.pyfunc.load_model` (and `mlflow models serve`) execute it rather than unpickle anything: what
loading a registered policy runs is these lines, readable in the registry's artifacts
(`model/chat_policy_code.py`), which only name the installed project's `ChatPolicy`
(tasks/serving/chat_policy.py). tasks/registry/registered_models.py logs it; nothing imports it.
"""

from mlflow.models import set_model

from tasks.serving.chat_policy import ChatPolicy

set_model(ChatPolicy())
