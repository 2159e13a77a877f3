"""Prompt rendering and completion decoding shared by every engine and the trainer (no torch, no mlx)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


class TextCodec:
    """Render chat prompts to token ids and decode completions, from an HF model directory.

    Args:
        model_dir: directory with tokenizer.json / tokenizer_config.json (chat template).
    """

    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        eos = set()
        if self.tok.eos_token_id is not None:
            eos.add(int(self.tok.eos_token_id))
        for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            tid = self.tok.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != self.tok.unk_token_id and tid >= 0:
                eos.add(tid)
        self.eos_ids: tuple[int, ...] = tuple(sorted(eos))
        self._cache: dict[tuple, list[int]] = {}

    def encode_prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of a chat prompt with the generation prompt appended (cached).

        Args:
            messages: chat messages with ``role`` and ``content``.
        """
        key = tuple((m["role"], m["content"]) for m in messages)
        if key not in self._cache:
            if getattr(self.tok, "chat_template", None):
                ids = self.tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
                if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                    ids = ids["input_ids"]
            else:
                ids = self.tok.encode("\n".join(m["content"] for m in messages) + "\n")
            self._cache[key] = [int(i) for i in ids]
        return list(self._cache[key])

    def encode_text(self, text: str) -> list[int]:
        """Token ids of plain text without special tokens (observations of multi-turn episodes).

        Args:
            text: the text.
        """
        return [int(i) for i in self.tok.encode(text, add_special_tokens=False)]

    def decode(self, tokens: Sequence[int]) -> str:
        """Completion text without special tokens.

        Args:
            tokens: completion token ids.
        """
        return self.tok.decode(list(tokens), skip_special_tokens=True)
