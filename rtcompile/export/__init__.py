"""Export: bundles (manifest, safetensors weights, plan) that load without tuning or pickle,
and the ONNX form of the state mixer (``ai.rtcompile::RunningTensor`` with a model-local
function body that plain onnxruntime runs). Whole-model ONNX graphs (prefill.onnx,
decode.onnx) are the next step of the model-and-export issue; bundles do not carry them yet.
"""

from .bundle import BUNDLE_FORMAT, BundleError, export_bundle, load_bundle, read_manifest
from .onnx_mixer import DOMAIN, mixer_model, running_tensor_function

__all__ = ["BUNDLE_FORMAT", "DOMAIN", "BundleError", "export_bundle", "load_bundle", "mixer_model", "read_manifest",
           "running_tensor_function"]
