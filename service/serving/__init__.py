"""Serving: the data plane every front end calls (`dataplane`, over the transport-free requests of
`dataplane_types`), and the model versions that are live (`registry`: load, unload, poll, drain).

It may use the models, scheduling, repository, observability and base layers, never a front end.
"""
