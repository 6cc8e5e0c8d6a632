"""The front ends: how clients reach the server.

Each transport decodes its wire format into the data plane's `InferRequest`, awaits the `DataPlane`
(service/serving/), and encodes the answer: `grpc_api` (the gRPC servicer) and `rest_api` with
`rest_codec` (HTTP/REST); `codec` turns protocol tensors into numpy arrays and back, `messages` builds the
protocol's metadata, config and statistics messages, `statuses` maps every gRPC status to its HTTP status,
and `security` decides who may call them. A front end may use everything below it (serving, models,
scheduling, repository, observability, the base modules); nothing below imports a front end.
"""
