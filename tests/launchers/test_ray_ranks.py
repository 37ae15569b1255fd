"""A train engine's ranks as Ray actors (``launcher.options.trainer_ranks: actors``).

The Ray rank group is driven directly with a trivial rank loop defined here
(gather, payloads, a remote exception, a rank that dies mid-call, a
deadline, placement in bundles), then the real ``fsdp`` engine at world
size 2 is built through the ray launcher's own path (placement groups, the
trainer actor installing the rank spawner) and one train step is compared
with the same step on rank processes; so is the ``megatron`` engine at
tensor parallel 2 (spawner installed directly). The package's Ray (``conftest.py``)
is loopback-only with 4 logical CPUs.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray", reason="the ray launcher needs Ray: pip install 'asyncflow[ray]'")

from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402

from asyncflow_core.errors import ConfigError  # noqa: E402
from asyncflow_core.flow.runtime import FlowRuntime  # noqa: E402
from asyncflow_core.launchers.ranks import RankError, RankSpawner, rank_spawner, use_rank_spawner  # noqa: E402
from asyncflow_core.processes import pid_alive  # noqa: E402
from asyncflow_core.launchers.ray.ranks import RayRankGroup, RayRankSpawner, check_one_node  # noqa: E402
from asyncflow_core.store.deployments.ray_store import ray_listening_addresses  # noqa: E402

# the rank loop below travels to the rank actors by value: Ray's workers cannot import this test module
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arithmetic_grpo.yaml"


def echo_rank(rank: int, world_size: int, conn, tag: str) -> None:
    """A rank loop with the engines' protocol: pickled ``(op, payload)`` in, ``("ok"|"error", ...)`` out."""
    while True:
        try:
            op, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if op == "shutdown":
            conn.send_bytes(pickle.dumps(("ok", None)))
            return
        try:
            if op == "echo":
                value = {"rank": rank, "world_size": world_size, "payload": payload, "tag": tag, "pid": os.getpid()}
            elif op == "raise" and rank == payload:
                raise ValueError(f"deliberate failure on rank {rank}")
            elif op == "die" and rank == payload:
                os.kill(os.getpid(), signal.SIGKILL)  # this rank's process dies in the middle of the call
            elif op in ("raise", "die", "hang"):
                time.sleep(3600)  # the other ranks: stuck, as in a collective the dead rank never joins
            else:
                raise KeyError(op)
            reply = ("ok", value)
        except BaseException as exc:  # noqa: BLE001 - the engines' rank loops report every failure the same way
            reply = ("error", (type(exc).__name__, str(exc), traceback.format_exc()))
        conn.send_bytes(pickle.dumps(reply))


