"""Everything checked about a bundle before any part of it is used (``load``, ``inspect``, ``run``).

A bundle is refused with one :class:`BundleError` line naming the bundle, the file and the
problem. The checks, in order (each reads only JSON, safetensors headers and ONNX protobufs,
so nothing in a bundle is ever executed):

1. ``manifest.json``: JSON (no repeated keys), a supported ``format``, exactly the known keys
   with the right types; every listed file inside the bundle, present, of its ``bytes`` (compared
   before the file is read) and ``sha256``. Each file is read once: every later check and every
   use (``load``, ``run``, installing kernels) takes those verified bytes (``VerifiedBundle.data``),
   never the file again, so a file replaced after its check is not what gets loaded;
2. ``spec`` through the spec module's own validation, ``model`` (class, ``vocab_size``,
   ``mlp``), ``plan`` through the plan module's reader (:func:`rtcompile.plan.check_plan_dict`:
   every field, and a decision for each phase the model runs) and made for this spec;
3. ``weights.safetensors``: a safetensors file whose tensors are exactly the model's, each of
   its shape and a floating dtype (read from the header; no weight is loaded); the compiled
   kernels' group files: JSON naming only files of their own entry (``compiled.read_group``);
4. the ONNX graphs: parseable, external data only in files the manifest lists (never a path
   leaving the bundle), valid for ``onnx.checker`` (known standard ops, no dangling input, no
   malformed tensor), and the digest of their weights equal to the one recorded at export.

The manifest is not signed: every check is against what it records. A rewrite that keeps it
consistent (new weights and their sha256) passes, and the graphs, whose weights are checked
against the manifest's record of them, not against ``weights.safetensors``, then hold the old
model's weights: the torch and onnxruntime engines decode different models. Tying the two
(the graphs' initializers to the safetensors tensors they were exported from) is not done.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from ..fileio import ReadError, parse_problem, read_whole, unique_keys
from .compiled import check_entry, check_groups

# 2: the manifest records a digest of the ONNX graphs' weights (onnx.weights_sha256), and
#    every key is checked; 1: rtcompile before 0.2 (no digest).
BUNDLE_FORMAT = 3
# format 2 has no 'kernels' (compiled kernels) and still loads as a bundle without them
READABLE_FORMATS = (2, 3)
OLD_FORMATS = {1: "written by rtcompile before 0.2 (no digest of the ONNX graphs' weights)"}
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
GRAPHS = ("prefill.onnx", "decode.onnx")
MANIFEST_KEYS = ("format", "spec", "model", "plan", "target", "onnx", "kernels", "versions", "files")
MODEL_CLASS = "RunningTensorLM"
# The largest vocabularies in use are ~256k tokens (Gemma: 262,144); 2**24 (16.8M) leaves 64x
# headroom while refusing a manifest whose embedding alone would be terabytes.
MAX_VOCAB = 1 << 24
# A file of a bundle is read whole (hashed, then loaded); 1 TiB is 16x the weights of a 16B-parameter
# fp32 model with a 2**24 vocabulary, and refuses a size no machine holds before anything is read.
MAX_FILE_BYTES = 1 << 40
# The dtypes load_state_dict converts into the fp32 parameters without losing meaning; an
# integer or boolean tensor in their place is a broken exporter, not a weight.
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class BundleError(ValueError):
    """A bundle cannot be written or is refused on load (one line, naming the file)."""


@dataclass(frozen=True)
class VerifiedBundle:
    """A bundle that passed every check: what ``load``, ``inspect`` and ``run`` use. ``data``
    holds every listed file's bytes as they were read once and hashed, ``graphs`` each ONNX
    graph as onnxruntime takes it (its external data inside): those are what is used, never the
    files again (a writer racing the check would have had its forged file loaded)."""

    root: Path
    manifest: dict[str, Any]
    spec: Any  # ModelSpec
    plan: Any  # Plan | None
    vocab_size: int
    mlp: bool
    data: dict[str, bytes] = field(default_factory=dict, repr=False)
    graphs: dict[str, bytes] = field(default_factory=dict, repr=False)
    weights_header: dict = field(default_factory=dict, repr=False)  # the checked header of data[WEIGHTS]


def refuse(root: Path, where: str, problem: str) -> BundleError:
    return BundleError(f"bundle {str(root)!r}: {where}: {problem}")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_format(root: Path, fmt: Any) -> None:
    if not _is_int(fmt):
        raise refuse(root, MANIFEST, f"'format' is {_type_name(fmt)} {fmt!r}; allowed: the integer {BUNDLE_FORMAT}")
    if fmt > BUNDLE_FORMAT:
        raise refuse(root, MANIFEST, f"format {fmt} is newer than this rtcompile reads ({BUNDLE_FORMAT}); upgrade rtcompile")
    if fmt not in READABLE_FORMATS:
        why = OLD_FORMATS.get(fmt, "not a format rtcompile ever wrote")
        raise refuse(root, MANIFEST, f"format {fmt} is {why}; allowed: {' or '.join(map(str, READABLE_FORMATS))} "
                                     "(re-export the bundle)")


def _safe_name(name: str) -> bool:
    """A plain relative path that stays inside the bundle on every OS."""
    if not name or "\\" in name or "\0" in name or PureWindowsPath(name).drive or os.path.isabs(name):
        return False
    return all(part not in ("", ".", "..") for part in PurePosixPath(name).parts) and not name.endswith("/")


def _check_files(root: Path, files: Any) -> dict[str, bytes]:
    """The manifest's 'files' checked, and each file read once: name -> its verified bytes."""
    if not isinstance(files, dict):
        raise refuse(root, MANIFEST, f"'files' is {_type_name(files)}; allowed: an object (file name -> bytes, sha256)")
    if WEIGHTS not in files:
        raise refuse(root, MANIFEST, f"'files' lists no {WEIGHTS}")
    base = root.resolve()
    for name, meta in files.items():  # every entry first: nothing outside the bundle is ever opened
        if name == MANIFEST or not _safe_name(name) or base not in (root / name).resolve().parents:
            raise refuse(root, MANIFEST, f"manifest entry {name!r} points outside the bundle or at the manifest")
        if not isinstance(meta, dict) or sorted(meta) != ["bytes", "sha256"]:
            got = sorted(meta) if isinstance(meta, dict) else _type_name(meta)
            raise refuse(root, MANIFEST, f"files[{name!r}] has keys {got}; allowed: exactly 'bytes' and 'sha256'")
        if not _is_int(meta["bytes"]) or not 0 <= meta["bytes"] <= MAX_FILE_BYTES:
            raise refuse(root, MANIFEST, f"files[{name!r}].bytes is {_type_name(meta['bytes'])} {meta['bytes']!r}; "
                                         f"allowed: an integer in [0, {MAX_FILE_BYTES}]")
        if not isinstance(meta["sha256"], str) or not _SHA256.fullmatch(meta["sha256"]):
            raise refuse(root, MANIFEST, f"files[{name!r}].sha256 is {meta['sha256']!r}; allowed: 64 lowercase hex digits")
    data = {}
    for name, meta in files.items():
        target = (root / name).resolve()
        if not target.is_file():
            what = "missing" if not target.exists() else "a folder" if target.is_dir() else "not a regular file"
            raise BundleError(f"bundle {str(root)!r}: {name} is {what}")
        # the size first: hashing reads the whole file (a sparse 64 GiB one took 110 s to be refused)
        size = target.stat().st_size
        if size != meta["bytes"]:
            raise refuse(root, MANIFEST, f"files[{name!r}].bytes is {meta['bytes']}, the file has {size}")
        try:
            with open(target, "rb") as fh:
                # one byte more: a file that grew since is seen. The weights into a bytearray:
                # the loaded model's parameters are views of these verified bytes (no copy)
                data[name] = _read_into_bytearray(fh, size + 1) if name == WEIGHTS else fh.read(size + 1)
        except OSError as exc:
            raise refuse(root, name, f"unreadable ({exc.strerror or exc})") from None
        except MemoryError:
            raise refuse(root, name, f"its {size} bytes do not fit in this machine's memory") from None
        if len(data[name]) != size:
            raise refuse(root, name, f"changed while it was read ({len(data[name])} bytes, {size} before)")
        if hashlib.sha256(data[name]).hexdigest() != meta["sha256"]:
            raise refuse(root, name, "does not match its sha256 in the manifest (tampered or corrupted)")
    return data


