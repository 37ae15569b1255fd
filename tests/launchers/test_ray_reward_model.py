"""A ``model`` reward under the ray launcher: its replicas are actors of their own role, built once.

The reward itself is thin dispatch in the driver; each replica is a
:class:`~asyncflow_core.launchers.ray.actors.RewardModelActor` in the
``reward_model`` placement group, reached through a
:class:`~asyncflow_core.launchers.ray.remote.RemoteRewardModel`. A killed
replica fails the batch it held (those samples are dropped as failed, with
the reason) and is replaced; the run goes on. The kill is a real
``ray.kill`` of the replica a batch was just dispatched to, landing before
the batch reaches it (the moment is exact, the failure real), as in
test_ray_launcher.py.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the ray launcher needs Ray: pip install 'asyncflow[ray]'")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from asyncflow_core.config.loader import load_config, resolve  # noqa: E402
from asyncflow_core.errors import ConfigError  # noqa: E402
from asyncflow_core.launchers.ray import remote as R  # noqa: E402
from asyncflow_core.launchers.ray.launcher import RayLauncher  # noqa: E402
from asyncflow_core.types import RewardInput  # noqa: E402
from tests.launchers.ray_kill import kill_and_wait  # noqa: E402
from tests.test_rewards_model_roles import reward_model_checkpoint  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "toy_grpo.yaml"
B = 4  # prompts per step in the example
#: small reservations on the package's 4-CPU Ray; two reward workers that a model reward must not use; a slow
#: heartbeat, so that a killed replica is found by the batch sent to it (the case under test), not between batches
RAY_OPTIONS = ("launcher.options={rollout_cpus: 0.5, trainer_cpus: 0.5, reward_cpus: 0.25, reward_workers: 2, "
               "heartbeat_s: 600}")


@pytest.fixture(scope="module")
def rm(tmp_path_factory) -> Path:
    return reward_model_checkpoint(tmp_path_factory.mktemp("rayrm") / "rm")


def config(rm: Path, *overrides: str, replicas: int = 1, placement: str = "{cpus: 0.5}", device: str = "cpu"):
    return resolve(load_config(EXAMPLE, [
        "async.mode=sync", "launcher.name=ray", RAY_OPTIONS, "reward.name=model",
        f"reward.options={{form: classifier, path: {rm}, replicas: {replicas}, placement: {placement}, "
        f"device: '{device}'}}",
        *overrides]))


def run_ray(resolved, run_dir: Path, *, during=None) -> tuple[dict, RayLauncher]:
    launcher = RayLauncher(resolved.components["launcher"].options)

    async def main():
        side = asyncio.ensure_future(during(launcher)) if during else None
        try:
            return await launcher.run(resolved, run_dir=run_dir)
        finally:
            if side is not None:
                side.cancel()
                await asyncio.gather(side, return_exceptions=True)
            await launcher.shutdown()

    return asyncio.run(main()), launcher


def test_the_reward_model_is_one_actor_for_the_run_and_a_killed_one_fails_its_batch_and_comes_back(
        rm, tmp_path, monkeypatch):
    kills: list[str] = []
    seen: dict[str, object] = {}
    call = R.WatchedActor.call

    async def kill_then_call(self, method, *args, timeout=None):
        if method == "score_many" and self.role == "reward_model/0" and not kills:
            kills.append(self.role)
            actor = self.actor
            # the batch the reward dispatched to this replica is the one that meets the death
            await kill_and_wait(actor, "reward-model actor")
        return await call(self, method, *args, timeout=timeout)

    async def record(launcher):
        while launcher.runtime is None or launcher.runtime.ctx is None:
            await asyncio.sleep(0.05)  # start-up: the actors boot first
        ctx = launcher.runtime.ctx
        await ctx.wait_for(lambda: ctx.version >= 2)  # after the kill and the restart
        proxy = next(p for p in launcher.roles.proxies if isinstance(p, R.RemoteRewardModel))
        seen["replica"] = await proxy.describe()

    monkeypatch.setattr(R.WatchedActor, "call", kill_then_call)
    summary, launcher = run_ray(config(rm, "trainer.total_steps=3", "pipeline.max_failure_rate=1.0"), tmp_path,
                                during=record)
    assert kills == ["reward_model/0"]
    # built once: one reward-model actor (replaced once after its kill), no reward worker actors, nothing loaded
    # in the driver, which holds the thin reward and one proxy
    roles = [w.role for w in launcher.roles.watched]
    assert roles.count("reward_model/0") == 1 and not [r for r in roles if r.startswith("reward/")], roles
    assert [type(p).__name__ for p in launcher.roles.proxies].count("RemoteRewardModel") == 1
    assert seen["replica"]["pid"] != os.getpid() and seen["replica"]["device"] == "cpu"
    counters = summary["counters"]
    assert counters["reward_model_restarts"] == 1, counters
    # the killed batch's samples failed (recorded, their groups dropped), the run went on to the end
    ledger = summary["ledger"]
    assert ledger["dropped"] >= 1 and ledger["dropped_failed"] == ledger["dropped"], ledger
    assert summary["steps"] == 3 and ledger["trained"] == 3 * B and ledger["unfinished"] == 0
    assert counters["failed_reward"] >= 1
    reasons = {str(r) for r in launcher.runtime.ctx.outcomes.reasons.values()}
    assert any(r.startswith("reward: reward model replica 0 failed: RoleLost: reward_model/0 actor lost")
               for r in reasons), reasons


def test_reward_model_placement_is_checked_with_one_line_errors(rm, tmp_path):
    # a replica asked onto cuda without a GPU reserved under ray
    resolved = config(rm, "trainer.total_steps=1", placement="{cpus: 0.25}", device="cuda:1")
    with pytest.raises(ConfigError) as err:
        run_ray(resolved, tmp_path / "a")
    assert "reserves no GPU under the ray launcher" in str(err.value) and "\n" not in str(err.value)
    # more than the cluster has: refused with what each role reserves, the reward model's own pool included
    resolved = config(rm, "trainer.total_steps=1", "launcher.options.start_timeout_s=2", replicas=2,
                      placement="{cpus: 8}")
    needs = r"needs 17 CPUs and 0 GPUs \(.*reward_model 2 x 8 CPU\), the cluster has 4 CPUs"
    with pytest.raises(ConfigError, match=needs):
        run_ray(resolved, tmp_path / "b")


@pytest.mark.gpu
def test_a_reward_model_replica_with_a_gpu_runs_on_it(rm, tmp_path):
    seen: dict = {}

    async def record(launcher):
        while launcher.runtime is None or launcher.runtime.ctx is None:
            await asyncio.sleep(0.05)
        ctx = launcher.runtime.ctx
        await ctx.wait_for(lambda: ctx.version >= 1)
        proxy = next(p for p in launcher.roles.proxies if isinstance(p, R.RemoteRewardModel))
        seen.update(await proxy.describe())

    summary, _ = run_ray(config(rm, "trainer.total_steps=2", placement="{cpus: 0.5, gpus: 1}"), tmp_path,
                         during=record)
    assert summary["steps"] == 2
    assert seen["device"] == "cuda" and seen["cuda_visible_devices"] not in (None, ""), seen


def test_a_judge_is_frozen_rollout_actors_of_its_own_and_a_killed_one_is_replaced(rm, tmp_path):
    """The judge form on RayRoles directly: engine actors in the reward model's pool, out of the weight path."""
    from asyncflow_core.flow.roles import run_roles
    from asyncflow_core.launchers.ray.launcher import RayRoles

    chat = rm.parent / f"{rm.name}-chat"  # the chat checkpoint the reward model was made from: a small judge
    resolved = resolve(load_config(EXAMPLE, [
        "launcher.name=ray", RAY_OPTIONS, "reward.name=model",
        f"reward.options={{form: judge, replicas: 1, placement: {{cpus: 0.5}}, judge: {{model_path: {chat}, "
        "engine: torch, max_new_tokens: 4, template: 'Q: {prompt} A: {completion} Correct?'}}"]))
    roles = RayRoles(resolved.components["launcher"].options, resolved)
    roles.declare(run_roles(resolved.config, needs_ref=False))
    samples = [RewardInput(prompt=f"{a} + 1 =", completion=str(a + 1)) for a in range(3)]

    async def main():
        comp = resolved.components["reward"]
        reward = roles.build("reward", comp.registered.record.factory, comp.options, role="reward")
        try:
            first = await reward.score_many(samples, 120.0)
            [engine] = [r.engine for r in reward._pool]
            pid = engine.pid
            await kill_and_wait(engine.actor, "reward-model actor")
            killed = await reward.score_many(samples, 120.0)
            after = await reward.score_many(samples, 120.0)  # waits for the replacement, then is judged
            return first, killed, after, pid, engine.pid
        finally:
            await reward.shutdown()

    try:
        roles.place()
        first, killed, after, pid, new_pid = asyncio.run(main())
        judge_actors = [w.role for w in roles.watched]
        on_weight_path = len(roles.weights.replicas)
    finally:
        asyncio.run(roles.close())
    assert judge_actors == ["reward_model/0"] and on_weight_path == 0  # one actor, frozen: no weights pushed to it
    for ok, value in first + after:  # random weights: a verdict or a clear "no verdict", never a hang
        assert (ok and value in (0.0, 1.0)) or (not ok and "no verdict" in value), (ok, value)
    assert all(not ok and "judge replica 0 failed: RoleLost: reward_model/0 actor lost" in why for ok, why in killed)
    assert roles.counters["reward_model_restarts"] == 1 and pid != new_pid != os.getpid()


