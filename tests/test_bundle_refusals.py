"""Malformed bundles, as a buggy exporter or a half-copied folder leaves them: the manifest's
hashes MATCH the files (``_rewrite`` updates them), so only the contents give them away. Each
is refused by ``load``, ``inspect`` and ``run`` alike with one BundleError line naming the
bundle, the file and the problem; never a traceback, never onnxruntime's own error."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from onnx.external_data_helper import set_external_data
from safetensors.torch import load_file, save_file

import rtcompile
from rtcompile.cli import main
from rtcompile.export import BundleError, export_bundle, load_bundle
from rtcompile.model import RunningTensorLM
from rtcompile.spec import ModelSpec

SPEC_TOML = 'order = 3\nkey_widths = [2, 4]\nvalue_width = 5\nheads = 2\nmodel_width = 12\n'
ORDER2_TOML = 'order = 2\nkey_widths = [8]\nvalue_width = 5\nheads = 2\nmodel_width = 12\n'


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One bundle with ONNX graphs, written by the CLI; each test edits a copy."""
    root = tmp_path_factory.mktemp("exported")
    (root / "s.toml").write_text(SPEC_TOML)
    assert main(["export", str(root / "s.toml"), "--out", str(root / "b"), "--vocab", "11"]) == 0
    return root / "b"


@pytest.fixture
def bundle(exported, tmp_path):
    return Path(shutil.copytree(exported, tmp_path / "bundle"))


def _edit(path: Path, fn) -> None:
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    (path / "manifest.json").write_text(json.dumps(m))


def _rewrite(path: Path, name: str, data: bytes) -> None:
    """Replace a listed file and update its sha256 and bytes in the manifest, as an exporter
    writing the wrong content would."""
    (path / name).write_bytes(data)
    _edit(path, lambda m: m["files"][name].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data)))


def _rewrite_weights(path: Path, fn) -> None:
    tensors = load_file(str(path / "weights.safetensors"))
    fn(tensors)
    tmp = path.parent / "w.tmp"
    save_file(tensors, str(tmp))
    _rewrite(path, "weights.safetensors", tmp.read_bytes())
    tmp.unlink()


def _rewrite_graph(path: Path, name: str, fn) -> None:
    model = onnx.load(str(path / name))
    fn(model)
    _rewrite(path, name, model.SerializeToString())


def _initializer(model, name: str):
    return next(t for t in model.graph.initializer if t.name == name)


def _refused(path: Path, capsys, *patterns: str) -> None:
    """load raises BundleError; inspect and run print one stderr line and exit 2; each message
    names the bundle and matches every pattern."""
    with pytest.raises(BundleError) as info:
        load_bundle(path)
    messages = [str(info.value)]
    for argv in (["inspect", str(path)], ["run", str(path), "--steps", "1"]):
        capsys.readouterr()
        code = main(argv)
        out = capsys.readouterr()
        lines = out.err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "Traceback" not in out.err, (argv, code, out.err)
        messages.append(lines[0])
    for msg in messages:
        assert str(path) in msg and all(re.search(p, msg) for p in patterns), (msg, patterns)


def _accepted(path: Path, capsys) -> None:
    assert isinstance(load_bundle(path), RunningTensorLM)
    for argv in (["inspect", str(path)], ["run", str(path), "--steps", "2"]):
        assert main(argv) == 0, (argv, capsys.readouterr().err)


# ----- weights.safetensors --------------------------------------------------------------------

@pytest.mark.parametrize("content", ["junk", "torch.save"])
def test_weights_that_are_not_safetensors(content, bundle, capsys, monkeypatch):
    if content == "junk":
        data = b"these are not weights\n" * 20
    else:  # a pickle saved under the bundle's name: refused without ever being unpickled
        tmp = bundle.parent / "w.pt"
        torch.save(load_file(str(bundle / "weights.safetensors")), tmp)
        data = tmp.read_bytes()
    _rewrite(bundle, "weights.safetensors", data)
    import pickle

    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load"))
    _refused(bundle, capsys, r"weights\.safetensors: not a safetensors file")


