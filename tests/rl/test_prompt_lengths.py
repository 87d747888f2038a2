"""Every built-in task's stated longest prompt (`Task.longest_prompt`) against brute force:
the task's own generator run down every sequence of random draws it can make, and a large
sample at the default parameters; then the run's check of `rollout.max_prompt_len`
against it, which stops with one `error:` line before anything compiles."""

import itertools
import logging
import pathlib

import jax
import pytest

from jaxspec.config import load_config
from jaxspec.rl.plan import prepare_run
from jaxspec.testing.scripts import load_script
from jaxspec.rl.tasks import TASKS, ArithmeticTask, CountdownTask, CountingTask, JsonlTask, \
    WorkedAdditionTask

ROOT = pathlib.Path(__file__).resolve().parents[2]
train_grpo = load_script("train_grpo")

LONG = str(ROOT / "configs" / "long.yaml")


class _Cut(Exception):
    """A path that draws more than a single attempt's worth (a redraw of the same set)."""


class EveryDraw:
    """A stand-in for `random.Random` that walks, depth first, every sequence of draws a
    generator can make: randint/randrange/choice branch on each value, shuffle on each
    permutation, random() on a grid of `grid` points of [0, 1) (fine enough that every
    outcome of a continuous draw the tasks make is hit)."""

    def __init__(self, grid: int):
        self.grid = grid
        self.path: list[int] = []  # the choice taken at each draw of the current walk
        self.arity: list[int] = []  # how many choices each of those draws had

    def _draw(self, n: int) -> int:
        if self.at == self.limit:
            raise _Cut
        if self.at == len(self.path):
            self.path.append(0)
            self.arity.append(n)
        assert self.arity[self.at] == n, "the generator must branch the same way on replay"
        self.at += 1
        return self.path[self.at - 1]

    def randint(self, a, b):
        return a + self._draw(b - a + 1)

    def randrange(self, n):
        return self._draw(n)

    def choice(self, seq):
        return seq[self._draw(len(seq))]

    def random(self):
        return (self._draw(self.grid) + 0.5) / self.grid

    def shuffle(self, x):
        perms = list(itertools.permutations(range(len(x))))
        perm = perms[self._draw(len(perms))]
        x[:] = [x[i] for i in perm]

    def outcomes(self, make, limit: int) -> list:
        """make(self) along every path of at most `limit` draws."""
        out, self.path, self.arity, self.limit = [], [], [], limit
        while True:
            self.at = 0
            try:
                out.append(make(self))
            except _Cut:
                pass
            del self.path[self.at:], self.arity[self.at:]  # a cut walk: its deeper draws
            while self.path and self.path[-1] + 1 == self.arity[-1]:
                self.path.pop()
                self.arity.pop()
            if not self.path:
                return out
            self.path[-1] += 1


# (task, random() grid, draws of one attempt): small enough to enumerate in a second or two
SMALL = {
    "arithmetic": [(ArithmeticTask(digits=2, ops="+-*", fixed_width=False), 1, 3),
                   (ArithmeticTask(digits=1, ops="-"), 1, 3)],
    "worked_addition": [(WorkedAdditionTask(min_digits=1, max_digits=2), 10, 5)],
    # n of 1-12 under 105: "104+1=" and "95+10=" tie at 6 characters, n = 6-9 give 5
    "counting": [(CountingTask(min_count=1, max_count=12, max_number=105), 100, 2),
                 (CountingTask(), 200, 2)],
    # count numbers, one shuffle, count - 1 operators; a second attempt redraws the same set
    "countdown": [(CountdownTask(count=3, max_number=6), 1, 6),
                  (CountdownTask(count=2, max_number=12, ops="+*/"), 1, 4),
                  (CountdownTask(count=2, max_number=1, ops="*-"), 1, 4)],
}


def test_every_generated_task_is_covered():
    generated = {name for name, cls in TASKS.items() if cls is not JsonlTask}
    assert set(SMALL) == generated, "a new built-in task needs its brute-force case here"


@pytest.mark.parametrize("name,case", [(n, i) for n, cases in SMALL.items()
                                       for i in range(len(cases))])
