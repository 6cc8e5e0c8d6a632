"""The model kinds a repository can hold (`kinds`: a tensor model, g2p), and the onnxruntime sessions
they run (`runtime`). A kind joins a runtime to a scheduler.

It may use scheduling, the repository, the seq2seq graphs, observability and the base layer; never
serving or a front end.
"""
