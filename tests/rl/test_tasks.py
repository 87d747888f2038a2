"""Built-in tasks, the character tokenizer and the JSONL loader."""

import json

import numpy as np
import pytest

from jaxspec.rl.tasks import (
    TASKS,
    ArithmeticTask,
    CharTokenizer,
    CountdownTask,
    CountingTask,
    DatasetError,
    Example,
    JsonlTask,
    WorkedAdditionTask,
    load_jsonl,
    make_task,
)

# ----------------------------------------------------------------------------- tokenizer

def test_tokenizer_round_trip_and_specials():
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 3 + len(CharTokenizer.ALPHABET) <= 64
    text = "12+34=46"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert len(ids) == len(text) + 2
    assert all(3 <= i < tok.vocab_size for i in ids[1:-1])
    assert tok.decode(ids) == text
    # decoding stops at EOS, skips PAD/BOS, and marks ids past the alphabet
    assert tok.decode(tok.encode("46", eos=True) + tok.encode("99")) == "46"
    assert tok.decode(tok.encode("46", eos=True) + tok.encode("9"), stop_at_eos=False) == "469"
    assert tok.decode([0, 1] + tok.encode("7") + [0]) == "7"
    assert tok.decode([tok.vocab_size + 3]) == "\ufffd"
    for c in "0123456789+-*=, ":
        assert tok.decode(tok.encode(c)) == c


def test_tokenizer_rejects_unknown_characters():
    with pytest.raises(ValueError, match=r"'x' at 2"):
        CharTokenizer().encode("12x")


# ----------------------------------------------------------------------------- arithmetic

def test_arithmetic_prompts_are_deterministic_and_resumable():
    task = ArithmeticTask(seed=3)
    first = task.batch(0, 10)
    assert first == ArithmeticTask(seed=3).batch(0, 10)
    assert task.batch(4, 6) == first[4:]  # resuming at data position 4 continues exactly
    assert [task.example(i) for i in range(10)] == first
    assert first != ArithmeticTask(seed=4).batch(0, 10)
    assert len({ex.prompt for ex in first}) > 5


@pytest.mark.parametrize("ops", ["+", "-", "*", "+-*"])
def test_arithmetic_answers_are_correct(ops):
    task = ArithmeticTask(seed=0, digits=3, ops=ops)
    tok = CharTokenizer()
    for ex in task.batch(0, 50):
        assert ex.prompt.endswith("=")
        a_str, rest = ex.prompt[:-1], None
        for op in "+-*":
            if op in a_str[1:]:
                left, right = a_str.split(op, 1)
                rest = (int(left), op, int(right))
        a, op, b = rest
        assert op in ops and 0 <= a <= 999 and 0 <= b <= 999
        assert int(ex.answer) == {"+": a + b, "-": a - b, "*": a * b}[op]
        tok.encode(ex.prompt + ex.answer)  # every character is in the alphabet


def test_arithmetic_formats_hand_computed():
    wide = ArithmeticTask(digits=2)  # fixed width by default
    assert (wide.format_number(45, 3), wide.format_number(-9, 3)) == ("045", "-009")
    rev = ArithmeticTask(digits=2, reverse=True)
    assert (rev.format_number(45, 3), rev.format_number(-9, 3)) == ("540", "-900")
    free = ArithmeticTask(digits=2, fixed_width=False)
    assert (free.format_number(45, 3), free.format_number(-9, 3)) == ("45", "-9")
    for task, want in ((wide, lambda v: f"{v:03d}"), (rev, lambda v: f"{v:03d}"[::-1]),
                       (free, str)):
        for ex in task.batch(0, 30):
            a, b = ex.prompt[:-1].split("+")
            assert len(a) == len(b) == 2 or not task.fixed_width
            assert ex.answer == ex.solution == want(int(a) + int(b))
    mul = ArithmeticTask(digits=2, ops="*")
    assert all(len(ex.answer) == 4 for ex in mul.batch(0, 20))  # products: 2 * digits wide


