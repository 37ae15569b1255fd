"""``asyncflow sim --calibrate``: the fit recovers a known latency model, and the twin of a config simulates it.

The oracle is a simulated run whose latency model is chosen here: its
spans and metrics are what a real run writes, so fitting them must give
back the chosen numbers (exactly enough: the virtual clock has no noise).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from asyncflow_core.cli.calibrate import fit_runs, load_run, sim_overrides
from asyncflow_core.config import load_config, resolve
from asyncflow_core.errors import ConfigError
from asyncflow_core.flow.runtime import run_flow

REPO = Path(__file__).resolve().parents[1]

PASS_S, TOKEN_S = 0.02, 0.001  # rollout: fixed cost of a decoding pass, cost per token in it
TRAIN_S_PER_TOKEN, TRAIN_OVERHEAD_S = 0.002, 0.5
SEND_S, RECEIVE_S = 0.1, 0.05
CAP = 50  # every response reaches it (median 100, no spread): each busy period is CAP passes
# a shared host of 2 cores: the trainer and a replica both fill it (demands 2 and 3), an oversubscribed host keeps
# 0.8 of its throughput; together the trainer runs at 0.8 x 2/5 = 0.32 of its speed alone, a replica at 0.48
HOST = {"capacity": 2.0, "efficiency": 0.8, "demand": {"train": 2.0, "rollout": 3.0, "reward": 1.0}}
DRIVER_S = 0.004  # per sample: the work outside the engines' spans, on the reward lane
HOST_TRAIN_S_PER_TOKEN = 0.0008  # the host runs train faster than the replica, so the replica sets the step


def _oracle(tmp: Path, prompts: int, name: str, *, mode: str = "sync", host: dict | None = None,
            reward_s: float = 0.0, steps: int = 5, train_s: float = TRAIN_S_PER_TOKEN) -> Path:
    def share(engine):
        return None if host is None else {"capacity": host["capacity"], "efficiency": host["efficiency"],
                                          "demand": host["demand"][engine]}

    data = {
        "name": name,
        "data": {"name": "sim", "options": {"size": 100, "prompt_tokens": 16, "prompt_sigma": 0.0},
                 "prompts_per_step": prompts},
        # keep: an in-flight weight update costs no recompute, so a replica's busy period is its work alone
        "rollout": {"name": "sim", "replicas": 1, "n": 2, "max_new_tokens": CAP, "max_inflight": 64, "kv_cache": "keep",
                    "options": {"payload": "lengths", "lengths": {"median_tokens": 100, "sigma": 0.0},
                                "latency": {"step_overhead_s": PASS_S, "weight_read_s": 0.0, "per_seq_s": TOKEN_S,
                                            "prefill_s_per_token": TOKEN_S}, "machine": share("rollout")}},
        "trainer": {"name": "sim", "total_steps": steps,
                    "options": {"latency": {"devices": 1, "params": 1.0, "mfu": 1.0,
                                            "peak_flops_per_device": 6.0 / train_s,
                                            "step_overhead_s": TRAIN_OVERHEAD_S}, "machine": share("train")}},
        "weight_transport": {"name": "sim", "options": {"latency": {
            "model_bytes": 1e6, "latency_s": 0.0, "send_bandwidth_bytes_per_s": 1e6 / SEND_S,
            "receive_bandwidth_bytes_per_s": 1e6 / RECEIVE_S}}},
        "algorithm": {"name": "grpo", "options": {"group_size": 2}},
        "reward": {"name": "sim", "options": {"seconds_per_sample": reward_s, "machine": share("reward")}},
        "async": {"mode": mode},
        "logging": {"level": "WARNING"},
    }
    from asyncflow_core.config.models import RunConfig

    run_dir = tmp / name
    run_flow(resolve(RunConfig.model_validate(data)), virtual=True, run_dir=run_dir, write_png=False)
    return run_dir


@pytest.fixture(scope="module")
def oracle_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("oracle")
    return [_oracle(tmp, 8, "b8"), _oracle(tmp, 4, "b4")]


def test_two_batch_sizes_recover_the_rollout_train_and_transfer_costs(oracle_runs):
    cal = fit_runs(oracle_runs)
    assert cal.fit["rollout_pass_s"] == pytest.approx(PASS_S, rel=0.02)
    assert cal.fit["rollout_token_s"] == pytest.approx(TOKEN_S, rel=0.02)
    assert cal.fit["train_s_per_token"] == pytest.approx(TRAIN_S_PER_TOKEN, rel=0.02)
    assert cal.fit["train_overhead_s"] == pytest.approx(TRAIN_OVERHEAD_S, rel=0.02)
    assert cal.fit["send_s"] == pytest.approx(SEND_S, rel=0.02)
    assert cal.fit["receive_s"] == pytest.approx(RECEIVE_S, rel=0.02)
    assert cal.fit["mean_response_tokens"] == pytest.approx(CAP)
    assert cal.lengths["median_tokens"] >= CAP  # every response reached the cap: so do the simulated ones
    assert (oracle_runs[0] / "calibration.yaml").is_file()  # the fit is kept beside the run it came from


@pytest.fixture(scope="module")
def host_runs(tmp_path_factory):
    """Two sync runs (the costs alone) and one overlapped run (the host) of engines sharing HOST."""
    tmp = tmp_path_factory.mktemp("host")
    kw = {"host": HOST, "reward_s": DRIVER_S, "train_s": HOST_TRAIN_S_PER_TOKEN}
    return [_oracle(tmp, 8, "b8", **kw), _oracle(tmp, 4, "b4", **kw),
            _oracle(tmp, 8, "one_step", mode="one_step", steps=10, **kw)]


def test_an_overlapped_run_recovers_the_shared_host_and_the_driver_work(host_runs):
    cal = fit_runs(host_runs, cores=2)
    # the engines alone, from the sync runs (the overlapped run's slowed spans stay out of these)
    assert cal.fit["rollout_pass_s"] == pytest.approx(PASS_S, rel=0.02)
    assert cal.fit["train_s_per_token"] == pytest.approx(HOST_TRAIN_S_PER_TOKEN, rel=0.02)
    assert cal.fit["train_overhead_s"] == pytest.approx(TRAIN_OVERHEAD_S, rel=0.02)
    # the driver's per-sample work goes to the reward lane, not to the train step
    assert cal.reward["seconds_per_sample"] == pytest.approx(DRIVER_S, rel=0.05)
    assert cal.train["step_overhead_s"] == pytest.approx(TRAIN_OVERHEAD_S, rel=0.02)
    # the host: a first guess of each engine's rate beside the other takes a span's work alone from the sync
    # fit (the driver's scoring overlaps some spans too, so it is off); the rates are then matched by simulating
    # the overlapped run until its median train step and its mean step agree within 0.5%
    last = cal.fit["host"]["rounds"][-1]
    assert last["train_width"][0] == pytest.approx(last["train_width"][1], rel=0.005)
    assert last["step"][0] == pytest.approx(last["step"][1], rel=0.005)
    assert cal.host["capacity"] == 2.0
    assert cal.host["efficiency"] == pytest.approx(HOST["efficiency"], rel=0.02)
    assert cal.host["demand"]["train"] == pytest.approx(HOST["demand"]["train"], rel=0.02)
    assert cal.host["demand"]["rollout"] == pytest.approx(HOST["demand"]["rollout"], rel=0.02)
    assert cal.host["demand"]["reward"] == HOST["demand"]["reward"]


def test_the_twin_of_an_overlapped_run_predicts_it_only_with_the_host(host_runs, tmp_path):
    """In-sample: the one_step run simulated with the fitted host gives back its rate; without the host the
    engines would not slow each other down and the prediction is far too fast."""
    from asyncflow_core.cli.calibrate import Calibration, simulated_twin

    cal = fit_runs(host_runs, cores=2)
    config = host_runs[2] / "config.yaml"
    actual = json.loads((host_runs[2] / "summary.json").read_text())["steady_samples_per_s"]
    raw = yaml.safe_load(config.read_text())
    rates = []
    for c in (cal, Calibration(**{**vars(cal), "host": {}})):
        ovs = simulated_twin(raw, c)
        rates.append(run_flow(resolve(load_config(config, ovs)), virtual=True, write_png=False)["steady_samples_per_s"])
    assert rates[0] == pytest.approx(actual, rel=0.05)
    assert rates[1] > 1.3 * actual


@pytest.fixture(scope="module")
def long_train_runs(tmp_path_factory):
    """As host_runs, but train steps five times longer than a replica's busy period: in the one_step run no
    train_step span is half overlapped by a generate span, so only the replica's rate can be first guessed."""
    tmp = tmp_path_factory.mktemp("long_train")
    kw = {"host": HOST, "reward_s": DRIVER_S, "train_s": 0.01}
    return [_oracle(tmp, 8, "b8", **kw), _oracle(tmp, 4, "b4", **kw),
            _oracle(tmp, 8, "one_step", mode="one_step", steps=10, **kw)]


