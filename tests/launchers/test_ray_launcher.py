"""The ``ray`` launcher on the real toy engines: same accounting as ``local``, faults, loopback-only sockets.

One loopback-only Ray for the package (``conftest.py``: ``init_local_ray``,
127.0.0.1, no dashboard, 4 logical CPUs), shut down at the end. Every actor is a real Ray actor hosting the
real engine; a kill is a real ``ray.kill`` of that actor's process. Where a
test must choose *when* to kill (mid-generation, mid-scoring), it wraps the
driver-side proxy's call so the kill lands right after the request reached
the actor: the moment is exact, the failure is real.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the ray launcher needs Ray: pip install 'asyncflow[ray]'")

from asyncflow_core.config.loader import load_config, resolve  # noqa: E402
from asyncflow_core.flow.checkpoint import latest_checkpoint  # noqa: E402
from asyncflow_core.flow.runtime import run_flow  # noqa: E402
from asyncflow_core.flow.stage import RunStopped  # noqa: E402
from asyncflow_core.launchers.ray import remote as R  # noqa: E402
from asyncflow_core.launchers.ray.config import RayLauncherConfig  # noqa: E402
from asyncflow_core.launchers.ray.launcher import RayLauncher  # noqa: E402
from asyncflow_core.store.deployments.ray_store import ray_listening_addresses  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "toy_grpo.yaml"
B = 4  # prompts per step in the example
#: small reservations: the module's Ray has 4 logical CPUs on whatever the machine has
RAY_OPTIONS = "launcher.options={rollout_cpus: 0.5, trainer_cpus: 0.5, reward_cpus: 0.25, reward_workers: 2}"
COMMON = ["async.mode=sync", "rollout.replicas=2", "data.shuffle=true"]


def config(*overrides: str, launcher: str = "ray"):
    extra = ["launcher.name=ray", RAY_OPTIONS] if launcher == "ray" else []
    return resolve(load_config(EXAMPLE, [*COMMON, *extra, *overrides]))


def run_ray(resolved, run_dir: Path, *, during=None, resume: bool = False) -> tuple[dict, RayLauncher]:
    """Run under the ray launcher; ``during(launcher)`` runs beside it on the same loop."""
    launcher = RayLauncher(resolved.components["launcher"].options)

    async def main():
        side = asyncio.ensure_future(during(launcher)) if during else None
        try:
            return await launcher.run(resolved, run_dir=run_dir, resume=resume)
        finally:
            if side is not None:
                side.cancel()
                await asyncio.gather(side, return_exceptions=True)
            await launcher.shutdown()

    return asyncio.run(main()), launcher


def trained(run_dir: Path) -> list[int]:
    return latest_checkpoint(run_dir)[1].trained


@pytest.fixture(scope="module")
def local_six_steps(tmp_path_factory):
    """The unbroken local run every ray run below is compared with (k = 0: the trained prompts are fixed)."""
    run_dir = tmp_path_factory.mktemp("local")
    summary = run_flow(config("trainer.total_steps=6", "trainer.checkpoint_every=2", launcher="local"),
                       run_dir=run_dir, write_png=False)
    return summary, trained(run_dir)


def test_ray_run_matches_local_accounting_and_listens_on_loopback_only(tmp_path, local_six_steps):
    local, local_trained = local_six_steps
    before = {(ip, port) for ip, port, _ in ray_listening_addresses()}
    seen: list[tuple[str, int, int]] = []

    async def sample_sockets(launcher):
        # sample the sockets while the run is going (every actor and the store are up by the first step)
        ctx = await _runtime_ctx(launcher)
        await ctx.wait_for(lambda: ctx.version >= 1)
        seen.extend(ray_listening_addresses())

    summary, launcher = run_ray(config("trainer.total_steps=6", "trainer.checkpoint_every=2"), tmp_path,
                                during=sample_sockets)
    assert summary["steps"] == 6 and summary["stop_reason"] == "done"
    assert summary["ledger"] == local["ledger"]
    assert trained(tmp_path) == local_trained  # the same prompts, each once
    # the roles really ran elsewhere: every proxy's actor is another process
    pids = {p.pid for p in launcher.roles.proxies if hasattr(p, "pid")}
    assert len(pids) == 3 and os.getpid() not in pids  # two replicas and the trainer
    assert type(launcher.runtime.ctx.store).__name__ == "RayStore"
    seen.extend(ray_listening_addresses())
    assert seen, "no listening socket found: /proc is needed for this check"
    opened = [a for a in seen if (a[0], a[1]) not in before]
    assert [a for a in seen if not _loopback(a[0])] == [], opened


def test_killed_rollout_and_reward_actors_lose_and_duplicate_nothing(tmp_path, local_six_steps, monkeypatch):
    _, local_trained = local_six_steps
    kills: list[str] = []
    call = R.WatchedActor.call

    async def call_then_kill(self, method, *args, timeout=None):
        if method == "start" and self.role == "rollout/1" and not kills:
            kills.append("start:rollout/1")  # dies while starting: replaced and started again
            ray.kill(self.actor, no_restart=True)
        out = call(self, method, *args, timeout=timeout)
        if method == "submit" and self.role == "rollout/0" and len(kills) == 1 and _version[0] >= 2:
            result = await out  # the requests are in the actor now: kill it mid-generation
            kills.append(self.role)
            ray.kill(self.actor, no_restart=True)
            return result
        if method == "score_many" and self.role == "reward/0" and kills[1:] == ["rollout/0"]:
            kills.append(self.role)
            ray.kill(self.actor, no_restart=True)  # its batch is in flight: it must be scored again elsewhere
        return await out

    _version = [0]

    async def track(launcher):
        ctx = await _runtime_ctx(launcher)
        while not ctx.stop.is_set():  # wait_for returns at once once the run stops: no busy loop after that
            await ctx.wait_for(lambda: ctx.version > _version[0])
            _version[0] = ctx.version

    monkeypatch.setattr(R.WatchedActor, "call", call_then_kill)
    summary, _ = run_ray(config("trainer.total_steps=6", "trainer.checkpoint_every=2"), tmp_path, during=track)
    assert kills == ["start:rollout/1", "rollout/0", "reward/0"]
    counters = summary["counters"]
    # at least the kills above; on a loaded machine a heartbeat may also declare a slow replica lost, which
    # is handled the same way (replaced, its requests re-queued), so the counts are lower bounds
    assert counters["replicas_died"] >= 1 and counters["replicas_restarted"] == counters["replicas_died"]
    assert counters["rollout_actor_restarts"] >= 2 and counters["requeued_engine_death"] >= 1
    assert counters["reward_actor_restarts"] >= 1 and counters["reward_batches_retried"] >= 1
    ledger = summary["ledger"]
    assert ledger["admitted"] == ledger["trained"] == 6 * B and ledger["dropped"] == ledger["unfinished"] == 0
    assert trained(tmp_path) == local_trained  # none lost, none trained twice


def test_trainer_death_stops_at_the_checkpoint_and_resume_finishes(tmp_path, local_six_steps):
    _, local_trained = local_six_steps

    async def kill_trainer(launcher):
        ctx = await _runtime_ctx(launcher)
        await ctx.wait_for(lambda: ctx.version >= 3)
        trainer = next(p for p in launcher.roles.proxies if p.watched.role == "trainer")
        ray.kill(trainer.actor, no_restart=True)

    # one STRICT_PACK placement group for every role this time (the other runs use one group per pool)
    resolved = config("trainer.total_steps=6", "trainer.checkpoint_every=2", "launcher.options.placement=colocated")
    with pytest.raises(RunStopped) as err:
        run_ray(resolved, tmp_path, during=kill_trainer)
    message = str(err.value)
    assert "\n" not in message
    assert "trainer died" in message and f"asyncflow run --resume {tmp_path}" in message, message
    step = latest_checkpoint(tmp_path)[1].version
    assert step in (2, 4) and f"(step {step})" in message
    assert (tmp_path / "summary.json").exists()
    summary, _ = run_ray(resolved, tmp_path, resume=True)
    assert summary["steps"] == 6
    assert trained(tmp_path) == local_trained


def test_a_call_past_its_deadline_fails_with_the_reason_and_kills_the_actor():
    @ray.remote(num_cpus=0)
    class Slow:  # defined here, shipped by value: a stand-in for an engine stuck in a call
        async def health(self):
            return True

        async def stuck(self):
            await asyncio.sleep(3600)

    async def main():
        w = R.WatchedActor("rollout/9", lambda: Slow.remote(), heartbeat_s=30, heartbeat_timeout_s=30)
        assert await w.call("health", timeout=60) is True
        deadline = r"rollout/9 actor lost: stuck\(\) did not return within its deadline of 0.5s"
        with pytest.raises(R.RoleTimeout, match=deadline):
            await w.call("stuck", timeout=0.5)
        with pytest.raises(R.RoleTimeout):  # every later call fails at once with the same reason
            await w.call("health", timeout=60)
        # the actor was killed. ray.kill is asynchronous: a call sent before its process exits may
        # still be served, so wait (bounded) for the death rather than expect it on the next call
        deadline_at = time.monotonic() + 30
        while True:
            try:
                await w.actor.health.remote()
            except ray.exceptions.RayActorError:
                break
            assert time.monotonic() < deadline_at, "the stuck actor still answers 30 s after it was killed"
            await asyncio.sleep(0.1)

    asyncio.run(main())


def test_an_actor_that_stops_answering_heartbeats_is_declared_lost():
    @ray.remote(num_cpus=0)
    class Hung:
        def health(self):
            import time

            time.sleep(3600)  # a blocked actor: nothing it serves answers

        def work(self):
            import time

            time.sleep(3600)

    lost: list[R.RoleLost] = []

    async def main():
        w = R.WatchedActor("trainer", lambda: Hung.remote(), heartbeat_s=0.2, heartbeat_timeout_s=1.0,
                           on_lost=lost.append)
        with pytest.raises(R.RoleLost, match="no heartbeat answer within 1.0s"):
            await w.call("work")  # no deadline of its own: the heartbeat ends it

    asyncio.run(main())
    assert [e.role for e in lost] == ["trainer"]


def test_bad_launcher_options_are_one_line_config_errors():
    from asyncflow_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"launcher.options.placment: unknown field"):
        resolve(load_config(EXAMPLE, ["launcher.name=ray", "launcher.options.placment=colocated"]))
    with pytest.raises(ConfigError, match=r"launcher.options.reward_workers"):
        resolve(load_config(EXAMPLE, ["launcher.name=ray", "launcher.options.reward_workers=0"]))
    assert RayLauncherConfig().placement == "separate"


def test_placement_that_does_not_fit_is_refused_with_what_it_needs(tmp_path):
    resolved = resolve(load_config(EXAMPLE, ["launcher.name=ray",
                                             "launcher.options={rollout_cpus: 64, start_timeout_s: 2}"]))
    from asyncflow_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"needs 65.5 CPUs .* the cluster has 4 CPUs"):
        run_ray(resolved, tmp_path)
    assert not (tmp_path / "summary.json").exists()


async def _runtime_ctx(launcher):
    """The live run's context, once the launcher has built the runtime and the runtime its context."""
    while launcher.runtime is None or launcher.runtime.ctx is None:
        await asyncio.sleep(0.05)  # start-up: the actors boot first; nothing to be notified of yet
    return launcher.runtime.ctx


def _loopback(ip: str) -> bool:
    import ipaddress

    return ipaddress.ip_address(ip).is_loopback
