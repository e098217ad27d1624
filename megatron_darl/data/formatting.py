"""Prompt formatting: a record's question -> user message (`prompt_template`) -> chat template of
the tokenizer (with an optional system prompt) -> token ids, with the prompt-length limits:
`data.max_prompt_tokens`, and the model's context less the tokens each answer may take
(`ContextLimit`: a longer prompt would be refused by the engine).

What it is: `PromptFormatter`, whose `encode(record)` is what `PromptLoader` calls per draw.
What it is not: tokenizer loading (`tokenizers.py`) or a place for task-specific instructions;
those belong in the record's question or in the configured template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_darl.config.data import DataConfig, template_fields
from megatron_darl.data.api import PromptError, PromptRecord


class PromptTooLong(PromptError):
    reason = "prompt_too_long"


class PromptExceedsContext(PromptError):
    reason = "prompt_exceeds_context"


class UnknownCharacters(PromptError):
    reason = "unknown_characters"


@dataclass(frozen=True)
class ContextLimit:
    """The model's context (`max_position_embeddings`, read from `source`) and the new tokens
    every request of the prompt asks for (`max_new_tokens`, the config key `key`): SGLang and
    darl-engine refuse a /generate whose prompt plus max_new_tokens exceeds the context (a 400,
    which marks the engine down), so a prompt longer than `room` is a bad row instead."""

    context: int
    max_new_tokens: int
    key: str  # e.g. "rollout.max_new_tokens"
    source: str  # the config.json (or built-in model) the context came from

    @property
    def room(self) -> int:
        """The most prompt tokens that fit (< 1: none)."""
        return self.context - self.max_new_tokens

    def describe(self) -> str:
        return (f"the model's context of {self.context} tokens (max_position_embeddings, {self.source}) "
                f"less {self.key}={self.max_new_tokens} leaves {self.room} for the prompt")


def template_values(record: PromptRecord) -> dict[str, Any]:
    """What `prompt_template` may name: {question} and the record's scalar metadata."""
    values = {k: v for k, v in record.metadata.items() if isinstance(v, (str, int, float))}
    values["question"] = record.question
    return values


def check_template(template: str, record: PromptRecord) -> None:
    """ValueError naming the fields `template` uses that `record` lacks."""
    values = template_values(record)
    missing = [f for f in template_fields(template) if f not in values]
    if missing:
        raise ValueError(
            f"prompt_template {template!r} uses {missing} but record {record.where} offers {sorted(values)}"
        )


class PromptFormatter:
    """Turns records into prompt token ids with one tokenizer (the chat template, or the raw
    `prompt_template`: see `chat_template` under `__init__`)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        prompt_template: str = "{question}",
        system_prompt: str | None = None,
        chat_template: bool = True,
        max_prompt_tokens: int = 1024,
        chat_kwargs: dict[str, Any] | None = None,
        context: ContextLimit | None = None,
    ) -> None:
        """A formatter; fails at once if the options do not fit the tokenizer.

        Args:
            tokenizer: a Hugging Face tokenizer (`encode`, `get_vocab`, and `apply_chat_template` for chat).
            prompt_template: the user message, a `str.format` template of `{question}` and the record's
                scalar metadata fields.
            system_prompt: a system message put before the user message; needs `chat_template`; None: none.
            chat_template: render through `tokenizer.apply_chat_template(..., add_generation_prompt=True)` and
                encode without special tokens (the template wrote them); False encodes the raw text, with BOS.
            max_prompt_tokens: the most prompt tokens; a longer prompt is rejected (`PromptTooLong`).
            chat_kwargs: extra keyword arguments of `apply_chat_template`, e.g. `{"enable_thinking": False}`.
            context: the model's context less each answer's tokens, also a limit (`PromptExceedsContext`);
                None: only `max_prompt_tokens` applies.
        """
        self.fields = template_fields(prompt_template)
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "chat_template=true but the tokenizer has no chat template; set data.chat_template=false "
                "to use the raw prompt_template"
            )
        if system_prompt is not None and not chat_template:
            raise ValueError("system_prompt needs chat_template=true (a raw template has no system role)")
        self.tokenizer, self.template, self.system_prompt = tokenizer, prompt_template, system_prompt
        self.use_chat, self.max_prompt_tokens = chat_template, max_prompt_tokens
        self.chat_kwargs = dict(chat_kwargs or {})  # e.g. {"enable_thinking": False} for Qwen3
        self.context = context  # None: no model context to respect (only max_prompt_tokens)
        self._longest: int | None = None

    @classmethod
    def from_config(cls, tokenizer: Any, cfg: DataConfig, context: ContextLimit | None = None,
                    **chat_kwargs: Any) -> PromptFormatter:
        return cls(
            tokenizer,
            prompt_template=cfg.prompt_template,
            system_prompt=cfg.system_prompt,
            chat_template=cfg.chat_template,
            max_prompt_tokens=cfg.max_prompt_tokens,
            chat_kwargs={**cfg.chat_kwargs, **chat_kwargs},
            context=context,
        )

    def user_message(self, record: PromptRecord) -> str:
        check_template(self.template, record)
        return self.template.format(**template_values(record))

    def render(self, record: PromptRecord) -> str:
        """The full prompt text, special tokens included."""
        text = self.user_message(record)
        if not self.use_chat:
            return text
        messages = [{"role": "user", "content": text}]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **self.chat_kwargs
        )

    def encode(self, record: PromptRecord) -> list[int]:
        text = self.render(record)
        longest = self._longest_token()
        if len(text) > self.max_prompt_tokens * longest:  # cannot fit: skip encoding it
            raise PromptTooLong(f"{len(text)} characters: more than max_prompt_tokens={self.max_prompt_tokens} "
                                f"tokens of at most {longest} characters")
        room = None if self.context is None else self.context.room
        if room is not None and len(text) > room * longest:
            raise PromptExceedsContext(f"{len(text)} characters: more than {max(room, 0)} tokens of at most "
                                       f"{longest} characters; {self.context.describe()}")
        ids = list(self.tokenizer.encode(text, add_special_tokens=not self.use_chat))
        unk = self.tokenizer.unk_token_id
        if unk is not None and unk in ids:
            raise UnknownCharacters(f"characters {self._unknown_chars(text)} are not in the tokenizer's vocabulary")
        if len(ids) > self.max_prompt_tokens:
            raise PromptTooLong(f"{len(ids)} tokens > max_prompt_tokens={self.max_prompt_tokens}")
        if room is not None and len(ids) > room:
            raise PromptExceedsContext(f"{len(ids)} tokens > {room}: {self.context.describe()}")
        return ids

    def _longest_token(self) -> int:
        """Characters the longest vocabulary entry spells (a byte-level entry's length is its byte
        count, at least its character count): a text longer than max_prompt_tokens times this
        has too many tokens, which a 1 MB row then shows without being encoded."""
        if self._longest is None:
            self._longest = max(len(t) for t in self.tokenizer.get_vocab())
        return self._longest

    def _unknown_chars(self, text: str) -> list[str]:
        unk = self.tokenizer.unk_token_id
        for special in self.tokenizer.all_special_tokens:  # their characters are not text characters
            text = text.replace(special, "")
        return sorted(c for c in set(text) if unk in self.tokenizer.encode(c, add_special_tokens=False))
