"""The model kinds a repository can hold: what any served version offers (`catalog.ServedVersion`) and the
capabilities a kind may add, the kinds themselves, one package each (`tensor`, `g2p`, `ensemble`, `text`,
`generation`; `catalog.BUILT_IN` lists them, and a kind from outside is found by its import path or entry
point), what every kind shares (`common`, `base`), and the onnxruntime sessions they run (`runtime`).

It may use scheduling, the repository, the seq2seq graphs, observability and the base layer; never
serving or a front end.
"""
