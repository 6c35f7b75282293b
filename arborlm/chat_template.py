"""Role markers derived from a tokenizer's own chat template.

A program's text is built role by role, so each role needs the text that opens
and closes it. Rendering the model's template (transformers
`apply_chat_template`) around a sentinel content and cutting at the sentinel
gives them for any template, with no table of model families to maintain.
"""

from __future__ import annotations

from dataclasses import dataclass

SENTINEL = "ARBORLM_CONTENT_SENTINEL"


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
