"""Compiled Triton kernels that travel in a bundle, so its first call on the GPU it was exported
on compiles nothing (the first prefill after load took 30.2 s of JIT on the H200 without them).

Export (on a CUDA machine): a child process loads the bundle's weights and runs the plan's
shapes (every pinned prefill config and a decode step) with Triton's cache pointed at an empty
folder; every entry Triton wrote there is copied under ``kernels/<entry>/`` and listed in the
manifest with its sha256 (``files``), beside the machine it was compiled for (``kernels.key``:
GPU name, compute capability, Triton, CUDA and torch versions). Group files name their members
by bare file name in the bundle (Triton writes absolute paths).

Load: the files were hashed with every other and each group file checked to name only listed
files of its own entry (``verify``); when this machine's key equals the bundle's, each entry is
written into Triton's cache folder from those verified bytes (group files with this machine's
paths; every file prepared before the first is written), where Triton's own loader finds them:
the kernels are data for it (cubin, PTX, IR and JSON metadata). Shared libraries (Triton's
compiled host launchers) are never shipped or installed: loading a bundle executes no code from
it, so those are built on first use as before. Another machine's kernels are skipped with one
message; the kernels JIT-compile as they do without a bundle. An entry already in the cache is
never replaced: Triton's cache is shared by every process of the user, and a bundle's sha256
prove its files intact, not who made them, so a bundle adds kernels for keys nothing has
compiled here and changes none that something has. (Its cubins are still machine code the GPU
runs when Triton finds their key: load such bundles from sources you trust; one exported with
``--no-kernels`` compiles here.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

KERNELS_DIR = "kernels"
KEY_FIELDS = ("gpu", "capability", "triton", "cuda", "torch")
# what Triton's cache holds per entry that its loader reads as data; anything else in an entry
# (a shared library above all) is neither exported nor accepted
DATA_SUFFIXES = (".json", ".cubin", ".ptx", ".ttir", ".ttgir", ".llir", ".source", ".hsaco", ".amdgcn", ".spv")
_ENTRY = re.compile(r"[A-Za-z0-9_-]{8,128}")
_FILE = re.compile(r"[A-Za-z0-9_.-]{1,200}")


def machine_key() -> dict[str, str] | None:
    """This machine's key for compiled kernels, or None without a CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    import triton

    major, minor = torch.cuda.get_device_capability()
    return {"gpu": torch.cuda.get_device_name(), "capability": f"{major}.{minor}", "triton": triton.__version__,
            "cuda": str(torch.version.cuda), "torch": torch.__version__}


def triton_cache_dir() -> Path:
    """The folder Triton's file cache uses on this machine (TRITON_CACHE_DIR, else its default)."""
    try:
        from triton import knobs

        path = knobs.cache.dir
    except (ImportError, AttributeError):  # Triton before its knobs module
        path = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return Path(path)


def is_data_file(name: str) -> bool:
    """Can ``name`` (a file of a cache entry) travel in a bundle? Only what Triton reads as data."""
    return bool(_FILE.fullmatch(name)) and name.endswith(DATA_SUFFIXES) and not name.startswith(".")


def collect(cache: Path, dest: Path) -> list[str]:
    """Copy every cache entry under ``cache`` into ``dest / kernels``: its data files only, group
    files rewritten to name their members by file name. Returns the bundle-relative names."""
    names = []
    for entry in sorted(p for p in cache.iterdir() if p.is_dir() and _ENTRY.fullmatch(p.name)):
        files = [f for f in sorted(entry.iterdir()) if f.is_file() and is_data_file(f.name)]
        if not files:
            continue
        out = dest / KERNELS_DIR / entry.name
        out.mkdir(parents=True, exist_ok=True)
        for f in files:
            if f.name.startswith(GROUP_PREFIX):
                children = json.loads(f.read_text(encoding="utf-8")).get("child_paths", {})
                (out / f.name).write_text(json.dumps({"child_paths": {c: Path(p).name for c, p in children.items()}}),
                                          encoding="utf-8")
            else:
                shutil.copyfile(f, out / f.name)
            names.append(f"{KERNELS_DIR}/{entry.name}/{f.name}")
    return names


def check_entry(kernels: Any, files: dict[str, Any]) -> str | None:
    """Why a manifest's ``kernels`` value (with its ``files``) is malformed, or None. The value is
    null or {"key": {KEY_FIELDS: strings}}; every listed file under kernels/ is
    ``kernels/<entry>/<data file>``, and with null there is none."""
    listed = [n for n in files if n.startswith(KERNELS_DIR + "/")]
    if kernels is None:
        return f"lists {listed[:2]} but 'kernels' is null" if listed else None
    key = kernels.get("key") if isinstance(kernels, dict) else None
    if not isinstance(kernels, dict) or sorted(kernels) != ["key"] or not isinstance(key, dict) \
            or sorted(key) != sorted(KEY_FIELDS) or not all(isinstance(v, str) for v in key.values()):
        return f"'kernels' must be null or {{\"key\": {{{', '.join(KEY_FIELDS)}: strings}}}}"
    for name in listed:
        parts = name.split("/")
        if len(parts) != 3 or not _ENTRY.fullmatch(parts[1]) or not is_data_file(parts[2]):
            return (f"files[{name!r}]: a compiled kernel's file must be kernels/<entry>/<name> with one of "
                    f"{', '.join(DATA_SUFFIXES)} (shared libraries and other code are never loaded from a bundle)")
    return None


GROUP_PREFIX = "__grp__"


def _members(files: Any, entry: str) -> set[str]:
    """The file names the manifest lists under ``kernels/<entry>/``."""
    prefix = f"{KERNELS_DIR}/{entry}/"
    return {n[len(prefix):] for n in files if n.startswith(prefix)}