def test_a_host_is_fitted_when_only_the_replica_spans_are_overlapped(long_train_runs):
    """The trainer's rate is searched from 1 (not slowed); the host found reproduces the overlapped run, which
    the engines alone miss by a fifth."""
    from asyncflow_core.cli.calibrate import Calibration, simulated_twin

    cal = fit_runs(long_train_runs, cores=2)
    assert cal.fit["host"]["train_spans"] == 0 and cal.fit["host"]["rollout_spans"] > 0
    assert any("searched from 1" in n for n in cal.notes)
    assert cal.host["demand"]["train"] == pytest.approx(HOST["demand"]["train"], rel=0.05)
    assert cal.host["efficiency"] == pytest.approx(HOST["efficiency"], rel=0.05)
    config = long_train_runs[2] / "config.yaml"
    actual = json.loads((long_train_runs[2] / "summary.json").read_text())["steady_samples_per_s"]
    raw = yaml.safe_load(config.read_text())
    rates = [run_flow(resolve(load_config(config, simulated_twin(raw, c))), virtual=True,
                      write_png=False)["steady_samples_per_s"] for c in (cal, Calibration(**{**vars(cal), "host": {}}))]
    assert rates[0] == pytest.approx(actual, rel=0.02)
    assert rates[1] > 1.15 * actual


