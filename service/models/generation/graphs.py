"""The exported graphs of a generation model, recognised from their inputs and outputs, and one step of each.

    decoder-only (`text-generation-with-past`): model.onnx
        input_ids (B, T), attention_mask (B, P+T), position_ids (B, T) if the graph takes them,
        past_key_values.{i}.key / .value (B, H, P, D)  ->  logits (B, T, V), present.{i}.key / .value (B, H, P+T, D)
    encoder-decoder (`text2text-generation-with-past`): encoder_model.onnx
        input_ids (B, S), attention_mask (B, S)  ->  last_hidden_state (B, S, E)
    and decoder_model_merged.onnx (use_cache_branch), or decoder_model.onnx with decoder_with_past_model.onnx:
        input_ids (B, T), encoder_attention_mask (B, S), encoder_hidden_states (B, S, E),
        past_key_values.{i}.decoder.* (B, H, P, D), past_key_values.{i}.encoder.* (B, H, S, D)
        ->  logits (B, T, V), present.{i}.decoder.* (B, H, P+T, D), present.{i}.encoder.* (B, H, S, D)
    The decoder with past is given a self-attention mask at load (masking.py), decoder_attention_mask
    (B, P+T), where its graph shows where: then rows of different cache lengths run in one call, left-padded.

A cache is a list of arrays, one a past input in the graph's order. A graph whose names differ is refused
with a message naming what is missing.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from service.decoding.steps import CacheLayout
from service.models.generation.masking import MASK, Unmasked, with_self_attention_mask
from service.repository.layout import RepositoryError

__all__ = ["CausalGraph", "Seq2SeqGraphs", "graph_files"]

log = logging.getLogger("qkv.generation")

_PAST = re.compile(r"past_key_values\.(\d+)\.(?:(decoder|encoder)\.)?(key|value)")


def graph_files(directory: Path) -> tuple[str, ...]:
    """The graphs a folder's generation model runs: ('model.onnx',) for a decoder-only export, the encoder
    and the merged decoder (or the two decoders) for an encoder-decoder one; () for neither."""
    has = {p.name for p in directory.glob("*.onnx")}
    if "encoder_model.onnx" in has:
        if "decoder_model_merged.onnx" in has:
            return "encoder_model.onnx", "decoder_model_merged.onnx"
        if {"decoder_model.onnx", "decoder_with_past_model.onnx"} <= has:
            return "encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx"
        return ()
    return ("model.onnx",) if "model.onnx" in has else ()


def _session(path: Path, options: ort.SessionOptions, providers: list[Any]) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), sess_options=options, providers=providers)


def _masked_session(path: Path, options: ort.SessionOptions, providers: list[Any],
                    where: str) -> tuple[ort.InferenceSession, bool]:  # fmt: skip
    """A decoder's session, given a self-attention mask input (MASK) where its graph shows where; whether it was."""
    try:
        data, external = with_self_attention_mask(path.read_bytes())
    except Unmasked as e:
        log.info("%s: %s takes no self-attention mask (%s): its decoder rows run in groups of equal length",
                 where, path.name, e)  # fmt: skip
        return _session(path, options, providers), False
    if external:  # a graph read from memory finds its weights' files here
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    return ort.InferenceSession(data, sess_options=options, providers=providers), True


def _past(session: ort.InferenceSession, where: str, file: str) -> CacheLayout:
    names: list[str] = []
    shapes: list[Any] = []
    for i in session.get_inputs():
        if _PAST.fullmatch(i.name):
            names.append(i.name)
            shapes.append(i.shape)
    if not names:
        raise RepositoryError(
            f"{where}: {file} takes no past key values (inputs {[i.name for i in session.get_inputs()]}); export "
            "it with past (optimum's text-generation-with-past or text2text-generation-with-past)"
        )
    outputs = {o.name for o in session.get_outputs()}
    present = tuple(n.replace("past_key_values", "present") for n in names)
    selfs = tuple((m := _PAST.fullmatch(n)) is not None and m.group(2) != "encoder" for n in names)
    missing = [p for p, own in zip(present, selfs, strict=True) if own and p not in outputs]
    if missing or "logits" not in outputs:
        raise RepositoryError(f"{where}: {file} lacks output(s) {missing or ['logits']} (outputs: {sorted(outputs)})")
    heads, head_dim = shapes[0][1], shapes[0][3]
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        raise RepositoryError(f"{where}: {file}: past key values of shape {shapes[0]}, not (batch, heads, length, dim)")
    return CacheLayout(tuple(names), present, heads, head_dim, selfs)


def _require(session: ort.InferenceSession, needed: tuple[str, ...], where: str, file: str) -> set[str]:
    inputs = {i.name for i in session.get_inputs()}
    missing = [n for n in needed if n not in inputs]
    if missing:
        raise RepositoryError(f"{where}: {file} lacks input(s) {missing} (inputs: {sorted(inputs)})")
    return inputs


