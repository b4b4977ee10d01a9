"""Prompt/response -> token ids and labels for instruction tuning.

The loss covers the response only: prompt tokens (and padding) carry label -100.
A tokenizer with a chat template (Qwen2.5-Instruct has one) formats the pair as a
user turn and an assistant turn; one without (the synthetic set's) gets
``<bos> prompt response <eos>``.

Multi-turn samples (LLaVA, messages; data/formats) train on every assistant turn and on
nothing else. With a chat template, the whole conversation is rendered once and each assistant
turn's tokens are found as the difference between the conversation up to it with the
generation prompt and up to its end. Without one, ours: ``<bos> user1 assistant1 <eos> user2
assistant2 <eos> ...`` (a system turn is text like a user's; an assistant turn starts with a
space, as the single turn's response does). A sample of one user and one assistant turn is
encoded exactly as a prompt and response (the same tokens either way). ``data.max_length`` cuts
the conversation's tail; a first user turn that leaves no room for the first answer is refused as
a prompt too long, as in the single-turn case.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from purrsight.labels import IGNORE_INDEX


@dataclass(frozen=True)
class EncodedText:
    input_ids: list[int]
    labels: list[int]


class PromptTooLongError(ValueError):
    """The prompt alone fills max_length, so no response token would be trained."""


class TextEncoder:
    def __init__(self, tokenizer: Any, max_length: int) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.use_chat_template = bool(getattr(tokenizer, "chat_template", None))

    def _split(self, prompt: str, response: str) -> tuple[list[int], list[int]]:
        tok = self.tokenizer
        if self.use_chat_template:
            user = [{"role": "user", "content": prompt}]
            prompt_ids = list(tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False))
            full = list(
                tok.apply_chat_template([*user, {"role": "assistant", "content": response}], tokenize=True, return_dict=False)
            )
            if full[: len(prompt_ids)] == prompt_ids:
                return prompt_ids, full[len(prompt_ids) :]
            # A template that renders the prompt differently once an answer follows: fall
            # back to the plain pieces rather than mislabel tokens.
        prefix = [tok.bos_token_id] if tok.bos_token_id is not None else []
        prompt_ids = prefix + tok(prompt, add_special_tokens=False)["input_ids"]
        suffix = [tok.eos_token_id] if tok.eos_token_id is not None else []
        response_ids = tok(" " + response, add_special_tokens=False)["input_ids"] + suffix
        return prompt_ids, response_ids

    def prompt_length(self, prompt: str) -> int:
        return len(self._split(prompt, "x")[0])

    def __call__(self, prompt: str, response: str) -> EncodedText:
        prompt_ids, response_ids = self._split(prompt, response)
        if len(prompt_ids) >= self.max_length:
            raise PromptTooLongError(
                f"prompt is {len(prompt_ids)} tokens, data.max_length is {self.max_length}: no room for the response"
            )
        response_ids = response_ids[: self.max_length - len(prompt_ids)]  # truncate the answer's tail
        return EncodedText(
            input_ids=prompt_ids + response_ids,
            labels=[IGNORE_INDEX] * len(prompt_ids) + response_ids,
        )

    def _render(self, turns: Sequence[tuple[str, str]], generation_prompt: bool) -> list[int]:
        messages = [{"role": role, "content": text} for role, text in turns]
        rendered = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
        )
        return list(rendered)

    def _templated_turns(self, turns: Sequence[tuple[str, str]]) -> tuple[list[int], list[tuple[int, int]]] | None:
        """(token ids, the [start, end) spans of the assistant turns) through the chat template; None
        when a partial rendering is not a prefix of the whole (a template that rewrites earlier turns)."""
        full = self._render(turns, generation_prompt=False)
        spans = []
        for i, (role, _) in enumerate(turns):
            if role != "assistant":
                continue
            before = self._render(turns[:i], generation_prompt=True) if i else []
            through = self._render(turns[: i + 1], generation_prompt=False)
            if full[: len(before)] != before or full[: len(through)] != through:
                return None
            spans.append((len(before), len(through)))
        return full, spans

    def _plain_turns(self, turns: Sequence[tuple[str, str]]) -> tuple[list[int], list[tuple[int, int]]]:
        tok = self.tokenizer
        ids = [tok.bos_token_id] if tok.bos_token_id is not None else []
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        spans = []
        previous = "assistant"
        for role, text in turns:
            if role == "assistant":
                start = len(ids)
                ids += tok(" " + text, add_special_tokens=False)["input_ids"] + eos
                spans.append((start, len(ids)))
            else:  # after another user or system turn, a space joins them; after an answer, a fresh start
                ids += tok(text if previous == "assistant" else " " + text, add_special_tokens=False)["input_ids"]
            previous = role
        return ids, spans

    def encode_turns(self, turns: Sequence[tuple[str, str]]) -> EncodedText:
        """Token ids and labels of a conversation: the loss on assistant turns only (module docstring)."""
        if len(turns) == 2 and turns[0][0] == "user" and turns[1][0] == "assistant":
            return self(turns[0][1], turns[1][1])
        found = self._templated_turns(turns) if self.use_chat_template else None
        ids, spans = found if found is not None else self._plain_turns(turns)
        if not spans:
            raise PromptTooLongError("no assistant turn: nothing to train on")
        if spans[0][0] >= self.max_length:
            raise PromptTooLongError(
                f"the turns before the first answer are {spans[0][0]} tokens, data.max_length is {self.max_length}: "
                "no room for the response"
            )
        labels = [IGNORE_INDEX] * len(ids)
        for start, end in spans:
            labels[start:end] = ids[start:end]
        return EncodedText(input_ids=ids[: self.max_length], labels=labels[: self.max_length])

    def first_prompt_length(self, turns: Sequence[tuple[str, str]]) -> int:
        """Tokens before the first answer (what must fit within data.max_length)."""
        if len(turns) == 2 and turns[0][0] == "user" and turns[1][0] == "assistant":
            return self.prompt_length(turns[0][1])
        found = self._templated_turns(turns) if self.use_chat_template else None
        _, spans = found if found is not None else self._plain_turns(turns)
        return spans[0][0] if spans else 0
