"""The `dataset` environment: rows from JSONL, splits, rewards, and the one-line errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from decentrl.config import ConfigError, TaskConfig
from decentrl.envs import environment_from_config, load_environment
from decentrl.envs.base import split_of
from decentrl.envs.dataset import DIGEST_PREFIX, DatasetTask
from decentrl.sandbox.base import SandboxUnavailable


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def sums(count: int) -> list[dict]:
    return [{"question": f"{a}+{a + 1}=", "answer": str(2 * a + 1)} for a in range(count)]


def make(tmp_path: Path, rows: list[dict] | None = None, **args) -> DatasetTask:
    path = write_jsonl(tmp_path / "data.jsonl", sums(60) if rows is None else rows)
    return load_environment("dataset", path=str(path), prompt="question", **args)  # type: ignore[return-value]


def test_hash_split_is_disjoint_and_covers_every_row(tmp_path: Path) -> None:
    env = make(tmp_path, prompt_format="raw")
    train = {env.problem(seed, "train").text for seed in range(200)}
    held_out = {env.problem(seed, "eval").text for seed in range(200)}
    assert train.isdisjoint(held_out) and len(train) + len(held_out) == 60
    assert all(split_of(text) == "eval" for text in held_out)
    first = env.problem(0, "train")
    assert first == env.problem(0, "train") and first.prompt == first.text  # raw text
    assert env.problem(len(train), "train").prompt == first.prompt  # seed % rows


def test_split_column_and_eval_file(tmp_path: Path) -> None:
    rows = [{**row, "part": "test" if index % 3 == 0 else "train"} for index, row in enumerate(sums(30))]
    env = make(tmp_path, rows, split_column="part")
    assert {env.problem(seed, "eval").answer for seed in range(10)} == {
        str(2 * a + 1) for a in range(0, 30, 3)
    }
    assert make(tmp_path, rows, split_column="part", eval_values="test").problem(0, "eval") == env.problem(
        0, "eval"
    )
    held_out = write_jsonl(tmp_path / "held_out.jsonl", [{"question": "9+9=", "answer": "18"}])
    env = make(tmp_path, eval_path=str(held_out))
    assert env.problem(5, "eval").answer == "18" and len(env) == 61


def test_chat_prompts_and_messages_column(tmp_path: Path) -> None:
    assert make(tmp_path).problem(0, "train").prompt[0]["role"] == "user"  # type: ignore[index]
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    rows = [
        {"chat": conversation, "answer": "4", "split": "train"},
        {"chat": conversation, "answer": "4", "split": "eval"},
    ]
    env = make(tmp_path, rows, messages="chat", split_column="split")
    assert env.problem(3, "train").prompt == tuple(conversation)


def test_exact_math_code_and_user_rewards(tmp_path: Path) -> None:
    env = make(tmp_path, prompt_format="raw")
    problem = env.problem(0, "train")
    assert (
        env.score(problem, f" {problem.answer}\n") == 1.0 and env.score(problem, "0" + problem.answer) == 0.0
    )
    math_env = make(
        tmp_path,
        [{"question": "1/2+1/4?", "answer": "\\frac{3}{4}", "split": s} for s in ("train", "eval")],
        reward="math",
        split_column="split",
    )
    assert math_env.score(math_env.problem(0, "train"), "so \\boxed{0.75}") == 1.0
    assert math_env.score(math_env.problem(0, "train"), "\\boxed{3/5}") == 0.0
    (tmp_path / "my_reward.py").write_text(
        "def longer(completion, answer):\n    return float(len(completion) > len(answer))\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        user = make(tmp_path, reward="my_reward:longer")
        assert user.score(problem, "x" * 20) == 1.0 and user.score(problem, "") == 0.0
        (tmp_path / "bad_reward.py").write_text("def scaled(completion, answer):\n    return 10.0\n")
        with pytest.raises(
            ValueError, match=r"reward 'bad_reward:scaled' returned 10.0; it must be in \[0, 1\]"
        ):
            make(tmp_path, reward="bad_reward:scaled").score(problem, "")
    finally:
        sys.path.remove(str(tmp_path))


def test_code_reward_runs_the_tests_column(tmp_path: Path) -> None:
    rows = [
        {
            "question": "f(x) = 2x",
            "answer": "def f(x):\n    return 2 * x",
            "tests": "assert f(3) == 6\nassert f(0) == 0",
            "split": s,
        }
        for s in ("train", "eval")
    ]
    env = make(tmp_path, rows, reward="code", split_column="split")
    problem = env.problem(0, "train")
    try:
        assert env.score(problem, "```python\ndef f(x):\n    return 2 * x\n```") == 1.0
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))
    assert env.score(problem, "def f(x):\n    return x") == 0.5  # f(0) == 0 holds, f(3) == 6 fails


def test_worker_payload_has_train_prompts_only(tmp_path: Path) -> None:
    env = make(tmp_path)
    args = env.worker_args()
    assert args["path"] == DIGEST_PREFIX + env.worker_digest and "reward" not in args
    assert b"answer" not in env.worker_payload
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(env.worker_payload)
    served = load_environment("dataset", **{**args, "path": str(copy)})
    assert all(
        served.problem(seed, "train").prompt == env.problem(seed, "train").prompt for seed in range(80)
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"path": "nowhere.jsonl"}, "dataset file 'nowhere.jsonl' not found; set task.args.path"),
        ({"answer": "solution"}, "row 1 has no column 'solution'"),
        ({"split_column": "part"}, "row 1 has no column 'part'"),
        ({"reward": "exakt"}, "unknown reward 'exakt'; use one of exact, math, code"),
        ({"reward": "no_such_module_here:f"}, "reward 'no_such_module_here:f' cannot be loaded"),
        ({"reward": "json:__doc__"}, "reward 'json:__doc__' is not a function"),
        ({"eval_path": "__empty__"}, "has no eval rows; add some, or set eval_path or split_column"),
    ],
)
def test_mistakes_are_one_line_config_errors(tmp_path: Path, args: dict, message: str) -> None:
    write_jsonl(tmp_path / "data.jsonl", sums(20))
    if args.get("eval_path") == "__empty__":
        args = {"eval_path": str(write_jsonl(tmp_path / "empty.jsonl", []))}
    task = TaskConfig(
        env="dataset", args={"path": str(tmp_path / "data.jsonl"), "prompt": "question", **args}
    )
    with pytest.raises(ConfigError) as error:
        environment_from_config(task)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_bad_jsonl_line_and_missing_parquet_reader(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not JSON"):
        load_environment("dataset", path=str(tmp_path / "bad.jsonl"))
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        (tmp_path / "data.parquet").write_bytes(b"PAR1")
        with pytest.raises(ValueError, match="reading Parquet needs pyarrow: pip install pyarrow"):
            load_environment("dataset", path=str(tmp_path / "data.parquet"))


def test_warm_start_cache_follows_the_rows_not_the_path(tmp_path: Path) -> None:
    from decentrl.config import ModelConfig, SFTConfig
    from decentrl.model.warmstart_cache import warmstart_key

    path = write_jsonl(tmp_path / "data.jsonl", sums(20))
    task = TaskConfig(env="dataset", args={"path": str(path), "prompt": "question"})
    before = warmstart_key(ModelConfig(), task, SFTConfig())
    assert warmstart_key(ModelConfig(), task, SFTConfig()) == before
    write_jsonl(path, sums(21))
    assert warmstart_key(ModelConfig(), task, SFTConfig()) != before


def test_parquet_file_reads_like_jsonl(tmp_path: Path) -> None:
    parquet = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    parquet.write_table(pyarrow.Table.from_pylist(sums(40)), tmp_path / "data.parquet")
    env = load_environment("dataset", path=str(tmp_path / "data.parquet"), prompt="question")
    assert [env.problem(seed, "train") for seed in range(40)] == [
        make(tmp_path, sums(40)).problem(seed, "train") for seed in range(40)
    ]


def test_saved_dataset_dict_splits_by_its_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    saved = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(sums(30)), "test": datasets.Dataset.from_list(sums(35)[30:])}
    )
    saved.save_to_disk(str(tmp_path / "saved"))
    env = load_environment("dataset", path=str(tmp_path / "saved"), prompt="question", split_column="split")
    assert {env.problem(seed, "eval").answer for seed in range(5)} == {str(2 * a + 1) for a in range(30, 35)}
    assert len({env.problem(seed, "train").text for seed in range(30)}) == 30


def test_the_digest_reads_only_the_named_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unset `eval_path` adds nothing: the working directory's files are not the dataset's."""
    from decentrl.envs.dataset import files_digest

    (tmp_path / "data").mkdir()
    path = write_jsonl(tmp_path / "data" / "data.jsonl", sums(20))
    monkeypatch.chdir(tmp_path)
    before = files_digest({"path": str(path)})
    (tmp_path / "unrelated.bin").write_bytes(b"x" * 100)
    assert files_digest({"path": str(path), "eval_path": None}) == before
    write_jsonl(path, sums(21))
    assert files_digest({"path": str(path)}) != before
