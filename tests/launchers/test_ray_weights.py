"""Weights under the ray launcher: trainer actor → rollout actors over the object store or torch.distributed.

The runs are the toy example under the real launcher (real actors, the real
dist weight transport on 127.0.0.1, gloo), compared with the same run under
``local``, which test_ray_launcher.py also compares the ``driver`` path with
(so the accounting of all three paths is the same). The weight path is
chosen per run with ``launcher.options.weights`` (set on the launcher's
options object, see :func:`launcher_options`).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
import torch

ray = pytest.importorskip("ray", reason="the ray launcher needs Ray: pip install 'asyncflow[ray]'")

from asyncflow_core.errors import WeightTransferError  # noqa: E402
from asyncflow_core.launchers.ray import remote as R  # noqa: E402
from asyncflow_core.launchers.ray.launcher import _RemoteRollout, _RemoteTrain  # noqa: E402
from asyncflow_core.launchers.ray.weights import HandleTransport, RayWeights, WeightHandle  # noqa: E402
from asyncflow_core.types import pack_buckets  # noqa: E402
from asyncflow_plugins.toy.policy import PARAM_NAME  # noqa: E402

from .ray_kill import kill_and_wait  # noqa: E402
from .test_ray_launcher import _runtime_ctx, config, trained  # noqa: E402

STEPS = 4
#: short deadlines: a transfer that cannot finish fails in seconds instead of the default 300 s
DEADLINE_S = 60
RUN = [f"trainer.total_steps={STEPS}", f"trainer.checkpoint_every={STEPS}"]


def launcher_options(resolved, weights: str):
    """The run's ray launcher options with ``weights`` set (the field is read with getattr by the launcher)."""
    return resolved.components["launcher"].options.model_copy(update={"weights": weights})


def run_with(weights: str, run_dir, *, during=None, deadline_s: float = 30) -> tuple[dict, object]:
    from asyncflow_core.launchers.ray.launcher import RayLauncher

    resolved = config(*RUN, f"weight_transport.deadline_s={deadline_s}")
    launcher = RayLauncher(launcher_options(resolved, weights))

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