def _read_into_bytearray(fh, limit: int) -> bytearray:
    """Up to ``limit`` bytes of ``fh`` (fewer at its end) in one writable buffer."""
    buf = bytearray(limit)
    got, view = 0, memoryview(buf)
    while got < limit and (n := fh.readinto(view[got:])):
        got += n
    view.release()
    del buf[got:]
    return buf


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest, its format, keys and types checked and every listed file hashed."""
    return _read_manifest(Path(path))[0]


def _read_manifest(root: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    """:func:`read_manifest`'s checks; the manifest and every listed file's verified bytes."""
    try:  # the folder itself first: a spec file given as the bundle read "manifest.json: Not a directory"
        if not root.is_dir():
            raise BundleError(f"bundle {str(root)!r}: " + ("no such folder" if not root.exists() else
                                                           "not a folder; allowed: a bundle folder (rtcompile export)"))
    except OSError as exc:  # a folder above it that cannot be searched
        raise BundleError(f"bundle {str(root)!r}: cannot be read ({exc.strerror or exc})") from None
    try:  # read_whole: a FIFO is refused, not waited on for ever
        raw = read_whole(root / MANIFEST)
    except ReadError as exc:
        if exc.why == "no such file":
            raise BundleError(f"bundle {str(root)!r}: no {MANIFEST}") from None
        raise refuse(root, MANIFEST, f"{exc.why}; allowed: a regular file") from None
    try:
        manifest = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
    except ValueError as exc:  # not UTF-8 or JSON, repeated keys, a number past Python's 4300 digits
        raise refuse(root, MANIFEST, f"unreadable ({parse_problem(exc)})") from None
    except RecursionError:  # ~1000 nested brackets exhaust the parser's recursion; a manifest nests 4 levels
        raise refuse(root, MANIFEST, "nested too deeply to parse") from None
    if not isinstance(manifest, dict):
        raise refuse(root, MANIFEST, f"is a JSON {_type_name(manifest)}; allowed: an object")
    _check_format(root, manifest.get("format"))
    keys = MANIFEST_KEYS if manifest["format"] == BUNDLE_FORMAT else tuple(k for k in MANIFEST_KEYS if k != "kernels")
    missing = [k for k in keys if k not in manifest]
    unknown = sorted(k for k in manifest if k not in keys)
    if missing or unknown:
        found = ", ".join(f"{what} keys {keys}" for what, keys in (("missing", missing), ("unknown", unknown)) if keys)
        raise refuse(root, MANIFEST, f"{found}; allowed: exactly {', '.join(keys)}")
    manifest.setdefault("kernels", None)
    for key, kind, allowed in (("spec", dict, "an object"), ("model", dict, "an object"),
                               ("plan", (dict, type(None)), "an object or null"),
                               ("target", (str, type(None)), "a string or null"),
                               ("onnx", (dict, type(None)), "an object or null"),
                               ("versions", dict, "an object")):
        if not isinstance(manifest[key], kind):
            raise refuse(root, MANIFEST, f"'{key}' is {_type_name(manifest[key])}; allowed: {allowed}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in manifest["versions"].items()):
        raise refuse(root, MANIFEST, "'versions' must map names to version strings")
    data = _check_files(root, manifest["files"])
    if (why := check_entry(manifest["kernels"], manifest["files"])) is not None:
        raise refuse(root, MANIFEST, why)
    return manifest, data


def plan_mismatch(plan_spec: Any, spec) -> str | None:
    """None when a plan's recorded spec is ``spec`` (its name aside: renaming changes no
    decision), else the fields that differ, as '<field> <plan's> vs <spec's>'."""
    mine = {k: v for k, v in spec.to_dict().items() if k != "name"}
    if not isinstance(plan_spec, dict):
        return f"the plan records no spec (got {_type_name(plan_spec)})"
    theirs = {k: v for k, v in plan_spec.items() if k != "name"}
    diff = [f"{k} {theirs.get(k, '(none)')!r} vs {mine.get(k, '(none)')!r}"
            for k in sorted(set(mine) | set(theirs)) if theirs.get(k) != mine.get(k)]
    return None if not diff else "; ".join(diff)


def _check_model(root: Path, model: dict[str, Any]) -> tuple[int, bool]:
    if sorted(model) != ["class", "mlp", "vocab_size"]:
        raise refuse(root, MANIFEST, f"'model' has keys {sorted(model)}; allowed: exactly class, mlp, vocab_size")
    if model["class"] != MODEL_CLASS:
        raise refuse(root, MANIFEST, f"model.class is {model['class']!r}; allowed: {MODEL_CLASS!r}")
    vocab = model["vocab_size"]
    if not _is_int(vocab) or not 2 <= vocab <= MAX_VOCAB:
        raise refuse(root, MANIFEST, f"model.vocab_size is {_type_name(vocab)} {vocab!r}; "
                                     f"allowed: an integer in [2, {MAX_VOCAB}]")
    if not isinstance(model["mlp"], bool):
        raise refuse(root, MANIFEST, f"model.mlp is {_type_name(model['mlp'])} {model['mlp']!r}; allowed: true or false")
    return vocab, model["mlp"]


def _check_onnx_entry(root: Path, manifest: dict[str, Any]) -> None:
    listed = [g for g in GRAPHS if g in manifest["files"]]
    entry = manifest["onnx"]
    if entry is None:
        if listed:
            raise refuse(root, MANIFEST, f"lists {listed} but 'onnx' is null")
        return
    if len(listed) != len(GRAPHS):
        raise refuse(root, MANIFEST, f"'onnx' is set but the files list only {listed}; allowed: both of {list(GRAPHS)}")
    digests = entry.get("weights_sha256")
    if sorted(entry) != ["mixer", "weights_sha256"] or not isinstance(entry["mixer"], str) \
            or not isinstance(digests, dict) or sorted(digests) != sorted(GRAPHS) \
            or not all(isinstance(d, str) and _SHA256.fullmatch(d) for d in digests.values()):
        raise refuse(root, MANIFEST, "'onnx' must be {\"mixer\": a string, \"weights_sha256\": {one 64-hex digest "
                                     f"per graph: {', '.join(GRAPHS)}}}")


def check_contents(root: Path, manifest: dict[str, Any]):
    """spec, plan, vocab_size and mlp of a read manifest, each validated."""
    from ..plan import Plan, PlanError
    from ..spec import ModelSpec, SpecError, SpecTypeError

    try:
        spec = ModelSpec.from_dict(manifest["spec"])
        plan = None if manifest["plan"] is None else Plan.from_dict(manifest["plan"])
    except (SpecError, SpecTypeError, PlanError) as exc:
        raise refuse(root, MANIFEST, str(exc).splitlines()[0]) from None
    vocab, mlp = _check_model(root, manifest["model"])
    if plan is not None:
        diff = plan_mismatch(plan.spec, spec)
        if diff is not None:
            raise refuse(root, MANIFEST, f"plan: made for another spec (plan's vs the bundle's: {diff})")
    _check_onnx_entry(root, manifest)
    return spec, plan, vocab, mlp


def skipping_init():
    """A torch-function mode under which ``torch.nn.init``'s functions leave their tensor as it
    is: on the meta device their in-place random fills run torch's Python decompositions, whose
    wrapper imports torch._dynamo (3.3 of the 4.4 s ``rtcompile.load`` took on the CPU machine)."""
    from torch.overrides import TorchFunctionMode

    class SkipInit(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__module__", None) == "torch.nn.init":
                return args[0] if args else kwargs["tensor"]
            return func(*args, **(kwargs or {}))

    return SkipInit()


def expected_tensors(spec, vocab_size: int, mlp: bool) -> dict[str, tuple[list[int], bool]]:
    """name -> (shape, is floating) of a RunningTensorLM's state dict, built on the meta device
    (no memory, whatever the sizes) with its random initialisation skipped."""
    import torch

    from ..model import RunningTensorLM

    with torch.device("meta"), skipping_init():
        model = RunningTensorLM(spec, vocab_size=vocab_size, mlp=mlp)
    return {k: (list(v.shape), v.is_floating_point()) for k, v in model.state_dict().items()}


# bytes per element of safetensors' dtypes (its format's names)
_ST_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                  "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
# the same names as torch's dtypes (safetensors' loader's table; bundle.safetensors_views)
ST_TORCH_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn",
                   "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "bfloat16", "I32": "int32",
                   "U32": "uint32", "F32": "float32", "I64": "int64", "U64": "uint64", "F64": "float64"}
# safetensors' own limit on the JSON header (100 MB)
_ST_MAX_HEADER = 100_000_000


def safetensors_header(data: bytes) -> dict[str, tuple[list[int], str, int]]:
    """name -> (shape, dtype, offset of its data in ``data``) of the safetensors file ``data``,
    read from its header and checked as safetensors' loader checks it (each tensor's data of its
    size, together covering the file's body exactly, once), so that ``safetensors.torch.load``
    or ``bundle.safetensors_views`` then loads it; ValueError saying why not. Copies no tensor."""
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes, shorter than the 8-byte header length")
    n = int.from_bytes(data[:8], "little")
    if n > min(len(data) - 8, _ST_MAX_HEADER):
        raise ValueError(f"header length {n} beyond the file's {len(data)} bytes")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"), object_pairs_hook=unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"header is not JSON ({_one_line(exc)})") from None
    if not isinstance(header, dict):
        raise ValueError(f"header is a JSON {_type_name(header)}; allowed: an object")
    body, got, spans = len(data) - 8 - n, {}, []
    for name, info in header.items():
        if name == "__metadata__":  # safetensors' loader takes only an object of strings here
            if not (isinstance(info, dict) and all(isinstance(x, str) for x in info.values())):
                raise ValueError(f"__metadata__ {str(info)[:120]} is not an object of strings")
            continue
        shape, dtype = (info.get("shape"), info.get("dtype")) if isinstance(info, dict) else (None, None)
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape) and dtype in _ST_ITEM_BYTES
                and isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise ValueError(f"tensor {name!r}: header entry {str(info)[:120]} is not a shape, a known dtype and 2 "
                             "offsets")
        size = _ST_ITEM_BYTES[dtype]
        for d in shape:
            size *= d
        if not 0 <= offsets[0] <= offsets[1] <= body or offsets[1] - offsets[0] != size:
            raise ValueError(f"tensor {name!r}: data offsets {offsets} for {size} bytes in a body of {body}")
        got[name] = (shape, dtype, 8 + n + offsets[0])
        spans.append(offsets)
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:  # a gap, or data two tensors share (safetensors' loader refuses both)
            raise ValueError(f"the tensors' data do not cover the file's {body} bytes of data exactly, once: "
                             f"a span starts at {begin}, the one before ends at {end}")
        end = stop
    if end != body:
        raise ValueError(f"the tensors' data do not cover the file's {body} bytes of data exactly, once")
    return got


def safetensors_problem(data: bytes, need: dict[str, tuple[list[int], bool]], what: str) -> str | None:
    """None when the safetensors file ``data`` (its bytes, read once by the caller, which then
    loads those same bytes) holds exactly the tensors ``need`` lists (name -> shape, is
    floating), each of its shape and, where floating, of a float dtype; else the problem in
    words. Reads the header only."""
    try:
        got = safetensors_header(data)
    except ValueError as exc:
        return f"not a safetensors file ({exc})"
    return header_problem(got, need, what)


def header_problem(got: dict[str, tuple[list[int], str, int]], need: dict[str, tuple[list[int], bool]],
                   what: str) -> str | None:
    """:func:`safetensors_problem` of a header parsed already (:func:`safetensors_header`)."""
    missing, extra = sorted(set(need) - set(got)), sorted(set(got) - set(need))
    if missing:
        return f"lacks {len(missing)} tensors {missing[:3]} that {what} need"
    if extra:
        return f"holds {len(extra)} tensors {extra[:3]} that {what} do not have"
    for name, (shape, floating) in need.items():
        if got[name][0] != shape:
            return f"tensor {name!r} has shape {got[name][0]}; {what} need {shape}"
        if floating and got[name][1] not in FLOAT_DTYPES:
            return f"tensor {name!r} has dtype {got[name][1]}; allowed: {', '.join(FLOAT_DTYPES)}"
    return None


def check_weights(root: Path, data: bytes, spec, vocab_size: int, mlp: bool) -> dict:
    """weights.safetensors (``data``, its verified bytes) holds exactly the model's tensors, each
    of its shape (header only); returns the header (:func:`safetensors_header`), which loading
    the bundle reads its tensors by instead of parsing it again."""
    what = f"the manifest's spec and model (vocab_size {vocab_size}, mlp {str(mlp).lower()})"
    try:
        header = safetensors_header(data)
    except ValueError as exc:
        raise refuse(root, WEIGHTS, f"not a safetensors file ({exc})") from None
    if (problem := header_problem(header, expected_tensors(spec, vocab_size, mlp), what)) is not None:
        raise refuse(root, WEIGHTS, problem)
    return header


def graph_tensors(model):
    """Every tensor an ONNX model carries, in file order: initializers (sparse ones too) and
    tensor attributes of nodes, in the graph, its subgraphs and the model's functions."""
    import onnx

    def in_nodes(nodes):
        for node in nodes:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield attr.t
                elif attr.type == onnx.AttributeProto.SPARSE_TENSOR:
                    yield from (attr.sparse_tensor.values, attr.sparse_tensor.indices)
                yield from attr.tensors
                for s in attr.sparse_tensors:
                    yield from (s.values, s.indices)
                for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else []) + list(attr.graphs):
                    yield from in_graph(g)

    def in_graph(graph):
        yield from graph.initializer
        for s in graph.sparse_initializer:
            yield from (s.values, s.indices)
        yield from in_nodes(graph.node)

    yield from in_graph(model.graph)
    for fn in model.functions:
        yield from in_nodes(fn.node)