def test_replicas_of_an_engine_in_the_driver_process_take_turns_on_one_thread(host_runs):
    """The torch engine under the local launcher serves from the driver's interpreter: its replicas share one
    thread of the host (the twin's rollout machine names it); vLLM's replicas, or any under Ray, do not."""
    from asyncflow_core.cli.calibrate import _replicas_share_driver, fit, simulated_twin

    records = [load_run(p) for p in host_runs]
    for r in records:
        r.config["rollout"]["name"] = "torch"
    cal = fit(records, cores=2)
    assert cal.host["threads"] == {"rollout": "driver"}
    assert cal.share("rollout")["thread"] == "driver" and "thread" not in cal.share("train")
    assert any("take turns" in n for n in cal.notes)
    twin = dict(o.split("=", 1) for o in simulated_twin({**records[2].config, "rollout": {
        **records[2].config["rollout"], "replicas": 2}}, cal))
    assert json.loads(twin["rollout.options"])["machine"]["thread"] == "driver"
    # what decides it
    assert _replicas_share_driver({"rollout": {"name": "torch"}})
    assert not _replicas_share_driver({"rollout": {"name": "vllm"}})
    assert not _replicas_share_driver({"rollout": {"name": "torch"}, "launcher": {"name": "ray"}})


def test_the_train_lanes_own_work_and_the_batch_fetch_are_measured_from_the_spans():
    """Hand-computed. The lane's time outside its spans, per step (median): steps (0, 2] and (2, 4] hold spans
    covering 1.5 and 1.0 s -> gaps 0.5 and 1.0. The fetch, per wait span after the first: from the last
    generate/score end inside it (2.6) to its end -> 0.4; none inside the last -> all of it, 1.0."""
    from asyncflow_core.cli.calibrate import _fetch_times, _lane_gap

    assert _lane_gap([(0.0, 1.0), (0.5, 0.8), (1.5, 2.0), (2.5, 3.5)], [0.0, 2.0, 4.0]) == pytest.approx(0.75)
    assert _fetch_times([(0.0, 1.0), (2.0, 3.0), (4.0, 5.0)], [0.5, 2.2, 2.6, 6.0]) == pytest.approx([0.4, 1.0])


def test_the_simulated_train_step_carries_the_lanes_own_work_and_the_fetch(host_runs):
    """Work the train stage does between its spans (gaps of the sync runs) and fetching a ready batch (an
    overlapped run's waits) is on the train lane's critical path; the twin's train step carries both, and
    the host search matches the real train step plus them. The simulator's own runs have neither."""
    from asyncflow_core.cli.calibrate import _lane_widths, fit

    records = [load_run(p) for p in host_runs]
    assert all(r.train_gap_seconds == pytest.approx(0.0, abs=1e-6) for r in records)
    assert all(f == pytest.approx(0.0, abs=1e-6) for f in records[2].fetch_seconds)
    for r in records[:2]:
        r.train_gap_seconds = 0.01
    records[2].fetch_seconds = [0.02] * len(records[2].fetch_seconds)
    cal = fit(records, cores=2)
    assert (cal.fit["train_lane_gap_s"], cal.fit["fetch_s"]) == pytest.approx((0.03, 0.02))
    assert cal.train["step_overhead_s"] == pytest.approx(TRAIN_OVERHEAD_S + 0.03, rel=0.02)
    real_width = _lane_widths(records[2].train_spans, records[2].step_ends, 1)[0]  # one_step: k = 1
    assert all(h["train_width"][1] == pytest.approx(real_width + 0.03, abs=1e-12) for h in cal.fit["host"]["rounds"])


