"""What an exported folder says about generating: the architecture, the special tokens, the limits and the
defaults (generation_config.json, then config.json, then transformers' own), and its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from service.models.generation.capability import EarlyStopping, GenerationDefaults
from service.repository.layout import MAX_CONFIG_BYTES, RepositoryError, folder_json

__all__ = ["CAUSAL_ARCHITECTURES", "DEFAULT_MAX_NEW_TOKENS", "FolderSettings", "read_folder", "recognises"]

MAX_FILE_BYTES = 64 << 20  # a tokenizer.json of a 250k vocabulary is some 20 MB
DEFAULT_MAX_NEW_TOKENS = 256  # `max_tokens` when neither the request nor generation_config.json gives one
UNBOUNDED_PROMPT = 4096  # an encoder with relative positions (T5): the longest prompt taken
CAUSAL_ARCHITECTURES = ("ForCausalLM", "LMHeadModel")  # config.json architectures of a decoder-only generator


def recognises(directory: Path) -> bool:
    """Whether a version directory holds a generation model as optimum exports it, tokenizer included: an
    encoder with its decoders (text2text-generation-with-past), or model.onnx of a causal LM (its
    config.json's architectures) with past (text-generation-with-past)."""
    if not (directory / "tokenizer.json").is_file():
        return False
    has = {p.name for p in directory.glob("*.onnx")}
    if "encoder_model.onnx" in has:
        return "decoder_model_merged.onnx" in has or {"decoder_model.onnx", "decoder_with_past_model.onnx"} <= has
    if "model.onnx" not in has:
        return False
    try:
        hf = folder_json(directory / "config.json", str(directory), MAX_CONFIG_BYTES)
    except RepositoryError:
        return False  # the kind that serves the folder says what is wrong with it
    architectures = hf.get("architectures")
    causal = isinstance(architectures, list) and any(
        isinstance(a, str) and a.endswith(CAUSAL_ARCHITECTURES) for a in architectures
    )
    return causal and bool(hf.get("use_cache", True))


@dataclass(frozen=True)
class FolderSettings:
    defaults: GenerationDefaults
    decoder_start: int  # an encoder-decoder's first decoder token
    pad: int
    vocab_size: int


def _ids(value: Any) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    return tuple(int(v) for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0)


def _number(value: Any, default: float) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default


def _early_stopping(value: Any) -> EarlyStopping:
    return value if value is True or value == "never" else False


def read_tokenizer(directory: Path, where: str) -> Tokenizer:
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise RepositoryError(f"{where}: a generation model needs its tokenizer.json beside the graphs")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises its own exception type
        raise RepositoryError(f"{where}: cannot read tokenizer.json: {e}") from None


def read_folder(directory: Path, encoder_decoder: bool, tokenizer: Tokenizer, where: str) -> FolderSettings:
    hf = folder_json(directory / "config.json", where, MAX_FILE_BYTES)
    gen = folder_json(directory / "generation_config.json", where, MAX_FILE_BYTES)

    def setting(key: str) -> Any:
        return gen[key] if key in gen else hf.get(key)

    eos = _ids(setting("eos_token_id"))
    if not eos:
        raise RepositoryError(f"{where}: no eos_token_id in generation_config.json or config.json")
    vocab = int(hf.get("vocab_size") or tokenizer.get_vocab_size())
    positions = 0 if encoder_decoder else int(hf.get("n_positions") or hf.get("max_position_embeddings") or 0)
    if positions:
        prompt = positions - 1
    else:
        limit = folder_json(directory / "tokenizer_config.json", where, MAX_FILE_BYTES).get("model_max_length")
        prompt = int(limit) if isinstance(limit, int) and 1 <= limit <= 1 << 20 else UNBOUNDED_PROMPT
    new = setting("max_new_tokens")
    defaults = GenerationDefaults(
        max_positions=positions,
        max_prompt_tokens=prompt,
        max_new_tokens=int(new) if isinstance(new, int) and new > 0 else DEFAULT_MAX_NEW_TOKENS,
        eos_token_ids=eos,
        do_sample=bool(setting("do_sample") or False),
        temperature=_number(setting("temperature"), 1.0),
        top_p=_number(setting("top_p"), 1.0),
        top_k=int(_number(setting("top_k"), 50)),  # transformers samples from the 50 best by default
        num_beams=int(_number(setting("num_beams"), 1)),
        length_penalty=_number(setting("length_penalty"), 1.0),
        early_stopping=_early_stopping(setting("early_stopping")),
        repetition_penalty=_number(setting("repetition_penalty"), 1.0),
    )
    start = _ids(setting("decoder_start_token_id"))
    pad = _ids(setting("pad_token_id"))
    if encoder_decoder and not start:
        raise RepositoryError(f"{where}: an encoder-decoder model needs decoder_start_token_id in config.json")
    return FolderSettings(defaults, start[0] if start else 0, pad[0] if pad else 0, vocab)
