"""The g2p kind: text to phonemes (model.py), its text rules (text.py), lexicon (lexicon.py), sessions (runtime.py)."""
