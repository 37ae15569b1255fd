"""The controller's kept-up-to-date eligibility masks agree with a scan from scratch after any operations.

A lease attempt reads a cached bool per slot (free for the task, alive,
ready for the columns) that every state change updates; a missed update
would lease a row twice or never. Random operation sequences check the
cache against the conditions computed from the controller's arrays.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_core.store import Controller
from asyncflow_core.store.controller import DONE, FREE

COLS = ["prompt_ids", "response_ids", "reward"]
TASKS = {"rollout": ["prompt_ids"], "reward": ["prompt_ids", "response_ids"], "train": COLS}


def _scan(c: Controller, task: str, columns: list[str]) -> torch.Tensor:
    """Eligible slots computed from the arrays, without the cache."""
    n = c._n
    t = c._tasks[task]
    ok = (c._state[t.index][:n] == FREE) & c._alive[:n]
    for w, need in c._need_masks(columns):
        ok &= (c._ready[:n, w] & need) == need
    return ok.nonzero().squeeze(1)


OPS = st.lists(
    st.tuples(st.sampled_from(["put", "ready", "lease", "ack", "release", "renew", "gc", "drop", "expire",
                                  "clear"]),
              st.integers(0, 1 << 30)),
    min_size=1, max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_the_cached_eligibility_matches_a_scan_after_any_operations(ops):
    c = Controller(300)
    c.register_task("feeder", produces=["prompt_ids"])
    c.register_task("rollout", consumes=TASKS["rollout"], produces=["response_ids"])
    c.register_task("reward", consumes=TASKS["reward"], produces=["reward"])
    c.register_task("train", consumes=TASKS["train"])
    leases: list[int] = []
    now = 0.0
    for op, r in ops:
        g = torch.Generator().manual_seed(r)
        live = c._row_id[: c._n][c._alive[: c._n]]
        if op == "put":
            n = 1 + r % 40
            if c.num_live + n <= c.capacity:
                ids = c.add_rows(n)
                c.mark_ready(ids, ["prompt_ids"])
        elif op == "ready" and live.numel():
            pick = live[torch.randperm(live.numel(), generator=g)[: 1 + r % 20]].sort().values
            col = COLS[1 + r % 2]
            c.mark_ready(pick, [col], versions=torch.full((pick.numel(),), r % 3))
        elif op == "lease":
            task = list(TASKS)[r % 3]
            meta = c.try_lease(task, TASKS[task], 1 + r % 30, partial=True, lease_s=1.0 + r % 5, now=now)
            if meta is not None and len(meta):
                leases.append(meta.lease_id)
        elif op in ("ack", "release") and leases:
            lid = leases.pop(r % len(leases))
            if c.lease_info(lid) is not None:
                (c.ack if op == "ack" else c.release)(lid)
        elif op == "renew" and leases:  # at a time past some deadlines: those leases expire here instead
            c.renew(leases[r % len(leases)], lease_s=None if r % 2 else 2.0, now=now + r % 3)
        elif op == "gc":
            c.gc()
        elif op == "drop" and live.numel():
            c.drop_rows(live[torch.randperm(live.numel(), generator=g)[: 1 + r % 10]])
        elif op == "expire":
            now += 1.0 + r % 3
            c.expire(now)
        elif op == "clear" and r % 4 == 0:
            c.clear()
        for task, cols in TASKS.items():
            t = c._tasks[task]
            got, _ = c._eligible(t, cols, None, None)
            assert got.tolist() == _scan(c, task, cols).tolist(), (op, task)
            # and no row is leased twice: a leased or done row is never eligible
            held = c._state[t.index][got] != FREE
            assert not bool(held.any()) and not bool((c._state[t.index][got] == DONE).any())
