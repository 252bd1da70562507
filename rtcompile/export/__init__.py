"""Export (bundles, ONNX graphs, ONNX Runtime custom-op implementations).

Not built yet: see the tracker's model-and-export issue. Nothing here is imported by the rest.
"""
