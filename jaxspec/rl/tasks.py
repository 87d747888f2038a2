"""Verifiable tasks and their rewards: tiny built-in tasks that a small character-level
model learns on a CPU, and JSONL math datasets checked by jaxspec.rl.answers.

A task's prompt stream is a pure function of (seed, data position): `task.example(i)`,
so a resumed run continues with exactly the prompts it would have seen.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
import random
from fractions import Fraction

from jaxspec.rl import answers

__all__ = ["ArithmeticTask", "CharTokenizer", "CountdownTask", "CountingTask", "DatasetError",
           "Example", "JsonlTask", "TASKS", "WorkedAdditionTask", "load_jsonl", "make_task"]


class CharTokenizer:
    """Character-level tokenizer over a fixed alphabet; no files, no downloads.

    Ids 0, 1, 2 are PAD, BOS, EOS; then one id per character of ALPHABET. A model may have
    a larger vocabulary: ids past the alphabet decode to U+FFFD (never a valid answer)."""

    PAD, BOS, EOS = 0, 1, 2
    ALPHABET = "0123456789+-*/=(),.:; "
    chat_template = False  # prompts are raw text (base-model tasks)

    def __init__(self):
        self._id = {c: i + 3 for i, c in enumerate(self.ALPHABET)}

    @property
    def vocab_size(self) -> int:
        return 3 + len(self.ALPHABET)

    @property
    def pad_id(self) -> int:
        return self.PAD

    @property
    def bos_id(self) -> int:
        return self.BOS

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a completion (the stop tokens of generation)."""
        return (self.EOS,)

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt as the policy sees it: BOS + the text."""
        return self.encode(text, bos=True)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = []
        for pos, c in enumerate(text):
            if c not in self._id:
                raise ValueError(f"character {c!r} at {pos} of {text!r} is not in the "
                                 f"tokenizer alphabet {self.ALPHABET!r}")
            ids.append(self._id[c])
        return ([self.BOS] if bos else []) + ids + ([self.EOS] if eos else [])

    def decode(self, ids, *, stop_at_eos: bool = True) -> str:
        out = []
        for i in (int(x) for x in ids):
            if i == self.EOS and stop_at_eos:
                break
            if i in (self.PAD, self.BOS, self.EOS):
                continue
            j = i - 3
            out.append(self.ALPHABET[j] if 0 <= j < len(self.ALPHABET) else "\ufffd")
        return "".join(out)


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt: `answer` is what the reward checks, `solution` a correct completion."""

    prompt: str
    answer: str
    solution: str


def _rng(seed: int, stream: str, index: int) -> random.Random:
    # Seeding from a string hashes it with SHA-512: stable across Python versions.
    return random.Random(f"{seed}/{stream}/{index}")


