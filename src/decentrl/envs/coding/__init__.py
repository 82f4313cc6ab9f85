"""`code`: write a small Python function; hidden tests run in the sandbox on the coordinator.

The whole task lives here: the problems and their single turn (`task.py`), the trusted reward
that runs the hidden tests against a solution in the sandbox and judges the result outside it
(`hidden_tests.py`), and the harness that runs inside the sandbox (`harness.py`). The sandbox itself is
the generic runner of `decentrl.sandbox`.
"""

from decentrl.envs.coding.task import CodeTask, code_reward, solution_code

__all__ = ["CodeTask", "code_reward", "solution_code"]
