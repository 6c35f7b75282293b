"""Chat templates: the `--chat-template` override, and role markers derived from a template.

`load_chat_template` reads `--chat-template` (a Jinja file, or the name of one
of the templates shipped in ``arborlm/chat_templates/``, for checkpoints whose
tokenizer has none or a broken one); `apply_chat_template_override` puts it
on the tokenizer, so the server, the Engine and the DSL all render with it.

A program's text is built role by role, so each role needs the text that opens
and closes it. Rendering the model's template (transformers
`apply_chat_template`) around a sentinel content and cutting at the sentinel
gives them for any template, with no table of model families to maintain.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SENTINEL = "ARBORLM_CONTENT_SENTINEL"
TEMPLATES_DIR = Path(__file__).with_name("chat_templates")
# The shipped templates, by name (file stem); each is the relevant part of a family's real template.
BUILTIN_CHAT_TEMPLATES = tuple(sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja")))


def is_template_file(path: str) -> bool:
    """True when `path` is a readable file (a Jinja chat template, presumably)."""
    return os.path.isfile(path) and os.access(path, os.R_OK)


def load_chat_template(name_or_path: str) -> str:
    """The text of a built-in template (by name) or of a Jinja file.

    Raises
    ------
    ValueError: neither a built-in name nor a readable file (naming `chat_template`).
    """
    if name_or_path in BUILTIN_CHAT_TEMPLATES:
        return (TEMPLATES_DIR / f"{name_or_path}.jinja").read_text(encoding="utf-8")
    if is_template_file(name_or_path):
        return Path(name_or_path).read_text(encoding="utf-8")
    raise ValueError(f"chat_template={name_or_path!r} is invalid: expected a readable Jinja file "
                     f"or one of {BUILTIN_CHAT_TEMPLATES}")


def apply_chat_template_override(tokenizer, name_or_path: str | None):
    """`tokenizer` with its chat template replaced by `name_or_path`'s (unchanged when None).

    Raises
    ------
    ValueError: see `load_chat_template`.
    """
    if name_or_path is not None:
        tokenizer.chat_template = load_chat_template(name_or_path)
    return tokenizer


@dataclass(frozen=True)
class ChatTemplate:
    """Text before and after the content of each role."""

    role_prefix_and_suffix: dict[str, tuple[str, str]]

    def prefix(self, role: str) -> str:
        return self.role_prefix_and_suffix[role][0]

    def suffix(self, role: str) -> str:
        return self.role_prefix_and_suffix[role][1]

    @classmethod
    def plain(cls) -> ChatTemplate:
        """For models without a chat template: "Role: content\\n"."""
        return cls({r: (f"{r.capitalize()}: ", "\n") for r in ("system", "user", "assistant")})

    @classmethod
    def from_tokenizer(cls, tokenizer) -> ChatTemplate:
        """Derive the markers by rendering the tokenizer's chat template."""
        if not getattr(tokenizer, "chat_template", None):
            return cls.plain()

        def render(messages: list[dict[str, str]]) -> str:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)

        def cut(before: list[dict[str, str]], role: str) -> tuple[str, str]:
            base = render(before) if before else ""
            full = render([*before, {"role": role, "content": SENTINEL}])
            if not full.startswith(base):
                base = ""
            head, _, tail = full[len(base):].partition(SENTINEL)
            return head, tail

        system = {"role": "system", "content": "S"}
        user = {"role": "user", "content": "U"}
        return cls({
            "system": cut([], "system"),
            "user": cut([system], "user"),
            "assistant": cut([system, user], "assistant"),
        })