class Task(abc.ABC):
    """A stream of prompts, a reward, and supervised pairs for the warm-up. A task that
    generates its prompts takes `dataset_size`: a fixed set of that many prompts visited
    in a fresh order every epoch (None: a new prompt at every position)."""

    name = "task"
    tokenizer: CharTokenizer | None = None  # None: the policy's own (HF) tokenizer

    def __init__(self, seed: int = 0, dataset_size: int | None = None):
        self.seed = int(seed)
        if dataset_size is not None and (not isinstance(dataset_size, int)
                                         or isinstance(dataset_size, bool) or dataset_size < 1):
            raise ValueError(f"dataset_size must be an int >= 1 or None; got {dataset_size!r}")
        self.dataset_size = dataset_size
        self._order: tuple[int, list[int]] | None = None

    def example(self, index: int) -> Example:
        """The prompt at data position `index` (a pure function of seed and index). With a
        dataset_size, positions visit that many fixed prompts in a fresh seeded order every
        epoch, as RL visits a finite dataset; without, every position draws a new one."""
        if self.dataset_size is not None:
            index = self._epoch_item(index, self.dataset_size, "dataset-epoch")
        return self._make(_rng(self.seed, "rl", index))

    def _epoch_item(self, position: int, n: int, tag: str) -> int:
        """The item (0..n-1) at data `position` when n items are visited in a fresh seeded
        order every epoch."""
        epoch, offset = divmod(position, n)
        if self._order is None or self._order[0] != epoch:
            order = list(range(n))
            _rng(self.seed, tag, epoch).shuffle(order)
            self._order = (epoch, order)
        return self._order[1][offset]

    def batch(self, position: int, n: int) -> list[Example]:
        """Prompts at data positions [position, position + n); the next position is
        position + n."""
        return [self.example(position + i) for i in range(n)]

    def supervised_examples(self, n: int, seed: int) -> list[tuple[str, str]]:
        """(prompt, target completion) pairs for the supervised warm-up, drawn from a
        stream separate from the RL prompts."""
        pairs = []
        for i in range(n):
            rng = _rng(seed, "warmup", i)
            ex = self._make(rng)
            pairs.append((ex.prompt, self._warmup_target(ex, rng)))
        return pairs

    @abc.abstractmethod
    def reward(self, example: Example, completion: str) -> float:
        """Reward of `completion` (text after the prompt, cut at EOS) for `example`."""

    def _make(self, rng: random.Random) -> Example:
        """A fresh example drawn with `rng` (tasks that generate their prompts)."""
        raise TypeError(f"{type(self).__name__} does not generate examples")

    def longest_prompt(self) -> str:
        """A prompt of the greatest length this task can produce, RL and warm-up streams
        alike (characters; with the task's character tokenizer, tokens less the BOS), so
        `rollout.max_prompt_len` is checked once before anything compiles."""
        raise TypeError(f"{type(self).__name__} does not generate its prompts: check each "
                        f"of them")

    def _warmup_target(self, example: Example, rng: random.Random) -> str:
        return example.solution


def _corrupt_digit(text: str, rng: random.Random) -> str:
    spots = [i for i, c in enumerate(text) if c.isdigit()]
    if not spots:
        return text
    i = rng.choice(spots)
    wrong = rng.choice([d for d in "0123456789" if d != text[i]])
    return text[:i] + wrong + text[i + 1:]


