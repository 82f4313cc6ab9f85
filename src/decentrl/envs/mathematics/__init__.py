"""`math`: generated math problems, scored with math-verify on the answer's single `\\boxed{}`.

The problems and their single turn are `task.py`; the grader is `grading.py` (`grade`: exactly one
box, one value, symbolically equal to the gold), also the reward of `math500`, of a dataset's
`math` reward and of the rubric's `math_verify` and `format` terms.
"""

from decentrl.envs.mathematics.task import MathTask

__all__ = ["MathTask"]