def test_a_combined_rewards_model_term_is_its_own_role_and_the_rule_runs_in_the_driver(rm):
    from asyncflow_core.flow.roles import run_roles
    from asyncflow_core.launchers.ray.launcher import RayRoles

    resolved = resolve(load_config(EXAMPLE, [
        "launcher.name=ray", RAY_OPTIONS, "reward.name=combined",
        "reward.options={terms: [{name: math_verify, label: correct, options: {fallback: none}}, "
        f"{{name: model, label: rm, weight: 0.1, options: {{form: classifier, path: {rm}, "
        "placement: {cpus: 0.5}}}]}"]))
    roles = RayRoles(resolved.components["launcher"].options, resolved)
    roles.declare(run_roles(resolved.config, needs_ref=False))
    samples = [RewardInput(prompt=f"What is {a} + 1?", completion=f"#### {a + 1}" if a % 2 else "no idea",
                           metadata={"answer": str(a + 1)}) for a in range(4)]

    async def main():
        comp = resolved.components["reward"]
        reward = roles.build("reward", comp.registered.record.factory, comp.options, role="reward")
        try:
            return await reward.score_many(samples, 120.0)
        finally:
            await reward.shutdown()

    try:
        roles.place()
        out = asyncio.run(main())
        actors = [w.role for w in roles.watched]
    finally:
        asyncio.run(roles.close())
    assert actors == ["reward_model.rm/0"]  # the model term's one replica; no reward worker for the rule
    for i, (ok, value) in enumerate(out):
        assert ok and value["correct"] == float(i % 2 == 1)
        assert abs(value["reward"] - (value["correct"] + 0.1 * value["rm"])) <= 1e-9 * (1 + abs(value["rm"]))