def test_sync_runs_alone_fit_no_host_and_say_so(oracle_runs):
    cal = fit_runs(oracle_runs)
    assert cal.host == {} and cal.share("train") is None
    assert any("no overlapped run" in n for n in cal.notes)


def test_one_run_cannot_split_the_pass_cost_and_says_so(oracle_runs):
    cal = fit_runs(oracle_runs[:1])
    assert any("one run cannot tell" in n for n in cal.notes)
    run = load_run(oracle_runs[0])
    # the whole busy period is still accounted for
    period = sorted(run.busy_durations)[len(run.busy_durations) // 2]
    tokens = (run.requests * run.prompt_tokens + run.generated_tokens) / run.busy_periods
    assert cal.fit["rollout_pass_s"] * CAP + cal.fit["rollout_token_s"] * tokens == pytest.approx(period, rel=0.02)


def test_the_twin_of_a_calibration_run_predicts_its_throughput(oracle_runs, tmp_path):
    """In-sample: simulating the b8 config with the model fitted from both runs gives back its rate."""
    config = oracle_runs[0] / "config.yaml"
    ovs = sim_overrides(config, [], calibrate=oracle_runs)
    predicted = run_flow(resolve(load_config(config, ovs)), virtual=True, write_png=False)
    actual = json.loads((oracle_runs[0] / "summary.json").read_text())
    assert predicted["steady_samples_per_s"] == pytest.approx(actual["steady_samples_per_s"], rel=0.03)


def test_the_twin_of_a_real_config_runs_on_the_sim_engines(oracle_runs):
    """The arithmetic example (torch rollout, fsdp trainer, a reward that reads text) becomes all-sim."""
    example = REPO / "examples" / "arithmetic_grpo.yaml"
    ovs = sim_overrides(example, ["trainer.total_steps=3", "trainer.checkpoint_every=0"], calibrate=oracle_runs)
    resolved = resolve(load_config(example, ovs))
    cfg = resolved.config
    assert (cfg.rollout.name, cfg.trainer.name, cfg.weight_transport.name, cfg.reward.name) == ("sim",) * 4
    ro = resolved.components["rollout"].options
    assert ro.payload == "lengths" and ro.latency.max_running_seqs == 256  # the torch engine's max_batch
    assert ro.vocab_size == 14  # the example's character vocabulary: its prompts are valid sim prompts
    s = run_flow(resolved, virtual=True, write_png=False)
    assert s["steps"] == 3


def test_the_payload_defaults_to_lengths_for_sim_configs_only():
    sim = REPO / "examples" / "sim_7b.yaml"
    assert sim_overrides(sim, ["trainer.total_steps=2"]) == ["trainer.total_steps=2",
                                                             "rollout.options.payload=lengths"]
    assert sim_overrides(sim, [], payload="tokens") == ["rollout.options.payload=tokens"]
    assert sim_overrides(sim, ["rollout.options.payload=tokens"]) == ["rollout.options.payload=tokens"]
    assert sim_overrides(REPO / "examples" / "arithmetic_grpo.yaml", []) == []
    with pytest.raises(ConfigError, match="--payload"):
        sim_overrides(sim, [], payload="ids")


def test_a_directory_that_is_not_a_run_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no config.yaml"):
        fit_runs([tmp_path])


def test_the_cli_takes_several_calibration_runs(oracle_runs, tmp_path, capsys):
    from asyncflow_core.cli.main import main

    config = oracle_runs[0] / "config.yaml"
    with pytest.raises(SystemExit) as exc:  # click's standalone mode exits, 0 on success
        main(["sim", str(config), "trainer.total_steps=2", "--run-dir", str(tmp_path / "twin"), "--no-progress",
              "--calibrate", str(oracle_runs[0]), "--calibrate", str(oracle_runs[1])])
    assert exc.value.code == 0
    err = capsys.readouterr().err
    assert f"calibrated from {oracle_runs[0]}, {oracle_runs[1]}" in " ".join(err.split())

    saved = yaml.safe_load((tmp_path / "twin" / "config.yaml").read_text())["rollout"]["options"]
    assert saved["payload"] == "lengths"
    assert saved["latency"]["step_overhead_s"] == pytest.approx(PASS_S, rel=0.02)  # both runs fitted the pass cost
