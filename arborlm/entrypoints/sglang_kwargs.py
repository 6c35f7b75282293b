"""SGLang's usual `Engine` / `Runtime` keywords that arborlm has no field for, translated.

SGLang programs start their backend with ``sgl.Runtime(model_path=..., tp_size=1,
mem_fraction_static=0.8, trust_remote_code=True)`` (or `sgl.Engine(...)`); arborlm's
`ServerArgs` refuses unknown keywords, so `sglang_server_kwargs` maps them first:

- ``tp``: SGLang's short name of ``tp_size`` (tensor-parallel ranks, a `ServerArgs` field that
  validates itself); given with a different ``tp_size`` it is refused.
- ``mem_fraction_static``: becomes ``mem_fraction``, arborlm's fraction of device memory for
  the server's static pool. SGLang's fraction covers the weights and the KV pool of the total
  memory; arborlm's is the KV pool's share of the memory free after the weights load, so the
  same number gives a KV pool of about the same size on a device the model fills little.
- ``trust_remote_code``: accepted (True or False) and dropped: arborlm implements each model
  architecture itself and never imports code shipped with a checkpoint, whatever the value.
"""

from __future__ import annotations

from typing import Any


def sglang_server_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with SGLang's `tp`, `mem_fraction_static` and `trust_remote_code` translated
    to `ServerArgs` fields (a new dict; the others, `tp_size` among them, pass through unchanged).

    Raises
    ------
    TypeError: ``tp`` given with a different ``tp_size``, ``trust_remote_code`` not a bool, or
        ``mem_fraction_static`` given with a different ``mem_fraction``.
    """
    out = dict(kwargs)
    if "tp" in out:
        tp = out.pop("tp")
        if out.get("tp_size", tp) != tp:
            raise TypeError(f"tp={tp!r} and tp_size={out['tp_size']!r} disagree: give one of them")
        out["tp_size"] = tp
    if "trust_remote_code" in out:
        trust = out.pop("trust_remote_code")
        if not isinstance(trust, bool):
            raise TypeError(f"trust_remote_code must be a bool, got {type(trust).__name__} {trust!r}")
    if "mem_fraction_static" in out:
        fraction = out.pop("mem_fraction_static")
        if out.get("mem_fraction", fraction) != fraction:
            raise TypeError(f"mem_fraction_static={fraction!r} and mem_fraction={out['mem_fraction']!r} "
                            "disagree: give one of them")
        out["mem_fraction"] = fraction
    return out
