"""Prompts for a ladder: from a JSONL dataset, or generated with a length distribution.

Dataset lines (JSON objects, one per line; blank lines skipped):
    {"prompt": "text"}                                   a completion-style prompt
    {"messages": [{"role": "user", "content": "..."}]}   a chat conversation
    either may add "max_tokens": N                       overrides --max-tokens for that line

Generated prompts have no tokenizer here (bench imports no model code): each is a lead-in plus
common short English words, one word being about one token for BPE tokenizers such as SmolLM2's.
The server's ``usage.prompt_tokens`` gives the real count, which the results report.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Endpoint = Literal["chat", "completions"]

_WORD_TEXT = (
    "the of and to in is it you that he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which she "
    "do how their if will up other about out many then them these so some her would make like "
    "him into time has look two more write go see number no way could people my than first water "
    "been call who oil its now find long down day did get come made may part"
)
_WORDS = _WORD_TEXT.split()

# Bounds that keep generation quick and small: a prompt is at most MAX_PROMPT_TOKENS words, and
# at most MAX_PROMPTS distinct prompts (MAX_WORDS words in all) are made; a ladder cycles them.
MAX_PROMPT_TOKENS = 131_072
MAX_PROMPTS = 1024
MAX_WORDS = 4_000_000

_LEAD = "Continue this list of words:"
_LEAD_WORDS = len(_LEAD.split())


class WorkloadError(ValueError):
    """A dataset or a length spec that cannot be used; the message is for a person."""


@dataclass(frozen=True)
class Prompt:
    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content)
    max_tokens: int | None = None

    def payload(self, endpoint: Endpoint) -> dict[str, object]:
        """The prompt part of an OpenAI request body for ``endpoint``."""
        if endpoint == "chat":
            messages = self.messages or (("user", self.text or ""),)
            return {"messages": [{"role": r, "content": c} for r, c in messages]}
        if self.text is not None:
            return {"prompt": self.text}
        return {"prompt": "\n".join(f"{r}: {c}" for r, c in self.messages or ())}


def parse_token_range(spec: str) -> tuple[int, int]:
    """``"200"`` -> (200, 200); ``"100:300"`` -> (100, 300), inclusive."""
    parts = spec.split(":")
    try:
        numbers = [int(p) for p in parts]
    except ValueError as exc:
        raise WorkloadError(f"--prompt-tokens: expected N or LOW:HIGH, got {spec!r}") from exc
    if len(numbers) == 1:
        numbers = numbers * 2
    if len(numbers) != 2 or numbers[0] < 1 or numbers[1] < numbers[0]:
        raise WorkloadError(
            f"--prompt-tokens: expected N or LOW:HIGH with 1 <= LOW <= HIGH, got {spec!r}"
        )
    if numbers[1] > MAX_PROMPT_TOKENS:
        raise WorkloadError(f"--prompt-tokens: at most {MAX_PROMPT_TOKENS}, got {spec!r}")
    return numbers[0], numbers[1]


def generate(count: int, tokens: tuple[int, int], seed: int) -> list[Prompt]:
    """Up to ``count`` prompts of about ``tokens`` (uniform in the range) tokens each, reproducibly.

    At most ``MAX_PROMPTS`` prompts and ``MAX_WORDS`` words in all: callers cycle through them.
    """
    rng = random.Random(seed)
    prompts = []
    for _ in range(max(1, min(count, MAX_PROMPTS, MAX_WORDS // tokens[1]))):
        n = rng.randint(*tokens)
        words = [rng.choice(_WORDS) for _ in range(max(1, n - _LEAD_WORDS))]
        prompts.append(Prompt(text=f"{_LEAD} {' '.join(words)}"))
    return prompts


def load_dataset(path: Path) -> list[Prompt]:
    """Read a JSONL dataset; every bad line is named with its number."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise WorkloadError(f"--dataset {path}: cannot read: {exc.strerror or exc}") from exc
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            prompts.append(_parse_line(json.loads(line)))
        except (json.JSONDecodeError, WorkloadError) as exc:
            raise WorkloadError(f"--dataset {path}:{number}: {exc}") from exc
    if not prompts:
        raise WorkloadError(f"--dataset {path}: no prompts in the file")
    return prompts


def _parse_line(item: object) -> Prompt:
    if not isinstance(item, dict):
        raise WorkloadError('each line must be a JSON object with "prompt" or "messages"')
    max_tokens = item.get("max_tokens")
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise WorkloadError(f'"max_tokens" must be a positive integer, got {max_tokens!r}')
    if isinstance(item.get("prompt"), str):
        return Prompt(text=item["prompt"], max_tokens=max_tokens)
    messages = item.get("messages")
    if isinstance(messages, list) and messages:
        pairs = []
        for m in messages:
            if not (
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
            ):
                raise WorkloadError('each message must be {"role": str, "content": str}')
            pairs.append((m["role"], m["content"]))
        return Prompt(messages=tuple(pairs), max_tokens=max_tokens)
    raise WorkloadError('each line needs "prompt" (a string) or "messages" (a non-empty list)')
