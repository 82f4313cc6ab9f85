"""`dataset`: the user's own prompts and answers from a JSONL file, a Parquet file or a Hugging
Face `datasets` directory (`save_to_disk`), with a reward named in the config.

    [task]
    env = "dataset"
    args = { path = "data/train.jsonl", prompt = "question", answer = "answer", reward = "math" }

Each row is one problem: a prompt column (a string) or a `messages` column (chat messages), and
an answer column (plus a tests column for the `code` reward). The held-out split is the rows of
`eval_path`, or those whose `split_column` holds one of `eval_values`, or else 1 in 10 rows by a
hash of the prompt (`split_of`, like the generated environments). Problem `seed` of a split is its
row `seed % len(rows)`, so coordinator and workers draw the same row from the same seed.

Workers never read the user's path: the coordinator serves them `worker_payload()`, the train
prompts alone as JSONL (no answers, no tests), named by its sha256 in `worker_args()`; a worker
fetches it once into its state directory and loads this environment from it with `served = true`.
Rewards run where they are computed (coordinator and trainer): `exact` (`base.exact_match`),
`math` (`mathematics.grading.grade`), `code` (`coding.code_reward` on the tests column) or a user
function `"module:function"` called as `function(completion, answer) -> float`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import random
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, cast

from decentrl.config import SandboxConfig
from decentrl.envs.base import Message, Problem, SingleTurnEnv, Split, TeacherHabits, exact_match, split_of
from decentrl.envs.coding import code_reward
from decentrl.envs.mathematics.grading import grade

REWARDS = ("exact", "math", "code")
DIGEST_PREFIX = "sha256:"
"""How `worker_args()` names a served file: a worker replaces it with its fetched copy."""
Row = dict[str, Any]


def _read_jsonl(path: Path) -> list[Row]:
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{path}:{number} is not JSON ({exc.msg}); each line must be one object"
            ) from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number} is not a JSON object; each line must be one object")
        rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[Row]:
    try:
        import pyarrow.parquet as parquet  # pyright: ignore[reportMissingImports] (optional, in no extra)
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from None
    return parquet.read_table(path).to_pylist()


def _read_saved_dataset(path: Path) -> list[Row]:
    """A `save_to_disk` directory; a DatasetDict's rows carry their split's name in `split`."""
    try:
        import datasets  # pyright: ignore[reportMissingImports] (optional, in no extra)
    except ImportError:
        raise ValueError(f"{path}: reading a saved dataset needs datasets: pip install datasets") from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        return [{**row, "split": name} for name, part in loaded.items() for row in part]
    return list(loaded)


def read_rows(path: str | Path) -> list[Row]:
    """The rows of a JSONL file (.jsonl, .json), a Parquet file or a saved `datasets` directory."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ValueError(
            f"dataset file {str(path)!r} not found; set task.args.path to a JSONL or Parquet file"
        )
    if path.is_dir():
        return _read_saved_dataset(path)
    if path.suffix == ".parquet":
        return _read_parquet(path)
    return _read_jsonl(path)