@pytest.mark.parametrize("cut, pattern", [(4, r"data offsets \[\d+, \d+\] for \d+ bytes in a body of \d+"),
                                          (-4, r"do not cover the file's \d+ bytes of data exactly")],
                         ids=["truncated", "trailing-bytes"])
def test_weights_whose_header_does_not_fit_their_data(cut, pattern, bundle, capsys):
    # the header is read from the verified bytes (verify.safetensors_header), checked as
    # safetensors' loader checks it: never its SafetensorError from load
    data = (bundle / "weights.safetensors").read_bytes()
    _rewrite(bundle, "weights.safetensors", data[:-cut] if cut > 0 else data + b"\0" * -cut)
    _refused(bundle, capsys, r"weights\.safetensors: not a safetensors file \(", pattern)


def test_weights_whose_tensors_share_their_data(bundle, capsys):
    """Two tensors pointing at the same bytes (safetensors' loader refuses the file): refused.
    Since the parameters are views of the verified bytes, such a file would load two parameters
    sharing memory; the header check stopped at the first overlap and let the rest pass."""
    w = load_file(str(bundle / "weights.safetensors"))
    names = sorted(w)
    sizes: dict = {}
    for n in names:
        sizes.setdefault((w[n].dtype, w[n].numel()), []).append(n)
    first, second = next(group for group in sizes.values() if len(group) >= 2)[:2]
    st_dtype = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    header, body = {}, b""
    for n in names:
        if n != second:
            raw = w[n].contiguous().view(torch.uint8).numpy().tobytes()
            header[n] = {"dtype": st_dtype[w[n].dtype], "shape": list(w[n].shape),
                         "data_offsets": [len(body), len(body) + len(raw)]}
            body += raw
    header[second] = {**header[first], "shape": list(w[second].shape)}
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    _rewrite(bundle, "weights.safetensors", len(h).to_bytes(8, "little") + h + body)
    _refused(bundle, capsys, r"weights\.safetensors: not a safetensors file \(", r"exactly, once")


def test_weight_of_the_wrong_shape(bundle, capsys):
    _rewrite_weights(bundle, lambda w: w.update({"embed.weight": torch.zeros(12, 12)}))
    _refused(bundle, capsys, r"weights\.safetensors: tensor 'embed\.weight' has shape \[12, 12\]", r"need \[11, 12\]")


def test_missing_weight(bundle, capsys):
    _rewrite_weights(bundle, lambda w: w.pop("head.weight"))
    _refused(bundle, capsys, r"weights\.safetensors: lacks 1 tensors \['head\.weight'\]")


def test_extra_weight(bundle, capsys):
    _rewrite_weights(bundle, lambda w: w.update({"mixers.7.out.weight": torch.zeros(2, 2)}))
    _refused(bundle, capsys, r"weights\.safetensors: holds 1 tensors \['mixers\.7\.out\.weight'\]")


def test_weight_of_an_integer_dtype(bundle, capsys):
    # load_state_dict would have cast it into the fp32 parameter without a word
    _rewrite_weights(bundle, lambda w: w.update({"head.weight": torch.ones(11, 12, dtype=torch.int64)}))
    _refused(bundle, capsys, r"tensor 'head\.weight' has dtype I64; allowed: F32, F16, BF16, F64")


# ----- manifest keys and types ----------------------------------------------------------------

@pytest.mark.parametrize("key", ["model", "spec", "files", "versions"])
def test_manifest_missing_a_key(key, bundle, capsys):
    _edit(bundle, lambda m: m.pop(key))
    _refused(bundle, capsys, rf"manifest\.json: missing keys \['{key}'\]")


def test_file_entry_missing_bytes(bundle, capsys):
    _edit(bundle, lambda m: m["files"]["weights.safetensors"].pop("bytes"))
    _refused(bundle, capsys, r"manifest\.json: files\['weights\.safetensors'\] has keys \['sha256'\]")