def _gone(pids: list[int], within_s: float = 15.0) -> bool:
    """Whether every process in ``pids`` has ended within ``within_s`` (Ray reaps killed workers asynchronously)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.1)  # observing another process's exit: nothing to be notified by
    return False


def make_group(**kwargs) -> RayRankGroup:
    return RayRankGroup(2, echo_rank, ("t",), num_cpus=0.25, start_timeout_s=120, **kwargs)


# ------------------------------------------------------------------ the rank group itself


def test_ranks_run_in_actors_and_answer_every_call_in_rank_order():
    pg = placement_group([{"CPU": 0.25}, {"CPU": 0.25}], strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    group = make_group(placement_group=pg, bundle_indices=(1, 0))
    try:
        pids = group.pids
        assert len(set(pids)) == 2 and os.getpid() not in pids
        got = group.call("echo", [{"x": 0}, {"x": 1}], timeout_s=30)
        assert [g["rank"] for g in got] == [0, 1] and [g["payload"] for g in got] == [{"x": 0}, {"x": 1}]
        assert {g["world_size"] for g in got} == {2} and [g["pid"] for g in got] == pids
        assert [g["payload"] for g in group.call("echo", same="all", timeout_s=30)] == ["all", "all"]
        assert group.call("echo", timeout_s=30)[1]["payload"] is None
        assert group.alive() == [True, True]
        # each rank actor sits in the bundle it was given, on this (the only) node
        assert {w["placement_group"] for w in group._where} == {pg.id.hex()}
        assert group.node_ips == ["127.0.0.1", "127.0.0.1"]
    finally:
        group.stop()
        remove_placement_group(pg)
    assert _gone(pids)
    assert group.pids == [] and group.broken == "shut down"
    with pytest.raises(RankError, match="shut down"):
        group.call("echo", timeout_s=5)


def test_an_exception_on_a_rank_is_a_rank_error_with_its_traceback_and_ends_the_group():
    group = make_group()
    pids = group.pids
    with pytest.raises(RankError, match=r"train: rank 1 raised ValueError: deliberate failure on rank 1") as info:
        group.call("raise", same=1, timeout_s=60, what="train")
    assert info.value.rank == 1
    assert "deliberate failure on rank 1" in info.value.remote_traceback
    assert 'raise ValueError(f"deliberate' in info.value.remote_traceback  # the rank's own traceback
    assert _gone(pids), "rank 0 was stuck in the call: it must be killed with the group"
    with pytest.raises(RankError, match="earlier failure"):
        group.call("echo", timeout_s=5)


def test_a_rank_actor_that_dies_mid_call_is_named_and_the_others_are_torn_down():
    group = make_group()
    pids = group.pids
    t0 = time.monotonic()
    with pytest.raises(RankError, match=rf"step: rank 1 \(pid {pids[1]}\) died: its Ray actor died") as info:
        group.call("die", same=1, timeout_s=120, what="step")
    assert time.monotonic() - t0 < 60, "a death must end the call, not its deadline"
    assert info.value.rank == 1
    assert _gone(pids)
    with pytest.raises(RankError, match="earlier failure"):
        group.call("echo", timeout_s=5)


def test_a_rank_that_does_not_answer_times_out_with_the_reason():
    group = make_group()
    pids = group.pids
    with pytest.raises(RankError, match=r"logprobs: rank\(s\) \[0, 1\] did not answer within 1.5 s"):
        group.call("hang", timeout_s=1.5, what="logprobs")
    assert _gone(pids)


def test_rank_actors_on_several_nodes_are_refused_with_what_to_do():
    where = [{"node_id": "a", "ip": "10.0.0.1"}, {"node_id": "b", "ip": "10.0.0.2"}]
    with pytest.raises(ConfigError, match=r"placed on 2 nodes .*must sit on one node.*trainer_ranks: processes"):
        check_one_node("fsdp", where)
    check_one_node("fsdp", [{"node_id": "a", "ip": "127.0.0.1"}] * 2)


def test_an_unplaceable_rank_group_fails_in_time_and_leaves_nothing_behind():
    with pytest.raises(RankError, match=r"rank actor\(s\) \[0, 1\] did not start within 2 s"):
        RayRankGroup(2, echo_rank, ("t",), num_cpus=64, start_timeout_s=2)


def test_the_spawner_hook_is_scoped_and_the_default_is_rank_processes():
    spawner = RayRankSpawner(num_cpus=0.25, start_timeout_s=120)
    assert type(rank_spawner()) is RankSpawner  # the base class: rank processes (RankGroup)
    with use_rank_spawner(spawner):
        assert rank_spawner() is spawner
        assert spawner.gpus_for_ranks(2) == 0 and RayRankSpawner(num_gpus=1).gpus_for_ranks(2) == 2
    assert rank_spawner() is not spawner


# ------------------------------------------------------------------ the fsdp engine through the ray launcher


def test_fsdp_world2_on_rank_actors_through_the_launcher_steps_like_rank_processes():
    """The launcher's own path: a trainer slot of 1 + 2 bundles, the trainer actor installing the Ray spawner,
    the fsdp ranks as two actors forming a gloo group. Same loss, grad norm, updated log-probs and exported
    weights as rank processes; every listener of the rank actors is on loopback."""
    pytest.importorskip("asyncflow_fsdp", reason="asyncflow-fsdp is not installed (pip install -e adapters/fsdp)")
    from asyncflow_fsdp.testing import tiny_options

    from asyncflow_core import columns as C
    from asyncflow_core.config.loader import load_config, resolve
    from asyncflow_core.launchers.ray.launcher import RayRoles
    from asyncflow_core.plugins import get_plugin_manager
    from asyncflow_core.types import Batch, RaggedTensor

    resolved = resolve(load_config(EXAMPLE, [
        "launcher.name=ray", "trainer.options={world_size: 2}",
        "launcher.options={rollout_cpus: 0.25, trainer_cpus: 0.25, trainer_rank_cpus: 0.5, reward_cpus: 0.25}",
    ]))
    pm = get_plugin_manager()
    options = pm.validate_options("train_engine", "fsdp", tiny_options(world_size=2, micro_batch_tokens=12))
    factory = pm.lookup("train_engine", "fsdp").record.factory
    algo = pm.create("algorithm", "grpo", {})
    gen, rows = torch.Generator().manual_seed(0), 6  # uneven lengths: several micro-batches per rank
    prompts = [torch.randint(0, 48, (2 + i % 3,), generator=gen) for i in range(rows)]
    responses = [torch.randint(0, 48, (1 + i % 4,), generator=gen) for i in range(rows)]
    batch = Batch({C.PROMPT_IDS: RaggedTensor.from_sequences(prompts),
                   C.RESPONSE_IDS: RaggedTensor.from_sequences(responses),
                   C.REWARD: (torch.arange(rows) % 3 == 0).float(), C.GROUP_ID: torch.arange(rows) // 3})

    async def step(engine, sample=None):
        await engine.setup()
        try:
            lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            train = algo.compute_advantages(batch.with_columns(**{C.BEHAVIOR_LOGPROBS: lp}))
            metrics = await engine.train_step(train, algo)
            after = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            # gathered from both ranks, handed over in shared memory by the rank actors on this host (through the
            # launcher: handles to buckets the trainer actor put in the object store)
            exported = [(b.checksum, b.nbytes) async for b in engine.export_weights(bucket_bytes=1 << 16)]
            return metrics, after, exported, sample() if sample else None
        finally:
            await engine.shutdown()

    roles = RayRoles(resolved.components["launcher"].options, resolved)
    roles.declare(FlowRuntime(resolved).role_specs())
    slot = 3 * (2 if roles.needs_ref else 1)
    assert len(roles._pools()["trainer"]) == slot  # the trainer actor's bundle and one per rank, per trainer
    roles.place()
    try:
        remote = roles.build("trainer", factory, options, role="trainer")

        def rank_actors():
            pids = _rank_actor_pids()
            return pids, [a for a in ray_listening_addresses() if a[2] in pids]

        m_ray, after_ray, weights_ray, (pids, listeners) = asyncio.run(asyncio.wait_for(step(remote, rank_actors),
                                                                                         240))
    finally:
        asyncio.run(roles.close())
    m_proc, after_proc, weights_proc, _ = asyncio.run(asyncio.wait_for(step(factory(options)), 240))

    assert m_ray["micro_batches"] > 1 and len(weights_ray) > 1
    assert weights_ray == weights_proc  # the same updated weights, bucket for bucket
    assert m_ray["loss"] == pytest.approx(m_proc["loss"], rel=1e-6, abs=1e-9)
    assert m_ray["grad_norm"] == pytest.approx(m_proc["grad_norm"], rel=1e-5)
    assert torch.allclose(after_ray.values, after_proc.values, atol=1e-6)
    assert len(pids) == 2, f"expected the two fsdp ranks as RankActor processes, found {pids}"
    assert listeners, "rank 0 hosts the rendezvous store: the rank actors must have a listener"
    assert [a for a in listeners if not a[0].startswith("127.") and a[0] != "::1"] == [], listeners
    assert _gone(pids)


def _rank_actor_pids() -> list[int]:
    """Processes Ray titled as RankActor workers (``ray::RankActor...``), read from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(b"ray::RankActor"):
                        out.append(int(entry))
            except OSError:
                continue
    return sorted(out)


