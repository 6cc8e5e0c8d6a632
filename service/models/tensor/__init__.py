"""The tensor kind: any ONNX graph (model.py), and a stateful one through the sequence batcher (stateful.py)."""