@pytest.mark.parametrize("key,value,pattern", [
    ("model", "RunningTensorLM", r"'model' is str; allowed: an object"),
    ("spec", [3, [2, 4]], r"'spec' is list; allowed: an object"),
    ("versions", None, r"'versions' is null; allowed: an object"),
    ("model.vocab_size", "11", r"model\.vocab_size is str '11'; allowed: an integer in \[2, 16777216\]"),
    ("model.mlp", "yes", r"model\.mlp is str 'yes'; allowed: true or false"),
    ("model.class", "GPT2", r"model\.class is 'GPT2'; allowed: 'RunningTensorLM'"),
    ("files.bytes", "10996", r"files\['weights\.safetensors'\]\.bytes is str '10996'"),
    ("files.bytes", 7, r"files\['weights\.safetensors'\]\.bytes is 7, the file has \d+"),
    ("onnx", {"mixer": "x"}, r"'onnx' must be"),
], ids=["model-str", "spec-list", "versions-null", "vocab-str", "mlp-str", "class", "bytes-str", "bytes-wrong",
        "onnx-no-digest"])
def test_manifest_value_of_the_wrong_type(key, value, pattern, bundle, capsys):
    def edit(m):
        if key == "files.bytes":
            m["files"]["weights.safetensors"]["bytes"] = value
        elif "." in key:
            m[key.split(".")[0]][key.split(".")[1]] = value
        else:
            m[key] = value

    _edit(bundle, edit)
    _refused(bundle, capsys, r"manifest\.json: " + pattern)


@pytest.mark.parametrize("vocab", [10**12, 1, -5, 12])
def test_absurd_or_wrong_vocab_size(vocab, bundle, capsys):
    _edit(bundle, lambda m: m["model"].update(vocab_size=vocab))
    if vocab == 12:  # plausible, but not what the weights hold
        _refused(bundle, capsys, r"tensor 'embed\.weight' has shape \[11, 12\]", r"vocab_size 12")
    else:
        _refused(bundle, capsys, rf"model\.vocab_size is int {vocab}; allowed: an integer in \[2, 16777216\]")


@pytest.mark.parametrize("field,value,pattern", [
    ("order", 9, r"spec\.order: got 9; allowed: an integer in \[2, 6\]"),
    ("key_widths", [0, 4], r"spec\.key_widths\[0\]: got 0"),
    ("chunk_size", 48, r"spec\.chunk_size: got 48"),
    ("heads", "2", r"spec\.heads: expected an integer"),
    ("mystery", 1, r"spec\.mystery: unknown key"),
])
def test_spec_the_spec_module_refuses(field, value, pattern, bundle, capsys):
    _edit(bundle, lambda m: m["spec"].update({field: value}))
    _refused(bundle, capsys, r"manifest\.json: " + pattern)


@pytest.mark.parametrize("fmt", [0, -1, True, 3.0, "3", None, 1, 4])
def test_format_other_than_the_supported_one(fmt, bundle, capsys):
    _edit(bundle, lambda m: m.update(format=fmt))
    _refused(bundle, capsys, r"manifest\.json: .*format", r"allowed: the integer 3|allowed: 2 or 3|newer than")


def test_manifest_with_a_repeated_key(bundle, capsys):
    text = (bundle / "manifest.json").read_text()
    (bundle / "manifest.json").write_text(text.replace('{', '{"format": 3, ', 1))
    _refused(bundle, capsys, r"manifest\.json: unreadable \(key 'format' appears more than once\)")


# ----- ONNX graphs ----------------------------------------------------------------------------

def _externalise(bundle: Path, location: str, data_path: Path) -> None:
    """prefill.onnx keeps lm.embed.weight's data in ``location`` (written at ``data_path``)."""
    def edit(model):
        t = _initializer(model, "lm.embed.weight")
        data_path.write_bytes(numpy_helper.to_array(t).tobytes())
        set_external_data(t, location)
        t.data_location = onnx.TensorProto.EXTERNAL
        t.ClearField("raw_data")

    _rewrite_graph(bundle, "prefill.onnx", edit)


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_onnx_external_data_escaping_the_bundle(where, bundle, capsys):
    # onnxruntime would read the file wherever it points (or fail at run with its own error)
    outside = bundle.parent / "x.bin"
    location = "../x.bin" if where == "parent" else str(outside)
    _externalise(bundle, location, outside)
    _refused(bundle, capsys, r"prefill\.onnx: tensor 'lm\.embed\.weight' keeps its data at .*outside the bundle")