def test_the_trainer_pool_reserves_a_bundle_per_rank_actor_and_says_so_when_it_cannot():
    from asyncflow_core.config.loader import load_config, resolve
    from asyncflow_core.launchers.ray.launcher import RayRoles

    def roles(*overrides: str) -> RayRoles:
        resolved = resolve(load_config(EXAMPLE, ["launcher.name=ray", *overrides]))
        roles = RayRoles(resolved.components["launcher"].options, resolved)
        roles.declare(FlowRuntime(resolved).role_specs())  # the run's roles, as the launcher gets them
        return roles

    two = "trainer.options={world_size: 2}"
    r = roles(two, "launcher.options={trainer_cpus: 0.5, trainer_rank_cpus: 2, trainer_rank_gpus: 1}")
    per_trainer = 2 if r.needs_ref else 1
    assert r._pools()["trainer"] == [{"CPU": 0.5}, {"CPU": 2, "GPU": 1}, {"CPU": 2, "GPU": 1}] * per_trainer
    assert len(roles(two, "launcher.options.trainer_ranks=processes")._pools()["trainer"]) == per_trainer
    assert len(roles("trainer.options={world_size: 1}")._pools()["trainer"]) == per_trainer

    big = roles(two, "launcher.options={trainer_cpus: 0.25, trainer_rank_cpus: 64, start_timeout_s: 2}")
    with pytest.raises(ConfigError, match=r"trainer 0.25 \+ 2 rank actors x 64 CPU, reward"):
        big.place()
    assert big.groups == {}


