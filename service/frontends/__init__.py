"""The front ends: how clients reach the server.

gRPC and HTTP/REST speak the v2 inference protocol (`codec` and `rest_codec` turn wire tensors into
numpy arrays and back), and `security` decides who may call them. A front end may use everything
below it (serving, models, scheduling, repository, observability, the base modules); nothing below
imports a front end.
"""
