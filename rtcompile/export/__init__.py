"""Export: bundles (manifest, safetensors weights, plan) that load without tuning or pickle.

ONNX graphs (prefill.onnx, decode.onnx with the ``ai.rtcompile::RunningTensor`` node) are the
next step of the model-and-export issue; nothing here writes them yet.
"""

from .bundle import BUNDLE_FORMAT, BundleError, export_bundle, load_bundle, read_manifest

__all__ = ["BUNDLE_FORMAT", "BundleError", "export_bundle", "load_bundle", "read_manifest"]
