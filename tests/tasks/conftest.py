"""Helpers for the task tests: a character codec, a keyword searcher and a scripted policy for episodes."""

from __future__ import annotations

from collections.abc import Sequence

from stoa.envs.base import Environment, Tools, episode_text
from stoa.episodes.driver import Episode, EpisodeDriver
from stoa.retrieval.base import Doc
from stoa.rollouts.episode import EpisodeLimits

EOS = 0
"""The codec's end-of-sequence id (no character maps to it)."""


class CharCodec:
    """One token per character (its code point); id 0 is EOS."""

    def encode_text(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, tokens: Sequence[int]) -> str:
        return "".join(chr(t) for t in tokens if t != EOS)


class KeywordSearcher:
    """Documents ranked by how many query words their title and text contain (ties: corpus order)."""

    def __init__(self, docs: Sequence[Doc], fingerprint: str = "kw") -> None:
        self.docs = list(docs)
        self.fingerprint = fingerprint
        self.calls: list[list[str]] = []

    def search(self, queries: Sequence[str], k: int) -> list[list[Doc]]:
        self.calls.append(list(queries))
        out = []
        for q in queries:
            words = {w.strip("?.,").lower() for w in q.split()}
            scored = [(-sum(w in f"{d.title} {d.text}".lower() for w in words if len(w) > 3), i)
                      for i, d in enumerate(self.docs)]
            out.append([self.docs[i] for _, i in sorted(scored)[:k]])
        return out


def play(envs: Sequence[Environment], tools: Tools, scripts: Sequence[Sequence[str]], limits: EpisodeLimits,
         n: int = 1) -> list[Episode]:
    """Run scripted turns through the engine-agnostic driver, one character per sampled token.

    A turn that runs out of characters without reaching a stop string samples EOS.

    Args:
        envs: one environment per row.
        tools: the tools.
        scripts: per row, the text of each turn the policy writes.
        limits: the episode limits.
        n: samples per prompt.
    """
    codec = CharCodec()
    driver = EpisodeDriver(envs, tools, codec, limits, eos_ids=[EOS])
    turn, pos = [0] * len(envs), [0] * len(envs)
    active = list(range(len(envs)))
    while active:
        while active:
            toks = []
            for r in active:
                text = scripts[r][turn[r]] if turn[r] < len(scripts[r]) else ""
                toks.append(ord(text[pos[r]]) if pos[r] < len(text) else EOS)
                pos[r] += 1
            keep = driver.record(active, toks, [-0.5] * len(active))
            active = [active[i] for i in keep]
        fed = driver.resume()
        for r in fed:
            turn[r], pos[r] = turn[r] + 1, 0
        active = sorted(fed)
    return [ep for group in driver.episodes(n) for ep in group]


def text_of(ep: Episode) -> str:
    """What the reward reads of an episode."""
    return episode_text(ep.tokens, ep.roles, CharCodec().decode)