def user_reward(spec: str) -> Callable[[str, str], float]:
    """The function `"module:function"`, imported here (only where rewards are computed)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(
            f"unknown reward {spec!r}; use one of {', '.join(REWARDS)} or a function as 'module:function'"
        )
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"reward {spec!r} cannot be loaded ({exc}); put its module on PYTHONPATH") from None
    if not callable(function):
        raise ValueError(
            f"reward {spec!r} is not a function; it must be function(completion, answer) -> float"
        )
    return cast(Callable[[str, str], float], function)  # the user's; its signature is not checked


def files_digest(args: dict) -> str:
    """sha256 over the bytes of the files `args` name (`path`, `eval_path`; every file of a saved
    dataset directory), so a cache keyed on it changes with their content."""
    digest = hashlib.sha256()
    for key in ("path", "eval_path"):
        if not args.get(key):  # unset: not Path(""), which is the working directory
            continue
        root = Path(str(args[key])).expanduser()
        files = sorted(root.rglob("*")) if root.is_dir() else [root]
        for file in (file for file in files if file.is_file()):
            digest.update(f"{key}:{file.relative_to(root) if root.is_dir() else ''}\n".encode())
            digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


class DatasetTask(SingleTurnEnv):
    name = "dataset"

    def __init__(
        self,
        path: str,
        prompt: str = "prompt",
        answer: str = "answer",
        messages: str | None = None,
        reward: str = "exact",
        tests: str = "tests",
        prompt_format: Literal["chat", "raw"] = "chat",
        eval_path: str | None = None,
        split_column: str | None = None,
        eval_values: list[str] | None = None,
        sandbox: dict | None = None,
        served: bool = False,
    ) -> None:
        self.path = path
        self.prompt_column = messages or prompt
        self.chat_column = messages is not None
        self.answer_column, self.tests_column = answer, tests
        self.prompt_format = prompt_format
        self.served = served
        self.sandbox = SandboxConfig(**(sandbox or {}))
        if prompt_format not in ("chat", "raw"):
            raise ValueError(f"prompt_format must be 'chat' or 'raw', got {prompt_format!r}")
        self.reward_name = reward
        self._user_reward = None if served or reward in REWARDS else user_reward(reward)
        rows = read_rows(path)
        if served:  # the coordinator's payload: the train prompts, in order
            self._splits = {"train": rows, "eval": []}
            self._check_columns(rows, path, [self.prompt_column])
            return
        needed = [self.prompt_column, answer] + ([tests] if reward == "code" else [])
        self._check_columns(rows, path, needed)
        if eval_path is not None:
            held_out = read_rows(eval_path)
            self._check_columns(held_out, eval_path, needed)
            self._splits = {"train": rows, "eval": held_out}
        else:
            values = [eval_values] if isinstance(eval_values, str) else eval_values  # one value as a string
            self._splits = self._split(rows, split_column, set(values or ("eval", "test", "validation")))
        for split, part in self._splits.items():
            if not part:
                raise ValueError(
                    f"dataset {path!r} has no {split} rows; add some, or set eval_path or split_column"
                )

    def _check_columns(self, rows: list[Row], path: str, columns: list[str]) -> None:
        for number, row in enumerate(rows, start=1):
            missing = [column for column in columns if row.get(column) is None]
            if missing:
                raise ValueError(
                    f"dataset {path!r} row {number} has no column {missing[0]!r} (it has {sorted(row)}); "
                    "name the right one in task.args (prompt, answer, messages or tests)"
                )

    def _split(self, rows: list[Row], column: str | None, eval_values: set[str]) -> dict[str, list[Row]]:
        if column is not None:
            self._check_columns(rows, self.path, [column])
            held_out = [str(row[column]) in eval_values for row in rows]
        else:
            held_out = [split_of(self._text(row)) == "eval" for row in rows]
        return {
            "train": [row for row, out in zip(rows, held_out, strict=True) if not out],
            "eval": [row for row, out in zip(rows, held_out, strict=True) if out],
        }

    def _text(self, row: Row) -> str:
        return json.dumps(row[self.prompt_column]) if self.chat_column else str(row[self.prompt_column])

    def _prompt(self, row: Row) -> str | tuple[Message, ...]:
        value = row[self.prompt_column]
        if self.chat_column:
            return tuple(dict(message) for message in value)
        text = str(value)
        return text if self.prompt_format == "raw" else ({"role": "user", "content": text},)

    def __len__(self) -> int:
        return len(self._splits["train"]) + len(self._splits["eval"])

    def problem(self, seed: int, split: Split) -> Problem:
        rows = self._splits[split]
        assert rows, f"the {split} split of this dataset is empty"  # refused when loaded
        row = rows[seed % len(rows)]
        answer = "" if self.served else str(row[self.answer_column])
        info = (
            {"tests": str(row[self.tests_column])} if self.reward_name == "code" and not self.served else {}
        )
        return Problem(seed=seed, split=split, prompt=self._prompt(row), answer=answer, info=info)

    def score(self, problem: Problem, completion: str) -> float:
        assert not self.served, "a worker's copy of the dataset has no answers to score against"
        if self._user_reward is not None:
            value = float(self._user_reward(completion, problem.answer))
            if not 0.0 <= value <= 1.0:  # also NaN: a reward outside [0, 1] would skew every advantage
                raise ValueError(f"reward {self.reward_name!r} returned {value}; it must be in [0, 1]")
            return value
        if self.reward_name == "exact":
            return exact_match(completion, problem.answer)
        if self.reward_name == "math":
            return grade(completion, problem.answer).reward
        return code_reward(completion, problem.info["tests"], self.sandbox)

    def demonstration(self, problem: Problem, rng: random.Random, teacher: TeacherHabits) -> list[str]:
        """The warm start imitates the answer column."""
        return [problem.answer]

    @cached_property
    def worker_payload(self) -> bytes:
        """What workers need to play train problems: each train row's prompt column alone, as JSONL."""
        lines = [json.dumps({self.prompt_column: row[self.prompt_column]}) for row in self._splits["train"]]
        return "".join(line + "\n" for line in lines).encode()

    @cached_property
    def worker_digest(self) -> str:
        return hashlib.sha256(self.worker_payload).hexdigest()

    def worker_args(self) -> dict:
        """The arguments a worker loads this environment with: the payload named by its hash."""
        column = {"messages": self.prompt_column} if self.chat_column else {"prompt": self.prompt_column}
        return {
            "path": DIGEST_PREFIX + self.worker_digest,
            **column,
            "prompt_format": self.prompt_format,
            "served": True,
        }