def test_megatron_tp2_on_rank_actors_steps_like_rank_processes():
    """The megatron engine's ranks as Ray actors (tensor parallel 2 on gloo) take the step rank processes take."""
    pytest.importorskip("asyncflow_megatron", reason="asyncflow-megatron is not installed (pip install -e "
                        "adapters/megatron)")
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from asyncflow_megatron.testing import cpu_options

    from asyncflow_core import columns as C
    from asyncflow_core.plugins import get_plugin_manager
    from asyncflow_core.types import Batch, RaggedTensor

    pm = get_plugin_manager()
    options = pm.validate_options("train_engine", "megatron",
                                  cpu_options(world_size=2, tensor_parallel_size=2, micro_batch_tokens=12))
    algo = pm.create("algorithm", "grpo", {})
    gen, rows = torch.Generator().manual_seed(1), 6
    batch = Batch({C.PROMPT_IDS: RaggedTensor.from_sequences([torch.randint(0, 48, (2 + i % 3,), generator=gen)
                                                              for i in range(rows)]),
                   C.RESPONSE_IDS: RaggedTensor.from_sequences([torch.randint(0, 48, (1 + i % 4,), generator=gen)
                                                                for i in range(rows)]),
                   C.REWARD: (torch.arange(rows) % 3 == 0).float(), C.GROUP_ID: torch.arange(rows) // 3})

    async def step():
        engine = pm.create("train_engine", "megatron", options)
        await engine.setup()
        try:
            lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            metrics = await engine.train_step(algo.compute_advantages(batch.with_columns(**{C.BEHAVIOR_LOGPROBS: lp})),
                                              algo)
            after = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            return metrics, (lp, after), sorted(_rank_actor_pids())
        finally:
            await engine.shutdown()

    with use_rank_spawner(RayRankSpawner(num_cpus=0.5)):
        m_ray, (before, after_ray), pids = asyncio.run(asyncio.wait_for(step(), 240))
    m_proc, (_, after_proc), _ = asyncio.run(asyncio.wait_for(step(), 240))

    assert len(pids) == 2, f"expected the two megatron ranks as RankActor processes, found {pids}"
    assert m_ray["micro_batches"] > 1
    assert m_ray["loss"] == pytest.approx(m_proc["loss"], rel=1e-6, abs=1e-9)
    assert m_ray["grad_norm"] == pytest.approx(m_proc["grad_norm"], rel=1e-5)
    assert torch.allclose(after_ray.values, after_proc.values, atol=1e-6)
    assert not torch.allclose(after_ray.values, before.values)  # the step moved the weights
    assert _gone(pids)
