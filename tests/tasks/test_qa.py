"""QA rewards: the final answer span, Search-R1's normalisation, EM and cover-EM, and what the reward reads."""

from __future__ import annotations

import pytest

from stoa.envs.base import episode_text
from stoa.rollouts.episode import ROLE_ACTION, ROLE_ECHO, ROLE_MASKED
from stoa.tasks.qa import (
    QAScore,
    check_reward_kind,
    cover_em,
    decode_golds,
    em,
    encode_golds,
    extract_final_answer,
    normalize_answer,
    score,
)

from .conftest import CharCodec


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  A   man, a plan;  an  canal: Panama ", "man plan canal panama"),
        ("THE theory", "theory"),  # whole words only: "theory" keeps its "the"
        ("Anne and an apple", "anne and apple"),
        ("1,847", "1847"),
        ("St. Louis-Park", "st louispark"),
        ("the", ""),
        ("Ünïcode Straße", "ünïcode straße"),  # only ASCII punctuation is removed, case folds per str.lower
        ("tab\tand\nnewline", "tab and newline"),
    ],
)
def test_normalize_answer_is_search_r1s(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer> Tarsk </answer>", "Tarsk"),
        ("<answer>first</answer> then <answer>second</answer>", "second"),
        ("<answer>first</answer> then <answer>unclosed", "first"),
        ("<answer>a <answer>b</answer>", "b"),  # the span opens at the last <answer> before the close
        ("no tags at all", None),
        ("<answer>never closed", None),
        ("</answer> stray close", None),
        ("<answer></answer>", ""),
        ("<answer>\n multi\nline \n</answer>", "multi\nline"),
    ],
)
def test_extract_final_answer(text: str, expected: str | None) -> None:
    assert extract_final_answer(text) == expected


# (prediction, golds, em, cover_em)
REWARD_TABLE = [
    ("Tarsk", ["Tarsk"], True, True),
    ("tarsk.", ["Tarsk"], True, True),
    ("The Tarsk", ["Tarsk"], True, True),
    ("Tarsk, in Velmoria", ["Tarsk"], False, True),
    ("Tars", ["Tarsk"], False, False),
    ("Velmora Quist", ["Quist"], False, True),
    ("Quist", ["Velmora Quist"], False, False),
    ("1847", ["1847"], True, True),
    ("in 1847", ["1847"], False, True),
    ("1,847", ["1847"], True, True),
    ("1848", ["1847"], False, False),
    ("Broushys", ["Broushys River", "Broushys"], True, True),
    ("Broushys River", ["Broushys River", "Broushys"], True, True),
    ("Paris", ["London", "paris"], True, True),
    ("", ["Tarsk"], False, False),
    ("the", ["the"], False, False),  # both normalise to "": never a match
    ("anything", ["a"], False, False),  # an empty gold must not cover every answer
    (None, ["Tarsk"], False, False),
    ("Tarsk", "Tarsk", True, True),  # one gold as a string
]


@pytest.mark.parametrize(("pred", "golds", "want_em", "want_cover"), REWARD_TABLE)
def test_em_and_cover_em_table(pred: str | None, golds: list[str] | str, want_em: bool, want_cover: bool) -> None:
    assert em(pred, golds) is want_em
    assert cover_em(pred, golds) is want_cover


def test_score_reads_the_last_answer_span_only() -> None:
    s = score("<think>maybe Tarsk</think><search>q</search>\n<answer>Velm</answer>", ["Tarsk"])
    assert s == QAScore(answer="Velm", em=False, cover_em=False)
    s = score("<answer>Velm</answer> no wait <answer>the Tarsk city</answer>", ["Tarsk"])
    assert (s.answer, s.em, s.cover_em) == ("the Tarsk city", False, True)
    assert (s.reward("cover_em"), s.reward("em")) == (1.0, 0.0)
    assert score("Tarsk", ["Tarsk"]).reward("cover_em") == 0.0  # no span, no answer


def test_answer_in_an_observation_never_counts() -> None:
    codec = CharCodec()
    pieces = [("<search>Tarsk</search>", ROLE_ACTION),
              ("\n\n<information>", ROLE_MASKED), ("Doc 1 <answer>Tarsk</answer>", ROLE_ECHO),
              ("</information>\n\n", ROLE_MASKED),
              ("I am not sure.", ROLE_ACTION)]
    tokens = [t for text, _ in pieces for t in codec.encode_text(text)]
    roles = [r for text, r in pieces for _ in text]
    text = episode_text(tokens, roles, codec.decode)
    assert "<answer>" not in text
    assert score(text, ["Tarsk"]).reward("cover_em") == 0.0
    # The same episode answering in its own turn scores.
    tokens += codec.encode_text("<answer>Tarsk</answer>")
    roles += [ROLE_ACTION] * len("<answer>Tarsk</answer>")
    assert score(episode_text(tokens, roles, codec.decode), ["Tarsk"]).reward("em") == 1.0


@pytest.mark.parametrize("golds", [["Tarsk"], ["Broushys River", "Broushys"], ['say "hi"', "[x]"], ["Ünï"]])
def test_golds_round_trip(golds: list[str]) -> None:
    assert decode_golds(encode_golds(golds)) == tuple(golds)


@pytest.mark.parametrize("answer", ["Tarsk", "[1, 2]", "[]", '"quoted"', "{}", "12"])
def test_a_plain_answer_is_one_gold(answer: str) -> None:
    assert decode_golds(answer) == (answer,)


def test_reward_kind_checked() -> None:
    assert check_reward_kind("search", "em") == "em"
    with pytest.raises(ValueError, match="option 'reward' must be one of"):
        check_reward_kind("search", "f1")