class ArithmeticTask(Task):
    """Multi-digit arithmetic: "47+38=" -> "85".

    fixed_width: operands are zero-padded to `digits` and the result to its largest width
    ("07+38=045"), so every digit sits at a fixed offset, which a tiny model learns much
    faster. reverse: the result's digits are written least-significant first ("07+38=540"),
    the order in which carries are computed. Reward 1 for the exact answer string; with
    partial_credit, a well-formed number earns 0.5 * (digits matching the answer, aligned
    at the units digit) / max(length of both), so GRPO sees graded signal. The warm-up
    targets are wrong in one digit with probability warmup_noise, so the warmed-up base
    policy is imperfect and RL has room to improve.

    The defaults suit the tiny CPU run: a 4-layer, 64-wide model learns 1-digit addition in
    ~300 warm-up steps of 64 (about a third right at temperature 1 with warmup_noise 0.5),
    then GRPO lifts it to ~0.8 reward within 40 steps; 2 digits need thousands of steps."""

    name = "arithmetic"

    def __init__(self, seed: int = 0, digits: int = 1, ops: str = "+", fixed_width: bool = True,
                 reverse: bool = False, partial_credit: bool = True, warmup_noise: float = 0.5,
                 dataset_size: int | None = None):
        super().__init__(seed, dataset_size)
        if digits < 1:
            raise ValueError(f"digits must be >= 1, got {digits}")
        if not ops or any(o not in "+-*" for o in ops):
            raise ValueError(f"ops must be a non-empty string of + - *, got {ops!r}")
        if not 0 <= warmup_noise <= 1:
            raise ValueError(f"warmup_noise must be in [0, 1], got {warmup_noise}")
        self.tokenizer = CharTokenizer()
        self.digits, self.ops, self.fixed_width, self.reverse = digits, ops, fixed_width, reverse
        self.partial_credit, self.warmup_noise = partial_credit, warmup_noise

    def format_number(self, value: int, width: int) -> str:
        """`value` as this task writes results (and, with width=digits, operands)."""
        digits = str(abs(value)).zfill(width if self.fixed_width else 1)
        return ("-" if value < 0 else "") + (digits[::-1] if self.reverse else digits)

    def _make(self, rng):
        hi = 10 ** self.digits - 1
        a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(self.ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        width = 2 * self.digits if op == "*" else self.digits + 1
        pad = self.digits if self.fixed_width else 1
        answer = self.format_number(value, width)
        return Example(f"{str(a).zfill(pad)}{op}{str(b).zfill(pad)}=", answer, answer)

    def longest_prompt(self) -> str:
        hi = str(10 ** self.digits - 1)  # operands have at most `digits` digits
        return f"{hi}{self.ops[0]}{hi}="

    def _warmup_target(self, example, rng):
        if rng.random() < self.warmup_noise:
            return _corrupt_digit(example.solution, rng)
        return example.solution

    def reward(self, example, completion):
        got, want = completion.strip(), example.answer
        if got == want:
            return 1.0
        if not self.partial_credit or not got.lstrip("-").isdigit():
            return 0.0
        g, w = got.lstrip("-"), want.lstrip("-")
        if not self.reverse:  # align at the units digit
            g, w = g[::-1], w[::-1]
        same = sum(x == y for x, y in zip(g, w, strict=False))
        return 0.5 * same / max(len(got), len(want))


def _log_uniform_int(rng: random.Random, lo: int, hi: int) -> int:
    """An int in [lo, hi]: log-uniform on [lo, hi + 1), floored (long-tailed lengths)."""
    return min(int(lo * ((hi + 1) / lo) ** rng.random()), hi)


def _worked_answer_reward(completion: str, want: str, partial_credit: bool) -> float:
    """Reward of a worked completion from its answer after the last ";": 1 when exact;
    with partial_credit, 0.5 * (digits right, aligned at the units) / max(length of both)
    for a well-formed number; 0 without a ";"."""
    if ";" not in completion:
        return 0.0
    got = completion.rsplit(";", 1)[1].strip()
    if got == want:
        return 1.0
    if not partial_credit or not got.isdigit():
        return 0.0
    same = sum(x == y for x, y in zip(got[::-1], want[::-1], strict=False))
    return 0.5 * same / max(len(got), len(want))


class WorkedAdditionTask(Task):
    """Long addition with the column-by-column work written out, like a reasoning trace:
    "47+38=" -> "7+8+0=15,4+3+1=08;085".

    Both operands have n digits (zero-padded), n drawn log-uniformly from 1..max_digits, so
    completion lengths (10n + 2 characters, plus EOS) are long-tailed: with the default
    max_digits 16 the mean is ~54 tokens, the median 42 and the 90th percentile 122 (the
    longest 163). Column i (units first) is written "x+y+c=s" with c the carry in and s the
    two-digit column sum; the answer after ";" has n + 1 digits. Reward comes from the
    answer only: 1 when exact; with partial_credit, 0.5 * (answer digits right, aligned at
    the units) / max(length of both) for a well-formed number; 0 without a ";". With
    probability warmup_noise a warm-up target adds one column wrong (by a random non-zero
    digit) and carries the mistake through to its answer, so the warmed-up policy makes
    arithmetic errors that RL can remove."""

    name = "worked_addition"

    def __init__(self, seed: int = 0, max_digits: int = 16, min_digits: int = 1,
                 partial_credit: bool = True, warmup_noise: float = 0.3,
                 dataset_size: int | None = None):
        super().__init__(seed, dataset_size)
        if not isinstance(min_digits, int) or not isinstance(max_digits, int) \
                or not 1 <= min_digits <= max_digits:
            raise ValueError(f"need integers 1 <= min_digits <= max_digits; got "
                             f"min_digits={min_digits!r}, max_digits={max_digits!r}")
        if not 0 <= warmup_noise <= 1:
            raise ValueError(f"warmup_noise must be in [0, 1], got {warmup_noise}")
        self.tokenizer = CharTokenizer()
        self.min_digits, self.max_digits = min_digits, max_digits
        self.partial_credit, self.warmup_noise = partial_credit, warmup_noise

    def _digits(self, rng: random.Random) -> int:
        return _log_uniform_int(rng, self.min_digits, self.max_digits)

    @staticmethod
    def work(a: str, b: str, wrong_column: int | None = None, error: int = 0) -> str:
        """The worked completion for n-digit operand strings a and b; column `wrong_column`
        (0 = units) has `error` added to its sum digit (mod 10)."""
        steps, carry, answer = [], 0, []
        for i in range(len(a)):
            x, y = int(a[-1 - i]), int(b[-1 - i])
            total = x + y + carry
            if i == wrong_column:
                total = total - total % 10 + (total % 10 + error) % 10
            steps.append(f"{x}+{y}+{carry}={total:02d}")
            carry, digit = divmod(total, 10)
            answer.append(str(digit))
        return ",".join(steps) + ";" + str(carry) + "".join(reversed(answer))

    def _make(self, rng):
        n = self._digits(rng)
        a = "".join(rng.choice("0123456789") for _ in range(n))
        b = "".join(rng.choice("0123456789") for _ in range(n))
        solution = self.work(a, b)
        return Example(f"{a}+{b}=", solution.split(";")[1], solution)

    def longest_prompt(self) -> str:
        return f"{'9' * self.max_digits}+{'9' * self.max_digits}="

    def _warmup_target(self, example, rng):
        if rng.random() >= self.warmup_noise:
            return example.solution
        a, b = example.prompt[:-1].split("+")
        return self.work(a, b, wrong_column=rng.randrange(len(a)), error=rng.randint(1, 9))

    def reward(self, example, completion):
        return _worked_answer_reward(completion, example.answer, self.partial_credit)


class CountingTask(Task):
    """Addition by counting, a long and locally predictable trace: "17+4=" ->
    "17:4,18:3,19:2,20:1,21:0;21" (count up from a while counting n down to 0, then the
    sum after ";").

    n is drawn log-uniformly from min_count..max_count and a uniformly from
    0..max_number - n, so completion lengths are long-tailed: with the defaults (n of 2-24,
    sums up to 99) the mean is ~52 tokens, the median ~38 and the 90th percentile ~3x the
    median (the longest 143). Every item is the one before it with the number up one and
    the counter down one, and the stop (counter 0) is local, which a small policy and a
    one-layer draft head learn quickly. Reward comes from the sum after the last ";": 1
    when exact; with partial_credit, 0.5 * (digits right, aligned at the units) /
    max(length of both) for a well-formed number; 0 without a ";". With probability
    warmup_noise a warm-up target miscounts once (at a random item the number steps by 0
    or 2 instead of 1, and counting goes on from there), so the warmed-up policy miscounts
    now and then and RL can remove it. dataset_size: a fixed set of that many prompts,
    visited in a fresh order every epoch (None: a new prompt at every position)."""

    name = "counting"

    def __init__(self, seed: int = 0, max_count: int = 24, min_count: int = 2,
                 max_number: int = 99, partial_credit: bool = True, warmup_noise: float = 0.3,
                 dataset_size: int | None = None):
        super().__init__(seed, dataset_size)
        for key, value in (("min_count", min_count), ("max_count", max_count),
                           ("max_number", max_number)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{key} must be an integer, got {value!r}")  # noqa: TRY004
        if not 1 <= min_count <= max_count:
            raise ValueError(f"need 1 <= min_count <= max_count; got min_count={min_count}, "
                             f"max_count={max_count}")
        if max_number < max_count:
            raise ValueError(f"max_number must be >= max_count = {max_count} (the largest "
                             f"sum), got {max_number}")
        if not 0 <= warmup_noise <= 1:
            raise ValueError(f"warmup_noise must be in [0, 1], got {warmup_noise}")
        self.tokenizer = CharTokenizer()
        self.min_count, self.max_count, self.max_number = min_count, max_count, max_number
        self.partial_credit, self.warmup_noise = partial_credit, warmup_noise

    @staticmethod
    def work(a: int, n: int, slip: int | None = None, step: int = 1) -> str:
        """The worked completion counting n up from a; at item `slip` (1..n) the number
        moves by `step` instead of 1."""
        items, x = [f"{a}:{n}"], a
        for i in range(1, n + 1):
            x += step if i == slip else 1
            items.append(f"{x}:{n - i}")
        return ",".join(items) + f";{x}"

    def _make(self, rng):
        n = _log_uniform_int(rng, self.min_count, self.max_count)
        a = rng.randint(0, self.max_number - n)
        return Example(f"{a}+{n}=", str(a + n), self.work(a, n))

    def longest_prompt(self) -> str:
        # a is at most max_number - n: the longest "a+n=" over every count n
        n = max(range(self.min_count, self.max_count + 1),
                key=lambda n: len(f"{self.max_number - n}+{n}="))
        return f"{self.max_number - n}+{n}="

    def _warmup_target(self, example, rng):
        if rng.random() >= self.warmup_noise:
            return example.solution
        a, n = (int(x) for x in example.prompt[:-1].split("+"))
        return self.work(a, n, slip=rng.randint(1, n), step=rng.choice((0, 2)))

    def reward(self, example, completion):
        return _worked_answer_reward(completion, example.answer, self.partial_credit)


class _ExprError(ValueError):
    pass


def _evaluate(expr: str, ops: str) -> tuple[Fraction, list[int]]:
    """Value of an integer expression over `ops` and parentheses (precedence as usual) and
    the numbers it uses; no eval()."""
    tokens, i = [], 0
    while i < len(expr):
        c = expr[i]
        if c.isdigit():
            j = i
            while j < len(expr) and expr[j].isdigit():
                j += 1
            tokens.append(int(expr[i:j]))
            i = j
        elif c in ops or c in "()":
            tokens.append(c)
            i += 1
        elif c == " ":
            i += 1
        else:
            raise _ExprError(f"unexpected {c!r}")
    pos, used = 0, []

    def atom():
        nonlocal pos
        if pos >= len(tokens):
            raise _ExprError("unexpected end")
        t = tokens[pos]
        pos += 1
        if t == "(":
            v = sum_()
            if pos >= len(tokens) or tokens[pos] != ")":
                raise _ExprError("unclosed (")
            pos += 1
            return v
        if isinstance(t, int):
            used.append(t)
            return Fraction(t)
        raise _ExprError(f"unexpected {t!r}")

    def product():
        nonlocal pos
        v = atom()
        while pos < len(tokens) and tokens[pos] in ("*", "/"):
            op = tokens[pos]
            pos += 1
            w = atom()
            if op == "/" and w == 0:
                raise _ExprError("division by zero")
            v = v * w if op == "*" else v / w
        return v

    def sum_():
        nonlocal pos
        v = product()
        while pos < len(tokens) and tokens[pos] in ("+", "-"):
            op = tokens[pos]
            pos += 1
            w = product()
            v = v + w if op == "+" else v - w
        return v

    value = sum_()
    if pos != len(tokens):
        raise _ExprError(f"trailing {tokens[pos]!r}")
    return value, used


class CountdownTask(Task):
    """Tiny Countdown: "3,5,7:22=" -> an expression using each number exactly once with
    the allowed operations, e.g. "3*5+7".

    Reward 1 for a correct expression; with partial_credit, 0.1 for a well-formed
    expression over exactly the given numbers whose value is wrong. The target always has a
    solution: the value of a random expression over the numbers, drawn again until it is a
    whole number >= 0 (after 100 draws, the sum, or with no "+" the product, of the last
    numbers; so `ops` must hold "+" or "*")."""

    name = "countdown"

    def __init__(self, seed: int = 0, count: int = 3, max_number: int = 9, ops: str = "+-*",
                 partial_credit: bool = True, warmup_noise: float = 0.3,
                 dataset_size: int | None = None):
        super().__init__(seed, dataset_size)
        if count < 2:
            raise ValueError(f"count must be >= 2, got {count}")
        if max_number < 1:
            raise ValueError(f"max_number must be >= 1, got {max_number}")
        if not ops or any(o not in "+-*/" for o in ops) or not set(ops) & set("+*"):
            raise ValueError(f"ops must be a string of + - * / holding + or * (so every draw "
                             f"of numbers has a whole target >= 0), got {ops!r}")
        if not 0 <= warmup_noise <= 1:
            raise ValueError(f"warmup_noise must be in [0, 1], got {warmup_noise}")
        self.tokenizer = CharTokenizer()
        self.count, self.max_number, self.ops = count, max_number, ops
        self.partial_credit, self.warmup_noise = partial_credit, warmup_noise

    def _make(self, rng):
        for _ in range(100):
            nums = [rng.randint(1, self.max_number) for _ in range(self.count)]
            order = nums[:]
            rng.shuffle(order)
            expr = str(order[0])
            for n in order[1:]:
                expr += rng.choice(self.ops) + str(n)
            value, _ = _evaluate(expr, self.ops)
            if value >= 0 and value.denominator == 1:
                break
        else:  # no whole target >= 0 in 100 draws: the last numbers' sum (or product)
            expr = ("+" if "+" in self.ops else "*").join(map(str, order))
            value, _ = _evaluate(expr, self.ops)
        prompt = ",".join(map(str, nums)) + f":{value.numerator}="
        return Example(prompt, str(value.numerator), expr)

    def longest_prompt(self) -> str:
        # every number at max_number, the target at its largest: with max_number >= 2 the
        # product of all of them (a sum of products of disjoint groups is at most it),
        # else (all ones) their sum when "+" is allowed
        m, c = self.max_number, self.count
        best = max((m ** c if "*" in self.ops else 0), (c * m if "+" in self.ops else 0))
        return ",".join([str(m)] * c) + f":{best}="

    def _warmup_target(self, example, rng):
        if rng.random() < self.warmup_noise:
            return _corrupt_digit(example.solution, rng)
        return example.solution

    def reward(self, example, completion):
        nums = sorted(int(x) for x in example.prompt.split(":")[0].split(","))
        try:
            value, used = _evaluate(completion.strip(), self.ops)
        except _ExprError:
            return 0.0
        if sorted(used) != nums:
            return 0.0
        if value == int(example.answer):
            return 1.0
        return 0.1 if self.partial_credit else 0.0


class DatasetError(ValueError):
    """A JSONL dataset that cannot be used: empty, or a bad line (named with its number)."""


def load_jsonl(path: str | os.PathLike) -> list[Example]:
    """Examples from a file of {"prompt": str, "answer": str | number} lines (blank lines
    are skipped; other keys are ignored)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"JSONL dataset not found: {path!r} (nothing is downloaded; "
                                f"give a local file of {{\"prompt\", \"answer\"}} lines)")
    out = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{lineno}: expected an object with \"prompt\" and "
                                   f"\"answer\", got {type(row).__name__}")
            for key in ("prompt", "answer"):
                if key not in row:
                    raise DatasetError(f"{path}:{lineno}: missing key {key!r} "
                                       f"(keys: {sorted(row)})")
            if not isinstance(row["prompt"], str) or not row["prompt"]:
                raise DatasetError(f"{path}:{lineno}: \"prompt\" must be a non-empty string")
            ans = row["answer"]
            if isinstance(ans, bool) or not isinstance(ans, (str, int, float)):
                raise DatasetError(f"{path}:{lineno}: \"answer\" must be a string or a "
                                   f"number, got {type(ans).__name__}")
            out.append(Example(row["prompt"], str(ans), str(ans)))
    if not out:
        raise DatasetError(f"{path}: the dataset is empty (no \"prompt\"/\"answer\" lines)")
    return out


class JsonlTask(Task):
    """Math prompts from a JSONL file, visited in a fresh seeded order every epoch;
    reward 1 when the completion's final answer matches (`answers.check_answer`:
    math-verify, with our checker where it gives no verdict)."""

    name = "jsonl"

    def __init__(self, path: str, seed: int = 0, shuffle: bool = True):
        super().__init__(seed)
        self.path = path
        self.examples = load_jsonl(path)
        self.shuffle = shuffle

    def _index(self, position: int) -> int:
        n = len(self.examples)
        if not self.shuffle:
            return position % n
        return self._epoch_item(position, n, "jsonl-epoch")

    def example(self, index):
        return self.examples[self._index(index)]

    def supervised_examples(self, n, seed):
        return [(ex.prompt, ex.solution) for ex in
                (self.examples[_rng(seed, "warmup", i).randrange(len(self.examples))]
                 for i in range(n))]

    def reward(self, example, completion):
        return 1.0 if answers.check_answer(completion, example.answer) else 0.0


TASKS: dict[str, type[Task]] = {
    "arithmetic": ArithmeticTask,
    "countdown": CountdownTask,
    "jsonl": JsonlTask,
    "worked_addition": WorkedAdditionTask,
    "counting": CountingTask,
}


def make_task(name: str, *, seed: int = 0, path: str | None = None, **params) -> Task:
    """The task registered as `name` (config: task.name, task.params, task.path)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; registered: {', '.join(TASKS)}")
    if path is not None:
        params["path"] = path
    return TASKS[name](seed=seed, **params)