def test_onnx_external_data_in_an_unlisted_file(bundle, capsys):
    _externalise(bundle, "embed.bin", bundle / "embed.bin")
    _refused(bundle, capsys, r"prefill\.onnx: .*'embed\.bin', which the manifest does not list")


def test_onnx_external_data_in_a_listed_file_is_accepted(bundle, capsys):
    _externalise(bundle, "embed.bin", bundle / "embed.bin")
    data = (bundle / "embed.bin").read_bytes()
    _edit(bundle, lambda m: m["files"].update({"embed.bin": {"sha256": hashlib.sha256(data).hexdigest(),
                                                             "bytes": len(data)}}))
    _accepted(bundle, capsys)


def test_onnx_external_data_in_the_weights_file_is_accepted(bundle, capsys):
    """A graph keeping an initializer's data in weights.safetensors itself (the embedding once
    on disk) is accepted: the weights are verified into a bytearray, whose slice protobuf takes
    as bytes (it raised a TypeError traceback when the bytearray came in)."""
    from rtcompile.export.verify import safetensors_header

    data = (bundle / "weights.safetensors").read_bytes()
    _, _, offset = safetensors_header(data)["embed.weight"]

    def edit(model):
        t = _initializer(model, "lm.embed.weight")
        raw = numpy_helper.to_array(t).tobytes()
        assert data[offset:offset + len(raw)] == raw  # the same fp32 values in both files
        set_external_data(t, "weights.safetensors", offset=offset, length=len(raw))
        t.data_location = onnx.TensorProto.EXTERNAL
        t.ClearField("raw_data")

    _rewrite_graph(bundle, "prefill.onnx", edit)
    _accepted(bundle, capsys)


def test_onnx_graph_whose_weights_were_changed(bundle, capsys):
    def edit(model):
        t = _initializer(model, "lm.embed.weight")
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * 2, t.name))

    _rewrite_graph(bundle, "decode.onnx", edit)
    _refused(bundle, capsys, r"decode\.onnx: its weights differ from those recorded at export")


def test_onnx_graph_copied_from_another_export(bundle, tmp_path, capsys):
    # same spec, other weights: the half-copied folder a failed rsync leaves
    (tmp_path / "s.toml").write_text(SPEC_TOML)
    torch.manual_seed(1)
    other = RunningTensorLM(ModelSpec(order=3, key_widths=(2, 4), value_width=5, heads=2, model_width=12), vocab_size=11)
    export_bundle(other, tmp_path / "other")
    _rewrite(bundle, "prefill.onnx", (tmp_path / "other" / "prefill.onnx").read_bytes())
    _refused(bundle, capsys, r"prefill\.onnx: its weights differ from those recorded at export")


def test_onnx_graph_rewritten_with_the_same_weights_is_accepted(bundle, capsys):
    # other bytes (a doc string), the same weights: the digest is about weights, not bytes
    _rewrite_graph(bundle, "prefill.onnx", lambda model: setattr(model, "doc_string", "re-saved by a tool"))
    _accepted(bundle, capsys)


def test_unedited_bundle_is_accepted(bundle, capsys):
    _accepted(bundle, capsys)


def test_export_refuses_graphs_that_do_not_carry_the_model(tmp_path, monkeypatch, capsys):
    # a buggy exporter: the graph's weights are not the module's; no bundle may be written
    from rtcompile.export import onnx_model

    finish = onnx_model._finish

    def wrong_weights(program, spec, body):
        model = finish(program, spec, body)
        t = _initializer(model, "lm.embed.weight")
        t.CopyFrom(numpy_helper.from_array(np.flip(numpy_helper.to_array(t), 0).copy(), t.name))
        return model

    monkeypatch.setattr(onnx_model, "_finish", wrong_weights)
    (tmp_path / "s.toml").write_text(SPEC_TOML)
    assert main(["export", str(tmp_path / "s.toml"), "--out", str(tmp_path / "b")]) == 2
    stderr = capsys.readouterr().err  # the exporter's own warnings may come before the error
    err = [line for line in stderr.splitlines() if line.startswith("rtcompile export: error")]
    assert len(err) == 1 and "Traceback" not in stderr, stderr
    assert re.search(r"prefill\.onnx: onnxruntime's logits differ from the torch model's", err[0]), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.toml"]


