"""Serving: the model versions that are live (`registry`: load, unload, poll, drain).

It may use the models, scheduling, repository, observability and base layers, never a front end.
"""
