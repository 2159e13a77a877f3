"""Final-answer extraction from model completions and number normalisation for exact verifiers."""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right

__all__ = [
    "EXTRACT_VERSION",
    "answers_match",
    "extract_answer",
    "find_numbers",
    "normalize_number",
]

# Bump whenever extract_answer or normalize_number can return something different for some input:
# every task folds it into its reward_version, so the run contract notices.
EXTRACT_VERSION = 1

# A number as models write it: optional sign (ASCII hyphen or U+2212) glued to the digits, optional
# dollar sign, digits with well-formed thousands separators or plain digits, optional decimal part.
# The sign only counts when it does not follow a word character or closing bracket ("5-3" is 5 and 3,
# "x = -3" is -3), and a number never starts or ends in the middle of a run of digits.
_NUMBER = re.compile(
    r"""
    (?<![\d.])
    (?P<sign>(?<![\w)\]}])[-\u2212])?
    \\?\$?
    (?P<int>\d{1,3}(?:,\d{3})+(?![\d,]\d)|\d+)
    (?P<frac>\.\d+)?
    (?!\d)
    """,
    re.VERBOSE,
)

_HASHES = re.compile(r"####")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")
_NEWLINE = re.compile(r"\n")
_TAG_OPEN = re.compile(r"<answer>", re.IGNORECASE)
_TAG_CLOSE = re.compile(r"</answer>", re.IGNORECASE)
_ANSWER_IS = re.compile(r"\banswer\s*(?:\bis\b|:|=)", re.IGNORECASE)
_THINK_END = "</think>"


def normalize_number(text: str) -> str | None:
    """Canonical string form of one number, or None if `text` is not a single number.

    Removes `$`, thousands commas, surrounding whitespace, a trailing period or percent sign, and
    trailing zeros of the fraction ("1,234.50" -> "1234.5", "42.0" -> "42", "-0" -> "0").

    Args:
        text: the number as written, e.g. "$1,234", "-7", "42.0".
    """
    s = text.strip().rstrip(".").strip()
    s = s.replace("\u2212", "-")
    if s.endswith("%"):
        s = s[:-1].rstrip()
    m = _NUMBER.fullmatch(s)
    if m is None:
        return None
    return _canonical(m)


def _canonical(m: re.Match[str]) -> str:
    """Canonical decimal string for a `_NUMBER` match (exact string arithmetic, no rounding)."""
    whole = m.group("int").replace(",", "").lstrip("0") or "0"
    frac = (m.group("frac") or ".")[1:].rstrip("0")
    if whole == "0" and not frac:
        return "0"
    out = whole + ("." + frac if frac else "")
    return "-" + out if m.group("sign") else out


def find_numbers(text: str) -> list[str]:
    """All numbers in `text`, in order, each in canonical form.

    Args:
        text: any text.
    """
    return [_canonical(m) for m in _NUMBER.finditer(text)]


class _Numbers:
    """The numbers of one text with their spans.

    Every lookup is a binary search, so extraction stays near-linear in the text even for
    adversarial completions with thousands of markers (the trainer runs it on untrusted input).
    """

    def __init__(self, text: str) -> None:
        matches = list(_NUMBER.finditer(text))
        self.starts = [m.start() for m in matches]
        self.ends = [m.end() for m in matches]
        self.values = [_canonical(m) for m in matches]
        self.newlines = [m.start() for m in _NEWLINE.finditer(text)]
        self.length = len(text)

    def last(self) -> str | None:
        return self.values[-1] if self.values else None

    def first_on_line_after(self, pos: int) -> str | None:
        """The first number starting at or after `pos` on the same line, if any."""
        i = bisect_left(self.starts, pos)
        if i == len(self.starts):
            return None
        j = bisect_left(self.newlines, pos)
        line_end = self.newlines[j] if j < len(self.newlines) else self.length
        return self.values[i] if self.starts[i] < line_end else None

    def last_within(self, lo: int, hi: int) -> str | None:
        """The last number lying entirely inside text[lo:hi], if any."""
        k = bisect_right(self.ends, hi) - 1
        return self.values[k] if k >= 0 and self.starts[k] >= lo else None


def _from_markers(marker: re.Pattern[str], text: str, nums: _Numbers) -> str | None:
    """First number after the last marker that has one on its own line."""
    for end in reversed([m.end() for m in marker.finditer(text)]):
        n = nums.first_on_line_after(end)
        if n is not None:
            return n
    return None


def _box_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of the contents of every \\boxed{...}, brace-balanced, in order.

    An unclosed box runs to the end of the text.
    """
    boxes = list(_BOXED.finditer(text))
    if not boxes:
        return []
    closing: dict[int, int] = {}
    stack: list[int] = []
    for m in _BRACE.finditer(text):
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            closing[stack.pop()] = m.start()
    return [(b.end(), closing.get(b.end() - 1, len(text))) for b in boxes]


def _from_boxed(text: str, nums: _Numbers) -> str | None:
    for lo, hi in reversed(_box_spans(text)):
        n = nums.last_within(lo, hi)
        if n is not None:
            return n
    return None


def _from_answer_tag(text: str, nums: _Numbers) -> str | None:
    opens = [m.end() for m in _TAG_OPEN.finditer(text)]
    if not opens:
        return None
    closes = [m.start() for m in _TAG_CLOSE.finditer(text)]
    for lo in reversed(opens):
        i = bisect_left(closes, lo)
        if i < len(closes):
            n = nums.last_within(lo, closes[i])
            if n is not None:
                return n
    return None


def extract_answer(completion: str) -> str | None:
    """The final numeric answer of a completion in canonical form, or None when there is none.

    Explicit markers win over the last number of the text, in this order: the last "#### N", the
    last "\\boxed{...}" (its last number), the last "<answer>...</answer>", the last "answer is N" /
    "answer: N" (first number after it on the same line), and finally the last number anywhere.
    A marker without a number falls through to the next rule. When the completion contains
    "</think>", only the text after the last one is read, so numbers in the reasoning never count.

    Args:
        completion: the model's generated text (without the prompt).
    """
    cut = completion.rfind(_THINK_END)
    text = completion[cut + len(_THINK_END) :] if cut >= 0 else completion
    nums = _Numbers(text)
    if not nums.values:
        return None
    return (
        _from_markers(_HASHES, text, nums)
        or _from_boxed(text, nums)
        or _from_answer_tag(text, nums)
        or _from_markers(_ANSWER_IS, text, nums)
        or nums.last()
    )


def answers_match(predicted: str | None, truth: str) -> bool:
    """Whether an extracted answer equals the ground truth as numbers in canonical form.

    Args:
        predicted: output of `extract_answer` (None never matches).
        truth: ground-truth answer; normalised here, so "1,234" and "1234" are equal.
    """
    if predicted is None:
        return False
    p = normalize_number(predicted)
    t = normalize_number(truth)
    return p is not None and p == t
