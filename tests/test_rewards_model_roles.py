"""A ``model`` reward's replicas are a role of the run (asyncflow_plugins/rewards_model.py, flow/roles.py).

The run declares them (``reward_model``, or ``reward_model.<label>`` for a
``combined`` term) with their count, frozen weights and placement; the
``local`` launcher's :class:`Roles` builds them in this process on their
``placement.devices`` and hands them to the reward; a replica that fails
fails the samples it held, and one that can be restarted comes back. The
ray side is tests/launchers/test_ray_reward_model.py.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from asyncflow_core.config.loader import load_config, resolve  # noqa: E402
from asyncflow_core.errors import ConfigError  # noqa: E402
from asyncflow_core.flow.roles import Roles, WeightPolicy, run_roles  # noqa: E402
from asyncflow_core.flow.runtime import run_flow  # noqa: E402
from asyncflow_core.interfaces.features import RolloutFeatures  # noqa: E402
from asyncflow_core.plugins import get_plugin_manager  # noqa: E402
from asyncflow_core.types import RewardInput  # noqa: E402
from asyncflow_plugins.hf.testing import TINY_CHAT_QWEN2, build_local_chat_checkpoint  # noqa: E402
from asyncflow_plugins.rewards_model import ClassifierReplica, ClassifierReward, ModelRewardConfig  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "toy_grpo.yaml"


def reward_model_checkpoint(out: Path, labels: int = 1) -> Path:
    """A small random Qwen2 sequence-classification reward model with a BPE tokenizer, saved in ``out``."""
    import torch

    chat = build_local_chat_checkpoint(out.parent / f"{out.name}-chat")
    tok = transformers.AutoTokenizer.from_pretrained(chat, local_files_only=True)
    config = transformers.Qwen2Config(vocab_size=len(tok), num_labels=labels, pad_token_id=tok.pad_token_id,
                                      **TINY_CHAT_QWEN2)
    torch.manual_seed(0)
    transformers.Qwen2ForSequenceClassification(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def rm(tmp_path_factory) -> Path:
    return reward_model_checkpoint(tmp_path_factory.mktemp("rmroles") / "rm")


def _samples(n: int = 4) -> list[RewardInput]:
    return [RewardInput(prompt=f"What is {a} + 1?", completion=f"#### {a + 1}") for a in range(n)]


def _roles(*overrides: str):
    resolved = resolve(load_config(EXAMPLE, list(overrides)))
    return resolved, run_roles(resolved.config, needs_ref=False)


def test_a_model_reward_declares_its_replicas_as_a_frozen_role_with_placement(rm):
    _, specs = _roles("reward.name=model", f"reward.options={{form: classifier, path: {rm}, replicas: 2, "
                      "placement: {devices: [cpu, cpu], cpus: 0.5, gpus: 1}}")
    [spec] = [s for s in specs if s.serves]
    assert (spec.name, spec.serves, spec.interface, spec.count) == ("reward_model", "reward", "reward_model", 2)
    assert spec.weights is WeightPolicy.FROZEN and spec.resources == "reward_model" and not spec.fatal
    assert (spec.placement.cpus, spec.placement.gpus, spec.placement.devices) == (0.5, 1, ("cpu", "cpu"))
    # a combined reward's model term is a role named by its label; a rule reward has none
    _, specs = _roles("reward.name=combined", "reward.options={terms: [{name: math_verify, label: correct}, "
                      f"{{name: model, label: rm, options: {{form: classifier, path: {rm}}}}}]}}")
    assert [s.name for s in specs if s.serves] == ["reward_model.rm"]
    _, specs = _roles()
    assert not [s for s in specs if s.serves]
    judge = ModelRewardConfig(form="judge", judge={"model_path": str(rm), "engine": "torch"}, replicas=3)
    [spec] = judge.served_roles()
    # a judge replica is a rollout engine whose weights never follow the policy
    assert (spec.interface, spec.count, spec.weights) == ("rollout", 3, WeightPolicy.FROZEN)
    assert type(spec.options).__name__ == "TorchRolloutConfig" and spec.options.model.path == str(rm)


def test_the_local_roles_build_the_replicas_on_their_devices_and_hand_them_to_the_reward(rm):
    resolved, specs = _roles("reward.name=model", f"reward.options={{form: classifier, path: {rm}, replicas: 2, "
                             "batch_size: 2, placement: {devices: [cpu, cpu]}}")
    roles = Roles()
    roles.declare(specs)
    comp = resolved.components["reward"]
    reward = roles.build("reward", comp.registered.record.factory, comp.options, role="reward")
    assert isinstance(reward, ClassifierReward) and reward.role == "reward_model"

    async def main():
        try:
            return await reward.score_many(_samples(), 60.0), reward.replicas
        finally:
            await reward.shutdown()

    answers, replicas = asyncio.run(main())
    assert all(ok for ok, _ in answers) and len(answers) == 4
    assert [type(r) for r in replicas] == [ClassifierReplica] * 2
    assert [r.device for r in replicas] == ["cpu", "cpu"] and {r.pid for r in replicas} == {os.getpid()}


def test_reward_model_options_that_do_not_fit_are_one_line_errors(rm):
    cases = [
        ("placement: {devices: [cpu]}, replicas: 2", "names 1 devices for 2 replicas"),
        ("placement: {devices: [gpu0]}", "is not a device"),
        ("placement: {gpus: -1}", "placement.gpus"),
    ]
    for extra, match in cases:
        with pytest.raises(ConfigError) as err:
            resolve(load_config(EXAMPLE, ["reward.name=model",
                                          f"reward.options={{form: classifier, path: {rm}, {extra}}}"]))
        assert match in str(err.value) and "\n" not in str(err.value).strip(), str(err.value)
    with pytest.raises(ValueError, match="disagree; give the replica count once"):
        ModelRewardConfig(form="judge", replicas=2, judge={"model_path": str(rm), "replicas": 3})
    assert ModelRewardConfig(form="judge", judge={"model_path": str(rm), "replicas": 3}).replicas == 3


class _Replica:
    """A replica in another process as the reward sees it; ``fail`` makes its next call raise like a dead actor."""

    out_of_process = True

    def __init__(self, restarts: int) -> None:
        self.features = RolloutFeatures(supports_restart=restarts > 0)
        self.restarts_left = restarts
        self.fail = False
        self.started = 0
        self.scored: list[int] = []

    async def start(self):
        self.started += 1

    async def restart(self):
        if self.restarts_left == 0:
            raise RuntimeError("no restarts left")
        self.restarts_left -= 1
        self.fail = False
        await self.start()

    async def score_many(self, samples, timeout_s):
        if self.fail:
            raise ConnectionError("its process died")
        self.scored.append(len(samples))
        return [(True, float(len(s.completion))) for s in samples]

    async def shutdown(self):
        pass


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_failing_replica_fails_its_batch_and_comes_back_when_it_can(rm, restarts):
    reward = ClassifierReward(ModelRewardConfig(form="classifier", path=str(rm)))
    replica = _Replica(restarts)
    reward.serve("reward_model", [replica])

    async def main():
        ok = await reward.score_many(_samples(2), 5.0)
        replica.fail = True
        failed = await reward.score_many(_samples(3), 5.0)
        later = await asyncio.wait_for(reward.score_many(_samples(1), 5.0), 30)
        return ok, failed, later

    ok, failed, later = asyncio.run(main())
    assert [v for _, v in ok] == [6.0, 6.0]
    assert all(not good and "reward model replica 0 failed: ConnectionError: its process died" in why
               for good, why in failed) and len(failed) == 3
    if restarts:  # restarted in the background: the next batch waits for it and is scored
        assert later == [(True, 6.0)] and replica.started == 2 and replica.scored == [2, 1]
    else:  # dead for good: later samples fail at once, with the reason
        ok, why = later[0]
        assert not ok and "every reward model replica died" in why and "its process died" in why


def test_a_local_run_scores_with_the_reward_model_role(rm, tmp_path):
    resolved = resolve(load_config(EXAMPLE, ["trainer.total_steps=2", "async.mode=sync", "reward.name=model",
                                             f"reward.options={{form: classifier, path: {rm}, replicas: 2}}"]))
    summary = run_flow(resolved, run_dir=tmp_path, write_png=False)
    ledger = summary["ledger"]
    assert summary["steps"] == 2 and ledger["trained"] == 2 * 4 and ledger["dropped"] == 0


@pytest.mark.gpu
def test_a_local_replica_runs_on_the_device_its_placement_names(rm):
    import torch

    last = f"cuda:{torch.cuda.device_count() - 1}"
    reward = ClassifierReward(ModelRewardConfig(form="classifier", path=str(rm), replicas=1,
                                                placement={"devices": [last]}))

    async def main():
        try:
            answers = await reward.score_many(_samples(), 60.0)
            return answers, [next(r._model.parameters()).device for r in reward.replicas]
        finally:
            await reward.shutdown()

    answers, devices = asyncio.run(main())
    assert all(ok for ok, _ in answers) and devices == [torch.device(last)]


def test_the_model_reward_is_still_registered():
    assert "model" in get_plugin_manager().registrations("reward")


def test_a_replica_known_to_be_lost_gets_no_batch(rm):
    """A replica whose launcher already declared it lost (a failed heartbeat) is failed before dispatch: the batch
    goes to the live one and loses nothing."""
    reward = ClassifierReward(ModelRewardConfig(form="classifier", path=str(rm)))
    gone, live = _Replica(0), _Replica(0)
    reward.serve("reward_model", [gone, live])

    async def main():
        await reward._start()
        gone.lost = ConnectionError("reward_model/0 actor lost: no heartbeat answer within 60s")
        return await reward.score_many(_samples(2), 5.0)

    assert asyncio.run(main()) == [(True, 6.0), (True, 6.0)]
    assert gone.scored == [] and live.scored == [2]
