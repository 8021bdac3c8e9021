"""tasks/registry/registered_models.py against an embedded SQLite tracking store: the policy is registered as a
chat model
that stops at the end-of-turn token and answers /invocations with one OpenAI chat completion naming its
registered version, the reward model as a scorer, versions are reused for unchanged content, and the
`challenger` alias follows the newest policy. Both registered models are stored as a code file and
safetensors, and load without unpickling anything."""

import pickle
from pathlib import Path

import cloudpickle
import mlflow
import pytest
import torch
import yaml
from mlflow import MlflowClient
from mlflow.pyfunc.scoring_server import init as scoring_app
from starlette.testclient import TestClient

from fixtures.stage_outputs import stage_output
from rlhf_core.config import ModelConfig
from rlhf_core.models.base import load_base_model
from rlhf_core.models.chat import encode_conversation, end_of_turn_id
from rlhf_core.models.heads import RewardModel
from rlhf_core.models.saving import save_causal_lm
from rlhf_core.stage_outputs import StageOutput
from tasks.registry import registered_models as registry
from tasks.registry.registered_models import CHALLENGER_ALIAS, CONTENT_TAG, register
from tasks.tracking.metrics_logger import get_or_create_experiment, local_artifact_location

pytestmark = pytest.mark.slow

CHAT_REQUEST = {"messages": [{"role": "user", "content": "Hello, who are you?"}], "max_tokens": 8}
PICKLE_SUFFIXES = (".pkl", ".pickle", ".cloudpickle", ".bin", ".pt", ".pth", ".ckpt")  # pickles, torch.save's too


def eager_end_of_turn_policy():
    """The tiny model rewired so that its most likely next token is ALWAYS the end-of-turn token."""
    return dominated_policy(lambda tokenizer: end_of_turn_id(tokenizer))


def never_ending_policy():
    """The tiny model rewired so that its most likely next token is ALWAYS "Hello" (never end-of-turn)."""
    return dominated_policy(lambda tokenizer: tokenizer.convert_tokens_to_ids("Hello"))


def dominated_policy(dominant_id):
    """The tiny model rewired so that its next token is (almost surely) `dominant_id(tokenizer)`.

    Every block's output projections are zeroed, so the last hidden state is the current token's embedding;
    the final norm keeps only dimension 0, where every embedding is positive and the dominant row is
    10^5 times larger: the logit of that token dominates whatever the input.
    """
    model, tokenizer = load_base_model(ModelConfig(kind="tiny"))
    dominant = dominant_id(tokenizer)
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        embeddings[:, 0] = 0.01
        embeddings[dominant, 0] = 1000.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model, tokenizer


def finished_output(stage: str, out_dir: Path) -> StageOutput:
    """`out_dir` (with its model) as a finished stage's output: metrics.json written."""
    (out_dir / "metrics.json").write_text("{}")
    return stage_output(stage, out_dir)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[MlflowClient, str, str]:
    """(client, tracking URI, run id) of an embedded store; the run plays the pipeline's register stage."""
    root = tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment_id = get_or_create_experiment(client, "registry-tests", local_artifact_location(uri, root))
    return client, uri, client.create_run(experiment_id).info.run_id


@pytest.fixture(scope="module")
def policy_output(tmp_path_factory: pytest.TempPathFactory) -> StageOutput:
    out_dir = tmp_path_factory.mktemp("ppo")
    save_causal_lm(*eager_end_of_turn_policy(), out_dir / "model")
    return finished_output("ppo", out_dir)


