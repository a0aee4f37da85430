"""A conversation -> token ids through a chat template, tools included: the tokenizer service
renders with it, and so does the colocated gateway (gateway/local_backend.py).

NOTE: which template renders a conversation.

    the request's chat_template  >  the server's --chat-template  >  the model's own
    with tools, a template that does not reference `tools` (the bundled SmolLM2's) would drop
    them silently: a ChatML one ("<|im_start|>") is swapped for templates/chatml_tools.jinja
    (logged once), any other is a ValueError asking for --chat-template
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import meta

logger = logging.getLogger(__name__)
TOOLS_TEMPLATE_PATH = Path(__file__).parent / "templates" / "chatml_tools.jinja"
CANNOT_RENDER_TOOLS = "the chat template cannot render tools"


def read_template(path: str) -> str | None:
    """The text of a --chat-template file (None for ""); ValueError if it cannot be read."""
    if not path:
        return None
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--chat-template {path}: {exc.strerror or exc}") from None


def references_tools(template: str) -> bool:
    """Whether the template reads a `tools` variable (a plain search if it does not parse)."""
    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return "tools" in template


class ChatRenderer:
    """Renders conversations with one tokenizer and the server's template (`default`: the
    --chat-template text, else the model's own)."""

    def __init__(self, tokenizer: Any, default: str | None = None) -> None:
        self.tokenizer, self.default = tokenizer, default
        self._tools_template: str | None = None  # read (and logged) on first use

    @property
    def has_template(self) -> bool:
        return bool(self.default or getattr(self.tokenizer, "chat_template", None))

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of `messages` (OpenAI's shape, content as text). ValueError for no
        messages, no template, a template that cannot render `tools`, or one that fails."""
        if not messages:
            raise ValueError("messages must not be empty")
        template = self.template(chat_template, tools)
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                tokenize=True, chat_template=template, return_dict=False,
            )
        except ValueError:
            raise
        except Exception as exc:  # jinja2 errors of a bad template or a role it rejects:
            raise ValueError(str(exc)) from exc  # the caller's mistake (INVALID_ARGUMENT)
        return list(ids)

    def template(self, chat_template: str | None, tools: list[dict[str, Any]] | None) -> str:
        """The template text that renders this conversation (see the module's NOTE)."""
        if not (chat_template or self.has_template):
            raise ValueError("the model has no chat template; pass chat_template")
        template = self.tokenizer.get_chat_template(chat_template or self.default, tools)
        if not tools or references_tools(template):
            return template
        if "<|im_start|>" not in template:
            raise ValueError(f"{CANNOT_RENDER_TOOLS}: start the server with --chat-template "
                             "PATH naming one that does")
        if self._tools_template is None:
            self._tools_template = TOOLS_TEMPLATE_PATH.read_text()
            logger.info("the chat template cannot render tools: requests with tools are "
                        "rendered with %s", TOOLS_TEMPLATE_PATH.name)
        return self._tools_template
