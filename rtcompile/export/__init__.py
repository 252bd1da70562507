"""Export: bundles (manifest, safetensors weights, plan, prefill.onnx, decode.onnx) that load
without tuning or pickle. The state mixer is one ONNX node ``ai.rtcompile::RunningTensor``
carrying a model-local function body that plain onnxruntime runs.
"""

from .bundle import (
           BUNDLE_FORMAT,
           BundleError,
           check_replaceable,
           export_bundle,
           load_bundle,
           read_manifest,
)
from .onnx_mixer import DOMAIN, mixer_model, running_tensor_function
from .verify import verify_bundle

__all__ = ["BUNDLE_FORMAT", "DOMAIN", "BundleError", "check_replaceable", "export_bundle", "load_bundle", "mixer_model",
           "read_manifest", "running_tensor_function", "verify_bundle"]
