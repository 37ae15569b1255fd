"""``asyncflow plan``: the placements it considers, what it writes, and a whole (tiny) plan end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from asyncflow_core.cli.plan import (
    Candidate,
    _rollout_seconds,
    candidates,
    estimate_step_seconds,
    ideal_samples_per_s,
    neighbours,
    pareto_front,
    run_plan,
    work_bound_samples_per_s,
    workload,
    write_outputs,
)
from asyncflow_core.config import load_config, resolve
from asyncflow_core.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "sim_7b.yaml"
#: a small version of the 7B example: 64 samples per step, a 2k cap, a few steps
SMALL = ["data.prompts_per_step=8", "rollout.max_new_tokens=2048", "store.options.capacity=4096"]


def test_every_placement_uses_whole_nodes_and_colocation_only_without_staleness():
    cands = candidates(32, node_size=8, max_k=2, replicas_per_node=(1, 8))
    # per replica size: 1 colocated + 3 splits (8/24, 16/16, 24/8) x 3 bounds
    assert len(cands) == 2 * (1 + 3 * 3) and len(set(cands)) == len(cands)
    for c in cands:
        assert c.trainer_devices % 8 == 0 and c.rollout_devices % 8 == 0
        assert c.replicas * c.devices_per_replica == c.rollout_devices
        if c.colocated:
            assert c.k == 0 and c.trainer_devices == c.rollout_devices == 32
        else:
            assert c.trainer_devices + c.rollout_devices == 32


def test_a_candidates_overrides_make_a_valid_config_with_that_placement():
    c = Candidate(k=2, colocated=False, trainer_devices=8, rollout_devices=24, devices_per_replica=2)
    cfg = load_config(EXAMPLE, c.overrides())
    resolved = resolve(cfg)
    assert cfg.async_.k == 2 and not cfg.async_.colocated and cfg.rollout.replicas == 12
    assert resolved.components["rollout"].options.latency.devices_per_replica == 2
    assert resolved.components["trainer"].options.latency.devices == 8
    sync = Candidate(0, True, 32, 32, 1)
    assert load_config(EXAMPLE, sync.overrides()).async_.colocated


def test_neighbours_stay_inside_the_space():
    space = {"devices": 32, "node_size": 8, "max_k": 2, "replicas_per_node": (1, 2, 8)}
    every = set(candidates(**space))
    c = Candidate(1, False, 16, 16, 4)
    near = neighbours(c, **space)
    assert near and set(near) <= every and c not in near
    assert {n.k for n in near} >= {0, 2}  # the bound moves both ways
    assert {n.trainer_devices for n in near} >= {8, 24}  # a node moves either way


def test_the_screen_and_the_ideal_read_the_sim_latency_models():
    w = workload(resolve(load_config(EXAMPLE, SMALL)))
    assert w.samples == 64 and 0 < w.response_tokens <= 2048 and w.longest <= 2048
    ideal = ideal_samples_per_s(w, 32, 8)
    for c in candidates(32, node_size=8, max_k=2, replicas_per_node=(1, 8)):
        # the estimate is a schedule's step time: never better than the ideal (which ignores tails and sync)
        assert w.samples / estimate_step_seconds(w, c) <= ideal * 1.0001, c
    for c in candidates(32, node_size=8, max_k=2, replicas_per_node=(1, 2, 8)):
        # the work bound (plan_check.py --bounded-sweep) drops what the estimate adds: never below its rate
        assert work_bound_samples_per_s(w, c) >= w.samples / estimate_step_seconds(w, c) * 0.9999, c


def test_the_estimate_times_a_k_ge_1_tail_at_the_window_batch():
    """Issue 19 at 128 devices: timed at a drained batch, the tail let 1-device replicas at k >= 1 read ~2x fast
    (k=4 48r/80t 48x1: 160.6 samples/s estimated, 70.7 simulated) and crowd out k=4 80r/48t 10x8 (123.15
    simulated, the best placement found), ranked 54th; k = 0 still drains."""
    w = workload(resolve(load_config(EXAMPLE, [])))
    every = candidates(128, node_size=8, max_k=4, replicas_per_node=(1, 2, 4, 8))
    rate = {c.label: w.samples / estimate_step_seconds(w, c) for c in every}
    assert rate["k=4 48r/80t 48x1"] < 0.5 * rate["k=4 80r/48t 10x8"]
    assert sorted(rate.values(), reverse=True).index(rate["k=4 80r/48t 10x8"]) < 20
    c0 = Candidate(0, False, 64, 64, 1)
    work, tail = _rollout_seconds(w, c0, per_step_batch=True)
    lat = w.rollout.model_copy(update={"devices_per_replica": 1})
    assert tail == pytest.approx(w.longest * lat.step_time(min(w.samples / 64, 256) / 4))


def test_the_pareto_front_keeps_only_rows_nothing_beats_on_both_axes():
    rows = [{"mean_staleness": s, "samples_per_s": t} for s, t in [(0, 5), (0, 4), (0.8, 7), (1.0, 6), (1.9, 9)]]
    front = pareto_front(rows)
    assert [(r["mean_staleness"], r["samples_per_s"]) for r in front] == [(0, 5), (0.8, 7), (1.9, 9)]


def test_a_non_sim_config_and_a_bad_budget_are_refused_with_one_line():
    with pytest.raises(ConfigError, match="sim engines"):
        run_plan(REPO / "examples" / "arithmetic_grpo.yaml", devices=16, progress=False)
    with pytest.raises(ConfigError, match="multiple of the node size"):
        run_plan(EXAMPLE, SMALL, devices=20, progress=False)
    with pytest.raises(ConfigError, match="divide the node size"):
        run_plan(EXAMPLE, SMALL, devices=16, replicas_per_node=(3,), progress=False)


def test_a_whole_plan_ranks_what_it_simulated_and_writes_a_runnable_pick(tmp_path):
    """Two nodes, k <= 1, one replica size: every placement simulated (--full), on one worker process."""
    result = run_plan(EXAMPLE, SMALL, devices=16, max_k=1, replicas_per_node=(8,), measured_steps=2, full=True,
                      workers=1, progress=False)
    # colocated k=0, 8/8 with k = 0 and 1, and 8/8 k = 1 with the start floor (async.start_on_step_weights)
    assert result.simulated == result.candidates == 4
    assert sorted(r["label"] for r in result.rows if r["candidate"]["start_floor"]) == ["k=1 8r/8t 8x1 floor"]
    rates = [r["samples_per_s"] for r in result.rows]
    assert rates == sorted(rates, reverse=True) and all(x > 0 for x in rates)
    assert result.chosen is result.rows[0]
    for r in result.rows:
        assert r["violations"] == 0 and max(r["staleness_histogram"]) <= r["candidate"]["k"]
        assert 0 < r["efficiency_vs_ideal"] <= 1.0
    files = write_outputs(result, tmp_path)
    overlay = yaml.safe_load(files["overlay"].read_text())
    chosen = Candidate(**result.chosen["candidate"])
    assert overlay["async"]["max_staleness"] == chosen.k and overlay["rollout"]["replicas"] == chosen.replicas
    assert overlay["async"]["start_on_step_weights"] is chosen.start_floor
    # the written config is the example with the pick applied: it validates as it is
    cfg = load_config(files["chosen"])
    assert cfg.async_.k == chosen.k and cfg.rollout.replicas == chosen.replicas
    assert json.loads(files["json"].read_text())["chosen"]["label"] == chosen.label
    assert files["png"].stat().st_size > 0


def test_the_screened_search_measures_its_finalists_over_every_step():
    """Screening simulates one step after the warm-up; only the finalists are measured over --steps, and rank first."""
    result = run_plan(EXAMPLE, SMALL, devices=24, max_k=1, replicas_per_node=(8,), measured_steps=2, shortlist=2,
                      finalists=1, workers=1, progress=False)
    assert result.chosen["measured_steps"] == 2 and result.chosen["rank"] == 1
    # the finalist and, at k >= 1, the same placement with the start floor (--start-floor)
    final = [r for r in result.rows if r["measured_steps"] == 2]
    assert result.rows[:len(final)] == final and 1 <= len(final) <= 2
    assert len({(r["candidate"]["k"], r["candidate"]["trainer_devices"]) for r in final}) == 1
    assert [r["measured_steps"] for r in result.rows[len(final):]] == [1] * (len(result.rows) - len(final))
    for r in result.rows:
        assert r["violations"] == 0


def test_the_cli_refuses_bad_plans_and_payloads_with_one_line(capsys):
    from asyncflow_core.cli.main import main

    for argv, expected in ((["plan", str(REPO / "examples" / "arithmetic_grpo.yaml")], "sim engines"),
                           (["plan", str(EXAMPLE), "--devices", "20"], "multiple of the node size"),
                           (["sim", str(EXAMPLE), "--payload", "ids"], "--payload")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and expected in err[0], err


def test_the_cli_plans_without_the_start_floor_when_told(tmp_path, capsys):
    """--no-start-floor: no placement is measured with async.start_on_step_weights, and the overlay sets it off."""
    from asyncflow_core.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["plan", str(EXAMPLE), *SMALL, "--devices", "16", "--max-staleness", "1", "--replicas-per-node", "8",
              "--steps", "1", "--full", "--workers", "1", "--no-progress", "--no-start-floor", "--out", str(tmp_path)])
    assert exc.value.code == 0
    rows = json.loads((tmp_path / "plan.json").read_text())["rows"]
    assert len(rows) == 3 and not any(r["candidate"]["start_floor"] for r in rows)
    assert yaml.safe_load((tmp_path / "overlay.yaml").read_text())["async"]["start_on_step_weights"] is False
    capsys.readouterr()


def test_asyncflow_sim_runs_lengths_only_unless_told(tmp_path, capsys):
    from asyncflow_core.cli.main import main

    for extra, payload in (([], "lengths"), (["--payload", "tokens"], "tokens")):
        run_dir = tmp_path / payload
        with pytest.raises(SystemExit) as exc:  # click's standalone mode exits, 0 on success
            main(["sim", str(EXAMPLE), *SMALL, "trainer.total_steps=1", "--run-dir", str(run_dir), "--no-progress",
                  *extra])
        assert exc.value.code == 0
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert saved["rollout"]["options"]["payload"] == payload
    capsys.readouterr()


def test_simulations_start_longest_first_and_rows_come_back_in_the_order_asked():
    from asyncflow_core.cli.plan import longest_first

    cands = [Candidate(0, True, 32, 32, 1), Candidate(2, False, 8, 24, 1), Candidate(2, False, 8, 24, 8),
             Candidate(1, False, 16, 16, 1), Candidate(2, False, 8, 24, 1)]
    order = longest_first(cands, 3)
    assert order == [cands[1], cands[2], cands[3], cands[0]]  # k = 2 (6 steps) first, 24 replicas before 3
    assert len(order) == len(set(order))  # a candidate asked twice is simulated once


def test_a_simulation_cut_off_below_its_floor_holds_a_bound_between_its_rate_and_the_floor():
    """The cut-off only stops a run: a floor it clears changes no field, one it misses cuts it below the floor."""
    from asyncflow_core.cli.plan import simulate
    from asyncflow_core.config.loader import read_yaml

    raw, cand = read_yaml(EXAMPLE), Candidate(1, False, 8, 16, 8)
    plain = simulate(raw, SMALL, cand, 1)
    rate = plain["samples_per_s"]
    assert not plain["cut_off"] and rate > 0

    def same(a: dict, b: dict) -> bool:
        return {k: v for k, v in a.items() if k != "wall_s"} == {k: v for k, v in b.items() if k != "wall_s"}

    assert same(simulate(raw, SMALL, cand, 1, floor=rate * 0.999), plain)  # cleared: every field as without
    cut = simulate(raw, SMALL, cand, 1, floor=rate * 1.5)
    assert cut["cut_off"] and rate < cut["samples_per_s"] < rate * 1.5
    assert cut["sim_seconds"] < plain["sim_seconds"]


def _made_up_search(monkeypatch, rate, every, estimate, space, *, shortlist=8, **kw):
    """``_search`` over made-up rates (``rate(c, steps)``), with and without cut-offs, on two worker threads:
    ``{cutoff: rows}``. A simulation cut off reports a bound in (rate, floor), as :func:`simulate` does."""
    from concurrent.futures import ThreadPoolExecutor

    from asyncflow_core.cli import plan as P

    def fake(raw, overrides, c, steps, floor=None):
        r = rate(c, steps)
        if floor is not None and r < floor:
            return {"samples_per_s": (r + floor) / 2, "cut_off": True, "measured_steps": steps}
        return {"samples_per_s": r, "cut_off": False, "measured_steps": steps}

    monkeypatch.setattr(P, "simulate", fake)
    runs = {}
    for cutoff in (False, True):
        with ThreadPoolExecutor(2) as pool, P._Runner({}, [], 2, False, pool=pool) as runner:
            runs[cutoff] = P._search(runner, every, estimate, space, shortlist=shortlist, finalists=3,
                                     measured_steps=3, cutoff=cutoff, **kw)
    return runs


@pytest.mark.parametrize("seed", range(12))
def test_cut_offs_change_no_finalist_and_no_pick(monkeypatch, seed):
    """The screened search over made-up rates, with and without cut-offs (two worker threads, so any order)."""
    import random

    space = {"devices": 64, "node_size": 8, "max_k": 4, "replicas_per_node": (1, 2, 4, 8)}
    every = candidates(**space)
    rng = random.Random(seed)
    screen = {c: rng.uniform(10, 100) for c in every}
    measured = {c: screen[c] * rng.uniform(0.8, 1.2) for c in every}
    estimate = {c: rng.uniform(1, 10) for c in every}

    runs = _made_up_search(monkeypatch, lambda c, steps: screen[c] if steps == 1 else measured[c], every, estimate,
                           space)
    plain, cut = runs[False], runs[True]
    assert list(cut) == list(plain)  # the same placements simulated, in the same order
    final = [c for c, r in plain.items() if r["measured_steps"] == 3]
    assert [c for c, r in cut.items() if r["measured_steps"] == 3] == final
    pick = max(final, key=lambda c: plain[c]["samples_per_s"])
    assert max(final, key=lambda c: cut[c]["samples_per_s"]) == pick
    assert not cut[pick]["cut_off"] and cut[pick]["samples_per_s"] == plain[pick]["samples_per_s"]
    third = sorted((screen[c] for c in plain), reverse=True)[2]  # the finalists' entry rate
    for c, r in cut.items():
        if not r["cut_off"]:
            assert r["samples_per_s"] == plain[c]["samples_per_s"]
        elif r["measured_steps"] == 1:
            assert screen[c] < r["samples_per_s"] < third
        else:
            assert measured[c] < r["samples_per_s"] < measured[pick]
    assert sum(r["cut_off"] for r in cut.values()) >= 3  # the floors did cut


@pytest.mark.parametrize("seed", range(6))
def test_the_finalists_with_a_bound_are_measured_again_with_the_start_floor(monkeypatch, seed):
    """--start-floor: every finalist with k >= 1, and only those, is measured again with
    async.start_on_step_weights; the pick is the fastest of all, the same with and without cut-offs, and a
    variant is cut off only when it cannot beat the best finalist (made-up rates, two worker threads)."""
    import random
    from dataclasses import replace

    space = {"devices": 64, "node_size": 8, "max_k": 4, "replicas_per_node": (1, 2, 4, 8)}
    every = candidates(**space)
    rng = random.Random(seed)
    screen = {c: rng.uniform(10, 100) for c in every}
    measured = {c: screen[c] * rng.uniform(0.8, 1.2) for c in every}
    floored = {c: measured[c] * rng.uniform(0.7, 1.4) for c in every}
    estimate = {c: rng.uniform(1, 10) for c in every}

    def rate(c, steps):
        if c.start_floor:
            assert steps == 3  # only finalists get the floor
            return floored[replace(c, start_floor=False)]
        return screen[c] if steps == 1 else measured[c]

    runs = _made_up_search(monkeypatch, rate, every, estimate, space, start_floor=True)
    plain, cut = runs[False], runs[True]
    assert list(cut) == list(plain)
    final = [c for c, r in plain.items() if r["measured_steps"] == 3 and not c.start_floor]
    assert len(final) == 3
    assert sorted(c for c in plain if c.start_floor) == sorted(replace(c, start_floor=True) for c in final if c.k >= 1)
    measured3 = {c: r["samples_per_s"] for c, r in plain.items() if r["measured_steps"] == 3}
    pick = max(measured3, key=measured3.get)
    assert max((c for c, r in cut.items() if r["measured_steps"] == 3), key=lambda c: cut[c]["samples_per_s"]) == pick
    best_final = max(measured[c] for c in final)
    for c in cut:
        if c.start_floor and cut[c]["cut_off"]:
            assert floored[replace(c, start_floor=False)] < best_final


def test_a_simulation_measures_its_steps_as_they_run_inside_a_longer_run():
    """The measured steps are not a run's last ones: a run's last steps have no later prompts to take the place
    of their long groups and drain (issue 19: a k = 1 placement screened at 4.4 instead of 6.4 samples/s)."""
    from asyncflow_core.cli.plan import _capture, simulate
    from asyncflow_core.config.loader import read_yaml
    from asyncflow_core.flow.clock import run_virtual
    from asyncflow_core.flow.runtime import FlowRuntime

    raw = read_yaml(EXAMPLE)
    for cand in (Candidate(1, False, 8, 24, 8), Candidate(2, False, 8, 24, 8)):
        warm = cand.k + 1
        longer = load_config(data=raw, overrides=[*SMALL, *cand.overrides(), f"trainer.total_steps={warm + 6}",
                                                  "rollout.options.payload=lengths", "trainer.checkpoint_every=0"])
        ends = run_virtual(FlowRuntime(resolve(longer), write_png=False, roles=_capture()).run())["step_end_s"]
        for steps in (1, 2):
            row = simulate(raw, SMALL, cand, steps)
            # the simulator is deterministic: the same steps take the same virtual time (ends are rounded alike)
            assert row["samples_per_s"] == 64 * steps / (ends[warm + steps - 1] - ends[warm - 1]), (cand, steps)
            assert row["steps"] == warm + steps and not row["cut_off"]


def test_the_screened_search_picks_the_full_sweeps_best_on_a_small_config():
    """Issue 19's miss, small: three nodes, one replica size, k <= 1, one finalist. With the measured steps the
    last of their runs, k = 1 screened low and the pick was k=0 colocated at 0.87 of the sweep's best."""
    kw = {"devices": 24, "max_k": 1, "replicas_per_node": (8,), "measured_steps": 2, "workers": 1, "progress": False}
    full = run_plan(EXAMPLE, SMALL, full=True, cutoff=False, **kw)
    plan = run_plan(EXAMPLE, SMALL, shortlist=2, finalists=1, **kw)
    assert full.simulated == full.candidates == 7  # 5 placements, and the 2 with k = 1 with the start floor
    assert plan.chosen["label"] == full.chosen["label"]
    assert plan.chosen["samples_per_s"] == full.chosen["samples_per_s"]  # the same steps of the same simulation
    # the bounded sweep of benchmarks/plan_check.py prunes by the work bound less its margin (10 %): no simulated
    # rate comes near it here (64 samples a step, so a step's mean length is far noisier than at 128 devices)
    w = workload(resolve(load_config(EXAMPLE, SMALL)))
    for row in full.rows:
        assert row["samples_per_s"] <= 0.9 * work_bound_samples_per_s(w, Candidate(**row["candidate"])), row["label"]


