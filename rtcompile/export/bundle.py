"""Bundles: a directory a deployment loads without running anything from it.

Layout: ``manifest.json`` (format version, spec, plan, target, tool/torch/triton/onnx versions,
sha256 and size of every other file), ``weights.safetensors``, ``prefill.onnx`` and
``decode.onnx`` (see ``onnx_model``), and from a CUDA machine ``kernels/`` (compiled Triton
kernels with the machine they are for: ``compiled``). Writing goes to a temporary
directory beside the destination, renamed into place at the end, so a reader never sees half a
bundle. Loading first runs every check of ``verify`` (manifest keys and types, files inside
the bundle with their sizes and hashes, spec, plan, the weights' names and shapes, the ONNX
graphs' external data and weight digest); it reads JSON, safetensors and ONNX protobufs only (no
pickle), and never tunes: the plan's variants are pinned as they were exported.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import warnings
from pathlib import Path

from ..fileio import ReadError, atomic_directory, file_sha256, honour_umask, parse_problem, read_whole, writing
from .compiled import compile_into, install
from .verify import (
    BUNDLE_FORMAT,
    GRAPHS,
    MANIFEST,
    MAX_VOCAB,
    WEIGHTS,
    BundleError,
    VerifiedBundle,
    graph_weights_sha256,
    plan_mismatch,
    ST_TORCH_DTYPES,
    read_manifest,
    safetensors_header,
    skipping_init,
    verify_bundle,
)

__all__ = ["BUNDLE_FORMAT", "BundleError", "ONNX_MAX_BYTES", "check_replaceable", "export_bundle", "load_bundle",
           "onnx_graph_bytes", "read_manifest", "verify_bundle"]

# protobuf serialises at most 2 GiB a message, and an ONNX file (without external data) is one
# message: a model past it built for 44 s and then failed ("EncodeError: Failed to serialize proto")
ONNX_MAX_BYTES = 1 << 31
# what a graph holds beyond its fp32 weights grows with the layers: 331 KB in each of o3 16x16's
# graphs at model_width 64, 4 layers (~83 KB a layer); 128 KiB a layer keeps a margin
ONNX_GRAPH_BYTES_PER_LAYER = 128 << 10


def onnx_graph_bytes(parameters: int, layers: int) -> int:
    """The estimated bytes of one ONNX graph of a model of ``parameters`` parameters and
    ``layers`` layers: its fp32 weights (the exporter casts to fp32) and the rest."""
    return 4 * parameters + ONNX_GRAPH_BYTES_PER_LAYER * layers


def _onnx_failed(exc: Exception) -> bool:
    """Is ``exc`` protobuf refusing a graph's size (EncodeError, or onnx's ValueError naming the
    2GB limit)? Other errors of the export are bugs and keep their traceback."""
    from google.protobuf.message import EncodeError

    text = str(exc)
    return isinstance(exc, EncodeError) or (isinstance(exc, ValueError) and ("2GB" in text or "protobuf" in text))


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
                  opset27: bool = False, compiled: bool = False) -> Path:
    """Write ``model`` (a :class:`~rtcompile.model.RunningTensorLM`) as a bundle at ``out``:
    manifest, weights, (``onnx``) ``prefill.onnx`` / ``decode.onnx`` and (``compiled``, on a
    CUDA machine) the Triton kernels the plan's shapes compile, for this GPU and software
    (``compiled.py``; without CUDA there are none to collect; ``rtcompile export`` asks for them
    unless ``--no-kernels``). A compile that fails leaves the bundle without kernels and says
    so once (the bundle is still complete). Before anything is written the arguments are
    checked and ``plan`` is read back through the loader's own reader (every field, a decision
    for prefill and decode, made for this spec): a bundle the loader would refuse is never written."""
    from ..model import RunningTensorLM
    from ..plan import Plan, PlanError

    if not isinstance(model, RunningTensorLM):
        raise TypeError(f"model: expected a RunningTensorLM, got {type(model).__name__}")
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a rtcompile.plan.Plan or None, got {type(plan).__name__}")
    for name, flag in (("overwrite", overwrite), ("onnx", onnx), ("opset27", opset27), ("compiled", compiled)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
    if not isinstance(out, (str, os.PathLike)):
        raise TypeError(f"out: expected a str or os.PathLike bundle folder, got {type(out).__name__}")
    dest = Path(out)
    vocab = model.head.out_features
    if not 2 <= vocab <= MAX_VOCAB:  # what the loader takes (verify._check_model): never write a bundle it refuses
        raise BundleError(f"bundle {str(dest)!r}: vocab_size {vocab}; allowed: an integer in [2, {MAX_VOCAB}]")
    if plan is not None:
        try:  # the loader's own reader: a plan it would refuse is never written
            Plan.from_dict(plan.to_dict())
        except PlanError as exc:
            raise BundleError(f"bundle {str(dest)!r}: {str(exc).splitlines()[0]}") from None
        diff = plan_mismatch(plan.spec, model.spec)
        if diff is not None:
            raise BundleError(f"bundle {str(dest)!r}: the plan was made for another spec (plan's vs the model's: "
                              f"{diff}); allowed: a plan made from this spec (rtcompile plan / build)")
    if (dest.exists() or dest.is_symlink()) and not overwrite:
        raise BundleError(f"bundle {str(dest)!r}: already exists; allowed: a new path, or overwrite=True (--force)")
    if onnx and (size := onnx_graph_bytes(sum(p.numel() for p in model.parameters()), model.spec.layers)) > ONNX_MAX_BYTES:
        raise BundleError(f"bundle {str(dest)!r}: each ONNX graph would hold ~{size:,} bytes (fp32 weights), beyond the "
                          f"{ONNX_MAX_BYTES:,} (2 GiB) a protobuf holds; allowed: onnx=False (--no-onnx), or a smaller model")
    with atomic_directory(dest, overwrite=overwrite, may_replace=check_replaceable) as tmp:
        # Each write into the temporary folder (a full disk, a folder made read-only meanwhile) is a
        # WriteError naming the bundle: one line from the CLI, and atomic_directory removes the
        # temporary folder, so no half-written bundle is left.
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        with writing(dest, WEIGHTS):
            _save_weights(state, tmp / WEIGHTS)
            honour_umask(tmp / WEIGHTS)  # save_file creates it 0600
        names, onnx_entry = [WEIGHTS], None
        if onnx:
            import copy

            import onnx as onnx_pkg
            from google.protobuf.message import EncodeError

            from . import onnx_model

            # The exporter renames, transposes and folds the weights (q_proj.weight becomes a
            # transposed `val_8`, a conv weight a reshaped `unsqueeze`), so a graph cannot be
            # matched to weights.safetensors tensor by tensor at load. Instead export_onnx runs
            # both graphs in onnxruntime against the torch model (equality where the weights are
            # known to be the same), and the manifest records a digest of each checked graph's
            # weights, which load compares: a graph swapped in later, even with its file's
            # sha256 updated, is refused.
            try:
                with writing(dest, "the ONNX graphs"):
                    onnx_model.export_onnx(copy.deepcopy(model), tmp, opset27=opset27)
            except BundleError as exc:
                raise BundleError(f"bundle {str(dest)!r}: {exc}") from None
            except (ValueError, EncodeError) as exc:
                if not _onnx_failed(exc):
                    raise
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise BundleError(f"bundle {str(dest)!r}: the ONNX graphs could not be serialised ({first}); allowed: "
                                  "onnx=False (--no-onnx), or a smaller model (a protobuf holds 2 GiB)") from None
            names += list(GRAPHS)
            onnx_entry = {"mixer": "LinearAttention (opset 27)" if opset27 else "ai.rtcompile::RunningTensor",
                          "weights_sha256": {g: graph_weights_sha256(onnx_pkg.load(str(tmp / g))) for g in GRAPHS}}
        kernels = None
        if compiled:
            got = _compile_kernels(model, plan, tmp)
            if got is not None and got[1]:
                kernels, names = {"key": got[0]}, names + got[1]
        files = {n: {"sha256": file_sha256(tmp / n), "bytes": (tmp / n).stat().st_size} for n in names}
        manifest = {
            "format": BUNDLE_FORMAT,
            "spec": model.spec.to_dict(),
            "model": {"class": "RunningTensorLM", "vocab_size": model.head.out_features, "mlp": model.mlps is not None},
            "plan": None if plan is None else plan.to_dict(),
            "target": None if plan is None else plan.target.get("name"),
            "onnx": onnx_entry,
            "kernels": kernels,
            "versions": _versions(),
            "files": files,
        }
        with writing(dest, MANIFEST):
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return dest


def _save_weights(state: dict, path: Path) -> None:
    """safetensors' ``save_file``, an I/O error of which (its own SafetensorError, not an
    OSError) raised as the OSError it reports; any other of its errors is a bug and stays one."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(state, str(path))
    except SafetensorError as exc:
        if "I/O error" not in str(exc):
            raise
        raise OSError(str(exc).splitlines()[0]) from exc


