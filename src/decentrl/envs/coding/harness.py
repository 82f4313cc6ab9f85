"""Test harness that runs *inside* the sandbox as main.py (`hidden_tests.py` sends its text).

The caller appends `main(nonce, prelude, expressions)`; it executes solution.py, evaluates each
test expression and prints the repr of each value. Nothing here has to be trusted: the solution shares
this interpreter and may patch any of it. What makes scoring sound lives outside the sandbox:

- the expected values never enter the sandbox, so a forged report still has to contain the right
  values, and the caller compares them type-strictly after parsing the reprs as literals
  (an object whose __eq__ always says True cannot survive that round trip);
- the nonce line is printed last, after every test ran, so an early `os._exit(0)`, a crash or a
  kill leaves no verdict at all, and any exit code is ignored.

It imports nothing but `sys` (under `python -I -S`): importing json alone costs ~10 ms, half a
sandboxed run.
"""

import sys

PLAIN = (int, float, complex, str, bytes, bool, type(None))
SEQUENCES = (list, tuple, set, frozenset)
MAX_DEPTH = 50
MAX_REPR_CHARS = 100_000


def plain_repr(value):
    """repr of a value built only from builtin literal types (exact types: no subclasses)."""
    _check_plain(value, 0)
    text = repr(value)
    if len(text) > MAX_REPR_CHARS:
        raise ValueError(f"result repr is {len(text)} characters (limit {MAX_REPR_CHARS})")
    return text


def _check_plain(value, depth):
    kind = type(value)
    if depth > MAX_DEPTH:
        raise TypeError("result is nested too deeply")
    if kind in PLAIN:
        return
    if kind is dict:
        for key, item in value.items():
            _check_plain(key, depth + 1)
            _check_plain(item, depth + 1)
        return
    if kind in SEQUENCES:
        for item in value:
            _check_plain(item, depth + 1)
        return
    raise TypeError(f"returned a {kind.__name__!s}, not a plain value (int, float, str, list, dict, ...)")


def describe(exc):
    try:
        message = str(exc)
    except BaseException:
        message = ""
    return f"{type(exc).__name__}: {message}"[:500]


def main(nonce, prelude, expressions):
    # The solution is module `solution` (importable by the prelude); not being __main__, its
    # `if __name__ == "__main__":` block does not run. Tests run in its namespace.
    module = type(sys)("solution")
    module.__file__ = "solution.py"
    sys.modules["solution"] = module
    namespace = module.__dict__
    results = []
    try:
        with open("solution.py") as handle:
            exec(compile(handle.read(), "solution.py", "exec"), namespace)
        exec(compile(prelude, "tests", "exec"), namespace)
    except BaseException as exc:  # SystemExit included: exiting early is a failure, not a pass
        results = [("error", "solution did not load: " + describe(exc))] * len(expressions)
    else:
        for expression in expressions:
            try:
                results.append(("ok", plain_repr(eval(expression, namespace))))
            except BaseException as exc:
                results.append(("error", describe(exc)))
    sys.stdout.write("\n" + nonce + " " + repr(results) + "\n")
    sys.stdout.flush()
