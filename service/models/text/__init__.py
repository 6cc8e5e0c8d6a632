"""The text kind: Hugging Face text models served from the folder as exported (docs/text-models.md).

- `settings.py`: what the folder is (task, pooling, normalization, lengths, prompts), and config.json's
  `text` section over it;
- `tokens.py`: the tokenizer, and the long-input policy (truncate, refuse, chunk);
- `pooling.py`: pooling, normalization, Matryoshka dimensions, windows pooled back, classifier scores;
- `model.py`: `TextModel`, the served version: texts to token rows, batched by length on the graph.
"""

from service.models.text.model import TextModel, build_text_model
from service.models.text.settings import TextSettings, is_text_folder

__all__ = ["TextModel", "TextSettings", "build_text_model", "is_text_folder"]
