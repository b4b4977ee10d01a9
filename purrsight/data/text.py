"""Prompt/response -> token ids and labels for instruction tuning.

The loss covers the response only: prompt tokens (and padding) carry label -100.
A tokenizer with a chat template (Qwen2.5-Instruct has one) formats the pair as a
user turn and an assistant turn; one without (the synthetic set's) gets
``<bos> prompt response <eos>``.
"""

from __future__ import annotations

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