def test_arithmetic_reward_hand_computed():
    task = ArithmeticTask()
    ex = Example("47+38=", "85", "85")
    assert task.reward(ex, "85") == 1.0
    assert task.reward(ex, " 85 ") == 1.0
    assert task.reward(ex, "84") == 0.25  # 1 of 2 digits right-aligned: 0.5 * 1/2
    assert task.reward(ex, "185") == 0.5 * 2 / 3
    assert task.reward(ex, "58") == 0.0
    rev = ArithmeticTask(reverse=True)  # units digit first: partial credit aligns there
    assert rev.reward(Example("47+38=", "580", "580"), "58") == 0.5 * 2 / 3
    assert task.reward(ex, "85+1") == 0.0  # not a number: no credit
    assert task.reward(ex, "") == 0.0
    strict = ArithmeticTask(partial_credit=False)
    assert strict.reward(ex, "84") == 0.0 and strict.reward(ex, "85") == 1.0


def test_arithmetic_warmup_is_noisy_but_mostly_right():
    task = ArithmeticTask(seed=0, digits=2, warmup_noise=0.3)
    pairs = task.supervised_examples(400, seed=7)
    assert pairs == task.supervised_examples(400, seed=7)
    right = sum(task.reward(Example(p, _solve(p), _solve(p)), t) == 1.0 for p, t in pairs)
    assert 0.6 < right / len(pairs) < 0.8  # ~70% correct targets
    wrong = [(p, t) for p, t in pairs if t != _solve(p)]
    assert all(len(t) == len(_solve(p)) for p, t in wrong)  # one digit changed
    # the warm-up stream is not the RL prompt stream
    rl = {ex.prompt for ex in task.batch(0, 400)}
    assert len(rl & {p for p, _ in pairs}) < 200
    clean = ArithmeticTask(seed=0, digits=2, warmup_noise=0.0).supervised_examples(50, seed=7)
    assert all(t == _solve(p) for p, t in clean)


def _solve(prompt):
    a, b = prompt[:-1].split("+")
    return f"{int(a) + int(b):03d}"


# ----------------------------------------------------------------------------- countdown

def test_countdown_is_deterministic_and_solvable():
    task = CountdownTask(seed=1)
    exs = task.batch(0, 100)
    assert exs == CountdownTask(seed=1).batch(0, 100)
    for ex in exs:
        nums, target = ex.prompt[:-1].split(":")
        assert len(nums.split(",")) == 3
        assert all(1 <= int(n) <= 9 for n in nums.split(","))
        assert int(target) == int(ex.answer) >= 0
        assert task.reward(ex, ex.solution) == 1.0  # the reference solution is correct
        CharTokenizer().encode(ex.prompt + ex.solution)


def test_countdown_reward_hand_computed():
    task = CountdownTask()
    ex = Example("3,5,7:22=", "22", "3*5+7")
    assert task.reward(ex, "3*5+7") == 1.0
    assert task.reward(ex, "7+5*3") == 1.0  # precedence: 7 + 15
    assert task.reward(ex, "(7+5)*3") == 0.1  # 36: right numbers, wrong value
    assert task.reward(ex, "3*5+7+0") == 0.0  # an extra number
    assert task.reward(ex, "3*5") == 0.0  # a number missing
    assert task.reward(ex, "5*5-3") == 0.0  # a number used twice
    assert task.reward(ex, "3*5+") == 0.0  # malformed
    assert task.reward(ex, "((3*5)+7)") == 1.0
    assert task.reward(ex, "(3*5+7") == 0.0
    assert task.reward(ex, "3/5+7") == 0.0  # '/' not among this task's ops
    div = CountdownTask(ops="+-*/")
    assert div.reward(Example("8,4,2:4=", "4", ""), "8/4*2") == 1.0
    assert div.reward(Example("8,4,2:4=", "4", ""), "8/(4-4)") == 0.0  # division by zero
    assert CountdownTask(partial_credit=False).reward(ex, "(7+5)*3") == 0.0


# ----------------------------------------------------------------------------- JSONL

