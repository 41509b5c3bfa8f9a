"""A conversation becomes a prompt: rendered with the model's chat template, then tokenized.

`LLM.chat` and the server's ``/v1/chat/completions`` both go through `chat_prompt`, so a conversation
gets the same token ids offline and online. The template writes every marker the model expects, BOS
included where the model wants one, so the text is encoded without the tokens a Hugging Face
tokenizer's post-processor would add (``transformers``' ``apply_chat_template(tokenize=True)`` and
vLLM do the same): otherwise a Llama prompt would start with two BOS tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from nanolab.text.chat_template import ChatTemplate, ChatTemplateError
from nanolab.text.hf_tokenizer import HFTokenizer


class NoChatTemplate(ChatTemplateError):
    """The model has no chat template (a plain language model, or a checkpoint saved without one)."""


class ChatPrompt(NamedTuple):
    text: str  # the rendered conversation
    token_ids: list[int]


NO_TEMPLATE = (
    "this model has no chat template (no chat_template.jinja, and no chat_template in "
    "tokenizer_config.json), so it cannot take a conversation: send a plain prompt to the completions "
    "API instead, or give the model a template"
)


def as_conversations(messages: Any) -> list[Any]:
    """One conversation (a list of messages) or a list of conversations, as a list of conversations.

    Example:
        >>> as_conversations([{"role": "user", "content": "hi"}])
        [[{'role': 'user', 'content': 'hi'}]]
    """
    if isinstance(messages, Sequence) and not isinstance(messages, (str, bytes)) and messages:
        if all(isinstance(m, Mapping) for m in messages):
            return [messages]
        if all(isinstance(c, Sequence) and not isinstance(c, (str, bytes)) for c in messages):
            return list(messages)
    raise ChatTemplateError(
        'give a conversation as a list of messages such as [{"role": "user", "content": "Hello"}], '
        "or a list of such conversations"
    )


def chat_prompt(
    template: ChatTemplate | None,
    tokenizer: Any,
    messages: Any,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> ChatPrompt:
    """Render one conversation and tokenize it; raises `ChatTemplateError` (a ValueError) if it cannot."""
    if template is None:
        raise NoChatTemplate(NO_TEMPLATE)
    if tokenizer is None:
        raise ChatTemplateError("this model has no tokenizer, so a rendered conversation cannot be encoded")
    text = template.render(messages, add_generation_prompt, **template_kwargs)
    return ChatPrompt(text, encode_text(tokenizer, text))


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text``, reading special tokens written in it (``<|endoftext|>``) as themselves.

    ``add_special_tokens``: let a Hugging Face tokenizer add what its post-processor adds (a BOS token,
    say); nanolab's own tokenizer never adds tokens of its own.
    """
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.encode(text, allowed_special="all", add_special_tokens=add_special_tokens)
    return tokenizer.encode(text, allowed_special="all")
