"""``rtcompile export`` (write a bundle) and ``rtcompile inspect`` (summarise one)."""

from __future__ import annotations

import argparse
import json

from .cli_args import check_out_parent, int_at_least, int_list_of, nonempty, write_out


def _vocab_text(text: str) -> int:
    """``--vocab``'s integer (its range is checked with the spec, before anything is built);
    text that is not one names the range, as that check does (2**24: ``verify.MAX_VOCAB``)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in [2, {2**24}], got {text!r}") from None


def add_parsers(sub) -> None:
    e = sub.add_parser("export", help="write a bundle: manifest, safetensors weights, plan")
    e.add_argument("spec", help="model spec file (.toml or .json)")
    e.add_argument("--out", required=True, metavar="DIR", type=nonempty("a folder path"),
                   help="bundle directory (written atomically; its parent folders made when missing)")
    e.add_argument("--weights", metavar="FILE", type=nonempty("a safetensors file"),
                   help="safetensors state dict of a RunningTensorLM (default: seeded init)")
    e.add_argument("--plan", metavar="FILE", type=nonempty("a plan file"),
                   help="plan file to pin into the bundle (rtcompile plan/build)")
    e.add_argument("--vocab", type=_vocab_text, default=256, metavar="N",
                   help="vocabulary size (default 256; at most 2**24, what a bundle holds)")
    e.add_argument("--force", action="store_true", help="replace an existing bundle")
    e.add_argument("--opset27", action="store_true",
                   help="emit ONNX's standard LinearAttention (opset 27) on materialised Kronecker features "
                        "instead of the ai.rtcompile::RunningTensor node")
    e.add_argument("--no-onnx", action="store_true", help="no ONNX graphs")
    e.add_argument("--no-kernels", action="store_true",
                   help="no compiled Triton kernels (on a CUDA machine export compiles the plan's shapes and ships "
                        "what Triton built, for this GPU and software; elsewhere there are none)")
    e.set_defaults(func=run_export)
    i = sub.add_parser("inspect", help="summarise a bundle (verifies its manifest and hashes)")
    i.add_argument("bundle", metavar="DIR")
    i.add_argument("--json", action="store_true", help="print the manifest as JSON")
    i.set_defaults(func=run_inspect)
    r = sub.add_parser("run", help="run a bundle: prefill a prompt, then greedy decode (CUDA graphs on a GPU, "
                                   "else the bundle's ONNX graphs in onnxruntime)")
    r.add_argument("bundle", metavar="DIR")
    r.add_argument("--tokens", type=int_list_of(0, "integers >= 0 (token ids)"), default=[1, 2, 3], metavar="ID,..",
                   help="prompt token ids, comma-separated (default 1,2,3)")
    r.add_argument("--steps", type=int_at_least(0), default=8, help="tokens to decode greedily (default 8)")
    r.add_argument("--engine", choices=ENGINES, default="auto",
                   help="auto (default): torch on a CUDA GPU (RunningTensorLM.generate, the decode step as a CUDA "
                        "graph), else onnxruntime; torch: the loaded model on this machine's best device (eager "
                        "off CUDA); onnxruntime: the bundle's ONNX graphs (the CPU and portable path)")
    r.add_argument("--compile-step", action="store_true",
                   help="torch engine on a CUDA GPU: fuse the decode step with torch.compile before capturing "
                        "it (fewer launches per step; one compile per batch bucket)")
    r.set_defaults(func=run_bundle)


ENGINES = ("auto", "torch", "onnxruntime")


def run_export(args) -> int:
    import torch

    from pathlib import Path

    from .export import BundleError, check_replaceable, export_bundle
    from .export.verify import MAX_VOCAB
    from .model import RunningTensorLM
    from .plan import Plan
    from .spec import load_spec

    if args.opset27 and args.no_onnx:  # accepted and ignored before: a bundle with no graph at all
        raise BundleError("--opset27: with --no-onnx; allowed: --opset27 without --no-onnx (it picks the mixer "
                          "node of the ONNX graphs that --no-onnx leaves out)")
    spec = load_spec(args.spec)
    # before anything is built: --vocab 60000000 allocated ~6 GB of embedding and head before
    # export_bundle refused a vocab_size that the loader would refuse (verify.MAX_VOCAB)
    if not 2 <= args.vocab <= MAX_VOCAB:
        why = "fewer than 2 tokens" if args.vocab < 2 else "more tokens than a bundle holds"
        raise BundleError(f"vocab_size: --vocab {args.vocab}: vocab_size {args.vocab:,} is {why}; allowed: an "
                          f"integer in [2, {MAX_VOCAB}]" + ("; reduce vocab_size" if args.vocab > MAX_VOCAB else ""))
    if not args.no_onnx:
        _check_onnx_size(spec, args.vocab)
    out = Path(args.out)
    if out.exists() or out.is_symlink():  # before building a model or an ONNX graph
        check_replaceable(out)  # a file or a user's folder: refused with or without --force
        if not args.force:
            raise BundleError(f"bundle {args.out!r}: already exists; allowed: a new path, or --force to replace a bundle")
    check_out_parent("rtcompile export", args.out)  # tried, nothing made
    # the plan is read and checked (Plan.load: every field, both phases, this spec) before the model is
    # built and its weights allocated: a bad plan file costs nothing
    plan = Plan.load(args.plan) if args.plan is not None else None
    if plan is not None:
        from .export.verify import plan_mismatch

        diff = plan_mismatch(plan.spec, spec)
        if diff is not None:
            raise BundleError(f"--plan {args.plan!r}: made for another spec than {args.spec!r} (plan's vs the spec "
                              f"file's: {diff}); allowed: a plan made from this spec (rtcompile plan / build "
                              f"{args.spec})")
    # the weights file read and its header checked before the model is built: at --vocab 2**24 the
    # build took 10 s and 1.8 GB before a missing file was named
    data = None if args.weights is None else _checked_weights(args, spec)
    torch.manual_seed(0)
    model = RunningTensorLM(spec, vocab_size=args.vocab)
    if data is not None:
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            state = load(data)
        except SafetensorError as exc:  # whatever safetensors refuses that the header check passed
            raise BundleError(f"--weights {args.weights!r}: not a safetensors file ({exc})") from None
        model.load_state_dict(state, strict=True)
    # the bundle is built in a temporary folder and renamed into place (export_bundle); a write that
    # fails (the weights, the ONNX graphs, the manifest: a WriteError) is one line naming --out, and
    # the parent folders made here are removed again
    write_out("rtcompile export", args.out, lambda: export_bundle(
        model, args.out, plan=plan, overwrite=args.force, onnx=not args.no_onnx, opset27=args.opset27,
        compiled=not args.no_kernels))
    print(f"bundle written to {out}")
    return 0


def _check_onnx_size(spec, vocab: int) -> None:
    """The ONNX graphs fit a protobuf (2 GiB), before the model is built: ``--vocab 16777216`` at
    model_width 16 built for 44 s, then failed in protobuf's serialiser with a traceback.
    BundleError naming --vocab, the largest vocabulary that fits and --no-onnx."""
    from .export import BundleError
    from .export.bundle import ONNX_MAX_BYTES, onnx_graph_bytes
    from .model import parameter_count

    size = onnx_graph_bytes(parameter_count(spec, vocab, mlp=True), spec.layers)
    if size <= ONNX_MAX_BYTES:
        return
    rest = onnx_graph_bytes(parameter_count(spec, 0, mlp=True), spec.layers)  # all but the embedding and head
    largest = (ONNX_MAX_BYTES - rest) // (4 * 2 * spec.model_width)  # two vocab x model_width tables
    smaller = (f"a smaller --vocab (at most {largest:,} at model_width {spec.model_width}) or model_width"
               if largest >= 2 else "a smaller model_width, layers or widths (the layers alone exceed it)")
    raise BundleError(f"--vocab {vocab}: each ONNX graph would hold ~{size:,} bytes (fp32 weights, embedding and head "
                      f"{2 * vocab * spec.model_width:,} parameters), beyond the {ONNX_MAX_BYTES:,} (2 GiB) a protobuf "
                      f"holds; allowed: --no-onnx, or {smaller}")


def _checked_weights(args, spec) -> bytes:
    """``--weights``' bytes, read once (the bytes checked are the bytes loaded), their header
    holding exactly the tensors of the model ``spec`` and ``--vocab`` make (the bundle check's
    meta-device shapes: nothing allocated); BundleError naming --weights."""
    from .export import BundleError
    from .export.verify import expected_tensors, safetensors_problem
    from .fileio import ReadError, read_whole

    try:
        data = read_whole(args.weights)
    except ReadError as exc:
        raise BundleError(f"--weights {args.weights!r}: {exc.why}; allowed: a safetensors file") from None
    need = expected_tensors(spec, args.vocab, mlp=True)  # export builds RunningTensorLM's default, with MLPs
    problem = safetensors_problem(data, need, f"the spec (with --vocab {args.vocab})")
    if problem is not None:
        raise BundleError(f"--weights {args.weights!r}: {problem}")
    return data


def run_inspect(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .export import verify_bundle

    m = verify_bundle(args.bundle).manifest  # every check load makes: what is shown is what load accepts
    if args.json:
        print(json.dumps(m, indent=1))
        return 0
    t = Table(title=f"bundle {args.bundle}", header_style="bold")
    t.add_column("field")
    t.add_column("value")
    s = m["spec"]
    t.add_row("format", str(m["format"]))
    t.add_row("spec", f"{s.get('name') or '-'}: order {s['order']}, key axes {s['key_widths']}, d_v {s['value_width']}, "
                      f"{s['heads']} heads, {s['layers']} layers")
    t.add_row("model", json.dumps(m["model"]))
    t.add_row("plan", "none" if m.get("plan") is None else f"for {m.get('target')} ({len(m['plan']['decisions'])} decisions)")
    t.add_row("onnx", "none" if m["onnx"] is None else f"{m['onnx']['mixer']}; both graphs' weights match the digest "
                                                         "recorded at export (verified)")
    key = (m.get("kernels") or {}).get("key")
    t.add_row("kernels", "none" if key is None else f"compiled for {key['gpu']} (sm {key['capability']}), "
                                                    f"Triton {key['triton']}, CUDA {key['cuda']} (verified)")
    t.add_row("versions", ", ".join(f"{k} {v}" for k, v in m["versions"].items()))
    for name, meta in m["files"].items():
        t.add_row(name, f"{meta['bytes']} bytes, sha256 {meta['sha256'][:16]}... (verified)")
    Console(width=160, markup=False).print(t)  # names and paths are text, never markup
    return 0


def run_bundle(args) -> int:
    """``rtcompile run``: check the bundle and the prompt, then decode on the chosen engine."""
    import torch

    from .export import BundleError, verify_bundle

    # the options first, each refused with its value, before the bundle is hashed (1.35 s for a
    # toy bundle; a 2 GB one takes seconds more); only the ids' range needs its manifest
    engine = args.engine
    if engine == "auto":
        engine = "torch" if torch.cuda.is_available() else "onnxruntime"
    if args.compile_step and not (engine == "torch" and torch.cuda.is_available()):
        raise BundleError(f"--compile-step: with engine {engine} on {'a CUDA GPU' if torch.cuda.is_available() else 'no GPU'}; "
                          "allowed: the torch engine on a CUDA GPU (it fuses the captured decode step)")
    prompt = args.tokens  # comma-separated ids >= 0, at least one (parsed by cli_args.int_list_of)
    from .generate import check_output_size

    try:  # both engines: an output of that many tokens must fit, before any work
        check_output_size(args.steps, 1, "cpu")
    except ValueError as exc:
        raise BundleError(f"--steps: {exc}") from None
    # every check load makes, before a graph or weights are used; what is run is the bytes verified
    v = verify_bundle(args.bundle)
    m = v.manifest
    if engine == "onnxruntime" and ("prefill.onnx" not in m["files"] or "decode.onnx" not in m["files"]):
        raise BundleError(f"bundle {args.bundle!r}: has no ONNX graphs (exported with --no-onnx?); "
                          "allowed: --engine torch, or a bundle exported with ONNX")
    vocab = int(m["model"]["vocab_size"])
    if bad := [t for t in prompt if not 0 <= t < vocab]:
        raise BundleError(f"--tokens: id {bad[0]}; allowed: ids 0 to {vocab - 1} (the bundle's vocabulary)")
    if engine == "onnxruntime":
        import numpy as np

        from .export.onnx_model import run_greedy

        decoded = run_greedy(v, np.array([prompt], dtype=np.int64), args.steps)[0].tolist()
        how = "onnxruntime"
    else:
        from .export.bundle import model_of

        model = model_of(v)
        if torch.cuda.is_available():
            model = model.cuda()
        device = model.embed.weight.device
        decoded = model.generate(torch.tensor([prompt], device=device), args.steps,
                                 compile_step=args.compile_step)[0].tolist()
        how = f"torch on {device}" + (", decode step as a CUDA graph" if device.type == "cuda" else ", eager") + \
            (" (torch.compile-fused)" if args.compile_step else "")
    print("engine ", how)
    print("prompt ", prompt)
    print("decoded", decoded)
    return 0