def _write(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_jsonl_loads_and_rewards(tmp_path):
    path = _write(tmp_path, [json.dumps({"prompt": "What is 1/2 + 1/4?", "answer": "3/4"}),
                             "",
                             json.dumps({"prompt": "2+2?", "answer": 4, "id": 9})])
    exs = load_jsonl(path)
    assert [e.answer for e in exs] == ["3/4", "4"]
    task = make_task("jsonl", seed=0, path=path)
    assert isinstance(task, JsonlTask) and task.tokenizer is None
    assert task.reward(exs[0], r"so \boxed{0.75}") == 1.0
    assert task.reward(exs[0], "it is 0.5") == 0.0
    assert task.reward(exs[1], "The answer is 4.") == 1.0


def test_jsonl_epochs_visit_every_example_in_seeded_order(tmp_path):
    path = _write(tmp_path, [json.dumps({"prompt": f"q{i}", "answer": i}) for i in range(7)])
    task = JsonlTask(path, seed=5)
    epoch0 = [e.prompt for e in task.batch(0, 7)]
    epoch1 = [e.prompt for e in task.batch(7, 7)]
    assert sorted(epoch0) == sorted(epoch1) == sorted(f"q{i}" for i in range(7))
    assert epoch0 != epoch1  # reshuffled each epoch (fixed by the seed)
    assert [e.prompt for e in JsonlTask(path, seed=5).batch(3, 8)] == (epoch0 + epoch1)[3:11]
    plain = JsonlTask(path, shuffle=False)
    assert [e.prompt for e in plain.batch(5, 4)] == ["q5", "q6", "q0", "q1"]


def test_a_generated_task_with_a_dataset_size_visits_fixed_prompts_in_epochs():
    """dataset_size n: positions visit the same n prompts every epoch (each once per epoch,
    in a new seeded order), as RL visits a finite dataset; None draws a new prompt at every
    position. The n prompts are the stream's items 0..n-1."""
    n = 6
    task = make_task("counting", seed=3, dataset_size=n)
    stream = make_task("counting", seed=3)
    items = sorted(e.prompt for e in stream.batch(0, n))
    epochs = [[e.prompt for e in task.batch(i * n, n)] for i in range(3)]
    assert all(sorted(ep) == items for ep in epochs)
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]  # reshuffled (seeded)
    again = make_task("counting", seed=3, dataset_size=n)
    assert [e.prompt for e in again.batch(4, 7)] == (epochs[0] + epochs[1])[4:11]
    assert len({e.prompt for e in stream.batch(0, 40)}) > n  # the default keeps drawing
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="dataset_size must be an int >= 1"):
            make_task("counting", dataset_size=bad)


def test_jsonl_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(DatasetError, match="empty"):
        load_jsonl(_write(tmp_path, ["", "  "], "empty.jsonl"))
    good = json.dumps({"prompt": "p", "answer": "1"})
    with pytest.raises(DatasetError, match=r"bad.jsonl:3: not valid JSON"):
        load_jsonl(_write(tmp_path, [good, good, "{oops"], "bad.jsonl"))
    with pytest.raises(DatasetError, match=r":2: missing key 'answer'"):
        load_jsonl(_write(tmp_path, [good, json.dumps({"prompt": "p"})], "nokey.jsonl"))
    with pytest.raises(DatasetError, match=r":1: expected an object"):
        load_jsonl(_write(tmp_path, ["[1, 2]"], "list.jsonl"))
    with pytest.raises(DatasetError, match=r":1: \"answer\" must be"):
        load_jsonl(_write(tmp_path, [json.dumps({"prompt": "p", "answer": None})], "n.jsonl"))


def test_registry_and_make_task():
    assert set(TASKS) == {"arithmetic", "countdown", "counting", "jsonl", "worked_addition"}
    task = make_task("arithmetic", seed=2, digits=3)
    assert isinstance(task, ArithmeticTask) and task.digits == 3 and task.seed == 2
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        make_task("nope")
    with pytest.raises(ValueError, match="digits"):
        ArithmeticTask(digits=0)


# ----------------------------------------------------------------------------- worked addition

def _brute_sum(a: str, b: str) -> str:
    """Schoolbook addition on digit lists, independent of the task's worked steps."""
    n = len(a)
    value = sum((int(x) + int(y)) * 10 ** (n - 1 - i) for i, (x, y) in enumerate(zip(a, b)))
    return str(value).zfill(n + 1)


