"""Write the GSM8K-style grade-school problems the CPU recipe ships (examples/data/gsm8k_{train,eval}.jsonl).

The problems are the project's own, generated from templates with a fixed
seed: two-to-three-step word problems (shopping, sharing, rates, ages) whose
worked solution ends, as GSM8K's do, with ``#### <answer>``. Each row is a
chat (``messages``: one user turn asking for that format), the worked
``solution`` and the bare ``answer``. Train and eval share no question.

    python scripts/make_gsm8k_data.py            # rewrites both files (identical bytes every time)
    python scripts/make_gsm8k_data.py --checkpoint runs/tiny-chat   # also builds the local chat checkpoint

``--checkpoint`` writes the tiny random Qwen2 chat checkpoint of
:func:`asyncflow_plugins.hf.testing.build_local_chat_checkpoint` (BPE tokenizer
trained on the fly, ChatML template, generation_config.json): the model
``examples/gsm8k_cpu.yaml`` loads by path. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Kira", "Liam", "Maya",
         "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells"]
INSTRUCTION = "Solve the problem. Show your steps, then give the final answer on its own line as '#### <number>'."

Problem = tuple[str, str, int]  # question, worked solution, answer


def _shopping(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    n, price, paid = rng.randint(2, 9), rng.randint(2, 12), 0
    cost = n * price
    paid = cost + rng.randint(1, 30)
    change = paid - cost
    q = (f"{name} buys {n} {item} that cost ${price} each. {name} pays with ${paid}. "
         f"How many dollars of change does {name} get?")
    s = (f"The {item} cost {n} * {price} = {cost} dollars.\n"
         f"The change is {paid} - {cost} = {change} dollars.\n#### {change}")
    return q, s, change


def _sharing(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each, left = rng.randint(2, 8), rng.randint(2, 9), rng.randint(0, 9)
    total = friends * each + left
    q = (f"{name} has {total} {item} and gives {each} to each of {friends} friends. "
         f"How many {item} does {name} have left?")
    s = (f"{name} gives away {friends} * {each} = {friends * each} {item}.\n"
         f"{total} - {friends * each} = {left}.\n#### {left}")
    return q, s, left


def _rate(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    per_hour, hours, days = rng.randint(5, 25), rng.randint(2, 8), rng.randint(2, 6)
    daily = per_hour * hours
    total = daily * days
    q = (f"{name} earns ${per_hour} an hour and works {hours} hours a day. "
         f"How much does {name} earn in {days} days?")
    s = (f"In a day {name} earns {per_hour} * {hours} = {daily} dollars.\n"
         f"In {days} days: {daily} * {days} = {total}.\n#### {total}")
    return q, s, total


def _ages(rng: random.Random) -> Problem:
    a, b = rng.sample(NAMES, 2)
    age_b, diff, years = rng.randint(4, 30), rng.randint(1, 15), rng.randint(2, 20)
    age_a = age_b + diff
    total = age_a + years + age_b + years
    q = (f"{a} is {diff} years older than {b}. {b} is {age_b} years old. "
         f"What will the sum of their ages be in {years} years?")
    s = (f"{a} is {age_b} + {diff} = {age_a}.\nIn {years} years they are {age_a + years} and {age_b + years}.\n"
         f"{age_a + years} + {age_b + years} = {total}.\n#### {total}")
    return q, s, total


def _boxes(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    boxes, per_box, extra, lost = rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 20), rng.randint(1, 10)
    have = boxes * per_box + extra
    left = have - lost
    q = (f"{name} has {boxes} boxes with {per_box} {item} in each, and {extra} loose {item}. "
         f"{name} loses {lost} of them. How many {item} are left?")
    s = (f"The boxes hold {boxes} * {per_box} = {boxes * per_box}.\nWith the loose ones: {boxes * per_box} + {extra} = "
         f"{have}.\nAfter losing {lost}: {have} - {lost} = {left}.\n#### {left}")
    return q, s, left


KINDS: list[Callable[[random.Random], Problem]] = [_shopping, _sharing, _rate, _ages, _boxes]


def problems(count: int, seed: int) -> list[Problem]:
    """``count`` distinct problems (by question), the same for the same seed."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[Problem] = []
    while len(out) < count:
        p = rng.choice(KINDS)(rng)
        if p[0] not in seen:
            seen.add(p[0])
            out.append(p)
    return out


def row(p: Problem) -> dict:
    q, s, a = p
    return {"messages": [{"role": "user", "content": f"{INSTRUCTION}\n\n{q}"}], "solution": s, "answer": str(a)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "examples" / "data")
    ap.add_argument("--train", type=int, default=200)
    ap.add_argument("--eval", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="also build the local tiny chat checkpoint here (what examples/gsm8k_cpu.yaml loads)")
    args = ap.parse_args()
    if args.checkpoint is not None:
        from asyncflow_plugins.hf.testing import build_local_chat_checkpoint

        print(f"wrote the local chat checkpoint {build_local_chat_checkpoint(args.checkpoint)}")
    ps = problems(args.train + args.eval, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, part in (("gsm8k_train.jsonl", ps[: args.train]), ("gsm8k_eval.jsonl", ps[args.train:])):
        with (args.out / name).open("w", encoding="utf-8") as fh:
            for p in part:
                fh.write(json.dumps(row(p)) + "\n")
        print(f"wrote {len(part)} problems to {args.out / name}")


if __name__ == "__main__":
    main()
