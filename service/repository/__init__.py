"""The model repository on disk (`layout`): one directory per model, numbered versions, and each
config.json parsed and checked against its types.

It may use scheduling (whose settings a config.json holds), observability and the base layer.
"""