def _parse_work(completion: str):
    """(column sums, answer) of a worked completion; checks each step's arithmetic form."""
    steps, answer = completion.split(";")
    sums = []
    for step in steps.split(","):
        lhs, total = step.split("=")
        x, y, c = (int(t) for t in lhs.split("+"))
        assert 0 <= x <= 9 and 0 <= y <= 9 and c in (0, 1) and len(total) == 2
        sums.append((x, y, c, int(total)))
    return sums, answer


def test_worked_addition_checker_matches_brute_force():
    task = make_task("worked_addition", seed=5)
    assert TASKS["worked_addition"] is WorkedAdditionTask
    for ex in task.batch(0, 300):
        a, b = ex.prompt[:-1].split("+")
        assert len(a) == len(b) and ex.prompt.endswith("=")
        want = _brute_sum(a, b)
        assert ex.answer == want
        assert task.reward(ex, ex.solution) == 1.0
        assert task.reward(ex, "anything;" + want) == 1.0  # reward reads the answer only
        assert task.reward(ex, want) == 0.0  # no ";": not the format
        wrong = str((int(want) + 1) % 10 ** len(want)).zfill(len(want))
        same = sum(x == y for x, y in zip(wrong, want))
        assert task.reward(ex, "x;" + wrong) == pytest.approx(0.5 * same / len(want))
        assert task.reward(ex, "x;" + want + "0") < 1.0
        assert task.reward(ex, "x;1a") == 0.0


def test_worked_addition_length_statistics():
    tok = CharTokenizer()
    task = WorkedAdditionTask(seed=0)
    lengths = np.array([len(tok.encode(ex.solution, eos=True)) for ex in task.batch(0, 2000)])
    median = np.median(lengths)
    assert lengths.mean() >= 48
    assert np.percentile(lengths, 90) >= 2.5 * median
    assert lengths.max() <= 10 * task.max_digits + 3
    # digits are log-uniform on [1, 17): P(n <= 4) = log(5) / log(17)
    ns = np.array([len(ex.prompt[:-1].split("+")[0]) for ex in task.batch(0, 2000)])
    p = np.log(5) / np.log(17)
    assert abs(np.mean(ns <= 4) - p) < 4 * np.sqrt(p * (1 - p) / 2000)  # ~6e-5 false failure


def test_worked_addition_warmup_targets_parse_back():
    task = WorkedAdditionTask(seed=0, warmup_noise=0.3)
    pairs = task.supervised_examples(400, seed=1)
    wrong = 0
    for prompt, target in pairs:
        a, b = prompt[:-1].split("+")
        sums, answer = _parse_work(target)
        # the steps add the right digits, units first, carrying what they wrote
        carry = 0
        for i, (x, y, c, total) in enumerate(sums):
            assert (x, y, c) == (int(a[-1 - i]), int(b[-1 - i]), carry)
            carry = total // 10
        # the answer is what the written steps say
        assert answer == str(carry) + "".join(str(t % 10) for *_, t in reversed(sums))
        ex = Example(prompt, _brute_sum(a, b), "")
        wrong += answer != ex.answer
        assert task.reward(ex, target) == (1.0 if answer == ex.answer else task.reward(ex, target))
    # noisy targets are wrong in exactly one column; 30% +- 4 sigma
    assert abs(wrong / 400 - 0.3) < 4 * np.sqrt(0.3 * 0.7 / 400)
    clean = WorkedAdditionTask(seed=0, warmup_noise=0.0).supervised_examples(100, seed=1)
    for prompt, target in clean:
        a, b = prompt[:-1].split("+")
        assert _parse_work(target)[1] == _brute_sum(a, b)


def test_worked_addition_rejects_bad_parameters():
    with pytest.raises(ValueError, match="min_digits"):
        WorkedAdditionTask(max_digits=0)
    with pytest.raises(ValueError, match="warmup_noise"):
        WorkedAdditionTask(warmup_noise=1.5)


