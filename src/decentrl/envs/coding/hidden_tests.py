"""Trusted reward for code: run hidden tests against a solution in the sandbox, decide outside it.

Tests are Python source. Each top-level `assert EXPR == LITERAL` is one test (also
`assert LITERAL == EXPR`, `assert EXPR is None/True/False`, `assert EXPR` meaning `EXPR == True`
and `assert not EXPR` meaning `EXPR == False`); every other top-level statement (imports, helpers,
`from solution import f`) is a prelude run before the tests, in the solution's namespace. Only the prelude and the left-hand expressions enter the
sandbox; the expected literals stay in this process.

Why not the exit code or an in-sandbox verdict: a solution that calls `os._exit(0)` passes every
exit-code harness, and one returning an object whose `__eq__` always says True passes any
`assert f(x) == y` run next to it (both known reward hacks of code RL; MacDiarmid et al. 2025,
arXiv 2511.18397). So the harness
prints each result's repr followed by a fresh per-run nonce only after every test ran; here the
reprs are parsed as literals and compared type-strictly with the hidden values. No nonce, or a
nonce seen twice, scores 0 whatever the exit code.
"""

from __future__ import annotations

import ast
import math
import secrets
from dataclasses import dataclass
from pathlib import Path

from decentrl.config import SandboxConfig
from decentrl.sandbox import run_python

HARNESS = (Path(__file__).parent / "harness.py").read_text()
MAX_REPORT_CHARS = 2_000_000


@dataclass(frozen=True)
class TestCase:
    statement: str
    """The assert as written, for reports."""
    expression: str
    """Evaluated inside the sandbox."""
    expected: object
    """Never leaves this process."""


@dataclass(frozen=True)
class TestResult:
    statement: str
    passed: bool
    detail: str
    """'ok', the wrong value the solution produced, or its error (never the expected value)."""


@dataclass(frozen=True)
class CodeScore:
    passed: bool
    """Every test passed."""
    reward: float
    """Fraction of tests passed, in [0, 1]; 0 when the run gave no verdict."""
    tests: list[TestResult]
    reason: str
    wall_s: float


def score_solution(solution: str, tests: str, config: SandboxConfig | None = None) -> CodeScore:
    """Score `solution` (Python source) against hidden `tests` (see the module docstring) in the
    sandbox. Raises ValueError for malformed tests and SandboxUnavailable when nothing can isolate
    the run; a solution's misbehaviour only ever lowers its score."""
    prelude, cases = parse_tests(tests)
    nonce = secrets.token_hex(16)
    expressions = [case.expression for case in cases]
    harness = f"{HARNESS}\nmain({nonce!r}, {prelude!r}, {expressions!r})\n"
    run = run_python(harness, files={"solution.py": solution}, config=config)
    if run.stdout.count(nonce) != 1:
        how = f"killed ({run.killed_reason})" if run.killed_reason else f"exited with code {run.exit_code}"
        seen = run.stdout.count(nonce)
        why = "no completion marker" if seen == 0 else f"completion marker printed {seen} times"
        return _zero(cases, f"{why}: the program {how} before the tests finished", run.wall_s)
    reported = _parse_report(run.stdout.split(nonce, 1)[1].split("\n", 1)[0], len(cases))
    if reported is None:
        return _zero(cases, "malformed test report", run.wall_s)
    results = [_judge(case, status, text) for case, (status, text) in zip(cases, reported, strict=True)]
    num_passed = sum(result.passed for result in results)
    return CodeScore(
        passed=num_passed == len(cases),
        reward=num_passed / len(cases),
        tests=results,
        reason=f"{num_passed}/{len(cases)} tests passed",
        wall_s=run.wall_s,
    )


def parse_tests(tests: str) -> tuple[str, list[TestCase]]:
    """Split test source into (prelude source, test cases); ValueError names a malformed test."""
    try:
        tree = ast.parse(tests)
    except SyntaxError as exc:
        raise ValueError(f"tests do not parse: {exc}") from None
    prelude: list[str] = []
    cases: list[TestCase] = []
    for node in tree.body:
        if isinstance(node, ast.Assert):
            expression, expected = _split_assert(node.test)
            cases.append(TestCase(ast.unparse(node), ast.unparse(expression), expected))
        else:
            prelude.append(ast.unparse(node))
    if not cases:
        raise ValueError("tests contain no `assert EXPR == LITERAL` statement")
    return "\n".join(prelude), cases


def _split_assert(test: ast.expr) -> tuple[ast.expr, object]:
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, right, op = test.left, test.comparators[0], test.ops[0]
        if isinstance(op, ast.Eq):
            if _is_literal(right):
                return left, ast.literal_eval(right)
            if _is_literal(left):
                return right, ast.literal_eval(left)
        if isinstance(op, ast.Is) and isinstance(right, ast.Constant) and right.value in (None, True, False):
            return left, right.value
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return test.operand, False
    if isinstance(test, ast.Compare | ast.BoolOp):
        raise ValueError(
            f"test `assert {ast.unparse(test)}` must compare an expression with a literal "
            "(`assert f(x) == 3`): the expected value has to stay outside the sandbox"
        )
    return test, True


def _is_literal(node: ast.expr) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _parse_report(line: str, num_tests: int) -> list[tuple[str, str]] | None:
    """The harness's list of (status, text) string pairs, or None if the solution mangled it."""
    if len(line) > MAX_REPORT_CHARS:
        return None
    try:
        report = ast.literal_eval(line)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    well_formed = type(report) is list and len(report) == num_tests
    if not well_formed or not all(
        type(item) is tuple and len(item) == 2 and all(type(part) is str for part in item) for item in report
    ):
        return None
    return [(status, text) for status, text in report]


def _judge(case: TestCase, status: str, text: str) -> TestResult:
    if status != "ok":
        return TestResult(case.statement, False, text[:500])
    try:
        actual = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return TestResult(case.statement, False, f"result is not a plain literal: {text[:200]}")
    if strict_equal(actual, case.expected):
        return TestResult(case.statement, True, "ok")
    return TestResult(case.statement, False, f"wrong value: got {text[:200]}")


def strict_equal(actual: object, expected: object) -> bool:
    """Equality of plain values that also requires equal types all the way down (1 != 1.0 != True,
    [1] != (1,)); floats compare with a relative tolerance of 1e-9."""
    if type(actual) is not type(expected):
        return False
    if isinstance(expected, float) and isinstance(actual, float):
        return math.isclose(actual, expected, rel_tol=1e-9, abs_tol=1e-12) or actual == expected
    if isinstance(expected, list | tuple) and isinstance(actual, list | tuple):
        return len(actual) == len(expected) and all(map(strict_equal, actual, expected))
    if isinstance(expected, dict) and isinstance(actual, dict):
        return actual.keys() == expected.keys() and all(
            strict_equal(actual[k], expected[k]) for k in expected
        )
    return actual == expected


def _zero(cases: list[TestCase], reason: str, wall_s: float) -> CodeScore:
    failed = [TestResult(case.statement, False, "not run to completion") for case in cases]
    return CodeScore(passed=False, reward=0.0, tests=failed, reason=reason, wall_s=wall_s)
