"""The g2p kind: text to phonemes (model.py), its text rules (text.py), lexicon (lexicon.py), sessions (runtime.py)."""

from __future__ import annotations

from functools import partial

from service.models.catalog import Context, Kind, ServedVersion
from service.models.g2p.model import G2PModel
from service.models.g2p.runtime import G2PRuntime
from service.repository.layout import ModelConfig

__all__ = ["KIND", "G2PModel"]


def _build(config: ModelConfig, context: Context) -> ServedVersion:
    runtime = context.compute.run_lowered(partial(G2PRuntime, config, context.providers))
    model = G2PModel(config, runtime, context.observer, context.compute)
    model.cache = context.cache if config.response_cache else None  # it keeps each word's answer
    return model


KIND = Kind(_build, limits=("max_word_length", "max_output_length", "max_words", "max_element_bytes", "max_beam_size"))
