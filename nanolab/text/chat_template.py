"""Chat templates: a conversation (a list of messages) rendered as the one prompt a model was trained on.

A chat model reads a conversation as text with markers between the turns (ChatML's
``<|im_start|>user\\n...<|im_end|>``, Llama 3's ``<|start_header_id|>``...). Which markers is the
model's business, so a checkpoint carries a Jinja template that writes them: ``chat_template.jinja``,
or ``"chat_template"`` in ``tokenizer_config.json``. `ChatTemplate` renders one the way ``transformers``'
``apply_chat_template`` does: a sandboxed Jinja environment (templates come from model files, so they
run as untrusted code) with ``trim_blocks`` and ``lstrip_blocks``, the variables ``messages``,
``add_generation_prompt`` and the special tokens (``bos_token``, ``eos_token``, ...), and the helpers
templates use (``raise_exception``, ``tojson``, ``strftime_now``, ``{% generation %}``).

``add_generation_prompt=True`` ends the text with the header of an assistant turn, so the model's
continuation is the assistant's reply.

Deliberately left out: tools, documents, images and other non-text content, continuing the final
message, several named templates per checkpoint (the ``"default"`` one is used).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

Message = dict[str, Any]  # {"role": "user", "content": "..."}, as in OpenAI's API


class ChatTemplateError(ValueError):
    """A conversation the template cannot render: malformed messages, or the template refused them."""


def normalize_messages(messages: Any) -> list[Message]:
    """Check a conversation and return it as plain dicts with string contents.

    Each message needs a ``role`` (a non-empty string) and a ``content``: a string, or OpenAI's list of
    content parts, of which only ``{"type": "text", "text": ...}`` is understood (the texts are joined
    with newlines, as vLLM does for templates that expect a string). Other keys are passed on.

    Example:
        >>> normalize_messages([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
        [{'role': 'user', 'content': 'hi'}]
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ChatTemplateError(
            'messages must be a non-empty list of messages such as {"role": "user", "content": "Hello"}'
        )
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"{where} must be an object with a role and a content, got {message!r}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f'{where} needs a "role" such as "system", "user" or "assistant"')
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, Mapping)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise ChatTemplateError(
                        f"{where}.content[{j}] is of type {kind!r}: only text parts "
                        '({"type": "text", "text": "..."}) are supported'
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise ChatTemplateError(f'{where} needs a "content" string, got {content!r}')
        out.append({**_plain(message), "role": role, "content": content})
    return out


def _plain(value: Any) -> Any:
    """Only JSON's types reach the template (its sandbox should see no object with methods of its own)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


class ChatTemplate:
    """A Jinja chat template and the special tokens it may refer to.

    Example:
        >>> t = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"
        ...                  "{% if add_generation_prompt %}<assistant>{% endif %}", {"eos_token": "</s>"})
        >>> t.render([{"role": "user", "content": "hi"}])
        '<user>hi</s><assistant>'
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ValueError("a chat template must be a non-empty string of Jinja")
        self.source = source
        self.special_tokens = dict(special_tokens or {})  # {"bos_token": "<s>", "eos_token": "</s>", ...}
        try:
            self._template = _environment().from_string(source)
        except Exception as exc:  # jinja2.TemplateSyntaxError, with the line
            line = getattr(exc, "lineno", None)
            at = f" (line {line})" if line else ""
            raise ValueError(f"the chat template is not valid Jinja{at}: {exc}") from None

    def render(self, messages: Any, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The conversation as the model's prompt text; raises `ChatTemplateError` for one it cannot render.

        ``kwargs`` are more template variables (a template's own switches, such as ``enable_thinking``).
        """
        import jinja2

        chat = normalize_messages(messages)
        variables = {**self.special_tokens, **_plain(kwargs)}
        try:
            return self._template.render(
                messages=chat, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as exc:  # raise_exception(...) in the template, or the sandbox said no
            raise ChatTemplateError(f"the chat template cannot render this conversation: {exc}") from None

    def __repr__(self) -> str:
        head = self.source[:40].replace("\n", "\\n")
        return f"ChatTemplate({head!r}{'...' if len(self.source) > 40 else ''})"


def _environment():
    """The Jinja environment ``transformers`` renders chat templates in (sandboxed, immutable)."""
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise ImportError("chat templates need the jinja2 package: pip install jinja2") from exc

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` marks the assistant's text for training; here it just renders."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters (<, >, &), which a prompt must not
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