# ----------------------------------------------------------------------------- counting

def _parse_count(prompt: str, completion: str):
    """(a, n, numbers, counters, answer) of a counting prompt and completion."""
    a, n = (int(x) for x in prompt[:-1].split("+"))
    items, answer = completion.split(";")
    pairs = [item.split(":") for item in items.split(",")]
    return a, n, [int(x) for x, _ in pairs], [int(c) for _, c in pairs], answer


def test_counting_solution_and_reward_match_python_addition():
    task = make_task("counting", seed=3)
    assert TASKS["counting"] is CountingTask
    for ex in task.batch(0, 300):
        a, n, numbers, counters, answer = _parse_count(ex.prompt, ex.solution)
        assert ex.answer == answer == str(a + n)  # Python's sum
        # a plain walk: up one while the counter goes down one, from (a, n) to (a + n, 0)
        assert numbers == [a + i for i in range(n + 1)]
        assert counters == [n - i for i in range(n + 1)]
        assert a >= 0 and a + n <= task.max_number and task.min_count <= n <= task.max_count
        assert task.reward(ex, ex.solution) == 1.0
        assert task.reward(ex, "anything;" + answer) == 1.0  # the reward reads the sum only
        assert task.reward(ex, answer) == 0.0  # no ";": not the format
        assert task.reward(ex, "x;1a") == 0.0
    ex = Example("17+9=", "26", "")
    assert task.reward(ex, "x;25") == 0.25  # the tens digit right: 0.5 * 1 / 2
    assert task.reward(ex, "x;126") == pytest.approx(0.5 * 2 / 3)
    assert task.reward(ex, "x;7") == 0.0
    assert CountingTask(partial_credit=False).reward(ex, "x;25") == 0.0


def test_counting_length_statistics():
    tok = CharTokenizer()
    task = CountingTask(seed=0)
    exs = task.batch(0, 2000)
    lengths = np.array([len(tok.encode(ex.solution, eos=True)) for ex in exs])
    median = np.median(lengths)
    assert lengths.mean() >= 48
    assert np.percentile(lengths, 90) >= 2.5 * median
    # the longest: max_count + 1 items "xx:yy," of two-digit numbers, then ";" + sum + EOS
    assert lengths.max() <= 6 * (task.max_count + 1) + 3
    # counts are log-uniform on [min, max + 1): P(n <= 5) = log(6 / min) / log((max + 1) / min)
    ns = np.array([int(ex.prompt[:-1].split("+")[1]) for ex in exs])
    p = np.log(6 / task.min_count) / np.log((task.max_count + 1) / task.min_count)
    assert abs(np.mean(ns <= 5) - p) < 4 * np.sqrt(p * (1 - p) / 2000)  # ~6e-5 false failure


def test_counting_warmup_targets_miscount_once():
    task = CountingTask(seed=0, warmup_noise=0.3)
    wrong = 0
    for prompt, target in task.supervised_examples(400, seed=1):
        a, n, numbers, counters, answer = _parse_count(prompt, target)
        assert numbers[0] == a and counters == [n - i for i in range(n + 1)]
        assert answer == str(numbers[-1])  # the answer is what the written count reached
        steps = np.diff(numbers)
        if answer == str(a + n):
            assert np.all(steps == 1)
        else:  # one slip: a step of 0 or 2, every other step 1
            wrong += 1
            assert np.sum(steps != 1) == 1 and set(steps) <= {0, 1, 2}
            assert abs(int(answer) - (a + n)) == 1
    assert abs(wrong / 400 - 0.3) < 4 * np.sqrt(0.3 * 0.7 / 400)


def test_counting_rejects_bad_parameters():
    with pytest.raises(ValueError, match="min_count=5, max_count=3"):
        CountingTask(min_count=5, max_count=3)
    with pytest.raises(ValueError, match="min_count=0"):
        CountingTask(min_count=0)
    with pytest.raises(ValueError, match="max_count must be an integer, got 2.5"):
        CountingTask(max_count=2.5)
    with pytest.raises(ValueError, match="max_number must be >= max_count = 24 .*got 9"):
        CountingTask(max_count=24, max_number=9)
    with pytest.raises(ValueError, match="warmup_noise must be in \\[0, 1\\], got -0.1"):
        CountingTask(warmup_noise=-0.1)


