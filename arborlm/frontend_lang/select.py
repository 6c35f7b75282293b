"""`select`: score every choice as a continuation of the program text and pick one.

Three requests, none of which generates a token (SGLang's procedure, after
``sglang/lang/backend/runtime_endpoint.py``, with token ids where SGLang
compares token text):

1. prefill the program text (``max_new_tokens=0``): its KV enters the radix
   cache and its length ``P`` is known;
2. one batch of ``text`` and ``text + choice`` for every choice, with prompt
   logprobs from position ``P - 1``: each item recomputes only the last prompt
   token and the choice's tokens, the rest is a cache hit;
3. only for `unconditional_likelihood_normalized`: the choices' tokens alone.

Token healing: tokenizing ``text + choice`` may merge the program's last token
with the choice's first. When position ``P - 1`` of a choice holds the
program's own last token, that entry is dropped and only the choice's tokens
count; when it differs, the merged token counts as part of the choice.
"""

from __future__ import annotations

from typing import Any

from arborlm.errors import InvalidRequestError
from arborlm.frontend_lang.backend.base_backend import BaseBackend
from arborlm.frontend_lang.choices import ChoicesDecision, ChoicesSamplingMethod


def check_choices(choices: Any) -> list[str]:
    """`choices` as a list of non-empty strings.

    Raises
    ------
    InvalidRequestError: empty, or not all non-empty strings.
    """
    if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError("choices must be a non-empty list of non-empty strings", "choices")
    return list(choices)


def select_choice(backend: BaseBackend, text: str, choices: list[str],
                  choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
    """Score each of `choices` after `text` on `backend` and decide with `choices_method`.

    Returns
    -------
    The decision; its meta info holds the method's scores plus "prompt_tokens"
    and "cached_tokens" summed over the scoring requests, and "completion_tokens",
    the chosen continuation's token count.

    Raises
    ------
    UnsupportedByBackendError: the backend cannot score prompts.
    InvalidRequestError: a scoring request was refused.
    """
    start = 0
    last_token = None
    metas: list[dict[str, Any]] = []
    if text:
        prefix = backend.prefill(text)
        if prefix is None:
            backend.score([text], 0)  # raises UnsupportedByBackendError for backends that cannot score
            raise InvalidRequestError(f"{type(backend).__name__}.prefill must report the prompt length", "choices")
        metas.append(prefix)
        start = max(prefix["prompt_tokens"] - 1, 0)
    prompts = ([text] if text else []) + [text + c for c in choices]
    scored = _checked(backend.score(prompts, start))
    metas += scored
    if text:
        last_token = scored[0]["input_token_logprobs"][-1][1]
        scored = scored[1:]
    input_lps = []
    for meta in scored:
        lps = [tuple(lp) for lp in meta["input_token_logprobs"]]
        if text and len(lps) > 1 and lps[0][1] == last_token:
            lps = lps[1:]
        input_lps.append(lps)
    normalized = [_mean([lp[0] for lp in lps if lp[0] is not None]) for lps in input_lps]
    unconditional = None
    if choices_method.requires_unconditional_logprobs:
        uncond_metas = _checked(backend.score([[lp[1] for lp in lps] for lps in input_lps], 0))
        metas += uncond_metas
        unconditional = [[tuple(lp) for lp in m["input_token_logprobs"]] for m in uncond_metas]
    decision = choices_method(
        choices=choices,
        normalized_prompt_logprobs=normalized,
        input_token_logprobs=input_lps,
        output_token_logprobs=[m.get("output_token_logprobs", []) for m in scored],
        unconditional_token_logprobs=unconditional,
    )
    decision.meta_info["prompt_tokens"] = sum(m["prompt_tokens"] for m in metas)
    decision.meta_info["cached_tokens"] = sum(m["cached_tokens"] for m in metas)
    decision.meta_info["completion_tokens"] = len(input_lps[choices.index(decision.decision)])
    return decision


def _checked(metas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`metas`, raising the refusal of any item a batch aborted."""
    for meta in metas:
        reason = meta.get("finish_reason") or {}
        if reason.get("type") == "abort":
            raise InvalidRequestError(reason.get("message", "a scoring request was aborted"), reason.get("param"))
    return metas


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")
