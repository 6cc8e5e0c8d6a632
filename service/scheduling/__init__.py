"""When requests run: dynamic batching for tensor models (`batching`), continuous decoding for
generation (`continuous`), the bounded queue and its refusals (`admission`), batching settings fitted
to a model's measured cost (`tuning`), those settings' defaults (`config`), and when the server's
event loop last waited for work (`loop_idle`).

It knows neither a wire protocol nor onnxruntime. It may use the seq2seq decoding (`generation`),
observability and the base layer.
"""
