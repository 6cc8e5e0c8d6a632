"""The decoding engine: continuous batching of autoregressive generation at the step level, for any graphs
that run one step over per-sequence key/value caches (an exported Hugging Face model's, g2p's own).

- `request.py`: what the engine is asked (`GenerationRequest`) and answers (`GenerationChunk`).
- `engine.py`: the decoding thread and its running batch; `planning.py`: each step's decoding rows and
  prefill chunks.
- `choosing.py`, `detokenize.py`: the next token; text deltas and stop strings.
"""
