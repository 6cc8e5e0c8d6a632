"""The tools that call a server, never part of one: the Python client (`client`), the load generator
(`loadgen`), `qkv bench` (`bench`), the attention pictures (`attention_plot`), tensors from files
(`tensor_io`), incremental decoding (`incremental`) and a server run as a child process (`process`).

The server (service.server and every package below it) never imports this package: an import-linter
contract in pyproject.toml says so.
"""
