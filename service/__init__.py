"""qkv: a gRPC model server for Transformers on onnxruntime (open v2 inference protocol)."""

__version__ = "0.1.0"