@pytest.mark.parametrize("how,pattern", [
    ("dims", r"raw_data size \(528 bytes\) is too small"),
    ("data-type-0", r"UNDEFINED"),
    ("data-type-999", r"tensor 'lm\.embed\.weight'.*data type 999"),
], ids=["dims", "data-type-0", "data-type-999"])
def test_onnx_graph_with_a_malformed_tensor(how, pattern, bundle, capsys):
    # numpy_helper raised ValueError / TypeError / KeyError: a traceback from inspect and run
    def edit(model):
        t = _initializer(model, "lm.embed.weight")
        if how == "dims":
            t.dims[0] += 3
        else:
            t.data_type = 0 if how == "data-type-0" else 999

    _rewrite_graph(bundle, "prefill.onnx", edit)
    _refused(bundle, capsys, r"prefill\.onnx: ", pattern)


@pytest.mark.parametrize("how,pattern", [
    ("dangling-input", r"input 'nowhere' of node.*is not output of any previous nodes"),
    ("unknown-op", r"No Op registered for Bogus"),
], ids=["dangling-input", "unknown-op"])
def test_onnx_graph_the_checker_refuses(how, pattern, bundle, capsys):
    # parsed fine, so inspect passed it and onnxruntime failed at run with its own traceback
    def edit(model):
        if how == "dangling-input":
            model.graph.node[3].input[0] = "nowhere"
        else:
            model.graph.node[3].op_type = "Bogus"

    _rewrite_graph(bundle, "decode.onnx", edit)
    _refused(bundle, capsys, r"decode\.onnx: not a valid ONNX model \(", pattern)