def replica_versions(launcher) -> list[int]:
    return [p.version for p in launcher.roles.proxies if isinstance(p, R.RemoteRolloutEngine)]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The run under ``local``, which the ``driver`` path matches (test_ray_launcher.py): what the others must match."""
    from asyncflow_core.flow.runtime import run_flow

    run_dir = tmp_path_factory.mktemp("local")
    summary = run_flow(config(*RUN, launcher="local"), run_dir=run_dir, write_png=False)
    return summary, trained(run_dir)


@pytest.mark.parametrize("weights", ["object_store", "dist"])
def test_a_run_moves_weights_actor_to_actor_with_the_driver_paths_accounting(weights, tmp_path, baseline,
                                                                             monkeypatch):
    base, base_trained = baseline
    replies: list[tuple[str, object]] = []
    staged: list[object] = []
    call, send = R.WatchedActor.call, HandleTransport.send

    async def recording_call(self, method, *args, timeout=None):
        out = await call(self, method, *args, timeout=timeout)
        replies.append((method, out))
        return out

    async def recording_send(self, buckets, *, deadline_s):
        async def seen():
            async for b in buckets:
                staged.append(b)
                yield b

        return await send(self, seen(), deadline_s=deadline_s)

    monkeypatch.setattr(R.WatchedActor, "call", recording_call)
    monkeypatch.setattr(HandleTransport, "send", recording_send)
    summary, launcher = run_with(weights, tmp_path)

    assert summary["steps"] == STEPS and summary["stop_reason"] == "done"
    assert summary["ledger"] == base["ledger"]
    assert trained(tmp_path) == base_trained  # the same prompts, each trained once
    # every replica took every version the run generated with; the last one is published as the run ends, so
    # a replica may or may not have loaded it before the shutdown
    assert all(STEPS - 1 <= v <= STEPS for v in replica_versions(launcher)), replica_versions(launcher)
    # the driver never held a bucket: it staged handles (one per step; the toy model needs no initial push), no
    # tensor inside
    assert [h.version for h in staged] == list(range(1, STEPS + 1))
    assert all(isinstance(h, WeightHandle) and not any(isinstance(v, torch.Tensor) for v in vars(h).values())
               for h in staged)
    methods = Counter(m for m, _ in replies)
    assert methods["export_weights"] == 0 and not launcher.roles.bucket_cache
    if weights == "object_store":
        assert methods["put_weights"] == STEPS and all(h.ref is not None for h in staged)
        assert methods["update_weights_refs"] == summary["counters"]["weight_updates"]
    else:
        assert methods["send_weights"] == STEPS and all(h.ref is None for h in staged)
        assert methods["load_weights_dist"] == summary["counters"]["weight_updates"]
        assert methods["update_weights_refs"] == 0
        assert methods["open_weight_group"] == 3  # the trainer and two replicas, once: the members never changed
        assert "weight_catch_ups_object_store" not in summary["counters"]


# dist only: under object_store a restarted replica loads the newest staged handles, as every update does
def test_a_replica_killed_during_a_broadcast_costs_no_deadline_and_catches_up_after_its_restart(tmp_path,
                                                                                                 monkeypatch):
    killed: list[int] = []
    sends: list[tuple[float, bool]] = []  #: (seconds, succeeded) of each send_weights call
    run_counters: list[Counter] = []
    launchers: list = []
    call, train_step = R.WatchedActor.call, R.RemoteTrainEngine.train_step

    async def kill_during_the_second_send(self, method, *args, timeout=None):
        if method != "send_weights":
            return await call(self, method, *args, timeout=timeout)
        if len(sends) == 1 and not killed:
            # the group was formed with rollout/1: it is dead (for sure) when the trainer announces version 2 to it,
            # so that rank never answers and the trainer's rank would wait for it until the deadline
            proxy = next(p for p in launchers[0].roles.proxies if isinstance(p, R.RemoteRolloutEngine)
                         and p.watched.role == "rollout/1")
            killed.append(proxy.pid)
            actor = proxy.actor
            await kill_and_wait(actor, "rollout actor")  # the send below meets the death
        t0 = time.monotonic()
        try:
            out = await call(self, method, *args, timeout=timeout)
        except WeightTransferError:
            sends.append((time.monotonic() - t0, False))
            raise
        sends.append((time.monotonic() - t0, True))
        return out

    async def after_the_restart(self, batch, algorithm):
        # the other replica alone could finish the run before the new actor has booted: hold the trainer until the
        # replacement is back, so that the versions after it have to reach it
        while killed and not run_counters[0]["replicas_restarted"]:
            await asyncio.sleep(0.05)
        return await train_step(self, batch, algorithm)

    async def during(launcher):
        launchers.append(launcher)
        run_counters.append((await _runtime_ctx(launcher)).counters)

    monkeypatch.setattr(R.WatchedActor, "call", kill_during_the_second_send)
    monkeypatch.setattr(R.RemoteTrainEngine, "train_step", after_the_restart)
    summary, launcher = run_with("dist", tmp_path, during=during, deadline_s=DEADLINE_S)
    assert killed, "the run ended before the kill"
    counters = summary["counters"]
    # the broadcast with a dead rank ended within seconds, not at its deadline, and was sent again. Which side saw
    # the death first is a race: the driver's liveness poll (it abandons the send) or the transport itself (gloo
    # fails the source rank's send with "connection reset"); either way exactly one send ended early
    assert [ok for _, ok in sends[:3]] == [True, False, True], sends
    assert sends[1][0] < DEADLINE_S / 3, sends
    assert counters.get("weight_sends_abandoned", 0) + counters.get("weight_sends_failed", 0) == 1, counters
    assert counters["weight_group_retries"] == 1, counters
    assert summary["steps"] == STEPS and counters["rollout_actor_restarts"] >= 1 and counters["replicas_restarted"] >= 1
    ledger = summary["ledger"]
    assert ledger["admitted"] == ledger["trained"] == STEPS * 4 and ledger["dropped"] == ledger["unfinished"] == 0
    restarted = next(p for p in launcher.roles.proxies if isinstance(p, R.RemoteRolloutEngine)
                     and p.watched.role == "rollout/1")
    assert restarted.pid != killed[0]
    assert all(STEPS - 1 <= v <= STEPS for v in replica_versions(launcher))  # the new actor too
    # the group was formed again (without the dead actor, then with its replacement), and the replacement got the
    # version it missed over the object store
    assert counters["weight_group_reformed"] >= 2
    assert counters["weight_catch_ups_object_store"] >= 1


def test_a_corrupted_bucket_is_refused_and_the_old_version_kept():
    """Object-store path into a real toy replica actor: a buffer that does not match its checksum never loads."""
    resolved = config()
    comp = resolved.components["rollout"]
    vocab = comp.options.vocab_size

    async def main():
        watched = R.WatchedActor("rollout/7", lambda: _RemoteRollout.options(num_cpus=0).remote(
            comp.registered.record.factory, comp.options), heartbeat_s=30, heartbeat_timeout_s=60)
        weights = RayWeights("object_store", deadline_s=30)
        proxy = R.RemoteRolloutEngine(watched, deadline_s=30, max_restarts=0, bucket_cache={}, counters=Counter(),
                                      weights=weights)
        try:
            await proxy.start()

            def handles(version: int, corrupt: bool = False, wrong_checksum: bool = False) -> list[WeightHandle]:
                table = torch.full((vocab, vocab), float(version))
                [bucket] = pack_buckets([(PARAM_NAME, table)], version=version, bucket_bytes=1 << 20)
                if corrupt:
                    bucket.buffer[0] ^= 0xFF  # after its checksum was computed: the bytes that "arrived" differ
                h = WeightHandle.of(bucket, ray.put(bucket))
                if wrong_checksum:  # a handle pointing at another object than the one it announces
                    h = WeightHandle(h.version, h.index, h.metas, "0" * 32, h.last, h.nbytes, h.ref)
                return [h]

            async def stream(items):
                for item in items:
                    yield item

            await proxy.update_weights(1, stream(handles(1)))
            assert proxy.version == 1
            with pytest.raises(WeightTransferError, match="bucket 0 of version 2 is corrupted"):
                await proxy.update_weights(2, stream(handles(2, corrupt=True)))
            with pytest.raises(WeightTransferError, match="is not the one announced"):
                await proxy.update_weights(2, stream(handles(2, wrong_checksum=True)))
            assert (await watched.call("describe", timeout=30))["version"] == 1  # the old version stays loaded
            await proxy.update_weights(2, stream(handles(2)))
            assert proxy.version == 2
        finally:
            await proxy.shutdown()

    asyncio.run(main())


def test_a_dist_send_a_replica_never_joins_fails_at_its_deadline_with_the_reason(monkeypatch):
    resolved = config()
    trainer_comp, rollout_comp = resolved.components["trainer"], resolved.components["rollout"]
    call = R.WatchedActor.call

    async def order_lost(self, method, *args, timeout=None):
        if method == "open_weight_group" and self.role == "rollout/0":
            return None  # this replica is never told to join: the trainer's rank waits for it in vain
        return await call(self, method, *args, timeout=timeout)

    monkeypatch.setattr(R.WatchedActor, "call", order_lost)

    def watched(role, cls, comp):
        return R.WatchedActor(role, lambda: cls.options(num_cpus=0).remote(comp.registered.record.factory,
                                                                           comp.options),
                              heartbeat_s=30, heartbeat_timeout_s=60)

    async def main():
        weights = RayWeights("dist", deadline_s=3.0)
        trainer = R.RemoteTrainEngine(watched("trainer", _RemoteTrain, trainer_comp), deadline_s=3.0, weights=weights)
        replica = R.RemoteRolloutEngine(watched("rollout/0", _RemoteRollout, rollout_comp), deadline_s=3.0,
                                        max_restarts=0, bucket_cache={}, counters=Counter(), weights=weights)
        weights.add_replica(replica)
        try:
            await asyncio.gather(trainer.setup(), replica.start())
            t0 = time.monotonic()
            with pytest.raises(WeightTransferError, match=r"weight group .*(within|timed out|Timeout)"):
                [h async for h in trainer.export_weights(bucket_bytes=1 << 20)]
            assert time.monotonic() - t0 < 20  # the 3 s deadline (a retry has no time left), not a hang
        finally:
            await asyncio.gather(trainer.shutdown(), replica.shutdown())

    asyncio.run(main())


def test_handles_that_do_not_form_one_whole_version_are_refused():
    transport = HandleTransport("object_store")
    meta = ()

    async def send(*items):
        async def it():
            for x in items:
                yield x

        return await transport.send(it(), deadline_s=5)

    async def main():
        h = [WeightHandle(3, i, meta, "c", i == 1, 8) for i in range(2)]
        with pytest.raises(WeightTransferError, match="indices must be 0..1"):
            await send(h[1], h[0])
        with pytest.raises(WeightTransferError, match="stages weight handles, but the trainer sent WeightBucket"):
            [b] = pack_buckets([("w", torch.zeros(2))], version=3, bucket_bytes=64)
            await send(b)
        report = await send(*h)
        assert (report.version, report.buckets, report.bytes) == (3, 2, 16)
        with pytest.raises(WeightTransferError, match="not newer than the staged version 3"):
            await send(*h)
        got = [x async for x in transport.receive(min_version=3, deadline_s=1)]
        assert got == h
        with pytest.raises(WeightTransferError, match=r"no weight version >= 4 was staged within 0.2s"):
            [x async for x in transport.receive(min_version=4, deadline_s=0.2)]
        await transport.close()

    asyncio.run(main())


def test_other_weight_transports_need_the_driver_path():
    from asyncflow_core.errors import ConfigError
    from asyncflow_core.launchers.ray.launcher import RayRoles

    resolved = config("weight_transport.name=shm")
    with pytest.raises(ConfigError, match="weight_transport.name='shm' is used only with launcher.options.weights"):
        RayRoles(launcher_options(resolved, "object_store"), resolved)
    RayRoles(launcher_options(resolved, "driver"), resolved)  # the configured transport runs in the driver


def test_dist_on_a_cluster_of_several_nodes_is_refused_with_the_fix(monkeypatch):
    from asyncflow_core.launchers.ray import weights as W

    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}, {"Alive": True}, {"Alive": False}])
    with pytest.raises(WeightTransferError, match="this Ray cluster has 2 nodes: set launcher.options.weights="
                                                  "object_store"):
        W._check_single_node()
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}, {"Alive": False}])
    W._check_single_node()  # one live node: the group on 127.0.0.1 reaches every actor
