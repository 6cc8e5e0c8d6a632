"""The model kinds a repository can hold: what any served version offers (`catalog.ServedVersion`), the
table from a kind's name to its factory (`catalog.KINDS`), the kinds themselves (`kinds`: a tensor model,
g2p), and the onnxruntime sessions they run (`runtime`). A kind joins a runtime to a scheduler.

It may use scheduling, the repository, the seq2seq graphs, observability and the base layer; never
serving or a front end.
"""