def test_longest_prompt_is_the_brute_force_maximum(name, case):
    task, grid, draws = SMALL[name][case]
    prompts = {ex.prompt for ex in EveryDraw(grid).outcomes(task._make, draws)}
    stated = task.longest_prompt()
    assert stated in prompts  # a prompt the task really makes ...
    assert len(stated) == max(len(p) for p in prompts)  # ... and none is longer


def test_the_brute_force_catches_a_wrong_statement():
    """Negative controls: the prompts of the smallest count (counting) and the sum target
    (countdown) are shorter than the longest the brute force finds."""
    task = CountingTask()
    prompts = {ex.prompt for ex in EveryDraw(200).outcomes(task._make, 2)}
    assert len("97+2=") < max(len(p) for p in prompts) == len(task.longest_prompt()) == 6
    task = CountdownTask(count=3, max_number=6)
    prompts = {ex.prompt for ex in EveryDraw(1).outcomes(task._make, 6)}
    assert len("6,6,6:18=") < max(len(p) for p in prompts)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_no_sampled_prompt_is_longer_than_the_stated_one(name):
    """The default parameters, where brute force is out of reach (worked_addition: 10^32
    operand pairs): 4000 prompts of the RL stream and 4000 of the warm-up stream."""
    task = TASKS[name]()
    sample = [ex.prompt for ex in task.batch(0, 4000)]
    sample += [p for p, _ in task.supervised_examples(4000, seed=7)]
    stated = len(task.longest_prompt())
    assert max(len(p) for p in sample) <= stated
    # the stated length is reached by the sample where the longest prompts are common
    if name in ("arithmetic", "counting"):
        assert max(len(p) for p in sample) == stated


def test_countdown_needs_an_operator_that_always_has_a_whole_target():
    with pytest.raises(ValueError, match=r"holding \+ or \*"):
        CountdownTask(ops="-/")


def test_countdown_after_100_bad_draws_uses_the_sum():
    """A generator whose every attempt is "1-5" (numbers 1 and 5, smallest first, '-'):
    after 100 negative values the target is the last numbers' sum."""

    class Negative:
        calls = 0

        def randint(self, a, b):
            self.calls += 1
            return 1 if self.calls % 2 else 5

        def shuffle(self, x):
            x.sort()

        def choice(self, seq):
            assert "-" in seq
            return "-"

    rng = Negative()
    ex = CountdownTask(count=2, max_number=5)._make(rng)
    assert rng.calls == 200  # 100 attempts of two numbers
    assert (ex.prompt, ex.answer, ex.solution) == ("1,5:6=", "6", "1+5")
    assert CountdownTask(count=2, max_number=5).reward(ex, ex.solution) == 1.0


def test_max_prompt_len_below_a_task_prompt_stops_before_compiling(tmp_path, capsys, caplog):
    """The issue's command: countdown prompts reach 11 tokens ('9,9,9:729=' + BOS)."""
    with caplog.at_level(logging.WARNING), jax.log_compiles(True):
        code = train_grpo.main([LONG, "task.name=countdown", "rollout.max_prompt_len=10",
                                f"run.dir={tmp_path / 'run'}"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert "'rollout.max_prompt_len' = 10" in err[0] and "'9,9,9:729='" in err[0]
    assert "has 11 tokens" in err[0] and "valid: >= 11" in err[0]
    assert not [r for r in caplog.records if "Compiling" in r.getMessage()]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", sorted(SMALL))
def test_the_check_passes_at_the_stated_length_and_fails_one_below(name, tmp_path):
    tokens = 1 + len(TASKS[name]().longest_prompt())  # BOS + characters
    base = [f"task.name={name}", f"run.dir={tmp_path}", "task.params={}",
            "rollout.max_new_tokens=16", "model.max_position_embeddings=256"]
    prepare_run(load_config(LONG, base + [f"rollout.max_prompt_len={tokens}"]))
    with pytest.raises(ValueError, match=rf"rollout.max_prompt_len' = {tokens - 1}: the "
                                         rf"longest prompt of task '{name}'"):
        prepare_run(load_config(LONG, base + [f"rollout.max_prompt_len={tokens - 1}"]))
