"""Built-in data and rewards: the arithmetic task family, math_verify, and the file datasets."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_core.config.models import ModelConfig
from asyncflow_core.errors import ConfigError
from asyncflow_core.flow.tokenizer import CharTokenizer
from asyncflow_core.plugins import PluginKind, get_plugin_manager
from asyncflow_core.types import RewardInput
from asyncflow_plugins.arithmetic import ArithmeticConfig, check_alphabet, task_alphabet
from asyncflow_plugins.rewards import extract_answer, math_equal
from asyncflow_spec import DatasetSpec, RewardSpec

DEFAULT_ALPHABET = ModelConfig.model_fields["alphabet"].default


def make(kind: PluginKind, name: str, **options):
    return get_plugin_manager().create(kind, name, options)


def dataset(name: str, **options):
    return make(PluginKind.DATASET, name, **options)


def score(name: str, completion: str, answer, **options) -> dict[str, float]:
    reward = make(PluginKind.REWARD, name, **options)
    return reward.score(RewardInput(prompt="", completion=completion, metadata={"answer": answer}))


# ------------------------------------------------------------------------------ arithmetic dataset


class TestArithmeticDatasetSpec(DatasetSpec):
    backend = "arithmetic"
    options = {"size": 64, "operators": "+-*", "operands": 3}


class TestArithmeticRewardSpec(RewardSpec):
    backend = "arithmetic"
    samples = (
        RewardInput(prompt="12+34=", completion="46.", metadata={"answer": "46", "terminator": "."}),
        RewardInput(prompt="12+34=", completion="4", metadata={"answer": "46"}),
        RewardInput(prompt="1-3=", completion="-2.junk", metadata={"answer": "-2"}),
    )


def test_the_suite_fails_a_reward_that_returns_an_undeclared_extra_value():
    """The reward stage keeps declared extras only: a reward returning ``correct`` without declaring it would lose
    that column silently (a warning), so the spec must fail it."""
    honest = get_plugin_manager().create("reward", "arithmetic", {})
    sample = TestArithmeticRewardSpec.samples[0]
    value = honest.score(sample)
    assert isinstance(value, dict) and set(value) - {"reward"}, "the arithmetic reward returns extra values"
    RewardSpec().test_every_extra_value_it_returns_is_declared(lambda: honest)

    class Undeclared(type(honest)):
        extras = ()

        @property
        def features(self):
            return type(honest.features)(**{**honest.features.model_dump(), "extras": ()})

    lying = Undeclared(honest.config)
    with pytest.raises(AssertionError, match="returns undeclared extra values"):
        RewardSpec().test_every_extra_value_it_returns_is_declared(lambda: lying)

def test_arithmetic_records_are_deterministic_and_seed_dependent():
    a = dataset("arithmetic", size=200, seed=3)
    b = dataset("arithmetic", size=200, seed=3)
    c = dataset("arithmetic", size=200, seed=4)
    assert [a[i] for i in range(200)] == [b[i] for i in range(200)]
    assert [a[i].prompt for i in range(200)] != [c[i].prompt for i in range(200)]
    # a longer dataset with the same seed extends, never reshuffles, the shorter one
    assert dataset("arithmetic", size=500, seed=3)[199] == a[199]


def test_arithmetic_records_are_pinned():
    """Records must not change between versions or machines: evaluation sets and resume depend on them."""
    ds = dataset("arithmetic")
    assert [(ds[i].prompt, ds[i].metadata["answer"]) for i in range(4)] == [
        ("6-8=", "-2"), ("7+52=", "59"), ("75+1=", "76"), ("18-7=", "11"),
    ]
    ds = dataset("arithmetic", operators="+-*", operands=3, max_digits=3, seed=5)
    assert [ds[i].prompt for i in range(2)] == ["9-1+4=", "6+7+353="]


def test_arithmetic_records_do_not_depend_on_the_process_hash_seed():
    code = (
        "from asyncflow_core.plugins import get_plugin_manager as g;"
        "d=g().create('dataset','arithmetic',{'size':20,'seed':7});"
        "print('|'.join(d[i].prompt for i in range(20)))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    here = dataset("arithmetic", size=20, seed=7)
    assert out.strip() == "|".join(here[i].prompt for i in range(20))


def test_default_task_fits_the_default_alphabet():
    tok = CharTokenizer(DEFAULT_ALPHABET)
    assert set(task_alphabet()) <= set(DEFAULT_ALPHABET)
    ds = dataset("arithmetic", size=300, operators="+-*", operands=3, max_digits=3)
    for i in range(len(ds)):
        rec = ds[i]
        tok.encode(rec.prompt + rec.metadata["answer"] + rec.metadata["terminator"])  # raises on a foreign char


@settings(max_examples=40, deadline=None)
@given(
    operators=st.sets(st.sampled_from("+-*"), min_size=1).map("".join),
    digits=st.tuples(st.integers(1, 4), st.integers(1, 4)).map(sorted),
    operands=st.integers(2, 5),
    seed=st.integers(0, 2**32),
    template=st.sampled_from(["{expression}=", "what is {expression}?", "({expression})="]),
)
def test_generated_records_are_correct_and_within_the_task_alphabet(operators, digits, operands, seed, template):
    cfg = dict(operators=operators, min_digits=digits[0], max_digits=digits[1], operands=operands, seed=seed,
               template=template, size=30)
    ds = dataset("arithmetic", **cfg)
    allowed = set(task_alphabet(ArithmeticConfig(**cfg)))
    for i in range(len(ds)):
        rec = ds[i]
        expr = rec.metadata["expression"]
        assert rec.prompt == template.format(expression=expr)
        assert int(rec.metadata["answer"]) == eval(expr)  # noqa: S307 - the test's independent oracle
        assert set(rec.prompt + rec.metadata["answer"] + rec.metadata["terminator"]) <= allowed
        numbers = expr.replace("*", "+").replace("-", "+").split("+")
        ops = [c for c in expr if c in "+-*"]
        assert len(numbers) == operands and set(ops) <= set(operators)
        for n in numbers:
            assert digits[0] <= len(n) <= digits[1] and (n == "0" or not n.startswith("0"))


def test_task_alphabet_and_check_alphabet():
    cfg = ArithmeticConfig(operators="*", template="{expression}=", terminator=",")
    assert task_alphabet(cfg) == "0123456789*=,"  # no '-' without subtraction
    check_alphabet(cfg, DEFAULT_ALPHABET)
    with pytest.raises(ConfigError, match=r"uses '\*,'.*lacks"):
        check_alphabet(cfg, "0123456789=")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"operators": "+/"}, r"operators.*subset of '\+-\*'.*'/'"),
        ({"operators": ""}, r"operators.*non-empty"),
        ({"min_digits": 3, "max_digits": 2}, r"min_digits \(3\) is larger than max_digits \(2\)"),
        ({"terminator": ".."}, r"terminator.*exactly one character"),
        ({"terminator": "5"}, r"terminator.*can be part of an answer"),
        ({"template": "{question}="}, r"template.*'\{expression\}'.*found \{question\}"),
        ({"template": "{expression"}, r"template.*not a valid format string"),
        ({"size": 0}, r"size"),
        ({"operands": 1}, r"operands"),
        ({"digits": 2}, r"digits"),
    ],
)
def test_bad_arithmetic_options_are_config_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        dataset("arithmetic", **options)


def test_arithmetic_out_of_range_index():
    ds = dataset("arithmetic", size=3)
    with pytest.raises(IndexError, match="record 3 out of range for 3"):
        ds[3]


# ------------------------------------------------------------------------------- arithmetic reward


@pytest.mark.parametrize(
    ("completion", "answer", "options", "correct"),
    [
        ("46.", "46", {}, 1.0),
        ("46.12+", "46", {}, 1.0),  # only the text up to the first terminator counts
        (" 46 .", "46", {}, 1.0),  # surrounding spaces are tolerated
        ("47.", "46", {}, 0.0),
        ("46", "46", {}, 0.0),  # missing terminator
        ("46", "46", {"require_terminator": False}, 1.0),
        ("-7.", "-7", {}, 1.0),
        ("7.", "-7", {}, 0.0),
        ("- 7.", "-7", {}, 0.0),
        ("046.", "46", {}, 0.0),  # leading zero: not the canonical form
        ("046.", "46", {"allow_leading_zeros": True}, 1.0),
        ("-07.", "-7", {"allow_leading_zeros": True}, 1.0),
        ("0.", "0", {}, 1.0),
        ("-0.", "0", {}, 0.0),
        ("00.", "0", {}, 0.0),
        ("+46.", "46", {}, 0.0),
        ("4 6.", "46", {}, 0.0),
        ("46?", "46", {}, 0.0),
        ("46?", "46", {"terminator": "?"}, 1.0),
        (".", "46", {}, 0.0),
        ("", "46", {}, 0.0),
        ("12345678901234567890.", "12345678901234567890", {}, 1.0),
    ],
)
def test_arithmetic_reward(completion, answer, options, correct):
    out = score("arithmetic", completion, answer, **options)
    assert out["reward"] == out["correct"] == correct


def test_arithmetic_reward_reads_the_records_terminator():
    reward = make(PluginKind.REWARD, "arithmetic")
    meta = {"answer": "5", "terminator": ","}
    assert reward.score(RewardInput(prompt="2+3=", completion="5,", metadata=meta))["reward"] == 1.0
    assert reward.score(RewardInput(prompt="2+3=", completion="5.", metadata=meta))["reward"] == 0.0


def test_arithmetic_partial_credit_is_shaping_and_off_by_default():
    assert score("arithmetic", "47.", "46") == {"reward": 0.0, "correct": 0.0, "formatted": 1.0}
    shaped = score("arithmetic", "47.", "46", partial_credit=0.5)
    assert shaped == {"reward": 0.25, "correct": 0.0, "formatted": 1.0}  # 1 of 2 digits right, weight 0.5
    assert score("arithmetic", "146.", "46", partial_credit=0.5)["reward"] == pytest.approx(0.5 * 2 / 3)
    assert score("arithmetic", "46.", "46", partial_credit=0.5)["reward"] == 1.0
    assert score("arithmetic", "4x6.", "46", partial_credit=0.5) == {"reward": 0.0, "correct": 0.0, "formatted": 0.0}
    with pytest.raises(ConfigError, match="partial_credit"):
        make(PluginKind.REWARD, "arithmetic", partial_credit=1.0)


def test_arithmetic_reward_scores_the_datasets_own_answers():
    ds = dataset("arithmetic", size=50, operators="+-*", operands=3, seed=11)
    reward = make(PluginKind.REWARD, "arithmetic")
    for i in range(len(ds)):
        rec = ds[i]
        good = RewardInput(prompt=rec.prompt, completion=rec.metadata["answer"] + ".", metadata=rec.metadata)
        bad = RewardInput(prompt=rec.prompt, completion=str(int(rec.metadata["answer"]) + 1) + ".",
                          metadata=rec.metadata)
        assert reward.score(good)["reward"] == 1.0 and reward.score(bad)["reward"] == 0.0


def test_arithmetic_reward_without_answer_raises_key_error():
    reward = make(PluginKind.REWARD, "arithmetic")
    with pytest.raises(KeyError):
        reward.score(RewardInput(prompt="1+1=", completion="2.", metadata={}))


def test_bad_arithmetic_reward_options():
    with pytest.raises(ConfigError, match="terminator"):
        make(PluginKind.REWARD, "arithmetic", terminator="..")
    with pytest.raises(ConfigError, match="bogus"):
        make(PluginKind.REWARD, "arithmetic", bogus=1)


# ---------------------------------------------------------------------------------- math_verify


class TestMathVerifySpec(RewardSpec):
    backend = "math_verify"


# (completion, reference, equal?)
VERIFIER_CASES = [
    ("\\boxed{42}", "42", True),
    ("so \\boxed{\\frac{1}{2}}", "1/2", True),
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac34", True),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", True),  # nested braces
    ("\\boxed{-\\frac{3}{4}}", "-0.75", True),
    ("\\boxed{1,000}", "1000", True),
    ("\\boxed{1{,}000}", "1000", True),
    ("The answer is 72.0", "72", True),
    ("The answer is $18.", "18", True),
    ("The answer is: $1,250.50. Hope that helps.", "1250.5", True),
    ("Natalia sold 48 clips in April... #### 72", "She sold 72 clips.\n#### 72", True),  # GSM8K style
    ("#### 5\nextra text", "5", True),
    ("\\boxed{5 \\text{ cm}}", "5", True),
    ("\\boxed{\\text{(B)}}", "B", True),
    ("\\boxed{x = 3}", "3", True),
    ("\\boxed{50\\%}", "50", True),
    ("\\boxed{90^\\circ}", "90", True),
    ("\\(\\boxed{\\left(1, 2\\right)}\\)", "(1,2)", True),
    ("First \\boxed{1} then \\boxed{2}", "2", True),  # the last box wins
    ("Final answer: 18 dollars", "18", True),
    ("The answer is **7**", "7", True),
    ("\\boxed 7", "7", True),
    ("\\boxed{\\text{Yes}}", "yes", True),
    ("\\boxed{41}", "42", False),
    ("\\boxed{1/3}", "0.333", False),
    ("\\boxed{-5}", "5", False),
    ("\\boxed{12}", "1,2", False),
    ("\\boxed{(1,2)}", "(2,1)", False),
    ("\\boxed{5", "5", False),  # an unclosed box marks no answer; the whole text is not "5" either
    ("", "0", False),
    ("\\boxed{}", "0", False),
]


@pytest.mark.parametrize(("completion", "reference", "equal"), VERIFIER_CASES)
def test_math_verify_cases(completion, reference, equal):
    assert score("math_verify", completion, reference)["reward"] == float(equal)


def test_extraction_and_equality_helpers():
    assert extract_answer("a \\boxed{\\frac{a}{\\sqrt{b}}} b") == "\\frac{a}{\\sqrt{b}}"
    assert extract_answer("blah #### 1,234") == "1,234"
    assert extract_answer("Thus the answer is 3.5. Done") == "3.5"
    assert extract_answer("no marked answer 12") is None
    assert math_equal("2/4", "0.5") and math_equal("\\$1,000", "1000.00")
    assert not math_equal("1/0", "0") and not math_equal("", "")


def test_math_verify_fallbacks_and_answer_found():
    assert score("math_verify", "12", "12") == {"reward": 1.0, "answer_found": 0.0}  # whole completion
    assert score("math_verify", "I think 3 then 12", "12")["reward"] == 0.0
    assert score("math_verify", "I think 3 then 12", "12", fallback="last_number")["reward"] == 1.0
    assert score("math_verify", "12", "12", fallback="none")["reward"] == 0.0
    assert score("math_verify", "\\boxed{12}", "12")["answer_found"] == 1.0
    # the reference's own marker is used unless turned off
    assert score("math_verify", "\\boxed{4}", "2+2 = \\boxed{4}")["reward"] == 1.0
    assert score("math_verify", "\\boxed{4}", "#### 4", extract_from_reference=False)["reward"] == 0.0


def test_exact_match_is_unchanged():
    assert make(PluginKind.REWARD, "exact_match").score(
        RewardInput(prompt="", completion="so \\boxed{2}", metadata={"answer": "2"})) == 1.0
    assert make(PluginKind.REWARD, "exact_match").score(
        RewardInput(prompt="", completion="2.0", metadata={"answer": "2"})) == 0.0


# ----------------------------------------------------------------------------------- file datasets

ROWS = [
    {"question": "1+1?", "solution": "#### 2", "level": 1},
    {"question": "2+3?", "solution": "#### 5", "level": 2},
    {"question": "4*4?", "solution": "#### 16", "level": 3},
]
OPTS = {"prompt_key": "question", "answer_key": "solution", "template": "Question: {question}\nAnswer:"}


def check_rows(ds) -> None:
    assert len(ds) == 3
    for i, row in enumerate(ROWS):
        rec = ds[i]
        assert rec.index == i and rec.prompt == f"Question: {row['question']}\nAnswer:"
        assert rec.metadata == {"solution": row["solution"], "level": row["level"], "answer": row["solution"]}
    with pytest.raises(IndexError):
        ds[3]


@pytest.fixture
def jsonl_file(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    return path


@pytest.fixture
def parquet_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    return path


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    import datasets

    root = tmp_path_factory.mktemp("hf")
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(root / "single"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(root / "splits"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(root / "one_split"))
    return root


def test_jsonl_with_template_and_answer_key(jsonl_file):
    check_rows(dataset("jsonl", path=str(jsonl_file), **OPTS))


def test_jsonl_defaults_are_unchanged(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    rec = dataset("jsonl", path=str(path))[0]
    assert rec.prompt == "1+1=" and rec.metadata == {"answer": "2"}


def test_parquet_file_and_directory(tmp_path, parquet_file):
    check_rows(dataset("parquet", path=str(parquet_file), **OPTS))
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS[:2]), shards / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[2:]), shards / "part-1.parquet")
    check_rows(dataset("parquet", path=str(shards), **OPTS))


def test_hf_disk_dataset_and_splits(hf_dirs):
    check_rows(dataset("hf_disk", path=str(hf_dirs / "single"), **OPTS))
    check_rows(dataset("hf_disk", path=str(hf_dirs / "splits"), split="train", **OPTS))
    check_rows(dataset("hf_disk", path=str(hf_dirs / "one_split"), **OPTS))  # the only split needs no name
    assert len(dataset("hf_disk", path=str(hf_dirs / "splits"), split="test", **OPTS)) == 1


def test_file_dataset_feeds_math_verify(parquet_file):
    ds = dataset("parquet", path=str(parquet_file), **OPTS)
    reward = make(PluginKind.REWARD, "math_verify")
    rec = ds[2]
    assert reward.score(RewardInput(prompt=rec.prompt, completion="\\boxed{16}", metadata=rec.metadata))["reward"] == 1


class TestParquetSpec(DatasetSpec):
    backend = "parquet"

    @pytest.fixture(autouse=True)
    def _data(self, parquet_file, monkeypatch):
        monkeypatch.setattr(type(self), "options", {"path": str(parquet_file), **OPTS})


class TestHfDiskSpec(DatasetSpec):
    backend = "hf_disk"

    @pytest.fixture(autouse=True)
    def _data(self, hf_dirs, monkeypatch):
        monkeypatch.setattr(type(self), "options", {"path": str(hf_dirs / "single"), **OPTS})


# ----------------------------------------------------------------------------- bad file inputs


@pytest.mark.parametrize("name", ["jsonl", "parquet", "hf_disk"])
def test_missing_path_names_it(tmp_path, name):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=rf"data.options.path: '{missing}'"):
        dataset(name, path=str(missing))


@pytest.mark.parametrize("name", ["jsonl", "parquet", "hf_disk"])
@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"prompt_key": "prompt"},
            r"no field 'prompt' \(data.options.prompt_key\); available fields: 'question', 'solution', 'level'",
        ),
        ({"prompt_key": "question", "answer_key": "answer"}, r"no field 'answer' \(data.options.answer_key\)"),
        (
            {"prompt_key": "question", "template": "Q: {question} {hint}"},
            r"no field 'hint' \(used by data.options.template\)",
        ),
    ],
)
def test_missing_fields_name_the_source_and_the_available_fields(
    name, options, message, jsonl_file, parquet_file, hf_dirs
):
    path = {"jsonl": jsonl_file, "parquet": parquet_file, "hf_disk": hf_dirs / "single"}[name]
    with pytest.raises(ConfigError, match=message) as info:
        dataset(name, path=str(path), **options)
    assert str(path) in str(info.value)
    if name == "jsonl":
        assert f"{path}:1:" in str(info.value)  # the line


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("Q: {question", r"template.*not a valid format string"),
        ("Q: {} {question}", r"template.*positional placeholder"),
        ("Q: {0}", r"template.*positional placeholder"),
    ],
)
def test_bad_template_syntax_is_a_config_error(jsonl_file, template, message):
    with pytest.raises(ConfigError, match=message):
        dataset("jsonl", path=str(jsonl_file), prompt_key="question", template=template)


def test_template_that_fails_on_a_row_names_the_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"q": "a", "n": 1}\n{"q": "b", "n": "x"}\n')
    with pytest.raises(ConfigError, match=rf"{path}:2: template '\{{q\}} \{{n:03d\}}' failed"):
        dataset("jsonl", path=str(path), prompt_key="q", template="{q} {n:03d}")


def test_row_level_problems_name_file_and_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": "a", "a": "1"}, {"q": None, "a": "2"}]), path)
    with pytest.raises(ConfigError, match=rf"{path}: row 1: field 'q' is empty"):
        dataset("parquet", path=str(path), prompt_key="q")
    pq.write_table(pa.Table.from_pylist([{"q": "a", "a": None}]), path)
    with pytest.raises(ConfigError, match=rf"{path}: row 0: answer field 'a' is empty"):
        dataset("parquet", path=str(path), prompt_key="q", answer_key="a")
    pq.write_table(pa.Table.from_pylist([{"q": 5}]), path)
    with pytest.raises(ConfigError, match=r"row 0: field 'q' is int, not text.*template"):
        dataset("parquet", path=str(path), prompt_key="q")
    assert dataset("parquet", path=str(path), prompt_key="q", template="{q}=")[0].prompt == "5="


def test_bad_jsonl_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ConfigError, match=rf"{path}:2: not valid JSON"):
        dataset("jsonl", path=str(path))
    path.write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(ConfigError, match=rf"{path}:2: expected a JSON object, got list"):
        dataset("jsonl", path=str(path))
    path.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ConfigError, match=rf"{path}:2: no field 'prompt'.*available fields: 'text'"):
        dataset("jsonl", path=str(path))


def test_bad_parquet_sources(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"holds no \*.parquet file"):
        dataset("parquet", path=str(tmp_path / "empty"))
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(ConfigError, match=rf"{junk}: not a readable Parquet file"):
        dataset("parquet", path=str(junk))


def test_bad_hf_disk_sources(tmp_path, hf_dirs, jsonl_file):
    (tmp_path / "plain").mkdir()
    with pytest.raises(ConfigError, match=r"not a directory written by datasets' save_to_disk"):
        dataset("hf_disk", path=str(tmp_path / "plain"), **OPTS)
    with pytest.raises(ConfigError, match=r"is not a directory"):
        dataset("hf_disk", path=str(jsonl_file), **OPTS)
    with pytest.raises(ConfigError, match=r"holds splits \['train', 'test'\]; choose one with data.options.split"):
        dataset("hf_disk", path=str(hf_dirs / "splits"), **OPTS)
    with pytest.raises(ConfigError, match=r"has no split 'validation'; it has \['train', 'test'\]"):
        dataset("hf_disk", path=str(hf_dirs / "splits"), split="validation", **OPTS)
    with pytest.raises(ConfigError, match=r"single dataset, not splits; remove split"):
        dataset("hf_disk", path=str(hf_dirs / "single"), split="train", **OPTS)


@pytest.mark.parametrize(("name", "module"), [("parquet", "pyarrow"), ("hf_disk", "datasets")])
def test_missing_optional_dependency_says_what_to_install(tmp_path, monkeypatch, name, module):
    for mod in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.setitem(sys.modules, mod, None)
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ConfigError, match=rf"'{name}' dataset needs {module}.*pip install 'asyncflow\[data\]'"):
        dataset(name, path=str(tmp_path))
