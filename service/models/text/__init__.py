"""The text kind: Hugging Face text models served from the folder as exported (docs/text-models.md).

- `settings.py`: what the folder is (task, pooling, normalization, lengths, prompts), and config.json's
  `text` section over it;
- `tokens.py`: the tokenizer, and the long-input policy (truncate, refuse, chunk);
- `pooling.py`: pooling, normalization, Matryoshka dimensions, windows pooled back, classifier scores;
- `tasks.py`: the text endpoints' asks as this kind's tensors, and its answers read back (`Tokenizes`);
- `model.py`: `TextModel`, the served version: texts to token rows, batched by length on the graph.
"""

from service.models.catalog import Context, Kind, ServedVersion
from service.models.text.model import TextModel, build_text_model
from service.models.text.settings import TextSettings, is_text_folder
from service.repository.layout import ModelConfig

__all__ = ["KIND", "TextModel", "TextSettings", "build_text_model", "is_text_folder"]


def _build(config: ModelConfig, context: Context) -> ServedVersion:
    return build_text_model(config, context.providers, context.observer, context.compute)


KIND = Kind(_build, sections=("text",), recognises=is_text_folder)  # a text model's limits are in its "text" section