class CausalGraph:
    """A decoder-only model with past: one call runs rows of new tokens over their caches."""

    def __init__(self, directory: Path, options: ort.SessionOptions, providers: list[Any], where: str) -> None:
        self.session = _session(directory / "model.onnx", options, providers)
        inputs = _require(self.session, ("input_ids", "attention_mask"), where, "model.onnx")
        self.with_positions = "position_ids" in inputs
        self.past = _past(self.session, where, "model.onnx")
        self.outputs = ["logits", *self.past.outputs]
        dtype = next(i.type for i in self.session.get_inputs() if i.name == self.past.inputs[0])
        self.dtype = np.float16 if "float16" in dtype else np.float32

    def run(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray,
            past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:  # fmt: skip
        """ids (B, T), mask (B, P+T), positions (B, T), past (B, H, P, D) each -> logits (B, T, V), present."""
        feeds: dict[str, np.ndarray] = {"input_ids": ids, "attention_mask": mask}
        if self.with_positions:
            feeds["position_ids"] = positions
        feeds.update(zip(self.past.inputs, past, strict=True))
        out = self.session.run(self.outputs, feeds)
        return out[0], out[1:]


class Seq2SeqGraphs:
    """An encoder and a decoder with past (merged, or the two decoders). `masked`: the decoder with past takes
    a self-attention mask (MASK), so its rows may have caches of different lengths, left-padded."""

    def __init__(self, directory: Path, files: tuple[str, ...], options: ort.SessionOptions, providers: list[Any],
                 where: str) -> None:  # fmt: skip
        self.encoder = _session(directory / files[0], options, providers)
        _require(self.encoder, ("input_ids", "attention_mask"), where, files[0])
        self.hidden = self.encoder.get_outputs()[0].name
        self.merged = len(files) == 2
        needed = ("input_ids", "encoder_attention_mask", "encoder_hidden_states")
        if self.merged:
            self.first, self.masked = _masked_session(directory / files[1], options, providers, where)
            self.decoder = self.first
            _require(self.decoder, (*needed, "use_cache_branch"), where, files[1])
        else:
            self.first = _session(directory / files[1], options, providers)
            self.decoder, self.masked = _masked_session(directory / files[2], options, providers, where)
            _require(self.first, needed, where, files[1])
            _require(self.decoder, ("input_ids", "encoder_attention_mask"), where, files[2])
        self.past = _past(self.decoder, where, files[-1])
        self.first_inputs = {i.name for i in self.first.get_inputs()}
        self.decoder_inputs = {i.name for i in self.decoder.get_inputs()}
        self.first_outputs = ["logits", *(o.name for o in self.first.get_outputs() if o.name.startswith("present"))]
        first_present = self.first_outputs[1:]
        if sorted(first_present) != sorted(self.past.outputs):
            raise RepositoryError(f"{where}: {files[1]} gives {first_present}, the decoder with past takes "
                                  f"{list(self.past.outputs)}")  # fmt: skip
        hidden = self.encoder.get_outputs()[0].shape[-1]
        self.d_model = hidden if isinstance(hidden, int) else self.past.heads * self.past.head_dim
        self.dtype = np.float32
        self._zeros = np.zeros((0, 0, self.d_model), dtype=self.dtype)

    def encode(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """(B, S) ids and mask -> (B, S, E) hidden states."""
        out: np.ndarray = self.encoder.run([self.hidden], {"input_ids": ids, "attention_mask": mask})[0]
        return out

    def start(self, ids: np.ndarray, hidden: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """The first decoder step, no past: ids (B, T) -> logits, present (the graph's past order)."""
        feeds: dict[str, np.ndarray] = {"input_ids": ids, "encoder_attention_mask": mask,
                                        "encoder_hidden_states": hidden}  # fmt: skip
        if self.merged:
            b, s = mask.shape
            h, d = self.past.heads, self.past.head_dim
            for name, own in zip(self.past.inputs, self.past.self_attention, strict=True):
                feeds[name] = np.zeros((b, h, 0 if own else s, d), dtype=self.dtype)
            feeds["use_cache_branch"] = np.array([False])
            if self.masked:  # read on the cache branch only
                feeds[MASK] = np.ones(ids.shape, dtype=np.int64)
        out = self.first.run(self.first_outputs, feeds)
        present = dict(zip(self.first_outputs[1:], out[1:], strict=True))
        return out[0], [present[n] for n in self.past.outputs]

    def _no_hidden_states(self, shape: tuple[int, ...]) -> np.ndarray:
        """Zeros of (B, S, E): what the decoder with past is given for encoder_hidden_states, whose shape alone it
        reads; the last one is kept (a running batch asks for the same shape step after step)."""
        if self._zeros.shape[:2] != shape:
            self._zeros = np.zeros((*shape, self.d_model), dtype=self.dtype)
        return self._zeros

    def step(self, ids: np.ndarray, mask: np.ndarray, past: list[np.ndarray],
             self_mask: np.ndarray | None = None) -> tuple[np.ndarray, list[np.ndarray]]:  # fmt: skip
        """A step with past: ids (B, T), the encoder mask (B, S), past, the self-attention mask (B, P+T) where
        the decoder is `masked` -> logits, present (encoder parts as given)."""
        feeds: dict[str, np.ndarray] = {"input_ids": ids, "encoder_attention_mask": mask}
        if self.masked:
            b, p = ids.shape[0], past[self.past.self_attention.index(True)].shape[2]
            feeds[MASK] = self_mask if self_mask is not None else np.ones((b, p + ids.shape[1]), dtype=np.int64)
        if "encoder_hidden_states" in self.decoder_inputs:  # read for its shape only on the cache branch
            feeds["encoder_hidden_states"] = self._no_hidden_states(mask.shape)
        if self.merged:
            feeds["use_cache_branch"] = np.array([True])
        feeds.update(zip(self.past.inputs, past, strict=True))
        outputs = ["logits"] + [o for o, own in zip(self.past.outputs, self.past.self_attention, strict=True) if own]
        out = self.decoder.run(outputs, feeds)
        grown = iter(out[1:])
        present = [next(grown) if own else p for p, own in zip(past, self.past.self_attention, strict=True)]
        return out[0], present
