"""The g2p kind's sessions: encoder + decoder-step graphs, the two vocabularies, and the lexicon if shipped."""

from __future__ import annotations

from service.models.g2p.lexicon import LEXICON_FILE, Lexicon
from service.models.runtime import _HOW_TO_QUANTIZE, triton_providers
from service.repository.layout import ModelConfig, RepositoryError
from service.seq2seq.graphs import (
    DECODER_FILE,
    ENCODER_FILE,
    GRAPHEMES_FILE,
    PHONEMES_FILE,
    OnnxSeq2Seq,
    graph_file,
    session_options,
)
from service.seq2seq.vocab import Vocabulary

__all__ = ["G2PRuntime"]


class G2PRuntime:
    """The g2p kind: encoder + decoder-step graphs, the two vocabularies, and the lexicon if shipped."""

    def __init__(self, config: ModelConfig, providers: list[str]) -> None:
        d = config.directory
        graphs = [graph_file(f, config.precision) for f in (ENCODER_FILE, DECODER_FILE)]
        for f in (*graphs, GRAPHEMES_FILE, PHONEMES_FILE):
            if not (d / f).exists():
                raise RepositoryError(
                    f"model '{config.name}': missing {d / f}{_HOW_TO_QUANTIZE.get(config.precision, '')}"
                )
        self.config = config
        try:
            options = session_options(config.intra_op_threads, config.inter_op_threads, config.optimization)
            providers = triton_providers(config, options, providers)  # a Triton config's, when it has them
            self.instances = [
                OnnxSeq2Seq(d, options, providers, config.precision) for _ in range(max(1, config.instances))
            ]
            self.graphemes = Vocabulary.load(d / GRAPHEMES_FILE)
            self.phonemes = Vocabulary.load(d / PHONEMES_FILE)
            # The pronouncing lexicon, when the version ships one: its words are answered without decoding.
            self.lexicon = Lexicon.load(d / LEXICON_FILE) if (d / LEXICON_FILE).is_file() else None
        except Exception as e:
            raise RepositoryError(f"model '{config.name}': cannot load {d}: {e}") from e
        self.provider = self.instances[0].providers[0]