def _compile_kernels(model, plan, tmp: Path):
    """:func:`compiled.compile_into` on the bundle being written (its weights and a warm-up
    description, removed after)."""
    info = tmp / "warmup.json"
    info.write_text(json.dumps({"spec": model.spec.to_dict(), "vocab_size": model.head.out_features,
                                "mlp": model.mlps is not None, "plan": None if plan is None else plan.to_dict()}),
                    encoding="utf-8")
    try:
        return compile_into(tmp)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        warnings.warn(f"bundle: no compiled kernels ({exc}); they compile on first use", RuntimeWarning, stacklevel=3)
        return None
    finally:
        info.unlink()


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
    try:  # read_whole: a FIFO is refused, not waited on for ever
        manifest = json.loads(read_whole(root / MANIFEST).decode("utf-8"))
    except ReadError as exc:
        raise refuse(f"is not a bundle ({MANIFEST} {exc.why})") from None
    except (ValueError, RecursionError) as exc:  # not UTF-8 or JSON, or a number past Python's 4300 digits
        raise refuse(f"is not a bundle (no readable {MANIFEST}: {parse_problem(exc)})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("format"), int) or not isinstance(files, dict):
        raise refuse(f"is not a bundle ({MANIFEST} is not a bundle manifest)")
    for entry in sorted(root.rglob("*")):
        name = entry.relative_to(root).as_posix()
        if entry.is_dir() and not entry.is_symlink() and any(f.startswith(name + "/") for f in files):
            continue  # a folder of listed files (kernels/<entry>)
        if name != MANIFEST and (name not in files or entry.is_symlink() or not entry.is_file()):
            raise refuse(f"holds {name!r}, which its {MANIFEST} does not list")


def safetensors_views(data: bytearray, header: dict | None = None) -> dict:
    """The tensors of the safetensors file ``data`` (checked by :func:`safetensors_header`) as
    views of its bytes: no copy, so a loaded model holds its weights once (``bundle.model_of``).
    A tensor whose data is not aligned to its element size (safetensors' own writer aligns
    them) is copied, so no kernel reads misaligned elements. ``header``: ``data``'s, parsed and
    checked already (``VerifiedBundle.weights_header``); None: parsed here."""
    import sys

    import torch

    if sys.byteorder != "little":  # safetensors is little-endian: its loader swaps the bytes
        from safetensors.torch import load

        return load(bytes(data))
    out = {}
    for name, (shape, dtype, offset) in (header or safetensors_header(data)).items():
        torch_dtype = getattr(torch, ST_TORCH_DTYPES[dtype])
        count = math.prod(shape)
        if count == 0:
            out[name] = torch.empty(shape, dtype=torch_dtype)
            continue
        t = torch.frombuffer(data, dtype=torch_dtype, count=count, offset=offset).view(shape)
        out[name] = t if offset % torch_dtype.itemsize == 0 else t.clone()
    return out


def load_bundle(path: str | os.PathLike):
    """A ready :class:`~rtcompile.model.RunningTensorLM` (eval mode) and its plan, or BundleError
    (every check of :func:`verify_bundle` first: nothing is built from an unchecked bundle)."""
    return model_of(verify_bundle(path))


def model_of(v: VerifiedBundle):
    """:func:`load_bundle` of a bundle verified already: the model is built from the bytes that
    were verified (``v.data``), never from the files read again. On the CPU its parameters are
    views of ``v.data``'s weight bytes: one model per verified bundle (a second would share them)."""
    import torch
    from safetensors import SafetensorError

    from ..model import RunningTensorLM, check_parameter_memory
    from ..spec import SpecError

    try:  # parameters larger than this machine's memory: refused before any is allocated
        check_parameter_memory(v.spec, v.vocab_size, v.mlp, tie_embeddings=False)
    except SpecError as exc:
        raise BundleError(f"bundle {str(v.root)!r}: {MANIFEST}: {exc}") from None
    # built on the meta device, its parameters then views of the verified bytes (assign): no
    # random initialisation of weights the file replaces, and no copy. A 571 MiB fp32 model on
    # the CPU machine: 1.14x its weights of peak memory, model_of 0.02 s after verify; 3.2x and
    # 0.5 s built on the CPU and copied into (2.1x with safetensors' own copies of the tensors)
    device = torch.get_default_device()  # where the model is built, as when it was built there
    with torch.device("meta"), skipping_init():
        model = RunningTensorLM(v.spec, vocab_size=v.vocab_size, mlp=v.mlp)
    try:
        state = safetensors_views(v.data[WEIGHTS], v.weights_header)  # the header verify checked
    except (SafetensorError, ValueError) as exc:
        raise BundleError(f"bundle {str(v.root)!r}: {WEIGHTS}: not a safetensors file ({exc})") from None
    built = model.state_dict()
    for name in list(state):  # the device and dtype it is built in, as copying into it gave; one at a time
        if name in built:
            state[name] = state[name].to(device=device, dtype=built[name].dtype)
    model.load_state_dict(state, strict=True, assign=True)  # names and shapes checked by verify
    model.eval()
    model.plan = v.plan
    done = install(v)  # hashes checked by verify; another machine's: said once, not installed
    if done is not None and not done[0]:
        warnings.warn(done[1], RuntimeWarning, stacklevel=2)
    return model