def test_policy_is_a_chat_model_that_stops_at_end_of_turn(store, policy_output: StageOutput) -> None:
    client, uri, run_id = store
    registered = register(client, uri, run_id, "policy-a", policy_output, {"data.version": "v1"}, CHALLENGER_ALIAS)

    assert (registered.version, registered.alias, registered.reused) == ("1", CHALLENGER_ALIAS, False)
    version = client.get_model_version_by_alias("policy-a", CHALLENGER_ALIAS)
    assert str(version.version) == "1" and version.run_id == run_id
    assert version.tags == {CONTENT_TAG: policy_output.sha256, "data.version": "v1"}

    mlflow.set_tracking_uri(uri)
    chat = mlflow.pyfunc.load_model(registered.uri)
    assert chat.metadata.metadata["task"] == "llm/v1/chat"
    reply = chat.predict(CHAT_REQUEST)
    assert reply["object"] == "chat.completion"
    assert reply["model"] == "policy-a/1"
    choice = reply["choices"][0]
    # The first generated token is <|im_end|>: generation stops there and the reply is empty.
    assert choice["message"] == {"role": "assistant", "content": ""}
    assert choice["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] == 0
    assert reply["usage"]["total_tokens"] == reply["usage"]["prompt_tokens"] > 0


def test_invocations_answers_a_chat_request_with_one_completion_cut_at_max_tokens(store, tmp_path: Path) -> None:
    """The scoring server `mlflow models serve` runs, on the registered version: an OpenAI-style request
    gets one chat completion object naming the registered name and version, cut with finish_reason length."""
    client, uri, run_id = store
    for name, policy in (("first", never_ending_policy()), ("second", eager_end_of_turn_policy())):
        save_causal_lm(*policy, tmp_path / name / "model")
    register(client, uri, run_id, "policy-c", finished_output("ppo", tmp_path / "first"), {}, CHALLENGER_ALIAS)
    newest = register(client, uri, run_id, "policy-c", finished_output("ppo", tmp_path / "second"), {}, alias=None)
    assert newest.version == "2"  # the alias, not the newest version, decides what is served

    mlflow.set_tracking_uri(uri)
    server = TestClient(scoring_app(mlflow.pyfunc.load_model(f"models:/policy-c@{CHALLENGER_ALIAS}")))
    request = {"model": "anything", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 3}
    response = server.post("/invocations", json={**request, "temperature": 0})

    assert response.status_code == 200, response.text
    reply = response.json()
    assert isinstance(reply, dict) and reply["object"] == "chat.completion"
    assert reply["id"].startswith("chatcmpl-") and isinstance(reply["created"], int)
    assert reply["model"] == "policy-c/1"
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"].count("Hello") == 3
    assert reply["usage"]["completion_tokens"] == 3

    bad = server.post("/invocations", json={"messages": [], "max_tokens": 3})
    assert bad.status_code == 400 and "messages" in bad.text


def test_unchanged_content_reuses_the_version_and_new_content_moves_the_alias(
    store, policy_output: StageOutput, tmp_path: Path
) -> None:
    client, uri, run_id = store
    first = register(client, uri, run_id, "policy-b", policy_output, {}, CHALLENGER_ALIAS)
    again = register(client, uri, run_id, "policy-b", policy_output, {"data.version": "v2"}, CHALLENGER_ALIAS)
    assert (again.version, again.reused) == (first.version, True)
    assert "data.version" not in client.get_model_version("policy-b", first.version).tags  # lineage kept

    model, tokenizer = load_base_model(ModelConfig(kind="tiny"))
    save_causal_lm(model, tokenizer, tmp_path / "model")
    newer = register(client, uri, run_id, "policy-b", finished_output("ppo", tmp_path), {}, CHALLENGER_ALIAS)
    assert (newer.version, newer.reused) == (str(int(first.version) + 1), False)
    assert str(client.get_model_version_by_alias("policy-b", CHALLENGER_ALIAS).version) == newer.version


def test_a_policy_version_left_by_a_run_killed_before_naming_it_is_named_by_the_rerun(
    store, policy_output: StageOutput, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kill between creating the version and writing its registered_model.json (the kill-point sweep,
    scripts/kill_point_sweep.py): the rerun reuses that version, and it must answer as `name/version`."""
    client, uri, run_id = store

    def killed(*args: object) -> None:
        raise KeyboardInterrupt  # the process ends here

    monkeypatch.setattr(registry, "record_registered_identity", killed)
    with pytest.raises(KeyboardInterrupt):
        register(client, uri, run_id, "policy-k", policy_output, {}, CHALLENGER_ALIAS)
    monkeypatch.undo()

    again = register(client, uri, run_id, "policy-k", policy_output, {}, CHALLENGER_ALIAS)
    assert (again.version, again.reused) == ("1", True)
    mlflow.set_tracking_uri(uri)
    assert mlflow.pyfunc.load_model(again.uri).predict(CHAT_REQUEST)["model"] == "policy-k/1"


def test_reward_model_scores_like_the_reward_model_itself(
    store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Logged from code: the stored model holds its source file and no pickle, and it loads and serves
    (`mlflow models serve`'s scoring server) with MLflow's pickle deserialisation turned off."""
    client, uri, run_id = store
    lm, tokenizer = load_base_model(ModelConfig(kind="tiny"))
    reward_model = RewardModel.from_causal_lm(lm, end_of_turn_id(tokenizer), seed=3).eval()
    reward_model.save_pretrained(tmp_path / "model", tokenizer)
    registered = register(client, uri, run_id, "reward-a", finished_output("reward", tmp_path), {}, alias=None)
    assert registered.uri == "models:/reward-a/1"

    requests = [
        {"messages": [{"role": "user", "content": "Is the sky blue?"}], "reply": "Yes, on a clear day."},
        {"messages": [{"role": "user", "content": "Is the sky blue?"}], "reply": "No."},
    ]
    mlflow.set_tracking_uri(uri)
    stored = Path(mlflow.artifacts.download_artifacts(registered.uri, dst_path=str(tmp_path / "stored")))
    names = {path.relative_to(stored).as_posix() for path in stored.rglob("*") if path.is_file()}
    assert "reward_scorer_code.py" in names
    assert not [name for name in names if name.endswith(".pkl")]
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "false")
    loaded = mlflow.pyfunc.load_model(registered.uri)
    scores = loaded.predict(requests)
    served = TestClient(scoring_app(loaded)).post("/invocations", json={"inputs": requests})
    assert served.status_code == 200, served.text
    assert served.json()["predictions"] == pytest.approx(scores)

    expected = []
    with torch.no_grad():
        for request in requests:
            encoded = encode_conversation(tokenizer, request["messages"], request["reply"])
            ids = torch.tensor([encoded.input_ids])
            expected.append(float(reward_model(ids, torch.ones_like(ids), encoded.reply_start).scores[0]))
    assert scores == pytest.approx(expected, abs=1e-5)
    assert scores[0] != pytest.approx(scores[1])


def pickled_files(stored: Path) -> list[str]:
    """The files under `stored` that hold a pickle: by name, or by content (pickle protocol 2+ starts with
    0x80 and the protocol; torch.save's zip archives hold a data.pkl)."""
    found = []
    for path in sorted(stored.rglob("*")):
        if not path.is_file():
            continue
        content = path.read_bytes()
        by_content = (
            content[:1] == b"\x80" and content[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")
        ) or b"data.pkl" in content
        if path.name.endswith(PICKLE_SUFFIXES) or by_content:
            found.append(path.relative_to(stored).as_posix())
    return found


def refuse_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every way MLflow could unpickle a Python object (pickle's and cloudpickle's load) fail the test."""

    def unpickle(*args: object, **kwargs: object) -> None:
        raise AssertionError("a registered model was unpickled")

    for module in (pickle, cloudpickle):
        monkeypatch.setattr(module, "load", unpickle)
        monkeypatch.setattr(module, "loads", unpickle)
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "false")


@pytest.mark.parametrize(("stage", "code_file"), [("ppo", "chat_policy_code.py"), ("reward", "reward_scorer_code.py")])
def test_a_registered_model_is_code_and_safetensors_and_loads_without_unpickling(
    store, stage: str, code_file: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The policy and the reward model (and the judge, logged as the reward model is) as the registry stores
    them: `python_model` is the project's models-from-code file, the weights are safetensors, no file is a
    pickle, and the model loads and answers with unpickling made to fail."""
    client, uri, run_id = store
    lm, tokenizer = load_base_model(ModelConfig(kind="tiny"))
    if stage == "ppo":
        save_causal_lm(lm, tokenizer, tmp_path / "model")
    else:
        RewardModel.from_causal_lm(lm, end_of_turn_id(tokenizer), seed=5).save_pretrained(tmp_path / "model", tokenizer)
    registered = register(client, uri, run_id, f"unpickled-{stage}", finished_output(stage, tmp_path), {}, alias=None)

    mlflow.set_tracking_uri(uri)
    stored = Path(mlflow.artifacts.download_artifacts(registered.uri, dst_path=str(tmp_path / "stored")))
    flavour = yaml.safe_load((stored / "MLmodel").read_text())["flavors"]["python_function"]
    assert flavour["loader_module"] == "mlflow.pyfunc.loaders.code_model"
    assert Path(flavour["model_code_path"]).name == code_file and (stored / code_file).is_file()
    assert "python_model" not in flavour  # the key of a cloudpickled PythonModel (python_model.pkl)
    assert pickled_files(stored) == []
    assert list(stored.rglob("*.safetensors"))

    refuse_unpickling(monkeypatch)
    loaded = mlflow.pyfunc.load_model(registered.uri)
    if stage == "ppo":
        assert loaded.predict(CHAT_REQUEST)["object"] == "chat.completion"
    else:
        assert len(loaded.predict([{"messages": CHAT_REQUEST["messages"], "reply": "Hello."}])) == 1
