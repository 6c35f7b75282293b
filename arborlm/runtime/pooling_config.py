"""How an embedding checkpoint (`--is-embedding`) turns hidden states into one vector.

Read from the checkpoint's sentence-transformers files when it has them, as
`sentence_transformers.SentenceTransformer` reads them: `modules.json` lists
the modules; its ``Pooling`` module's `config.json` says the pooling
(``pooling_mode_lasttoken``, ``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``)
and a ``Normalize`` module means unit-length vectors. Without those files the
pooling is SGLang's default for decoder embedding models: the last token,
normalized (Qwen3-Embedding and e5-mistral both pool so).

`dimensions` (OpenAI's field) truncates a vector to its first values before the
normalization, which is meaningful only for Matryoshka-trained models: those
whose config.json says ``is_matryoshka`` or lists ``matryoshka_dimensions``
(vLLM's convention); the others accept only their full size.

Pure Python (no torch): the HTTP front reads it too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from arborlm.errors import ModelLoadError

POOLINGS = ("last", "mean", "cls")
# sentence-transformers' Pooling options we serve, and the ones we refuse by name.
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_UNSERVED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens")
_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
_TRANSFORMER_MODULES = ("sentence_transformers.models.Transformer", "sentence_transformers.base.modules.Transformer")


@dataclass(frozen=True)
class PoolingConfig:
    """One embedding model's pooling.

    pooling: ``last`` (the last prompt token's hidden state), ``mean`` (the mean over
        the prompt's tokens) or ``cls`` (the first token's).
    normalize: vectors are scaled to unit L2 norm.
    hidden_size: the length of a full vector.
    matryoshka_dimensions: the sizes `dimensions` may ask for; None: any size up to
        `hidden_size` (a Matryoshka model without a list); () : only the full size.
    """

    pooling: str = "last"
    normalize: bool = True
    hidden_size: int = 0
    matryoshka_dimensions: tuple[int, ...] | None = ()

    def __post_init__(self):
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")

    def check_dimensions(self, dimensions: int | None) -> str | None:
        """None when `dimensions` can be served, else why not (for a 400 naming `dimensions`)."""
        if dimensions is None or dimensions == self.hidden_size:
            return None
        if not 1 <= dimensions <= self.hidden_size:
            return f"dimensions must be between 1 and {self.hidden_size} (this model's size), got {dimensions}"
        if self.matryoshka_dimensions == ():
            return (f"this model does not support dimensions other than {self.hidden_size}: it is not a "
                    "Matryoshka model (its config.json has neither is_matryoshka nor matryoshka_dimensions)")
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            return f"dimensions must be one of {list(self.matryoshka_dimensions)} for this model, got {dimensions}"
        return None


def read_pooling_config(checkpoint: str | Path) -> PoolingConfig:
    """The pooling of the checkpoint folder `checkpoint` (see the module docstring).

    Raises
    ------
    ModelLoadError: a sentence-transformers pooling mode we do not serve (max, mean of
        sqrt length, weighted mean, several at once), or a module after the pooling we
        cannot apply (a ``Dense`` projection).
    """
    folder = Path(checkpoint)
    config = _json(folder / "config.json") or {}
    text = config.get("text_config") or config
    hidden = int(text.get("hidden_size") or 0)
    matryoshka = _matryoshka(config)
    modules = _json(folder / "modules.json")
    if modules is None:
        return PoolingConfig("last", True, hidden, matryoshka)
    pooling, normalize = "last", False
    for module in modules:
        kind = module.get("type", "")
        if kind == _POOLING_MODULE:
            pooling = _pooling_mode(_json(folder / module.get("path", "") / "config.json") or {}, folder)
        elif kind == _NORMALIZE_MODULE:
            normalize = True
        elif kind not in _TRANSFORMER_MODULES:
            raise ModelLoadError(f"{folder / 'modules.json'}: the sentence-transformers module {kind!r} is not "
                                 "served (arborlm applies a Transformer, a Pooling and a Normalize module)")
    return PoolingConfig(pooling, normalize, hidden, matryoshka)


def _pooling_mode(config: dict, folder: Path) -> str:
    unserved = [m for m in _UNSERVED_MODES if config.get(m)]
    chosen = [name for key, name in _MODES.items() if config.get(key)]
    if unserved or len(chosen) != 1:
        raise ModelLoadError(f"{folder}: sentence-transformers pooling {unserved or chosen or 'none'} is not served; "
                             "arborlm pools with exactly one of pooling_mode_lasttoken, pooling_mode_mean_tokens "
                             "and pooling_mode_cls_token")
    return chosen[0]


def _matryoshka(config: dict) -> tuple[int, ...] | None:
    dims = config.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    return None if config.get("is_matryoshka") else ()


def _json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def normalized(vector: list[float]) -> list[float]:
    """`vector` scaled to unit L2 norm (a zero vector stays zero)."""
    norm = sum(v * v for v in vector) ** 0.5
    return [v / norm for v in vector] if norm > 0 else list(vector)
