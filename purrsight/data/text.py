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

Media placeholders (``<image>``, ``<audio>``, in any format's text) say where the sample's media go.
The text is tokenized in pieces split at them, as LLaVA's ``tokenizer_image_token`` does (a chat
template's rendering is split the same way): each placeholder is taken out, and
``EncodedText.media_at`` holds the index of the token its media go before (PurrSightModel places
the projected media there). The line break beside a placeholder leaves with it, from the sample's
text only (never a chat template's), and ours joins turns with a space after any placeholders a
turn starts with. A sample without one has its media in front of the text, as before placeholders
were read; one cut off by ``data.max_length`` goes at the end. Without placeholders the tokens are
the same as one pass over the whole text.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from purrsight.data.formats.records import PLACEHOLDERS
from purrsight.labels import IGNORE_INDEX

_MODALITY_OF = {placeholder: modality for modality, placeholder in PLACEHOLDERS.items()}
_ANY = "|".join(re.escape(p) for p in PLACEHOLDERS.values())
_PLACEHOLDER = re.compile(f"({_ANY})")
# A placeholder with the line break LLaVA puts after it (or, when none follows, before it).
_WITH_BREAK = re.compile(f"({_ANY})\n|\n({_ANY})(?!\n)")
_LEADING = re.compile(f"(?:(?:{_ANY})[ \t]*)+")  # placeholders a text starts with, and the blanks among them


@dataclass(frozen=True)
class EncodedText:
    input_ids: list[int]
    labels: list[int]
    media_at: dict[str, int] = field(default_factory=dict)  # modality -> the token index its media go before


def drop_breaks(text: str) -> str:
    """A sample's text with the line break beside each placeholder taken out (once per text: the
    chat template's own line breaks are never touched)."""
    return _WITH_BREAK.sub(lambda found: found.group(1) or found.group(2), text)


def split_at_placeholders(text: str) -> Iterator[tuple[str | None, str]]:
    """``text`` as (None, piece) and (modality, placeholder) parts, in order."""
    start = 0
    for found in _PLACEHOLDER.finditer(text):
        yield None, text[start : found.start()]
        yield _MODALITY_OF[found.group(1)], found.group(1)
        start = found.end()
    yield None, text[start:]


def joined(text: str) -> str:
    """``text`` after a space (ours joins turns so), the space after any placeholders it starts
    with: the word after them tokenizes as it would without them."""
    leading = _LEADING.match(text)
    if leading is None:
        return " " + text
    return "".join(_PLACEHOLDER.findall(leading.group(0))) + " " + text[leading.end() :]


class PromptTooLongError(ValueError):
    """The prompt alone fills max_length, so no response token would be trained."""


class TemplateRefusedError(ValueError):
    """The tokenizer's chat template raised on a conversation (Gemma's on a system turn, Mistral's on
    two user turns in a row): that sample is bad, named with the template's own message."""


class TextEncoder:
    def __init__(self, tokenizer: Any, max_length: int) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.use_chat_template = bool(getattr(tokenizer, "chat_template", None))

    def _tokens(self, text: str, media_at: dict[str, int], start: int) -> list[int]:
        """``text``'s token ids, placeholders taken out; where each stood (counted from ``start``) is
        put in ``media_at`` (the first of a modality's, should a text hold two)."""
        ids: list[int] = []
        for modality, piece in split_at_placeholders(text):
            if modality is not None:
                media_at.setdefault(modality, start + len(ids))
            elif piece:
                ids += self.tokenizer(piece, add_special_tokens=False)["input_ids"]
        return ids

    def _split(self, prompt: str, response: str) -> tuple[list[int], list[int], dict[str, int]]:
        tok = self.tokenizer
        media_at: dict[str, int] = {}
        if self.use_chat_template:
            user = [("user", prompt)]
            prompt_ids = self._render(user, generation_prompt=True, media_at={})
            full = self._render([*user, ("assistant", response)], generation_prompt=False, media_at=media_at)
            if full[: len(prompt_ids)] == prompt_ids:
                return prompt_ids, full[len(prompt_ids) :], media_at
            # A template that renders the prompt differently once an answer follows: fall
            # back to the plain pieces rather than mislabel tokens.
            media_at = {}
        prefix = [tok.bos_token_id] if tok.bos_token_id is not None else []
        prompt_ids = prefix + self._tokens(drop_breaks(prompt), media_at, len(prefix))
        suffix = [tok.eos_token_id] if tok.eos_token_id is not None else []
        response_ids = self._tokens(joined(drop_breaks(response)), media_at, len(prompt_ids)) + suffix
        return prompt_ids, response_ids, media_at

    def prompt_length(self, prompt: str) -> int:
        return len(self._split(prompt, "x")[0])

    def __call__(self, prompt: str, response: str) -> EncodedText:
        prompt_ids, response_ids, media_at = self._split(prompt, response)
        if len(prompt_ids) >= self.max_length:
            raise PromptTooLongError(
                f"prompt is {len(prompt_ids)} tokens, data.max_length is {self.max_length}: no room for the response"
            )
        response_ids = response_ids[: self.max_length - len(prompt_ids)]  # truncate the answer's tail
        return _encoded(prompt_ids + response_ids, [IGNORE_INDEX] * len(prompt_ids) + response_ids, media_at)

    def _render(self, turns: Sequence[tuple[str, str]], generation_prompt: bool, media_at: dict[str, int]) -> list[int]:
        """The chat template's rendering, tokenized as ``apply_chat_template(tokenize=True)`` does (the
        string without special tokens added) but in pieces split at the placeholders."""
        messages = [{"role": role, "content": drop_breaks(text)} for role, text in turns]
        try:
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        except Exception as err:  # the template's raise_exception (jinja2's TemplateError), or its own bug on these turns
            roles = ", ".join(role for role, _ in turns)
            raise TemplateRefusedError(f"the tokenizer's chat template refuses these turns ({roles}): {err}") from None
        return self._tokens(str(rendered), media_at, 0)

    def _templated_turns(
        self, turns: Sequence[tuple[str, str]], media_at: dict[str, int]
    ) -> tuple[list[int], list[tuple[int, int]]] | None:
        """(token ids, the [start, end) spans of the assistant turns) through the chat template; None
        when a partial rendering is not a prefix of the whole (a template that rewrites earlier turns)."""
        full = self._render(turns, generation_prompt=False, media_at=media_at)
        spans = []
        for i, (role, _) in enumerate(turns):
            if role != "assistant":
                continue
            before = self._render(turns[:i], generation_prompt=True, media_at={}) if i else []
            through = self._render(turns[: i + 1], generation_prompt=False, media_at={})
            if full[: len(before)] != before or full[: len(through)] != through:
                return None
            spans.append((len(before), len(through)))
        return full, spans

    def _plain_turns(self, turns: Sequence[tuple[str, str]], media_at: dict[str, int]) -> tuple[list[int], list[tuple[int, int]]]:
        tok = self.tokenizer
        ids = [tok.bos_token_id] if tok.bos_token_id is not None else []
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        spans = []
        previous = "assistant"
        for role, text in turns:
            text = drop_breaks(text)
            if role == "assistant":
                start = len(ids)
                ids += self._tokens(joined(text), media_at, len(ids)) + eos
                spans.append((start, len(ids)))
            else:  # after another user or system turn, a space joins them; after an answer, a fresh start
                ids += self._tokens(text if previous == "assistant" else joined(text), media_at, len(ids))
            previous = role
        return ids, spans

    def _turn_ids(self, turns: Sequence[tuple[str, str]], media_at: dict[str, int]) -> tuple[list[int], list[tuple[int, int]]]:
        found = self._templated_turns(turns, media_at) if self.use_chat_template else None
        if found is None:
            media_at.clear()  # positions of a template's rendering that was given up
            return self._plain_turns(turns, media_at)
        return found

    def encode_turns(self, turns: Sequence[tuple[str, str]]) -> EncodedText:
        """Token ids and labels of a conversation: the loss on assistant turns only (module docstring)."""
        if len(turns) == 2 and turns[0][0] == "user" and turns[1][0] == "assistant":
            return self(turns[0][1], turns[1][1])
        media_at: dict[str, int] = {}
        ids, spans = self._turn_ids(turns, media_at)
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
        return _encoded(ids[: self.max_length], labels[: self.max_length], media_at)

    def first_prompt_length(self, turns: Sequence[tuple[str, str]]) -> int:
        """Tokens before the first answer (what must fit within data.max_length)."""
        if len(turns) == 2 and turns[0][0] == "user" and turns[1][0] == "assistant":
            return self.prompt_length(turns[0][1])
        _, spans = self._turn_ids(turns, {})
        return spans[0][0] if spans else 0


def _encoded(ids: list[int], labels: list[int], media_at: dict[str, int]) -> EncodedText:
    """Media whose placeholder the cut left out go after the last token kept."""
    return EncodedText(ids, labels, {modality: min(at, len(ids)) for modality, at in media_at.items()})