def _all_nodes(model):
    """Every node of the model: its graph's, its functions' and, depth first, their subgraphs'."""
    import onnx

    def in_nodes(nodes):
        for node in nodes:
            yield node
            for attr in node.attribute:
                for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else []) + list(attr.graphs):
                    yield from in_nodes(g.node)

    yield from in_nodes(model.graph.node)
    for fn in model.functions:
        yield from in_nodes(fn.node)


STANDARD_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")


def undefined_op(model) -> str | None:
    """The first node of a domain outside the standard ones that no model-local function
    defines, as "domain.op_type", or None. The checker skips such nodes (it knows no domain's
    ops but the standard ones), so without this a graph naming an op nothing defines passed
    ``inspect`` and failed only when onnxruntime made its session."""
    defined = {(fn.domain, fn.name) for fn in model.functions}
    for node in _all_nodes(model):
        if node.domain not in STANDARD_DOMAINS and (node.domain, node.op_type) not in defined:
            return f"{node.domain}.{node.op_type}"
    return None


def graph_weights_sha256(model) -> str:
    """sha256 over every tensor of an ONNX model (name, type, dims, values): what the manifest
    records at export and load compares. ValueError, naming the tensor, for one that cannot be
    read as its data type and dims say."""
    import onnx
    from onnx import numpy_helper

    h = hashlib.sha256()
    for t in graph_tensors(model):
        try:
            if t.data_type == onnx.TensorProto.STRING:
                data = b"".join(len(s).to_bytes(8, "little") + s for s in t.string_data)
            else:
                data = numpy_helper.to_array(t).tobytes()
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            # numpy_helper on a malformed tensor: dims that disagree with its data (ValueError), data
            # type 0 (TypeError) or one ONNX does not define (KeyError), none naming the tensor
            raise ValueError(f"tensor {t.name!r} (data type {t.data_type}, dims {list(t.dims)}) cannot be read: "
                             f"{str(exc) or type(exc).__name__}") from None
        h.update(f"{t.name}\0{t.data_type}\0{list(t.dims)}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _one_line(exc: BaseException) -> str:
    """An error's message on one line (the ONNX checker's span several), at most 300 characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _inline(root: Path, name: str, t, data: bytes) -> None:
    """Put an external tensor's data (its ``offset`` and ``length`` in the verified bytes
    ``data`` of its file) into the tensor, as onnx's load_external_data_for_model would from the
    file, which could have changed since it was hashed."""
    import onnx

    info = {e.key: e.value for e in t.external_data}
    try:
        offset = int(info.get("offset", 0))
        length = len(data) - offset if info.get("length") is None else int(info["length"])
    except ValueError:
        offset = length = -1
    if not 0 <= offset <= offset + length <= len(data) or length < 0:
        raise refuse(root, name, f"tensor {t.name!r}: external data offset {info.get('offset')!r}, length "
                                 f"{info.get('length')!r} outside the {len(data)} bytes of {info['location']!r}")
    t.raw_data = bytes(data[offset:offset + length])  # protobuf takes bytes (the weights are a bytearray)
    del t.external_data[:]
    t.data_location = onnx.TensorProto.DEFAULT


def check_graphs(root: Path, manifest: dict[str, Any], data: dict[str, bytes]) -> dict[str, bytes]:
    """Each ONNX graph parses, keeps its external data in files the manifest lists (so hashed
    and inside the bundle; onnxruntime would follow ``../x`` or ``/etc/x`` wherever it points),
    passes ``onnx.checker.check_model`` (ops of the standard domains that exist at the graph's
    opset, every node input produced before it, well-formed tensors, the model-local functions),
    names no op of another domain that none of its functions defines (:func:`undefined_op`),
    and its weights, each readable, are those recorded at export
    (``onnx.weights_sha256``). Reads the verified bytes ``data`` (file name -> bytes); returns
    each graph as onnxruntime is to take it (its bytes, or with external data, the checked proto
    holding that data)."""
    import onnx
    from google.protobuf.message import DecodeError
    from onnx.checker import ValidationError

    files, graphs = manifest["files"], {}
    for name in GRAPHS:
        try:
            model = onnx.load_model_from_string(data[name])
        except (DecodeError, ValueError) as exc:
            raise refuse(root, name, f"not an ONNX model ({str(exc).splitlines()[0]})") from None
        external = []
        for t in graph_tensors(model):
            if t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            location = {e.key: e.value for e in t.external_data}.get("location", "")
            if not _safe_name(location) or root.resolve() not in (root / location).resolve().parents:
                raise refuse(root, name, f"tensor {t.name!r} keeps its data at {location!r}, outside the bundle; "
                                         "allowed: a file of the bundle that the manifest lists")
            if location not in files:
                raise refuse(root, name, f"tensor {t.name!r} keeps its data in {location!r}, which the manifest "
                                         "does not list (unverified)")
            external.append((t, location))
        for t, location in external:
            _inline(root, name, t, data[location])
        # with its external data in the proto: the checker would look for the data files relative
        # to the working folder. A graph over 2 GiB is refused here (the exporter's onnx.save
        # cannot write one, and onnxruntime takes none from memory either)
        try:
            onnx.checker.check_model(model)
        except (ValidationError, ValueError) as exc:
            raise refuse(root, name, f"not a valid ONNX model ({_one_line(exc)})") from None
        if (op := undefined_op(model)) is not None:
            raise refuse(root, name, f"op {op} is neither a standard ONNX op nor a function of the model; allowed: "
                                     f"the domains {', '.join(repr(d) for d in STANDARD_DOMAINS)} and the model's "
                                     "functions (the exporter defines its ai.rtcompile ops as functions)")
        try:
            digest = graph_weights_sha256(model)
        except ValueError as exc:
            raise refuse(root, name, _one_line(exc)) from None
        if digest != manifest["onnx"]["weights_sha256"][name]:
            raise refuse(root, name, f"its weights differ from those recorded at export (onnx.weights_sha256 in "
                                     f"{MANIFEST}): the graph was changed since export")
        graphs[name] = model.SerializeToString() if external else data[name]
    return graphs


def verify_bundle(path: str | os.PathLike) -> VerifiedBundle:
    """Every check of the module docstring; BundleError at the first that fails (TypeError for
    a ``path`` that is not a path)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a str or os.PathLike bundle folder, got {type(path).__name__}")
    root = Path(path)
    manifest, data = _read_manifest(root)
    spec, plan, vocab, mlp = check_contents(root, manifest)
    header = check_weights(root, data[WEIGHTS], spec, vocab, mlp)
    if (why := check_groups(manifest["files"], data)) is not None:
        raise refuse(root, *why)
    graphs = {} if manifest["onnx"] is None else check_graphs(root, manifest, data)
    return VerifiedBundle(root, manifest, spec, plan, vocab, mlp, data, graphs, header)
