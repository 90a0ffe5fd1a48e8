"""The synthetic task: add two numbers that were stated far back, beyond the sliding window.

``a=37;<filler>b=45;<filler>a+b=`` -> ``82``. The second filler is always longer than the window
(and the first one often is), so when the answer is produced neither operand is among the window
rows: a correct answer has to come from the compressed entries (ratio 4: the indexer's top-k
picks; ratio 128: every complete 128-token entry). Filler never holds digits, ``=``, ``a`` or
``b``, so the operands are the only things worth retrieving.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

FILLER_CHARS = "cdefghijklmnopqrstuvwxyz "
HELDOUT_SEED = 20261202
HELDOUT_SIZE = 400


@dataclass(frozen=True)
class TaskSpec:
    """Ranges of the problem generator (inclusive)."""

    max_operand: int = 99
    filler1: tuple[int, int] = (4, 90)
    filler2: tuple[int, int] = (20, 90)
    """The gap between ``b=..;`` and ``a+b=``: at least ``window + 4`` keeps b out of the window."""

    @property
    def max_answer_tokens(self) -> int:
        """Answer digits plus ``<eos>``."""
        return len(str(2 * self.max_operand)) + 1

    @property
    def max_prompt_chars(self) -> int:
        n = len(str(self.max_operand))
        return 2 * (n + 3) + self.filler1[1] + self.filler2[1] + 4


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    a: int
    b: int


def _filler(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choices(FILLER_CHARS, k=rng.randint(lo, hi)))


def make_problem(rng: random.Random, spec: TaskSpec = TaskSpec()) -> Problem:
    a = rng.randint(0, spec.max_operand)
    b = rng.randint(0, spec.max_operand)
    prompt = (f"a={a};" + _filler(rng, *spec.filler1) + f"b={b};" + _filler(rng, *spec.filler2)
              + "a+b=")
    return Problem(prompt, str(a + b), a, b)


def make_problems(n: int, seed: int, spec: TaskSpec = TaskSpec()) -> list[Problem]:
    """``n`` problems from one seeded stream (the same seed always gives the same list)."""
    rng = random.Random(seed)
    return [make_problem(rng, spec) for _ in range(n)]


def heldout_problems(n: int = HELDOUT_SIZE, spec: TaskSpec = TaskSpec()) -> list[Problem]:
    """The fixed evaluation set: the first ``n`` (<= 400) problems of :data:`HELDOUT_SEED`."""
    if not 0 < n <= HELDOUT_SIZE:
        raise ValueError(f"the held-out set has {HELDOUT_SIZE} problems; asked for {n}")
    return make_problems(HELDOUT_SIZE, HELDOUT_SEED, spec)[:n]


def describe_format(spec: TaskSpec = TaskSpec()) -> str:
    """The prompt format the model was trained on, in words."""
    lo1, hi1 = spec.filler1
    lo2, hi2 = spec.filler2
    return (f"a=<0..{spec.max_operand}>;<{lo1}-{hi1} filler chars>b=<0..{spec.max_operand}>;"
            f"<{lo2}-{hi2} filler chars>a+b=  (filler: letters c-z and spaces)")


def format_problem(prompt: str, spec: TaskSpec = TaskSpec()) -> str | None:
    """None when ``prompt`` is in the trained format, else what is outside it."""
    lo1, hi1 = spec.filler1
    lo2, hi2 = spec.filler2
    filler = "[" + re.escape(FILLER_CHARS) + "]"
    m = re.fullmatch(rf"a=(\d+);({filler}*)b=(\d+);({filler}*)a\+b=", prompt)
    if m is None:
        return ("not of the form a=<number>;<filler>b=<number>;<filler>a+b= with filler of "
                "letters c-z and spaces")
    a, f1, b, f2 = m.groups()
    problems = [f"operand {v} is outside 0..{spec.max_operand}" for v in (a, b)
                if int(v) > spec.max_operand or (len(v) > 1 and v.startswith("0"))]
    if not lo1 <= len(f1) <= hi1:
        problems.append(f"the first filler has {len(f1)} chars, trained on {lo1}-{hi1}")
    if not lo2 <= len(f2) <= hi2:
        problems.append(f"the second filler has {len(f2)} chars, trained on {lo2}-{hi2}")
    return "; ".join(problems) or None
