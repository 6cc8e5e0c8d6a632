"""The ensemble kind: a pipeline of served models, run step by step (model.py)."""
