"""The generation kind: Hugging Face seq2seq and decoder-only models served from the folder as exported by
`optimum-cli export onnx --task text2text-generation-with-past` or `text-generation-with-past`
(docs/generation.md).

- `capability.py`: the generation capability: what a front end asks (`GenerationRequest`), what it hears
  back (`GenerationChunk`, one per step that produced text), and `Generator`, the protocol a served
  version that generates answers to (front ends find it by this capability, never by the kind's name).
- `model.py`: the kind (`GenerationModel`): a v2 infer (text_input -> text_output) and the capability.
- `graphs.py`: the exported graphs, recognised and run one step, in the decoding engine (service.decoding).
- `requests.py`, `folder.py`: a request checked (or built from v2 parameters); the folder's defaults and
  special tokens.
"""

from service.models.generation.capability import (
    FINISH_REASONS,
    GenerationChunk,
    GenerationDefaults,
    GenerationRequest,
    Generator,
)

__all__ = ["FINISH_REASONS", "GenerationChunk", "GenerationDefaults", "GenerationRequest", "Generator"]
