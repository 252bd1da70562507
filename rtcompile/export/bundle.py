"""Bundles: a directory a deployment loads without running anything from it.

Layout: ``manifest.json`` (format version, spec, plan, target, tool/torch/triton/onnx versions,
sha256 and size of every other file), ``weights.safetensors``, ``prefill.onnx`` and
``decode.onnx`` (see ``onnx_model``). Writing goes to a temporary
directory beside the destination, renamed into place at the end, so a reader never sees half a
bundle. Loading checks the format, that every listed file is inside the bundle, exists and has
its hash, before reading any weight; it reads JSON and safetensors only (no pickle), and never
tunes: the plan's variants are pinned as they were exported.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..fileio import atomic_directory, file_sha256, honour_umask

BUNDLE_FORMAT = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"


class BundleError(ValueError):
    """A bundle cannot be written or is refused on load (one line, naming the file)."""


def _versions() -> dict[str, str]:
    import torch

    from .._version import __version__

    out = {"rtcompile": __version__, "torch": torch.__version__}
    for name in ("triton", "onnx", "onnxruntime", "safetensors"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = "not installed"
    return out


def export_bundle(model, out: str | os.PathLike, *, plan=None, overwrite: bool = False, onnx: bool = True,
                  opset27: bool = False) -> Path:
    """Write ``model`` (a :class:`~rtcompile.model.RunningTensorLM`) as a bundle at ``out``:
    manifest, weights and (``onnx``) ``prefill.onnx`` / ``decode.onnx``."""
    from safetensors.torch import save_file

    dest = Path(out)
    if (dest.exists() or dest.is_symlink()) and not overwrite:
        raise BundleError(f"bundle {str(dest)!r}: already exists; allowed: a new path, or overwrite=True (--force)")
    with atomic_directory(dest, overwrite=overwrite, may_replace=check_replaceable) as tmp:
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS))
        honour_umask(tmp / WEIGHTS)  # save_file creates it 0600
        names = [WEIGHTS]
        if onnx:
            import copy

            from .onnx_model import export_onnx

            export_onnx(copy.deepcopy(model), tmp, opset27=opset27)
            names += ["prefill.onnx", "decode.onnx"]
        files = {n: {"sha256": file_sha256(tmp / n), "bytes": (tmp / n).stat().st_size} for n in names}
        manifest = {
            "format": BUNDLE_FORMAT,
            "spec": model.spec.to_dict(),
            "model": {"class": "RunningTensorLM", "vocab_size": model.head.out_features, "mlp": model.mlps is not None},
            "plan": None if plan is None else plan.to_dict(),
            "target": None if plan is None else plan.target.get("name"),
            "onnx": None if not onnx else {"mixer": "LinearAttention (opset 27)" if opset27 else "ai.rtcompile::RunningTensor"},
            "versions": _versions(),
            "files": files,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return dest


def check_replaceable(path: str | os.PathLike) -> None:
    """BundleError unless ``path`` is a bundle that ``overwrite`` (``--force``) may replace: a real
    folder whose manifest.json is a bundle manifest and which holds nothing but that manifest
    and the files it lists. Anything else (a user's folder, a file, a link, a bundle with extra
    files added) would lose data that is not ours to delete. Hashes are not checked: replacing
    a corrupted bundle is what ``--force`` is for."""
    root = Path(path)
    refuse = lambda why: BundleError(f"--out {str(root)!r}: {why}; --force replaces only an existing bundle "
                                     "(allowed: a new path, or a folder rtcompile export wrote)")
    if root.is_symlink() or not root.is_dir():
        raise refuse("exists and is not a folder")
    try:
        manifest = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise refuse(f"is not a bundle (no readable {MANIFEST})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("format"), int) or not isinstance(files, dict):
        raise refuse(f"is not a bundle ({MANIFEST} is not a bundle manifest)")
    for entry in sorted(root.iterdir()):
        if entry.name != MANIFEST and (entry.name not in files or entry.is_symlink() or not entry.is_file()):
            raise refuse(f"holds {entry.name!r}, which its {MANIFEST} does not list")


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The verified manifest: format, file list inside the bundle, hashes. Reads no weights."""
    root = Path(path)
    mf = root / MANIFEST
    try:
        manifest = json.loads(mf.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BundleError(f"bundle {str(root)!r}: no {MANIFEST}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"bundle {str(root)!r}: {MANIFEST} unreadable ({str(exc).splitlines()[0]})") from None
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
    if not isinstance(fmt, int):
        raise BundleError(f"bundle {str(root)!r}: {MANIFEST} has no integer 'format'")
    if fmt > BUNDLE_FORMAT:
        raise BundleError(f"bundle {str(root)!r}: format {fmt} is newer than this rtcompile reads ({BUNDLE_FORMAT})")
    files = manifest.get("files")
    if not isinstance(files, dict) or WEIGHTS not in files:
        raise BundleError(f"bundle {str(root)!r}: {MANIFEST} lists no {WEIGHTS}")
    base = root.resolve()
    for name in files:  # every entry first: nothing outside the bundle is ever opened
        if base not in (root / name).resolve().parents:
            raise BundleError(f"bundle {str(root)!r}: manifest entry {name!r} points outside the bundle")
    for name, meta in files.items():
        target = (root / name).resolve()
        if not target.is_file():
            raise BundleError(f"bundle {str(root)!r}: {name} is missing")
        if not isinstance(meta, dict) or file_sha256(target) != meta.get("sha256"):
            raise BundleError(f"bundle {str(root)!r}: {name} does not match its sha256 in the manifest (tampered or corrupted)")
    return manifest


def load_bundle(path: str | os.PathLike):
    """A ready :class:`~rtcompile.model.RunningTensorLM` (eval mode) and its plan, or BundleError."""
    from safetensors.torch import load_file

    from ..model import RunningTensorLM
    from ..plan import Plan, PlanError
    from ..spec import ModelSpec, SpecError, SpecTypeError

    manifest = read_manifest(path)
    try:
        spec = ModelSpec.from_dict(manifest["spec"])
        info = manifest["model"]
        plan = None if manifest.get("plan") is None else Plan.from_dict(manifest["plan"])
    except (KeyError, TypeError, SpecError, SpecTypeError, PlanError) as exc:
        raise BundleError(f"bundle {str(path)!r}: manifest: {exc}") from None
    model = RunningTensorLM(spec, vocab_size=int(info["vocab_size"]), mlp=bool(info["mlp"]))
    weights = load_file(str(Path(path) / WEIGHTS))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise BundleError(f"bundle {str(path)!r}: weights do not fit the spec (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]})")
    model.eval()
    model.plan = plan
    return model
