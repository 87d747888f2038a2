"""Answer checking for math datasets: `check_answer` asks math-verify (HF's checker: it
extracts the final answer — boxed, "the final answer is", the last expression — and compares
with sympy: 2\\sqrt 3 == \\sqrt{12}, sets, intervals, percentages), and falls back on the
small checker below only where math-verify cannot decide (a parse or compare error, a
timeout, nothing extracted from the gold answer).

The fallback: \\boxed{...}, else the last number; numbers compare exactly as fractions, so
3/4 == 0.75 == \\frac{3}{4} == 0.750, and 1,234 == 1234; other answers compare as
normalised strings.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from fractions import Fraction

__all__ = ["answers_match", "check_answer", "check_answer_fallback", "extract_answer",
           "extract_boxed", "last_number", "math_verify_match", "parse_number"]

# Seconds math-verify may spend parsing one text or comparing one pair (SIGALRM, so only on
# the main thread; elsewhere it runs without a timer on at most _MAX_CHARS characters).
MATH_VERIFY_TIMEOUT_S = 2
_MAX_CHARS = 4000

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")

# An integer with optional thousands separators, an optional decimal part; or ".5".
_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][+-]?\d+)?|\.\d+"
_TEX_FRAC = r"\\[dt]?frac\s*(?:\{[^{}]*\}\s*\{[^{}]*\}|\d\s*\d)"
# A leading minus counts only where it cannot be a subtraction ("5-3" holds 5 and 3).
_NEG = r"(?:(?<![\w)\]}])-\s*)?"
_NUMBER_IN_TEXT = re.compile(
    rf"{_NEG}(?:{_TEX_FRAC}|(?<![\d.])(?:{_NUM})(?:\s*/\s*(?:{_NUM}))?)")


def extract_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces may nest), or None."""
    found = None
    for m in _BOXED.finditer(text):
        depth, start = 1, m.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    found = text[start:i]
                    break
    return found


def last_number(text: str) -> str | None:
    """The last number-like span of `text` (integer, decimal, a/b, \\frac{a}{b}), or None."""
    spans = _NUMBER_IN_TEXT.findall(_unicode(text))
    return spans[-1].strip() if spans else None


def extract_answer(text: str) -> str | None:
    """What a completion answers: its last \\boxed{...}, else its last number."""
    boxed = extract_boxed(text)
    return boxed if boxed is not None else last_number(text)


def _unicode(text: str) -> str:
    return text.replace("\u2212", "-").replace("\u2013", "-").replace("\u00a0", " ")


def _clean(text: str) -> str:
    """Strip the decoration around an answer: $ signs, \\left/\\right, spacing commands,
    a leading 'x =', a trailing period, %, degrees."""
    s = _unicode(text).strip()
    s = re.sub(r"\\(?:left|right)\b", "", s)
    s = re.sub(r"\\[!,;: ]", "", s)
    s = re.sub(r"\^\s*\{?\\circ\}?", "", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").rstrip("%")
    s = s.strip()
    s = re.sub(r"^[A-Za-z]\s*=\s*", "", s)
    s = s.strip().rstrip(".").strip()
    return s


_UNIT = r"\\(?:text|mathrm|mbox)\s*\{\s*[A-Za-z ]*\}"  # "5 \text{ cm}" is the number 5
_PLAIN = re.compile(rf"[+-]?(?:{_NUM})")
_TEX_FRAC_FULL = re.compile(r"([+-]?)\\[dt]?frac\s*(?:\{([^{}]*)\}\s*\{([^{}]*)\}|(\d)\s*(\d))")


def parse_number(text: str) -> Fraction | None:
    """`text` as an exact number, or None when it is not one number.

    Accepts 1234, 1,234, -3, 0.75, .5, 1e-3, 3/4, \\frac{3}{4}, \\dfrac34, -\\frac{3}{4},
    with the decoration _clean removes."""
    if text is None:
        return None
    s = re.sub(_UNIT, "", _clean(text)).replace(" ", "").rstrip(".")
    if not s:
        return None
    if _PLAIN.fullmatch(s):
        try:
            return Fraction(s.replace(",", ""))
        except (ValueError, ZeroDivisionError):
            return None
    m = _TEX_FRAC_FULL.fullmatch(s)
    if m:
        sign, num, den = m.group(1), m.group(2) or m.group(4), m.group(3) or m.group(5)
        a, b = parse_number(num), parse_number(den)
        if a is None or b is None or b == 0:
            return None
        return -a / b if sign == "-" else a / b
    if s.count("/") == 1:
        num, den = s.split("/")
        if _PLAIN.fullmatch(num) and _PLAIN.fullmatch(den):
            a, b = parse_number(num), parse_number(den)
            if a is not None and b:
                return a / b
    return None


def _normal_text(text: str) -> str:
    s = re.sub(r"\\(?:text|mathrm|textbf|mbox)\s*\{([^{}]*)\}", r"\1", _clean(text))
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    return re.sub(r"\s+", "", s).lower()


def answers_match(predicted: str | None, gold: str) -> bool:
    """Whether an extracted answer equals the reference answer."""
    if predicted is None:
        return False
    gold_value = parse_number(str(gold))
    if gold_value is not None:
        value = parse_number(predicted)
        if value is None:
            # "5 apples": one number beside words only (never "2\sqrt{3}" read as 3).
            nums = _NUMBER_IN_TEXT.findall(_clean(predicted))
            rest = _NUMBER_IN_TEXT.sub("", _clean(predicted))
            if len(nums) == 1 and re.fullmatch(r"[A-Za-z\s]*", rest):
                value = parse_number(nums[0])
        return value is not None and value == gold_value
    return _normal_text(predicted) == _normal_text(str(gold))


def check_answer_fallback(completion: str, gold: str) -> bool:
    """Whether a completion's final answer (boxed, else last number) equals `gold`."""
    return answers_match(extract_answer(completion), gold)


def _timeout() -> int | None:
    # math-verify's timer is signal.alarm: it raises off the main thread.
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout: int | None) -> tuple:
    from math_verify import parse

    text = gold if "$" in gold or "\\boxed" in gold else f"\\boxed{{{gold}}}"
    return tuple(parse(text, parsing_timeout=timeout, raise_on_error=True))


def math_verify_match(completion: str, gold: str) -> bool | None:
    """math-verify's verdict on the completion's final answer against `gold`, or None
    where it cannot give one (an error, a timeout, a gold answer it extracts nothing from)."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    timeout = _timeout()
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" off-thread
    try:
        target = _parse_gold(str(gold), timeout)
        if not target:
            return None
        found = parse(completion[-_MAX_CHARS:], parsing_timeout=timeout, raise_on_error=True)
        if not found:
            return False  # no answer in the completion
        return bool(verify(list(target), found, timeout_seconds=timeout, raise_on_error=True))
    except (Exception, TimeoutException):  # noqa: BLE001 (any failure: the fallback decides)
        return None


def check_answer(completion: str, gold: str) -> bool:
    """Whether a completion's final answer equals `gold`: math-verify's verdict, or the
    fallback checker's where math-verify gives none."""
    verdict = math_verify_match(completion, gold)
    return check_answer_fallback(completion, gold) if verdict is None else verdict
