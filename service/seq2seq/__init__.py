"""Sequence to sequence with ONNX graphs: the exported encoder and decoder (`graphs`), greedy and beam
decoding over any step model (`generation`), and the vocabularies (`vocab`).

It uses the base layer only, and never torch: the export (export/) produces what it loads.
"""