# ----------------------------------------------------------------------------- HF tokenizer
# A real-format tokenizer directory (byte-level BPE, Qwen's special tokens, a chat template)
# as test_real_config.py builds it; transformers' own tokenizer is the reference.

@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    from jaxspec.testing.qwen_tokenizer import write_tokenizer_files

    path = tmp_path_factory.mktemp("tok")
    ids = write_tokenizer_files(path)
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}))
    return path, ids


def test_hf_tokenizer_chat_template_and_every_eos(hf_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from jaxspec.rl.tokenizer import HFTokenizer

    path, ids = hf_tokenizer_dir
    im_end, eot = ids["<|im_end|>"], ids["<|endoftext|>"]
    ref = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tok = HFTokenizer(str(path))  # chat_template 'auto': the tokenizer has one
    assert tok.chat_template and tok.eos_ids == (im_end, eot) and tok.eos_id == im_end
    turn = [{"role": "user", "content": "What is 2+3?"}]
    assert tok.encode_prompt("What is 2+3?") == list(ref.apply_chat_template(
        turn, tokenize=True, add_generation_prompt=True, return_dict=False))
    assert tok.format_prompt("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    raw = HFTokenizer(str(path), chat_template=False)
    assert raw.encode_prompt("What is 2+3?") == ref.encode("What is 2+3?", add_special_tokens=False)
    # Text after the first EOS of either kind is never decoded (never graded).
    answer = tok.encode("The answer is 42.")
    for eos in (im_end, eot):
        assert tok.decode(answer + [eos] + tok.encode(" no, 7")) == "The answer is 42."
    # No template: 'auto' sends raw text, true is an error naming the key.
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("tokenizer.json", "generation_config.json"):
        (bare / f).write_bytes((path / f).read_bytes())
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    assert not HFTokenizer(str(bare)).chat_template
    with pytest.raises(ValueError, match="task.chat_template is true"):
        HFTokenizer(str(bare), chat_template=True)


def test_truncated_completions_score_zero_unless_configured():
    from jaxspec.rl.rollouts import completions_ended, score_completions

    tok, task = CharTokenizer(), make_task("arithmetic")
    ex = Example("1+2=", "03", "03")
    eos, pad = tok.EOS, tok.PAD
    rows = [tok.encode("03") + [eos], tok.encode("03"), tok.encode("03") + [eos, pad], [eos, pad, pad]]
    tokens = np.array([r + [pad] * (4 - len(r)) for r in rows])
    lengths = np.array([3, 2, 3, 1])  # row 1 ran out of tokens; row 3 stopped at once
    np.testing.assert_array_equal(completions_ended(tokens, lengths, tok.eos_ids),
                                  [True, False, True, True])
    zero = score_completions(task, tok, [ex], tokens, lengths, group_size=4)
    score = score_completions(task, tok, [ex], tokens, lengths, group_size=4,
                              truncated_reward="score")
    np.testing.assert_array_equal(zero, [1.0, 0.0, 1.0, 0.0])
    np.testing.assert_array_equal(score, [1.0, 1.0, 1.0, 0.0])


def test_chat_template_and_truncated_reward_keys():
    from jaxspec.config import ConfigError, load_config

    cfg = load_config(None)
    assert cfg.task.chat_template == "auto" and cfg.rollout.truncated_reward == "zero"
    cfg = load_config(None, ["task.chat_template=false", "rollout.truncated_reward=score"])
    assert cfg.task.chat_template is False and cfg.rollout.truncated_reward == "score"
    for override, key, words in [
            ("task.chat_template=true", "task.chat_template", "has no chat template"),
            ("task.chat_template=maybe", "task.chat_template", "'auto'"),
            ("rollout.truncated_reward=half", "rollout.truncated_reward", "'zero', 'score'")]:
        with pytest.raises(ConfigError) as e:
            load_config(None, [override])
        assert e.value.key == key and words in str(e.value), str(e.value)