def read_group(data: bytes, members: set[str]) -> dict[str, str]:
    """child -> file name of a bundle's group file (``data``), each file one of ``members`` (the
    files of its entry that the manifest lists: never a path, '..' or a file not verified);
    ValueError saying what is wrong."""
    try:
        group = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    allowed = '{"child_paths": {name: file name}}'
    if not isinstance(group, dict):
        raise ValueError(f"a JSON {type(group).__name__}; allowed: an object {allowed}")
    if sorted(group) != ["child_paths"]:
        raise ValueError(f"has keys {sorted(group)}; allowed: exactly {allowed}")
    children = group["child_paths"]
    if not isinstance(children, dict):
        raise ValueError(f"'child_paths' is {type(children).__name__}; allowed: an object (name -> file name)")
    for child, path in children.items():
        if not isinstance(path, str) or path not in members:
            raise ValueError(f"child_paths[{child!r}] is {path!r}; allowed: the name of a file of its entry that "
                             "the manifest lists")
    return children


def check_groups(files: dict[str, Any], data: dict[str, bytes]) -> tuple[str, str] | None:
    """(file, why) for the first malformed group file of a bundle (``data``: the files' verified
    bytes), else None: run by ``verify`` so that :func:`install` meets only valid ones."""
    for name in files:
        parts = name.split("/")
        if len(parts) == 3 and parts[0] == KERNELS_DIR and parts[2].startswith(GROUP_PREFIX):
            try:
                read_group(data[name], _members(files, parts[1]))
            except ValueError as exc:
                return name, str(exc)
    return None


def install(bundle, cache: Path | None = None) -> tuple[bool, str] | None:
    """Install a verified bundle's compiled kernels (``bundle``: a ``VerifiedBundle``) into
    Triton's cache (``cache``: its folder, default :func:`triton_cache_dir`) when they were
    compiled for this machine. Returns (installed, a one-line message), None when the bundle has
    no compiled kernels. What is written is the bytes that were verified (never the files read
    again: a writer racing the check), every file prepared before the first is written."""
    root, manifest = bundle.root, bundle.manifest
    kernels = manifest.get("kernels")
    if kernels is None:
        return None
    names = [n for n in manifest["files"] if n.startswith(KERNELS_DIR + "/")]
    here = machine_key()
    theirs = kernels["key"]
    if here != theirs:
        diff = "no CUDA GPU" if here is None else ", ".join(
            f"{f} {here[f]!r} (bundle: {theirs[f]!r})" for f in KEY_FIELDS if here[f] != theirs[f])
        return False, (f"bundle {str(root)!r}: its {len(names)} compiled kernel files are for {theirs['gpu']} "
                       f"(Triton {theirs['triton']}); this machine differs ({diff}): kernels compile on first use")
    cache = triton_cache_dir() if cache is None else cache
    writes = []
    for name in names:
        _, entry, fname = name.split("/")
        data = bundle.data[name]
        if fname.startswith(GROUP_PREFIX):  # members by this machine's paths, as Triton writes them
            children = read_group(data, _members(manifest["files"], entry))  # checked by verify: cannot fail
            data = json.dumps({"child_paths": {c: str(cache / entry / p) for c, p in children.items()}}).encode()
        writes.append((cache / entry, fname, data))
    kept = 0
    for out, fname, data in writes:
        if (out / fname).exists():  # Triton's own, or an earlier install's: never replaced
            kept += 1
            continue
        out.mkdir(parents=True, exist_ok=True)
        _write_atomic(out / fname, data)
    return True, (f"bundle {str(root)!r}: installed {len(names) - kept} compiled kernel files into {cache}"
                  + (f" ({kept} already there, kept)" if kept else ""))


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def compile_into(bundle_dir: Path, timeout_s: float = 900.0) -> tuple[dict[str, str], list[str]] | None:
    """On a CUDA machine: run the bundle being written at ``bundle_dir`` (its weights and
    ``warmup.json``) in a child process whose Triton cache is an empty folder, then collect what
    it compiled. Returns (the machine key, the bundle-relative names), or None without CUDA."""
    key = machine_key()
    if key is None:
        return None
    with tempfile.TemporaryDirectory(prefix="rtcompile-kernels-") as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        done = subprocess.run([sys.executable, "-m", "rtcompile.export.compiled", str(bundle_dir)], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"compiling the bundle's kernels failed: {last}")
        return key, collect(Path(cache), bundle_dir)


def _warm_up(bundle_dir: Path) -> None:
    """The child of :func:`compile_into`: every prefill shape of the plan and one decode step."""
    import torch
    from safetensors.torch import load_file

    from ..model import RunningTensorLM
    from ..plan import Plan
    from ..spec import ModelSpec

    info = json.loads((bundle_dir / "warmup.json").read_text(encoding="utf-8"))
    spec = ModelSpec.from_dict(info["spec"])
    model = RunningTensorLM(spec, vocab_size=info["vocab_size"], mlp=info["mlp"])
    model.load_state_dict(load_file(str(bundle_dir / "weights.safetensors")))
    model = model.cuda().eval()
    model.plan = None if info["plan"] is None else Plan.from_dict(info["plan"])
    shapes = {(1, 64), (1, 1024)} | {(d["batch"], d["seq_len"]) for d in (info["plan"] or {}).get("decisions", [])
                                     if d.get("phase") == "prefill"}
    with torch.no_grad():
        for b, t in sorted(shapes):
            model(torch.zeros(b, t, dtype=torch.long, device="cuda"))
        tokens = torch.zeros(1, 4, dtype=torch.long, device="cuda")
        model.generate(tokens, max_new_tokens=2)
    torch.cuda.synchronize()


if __name__ == "__main__":
    _warm_up(Path(sys.argv[1]))