def test_the_walk_steps_over_one_worse_node_along_the_split(monkeypatch):
    """Issue 19 at 128 devices: along the split at k = 4 the measure dips one node past the best screened
    placement (64r 102, 72r 85, 80r 122), and a walk that stops at the first worse node picks 0.84 of the best.
    Made-up rates of that shape, with and without cut-offs: the walk steps over the dip, and two worse nodes in a
    row end it on that side."""
    from asyncflow_core.cli import plan as P

    space = {"devices": 128, "node_size": 8, "max_k": 4, "replicas_per_node": (1, 2)}  # 8- and 4-device replicas
    every = candidates(**space)
    line = {48: 60.0, 56: 90.0, 64: 100.0, 72: 85.0, 80: 120.0, 88: 95.0, 96: 70.0, 104: 110.0}

    def rate(c: Candidate) -> float:
        on_line = c.k == 4 and not c.colocated and c.devices_per_replica == 8
        return line.get(c.rollout_devices, 40.0) if on_line else 50.0

    start = Candidate(4, False, 64, 64, 8)
    estimate = {c: 1.0 if c == start else 2.0 + (c.k + c.trainer_devices / 8) / 100 for c in every}

    seen_rate = {c: rate(c) for c in every}
    got = P.beyond_worse_split(start, {c: None for c in every if c.rollout_devices in (56, 72)}, seen_rate.get,
                               node_size=8)
    assert got == [Candidate(4, False, 80, 48, 8), Candidate(4, False, 48, 80, 8)]  # both sides dip: both beyond
    better = {start: 100.0, Candidate(4, False, 72, 56, 8): 90.0, Candidate(4, False, 56, 72, 8): 101.0}
    # 72r reads above 64r (the walk moves there instead): only the 56r side is stepped over
    assert P.beyond_worse_split(start, better, better.get, node_size=8) == [Candidate(4, False, 80, 48, 8)]
    assert P.beyond_worse_split(start, {}, seen_rate.get, node_size=8) == got  # neither side known: both
    runs = _made_up_search(monkeypatch, lambda c, steps: rate(c), every, estimate, space, shortlist=1)
    for cutoff, done in runs.items():
        final = {c: r for c, r in done.items() if r["measured_steps"] == 3}
        pick = max(final, key=lambda c: final[c]["samples_per_s"])
        assert pick == Candidate(4, False, 48, 80, 8), cutoff  # 80r at 120: over the dip at 72r
        screened = {c.rollout_devices for c in done if c.k == 4 and c.devices_per_replica == 8}
        assert 96 in screened and 104 not in screened  # 88r and 96r both below 80r: the walk ends on that side


def test_a_simulation_leaves_nothing_of_its_run_behind():
    """A planner's worker simulates placement after placement in one process: each run's object graph (store
    arenas, engines, the flow context) must be gone when ``simulate`` returns, not left as cyclic garbage for
    the collector's rare full passes (a 128-device full sweep grew a worker to 12 GB that way)."""
    import gc

    from asyncflow_core.cli.plan import simulate
    from asyncflow_core.config.loader import read_yaml
    from asyncflow_core.flow.runtime import FlowRuntime
    from asyncflow_core.flow.stage import FlowContext

    def runs() -> dict[int, str]:
        return {id(o): type(o).__name__ for o in gc.get_objects() if isinstance(o, (FlowRuntime, FlowContext))}

    gc.collect()
    before = runs()  # what other tests still hold (a failed test's traceback keeps its run alive), not garbage
    raw = read_yaml(EXAMPLE)
    thresholds = gc.get_threshold()
    gc.disable()  # no collection of the test's own timing may hide what simulate leaves
    try:
        simulate(raw, SMALL, Candidate(1, False, 8, 24, 8), 1)
        left = [name for i, name in runs().items() if i not in before]
    finally:
        gc.enable()
        gc.set_threshold(*thresholds)
    assert left == [], left