@pytest.mark.parametrize("where", ["graph", "function"])
def test_onnx_op_that_nothing_defines_is_refused_by_inspect(where, bundle, capsys):
    # an op of a foreign domain that no model-local function defines: the checker skips such
    # domains, so inspect passed it and only onnxruntime refused it, at `run --engine onnxruntime`
    def edit(model):
        nodes = model.graph.node if where == "graph" else model.functions[0].node
        nodes[len(nodes) // 2].domain = "ai.rtcompile"
        nodes[len(nodes) // 2].op_type = "Bogus"
        if where == "function":  # a function imports each domain its body uses (the checker asks)
            model.functions[0].opset_import.add(domain="ai.rtcompile", version=1)

    _rewrite_graph(bundle, "prefill.onnx", edit)
    _refused(bundle, capsys, r"prefill\.onnx: ", r"op ai\.rtcompile\.Bogus is neither a standard ONNX op nor a "
                                                  r"function of the model; allowed: ")


def test_onnx_graph_onnxruntime_cannot_load_is_one_line_from_run(bundle, capsys, monkeypatch):
    # whatever else onnxruntime refuses when it makes the session (no edit of a verified graph
    # known to reach it: the failure is planted) is one line naming the graph, not a traceback
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail

    from rtcompile.export import onnx_model

    def refuse(graph):
        raise Fail("[ONNXRuntimeError] : 1 : FAIL : planted\nsecond line")

    monkeypatch.setattr(onnx_model, "_session", refuse)
    capsys.readouterr()
    code = main(["run", str(bundle), "--engine", "onnxruntime", "--steps", "1"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert str(bundle) in lines[0] and re.search(r"prefill\.onnx: onnxruntime cannot load it \(.*planted second line",
                                                 lines[0]), lines


def test_a_file_of_the_wrong_size_is_refused_before_it_is_hashed(bundle, capsys, monkeypatch):
    # a sparse 64 GiB file in place of the weights took 110 s to hash before its size was compared
    from rtcompile.export import verify

    with open(bundle / "weights.safetensors", "r+b") as f:
        f.truncate(64 << 30)
    monkeypatch.setattr(verify, "file_sha256", lambda *a: pytest.fail("hashed a file of the wrong size"), raising=False)
    monkeypatch.setattr(verify.hashlib, "sha256", lambda *a: pytest.fail("hashed a file of the wrong size"))
    _refused(bundle, capsys, r"manifest\.json: files\['weights\.safetensors'\]\.bytes is \d+, the file has 68719476736")


def test_a_file_that_does_not_fit_in_memory_is_refused(bundle, capsys, monkeypatch):
    # each file is read whole (then hashed and used from memory): a MemoryError is one line
    import io

    from rtcompile.export import verify

    class Huge(io.BytesIO):  # the weights are read into a buffer (readinto), the rest by read
        def read(self, *args):
            raise MemoryError

        readinto = read

    monkeypatch.setattr(verify, "open", lambda *a, **k: Huge(), raising=False)
    _refused(bundle, capsys, r"weights\.safetensors: its \d+ bytes do not fit in this machine's memory")


def test_a_recorded_size_beyond_the_cap_is_refused(bundle, capsys):
    _edit(bundle, lambda m: m["files"]["weights.safetensors"].update(bytes=1 << 50))
    _refused(bundle, capsys, r"files\['weights\.safetensors'\]\.bytes is int 1125899906842624; allowed: an integer "
                             r"in \[0, 1099511627776\]")


# ----- plans ----------------------------------------------------------------------------------

def test_export_refuses_a_plan_of_another_spec(tmp_path, capsys):
    (tmp_path / "order3.toml").write_text(SPEC_TOML)
    (tmp_path / "order2.toml").write_text(ORDER2_TOML)
    plan = tmp_path / "plan-of-order3.json"
    assert main(["plan", str(tmp_path / "order3.toml"), "--target", "h200", "--batch", "1", "--seq-len", "64",
                 "--decode-batch", "1", "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "order2.toml"), "--plan", str(plan), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "plan-of-order3.json" in err[0] and "order2.toml" in err[0], err
    assert re.search(r"key_widths \[2, 4\] vs \[8\].*order 3 vs 2", err[0]), err
    assert not (tmp_path / "b").exists()
    # the API refuses the same, and the plan of the right spec is taken
    from rtcompile.plan import Plan

    model = RunningTensorLM(rtcompile.load_spec(tmp_path / "order2.toml"), vocab_size=11)
    with pytest.raises(BundleError, match=r"the plan was made for another spec .*key_widths \[2, 4\] vs \[8\]"):
        export_bundle(model, tmp_path / "b", plan=Plan.load(plan), onnx=False)
    assert main(["export", str(tmp_path / "order3.toml"), "--plan", str(plan), "--out", str(tmp_path / "b"),
                 "--no-onnx"]) == 0


def test_bundle_whose_plan_is_of_another_spec(bundle, tmp_path, capsys):
    (tmp_path / "order3.toml").write_text(SPEC_TOML)
    plan = tmp_path / "p.json"
    assert main(["plan", str(tmp_path / "order3.toml"), "--target", "h200", "--batch", "1", "--seq-len", "64",
                 "--decode-batch", "1", "--out", str(plan)]) == 0
    data = json.loads(plan.read_text())
    data["spec"]["value_width"] = 7
    _edit(bundle, lambda m: m.update(plan=data))
    _refused(bundle, capsys, r"manifest\.json: plan: made for another spec .*value_width 7 vs 5")


@pytest.mark.parametrize("field,value,pattern", [
    ("batch", 0, r"plan\.decisions\[0\]\.batch: got 0; allowed: an integer >= 1"),
    ("mode", "fast", r"plan\.decisions\[0\]\.mode: got 'fast'; allowed: chunk, recurrent"),
    ("variant", {"form": "turbo"}, r"plan\.decisions\[0\]\.variant: config: form 'turbo'; allowed:"),
    ("state_dtype", "int8", r"plan\.decisions\[0\]\.state_dtype: got 'int8'; allowed: float32, float16, bfloat16"),
])
def test_bundle_whose_plan_decision_cannot_be_followed(field, value, pattern, bundle, tmp_path, capsys):
    (tmp_path / "order3.toml").write_text(SPEC_TOML)
    plan = tmp_path / "p.json"
    assert main(["plan", str(tmp_path / "order3.toml"), "--target", "h200", "--batch", "1", "--seq-len", "64",
                 "--decode-batch", "1", "--out", str(plan)]) == 0
    data = json.loads(plan.read_text())
    data["decisions"][0][field] = value
    _edit(bundle, lambda m: m.update(plan=data))
    _refused(bundle, capsys, r"manifest\.json: " + pattern)


@pytest.mark.parametrize("case", ["wrong-shape", "junk", "absent", "metadata-not-strings"])
def test_export_of_weights_that_do_not_fit(case, tmp_path, capsys):
    # a wrong shape gave load_state_dict's RuntimeError traceback; metadata that is not an object
    # of strings passed the header check and safetensors' load raised a traceback
    (tmp_path / "s.toml").write_text(SPEC_TOML)
    w = tmp_path / "w.safetensors"
    if case in ("wrong-shape", "metadata-not-strings"):
        state = {k: v.clone() for k, v in RunningTensorLM(rtcompile.load_spec(tmp_path / "s.toml"), 11).state_dict().items()}
        if case == "wrong-shape":
            state["head.weight"] = torch.zeros(11, 13)
        save_file(state, str(w), metadata={"format": "pt"})
        if case == "metadata-not-strings":
            data = w.read_bytes()
            n = int.from_bytes(data[:8], "little")
            header = json.loads(data[8:8 + n])
            header["__metadata__"] = {"format": 1}
            raw = json.dumps(header).encode()
            w.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])
    elif case == "junk":
        w.write_bytes(b"\0" * 64)
    assert main(["export", str(tmp_path / "s.toml"), "--out", str(tmp_path / "b"), "--vocab", "11",
                 "--weights", str(w), "--no-onnx"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(w) in err[0], err
    pattern = {"wrong-shape": r"tensor 'head\.weight' has shape \[11, 13\]; the spec \(with --vocab 11\) need \[11, 12\]",
               "junk": r"not a safetensors file", "absent": r"no such file",
               "metadata-not-strings": r"not a safetensors file \(__metadata__ .* is not an object of strings\)"}[case]
    assert re.search(pattern, err[0]), err
    assert not (tmp_path / "b").exists()


def test_export_loads_the_weights_it_checked_not_a_file_swapped_in_after(tmp_path, monkeypatch):
    # the check read the file's header and the load opened it again: a file replaced in between
    # (same names and shapes, other values) was exported unchecked
    import rtcompile.export.verify as verify

    (tmp_path / "s.toml").write_text(SPEC_TOML)
    w = tmp_path / "w.safetensors"
    state = {k: torch.randn_like(v) if v.is_floating_point() else v.clone()
             for k, v in RunningTensorLM(rtcompile.load_spec(tmp_path / "s.toml"), 11).state_dict().items()}
    save_file(state, str(w))
    checked = verify.safetensors_problem

    def check_then_swap(*a, **kw):
        problem = checked(*a, **kw)
        save_file({k: torch.zeros_like(v) for k, v in state.items()}, str(w))
        return problem

    monkeypatch.setattr(verify, "safetensors_problem", check_then_swap)
    assert main(["export", str(tmp_path / "s.toml"), "--out", str(tmp_path / "b"), "--vocab", "11",
                 "--weights", str(w), "--no-onnx"]) == 0
    got = load_file(str(tmp_path / "b" / "weights.safetensors"))
    assert set(got) == set(state)
    for k, v in state.items():
        assert torch.equal(got[k], v), k


def test_manifest_with_an_unknown_key(bundle, capsys):
    # a newer exporter's field this version would silently ignore
    _edit(bundle, lambda m: m.update(quantization={"bits": 4}))
    _refused(bundle, capsys, r"manifest\.json: unknown keys \['quantization'\]; allowed: exactly format, spec")
