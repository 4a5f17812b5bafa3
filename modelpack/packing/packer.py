"""The packer: a safetensors checkpoint directory → a ModelPack OCI artifact.

``build_artifact`` reads each file once (hashing files in parallel threads; hashlib releases the
GIL), validates every safetensors header strictly, infers the model config and builds the
manifest. The result is a ``PackedArtifact``, a read-only Target, so ``pack``/``push`` are just
``copy(packed, destination)``: a layout on the same filesystem gets reflinks or hard links, a
registry gets the files streamed straight from the checkpoint (no intermediate copy).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from modelpack.errors import NotFoundError, PackError, SafetensorsError, UnsafePathError
from modelpack.mediatypes import (
    ANNOTATION_CREATED,
    ANNOTATION_FILE_MEDIATYPE_UNTESTED,
    ANNOTATION_FILE_METADATA,
    ANNOTATION_FILEPATH,
    ANNOTATION_TITLE,
    ARTIFACT_TYPE_MODEL,
    MEDIA_TYPE_CONFIG,
    FileMetadata,
    ModelConfig,
    ModelDescriptor,
    ModelFS,
    ModelSpecConfig,
    layer_media_type,
)
from modelpack.mediatypes.annotations import safe_relative_path
from modelpack.oci.descriptor import Descriptor, Manifest
from modelpack.oci.digest import Digest, sha256_file
from modelpack.packing.safetensors_format import SafetensorsHeader, build_header, read_header
from modelpack.progress import Progress
from modelpack.targets.base import BlobSource, bytes_blob_source, file_blob_source

WEIGHT_CONFIG_NAMES = {
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "processor_config.json",
    "spiece.model",
}
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".onnx", ".h5", ".msgpack")
DOC_PREFIXES = ("readme", "license", "licence", "notice", "copying", "use_policy")
OTHER_FILE_CHOICES = ("doc", "dataset", "code", "refuse")

# safetensors dtype -> precision name used in the config (torch's spelling)
PRECISION_NAMES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "I8": "int8",
    "U8": "uint8",
    "F4": "float4_e2m1",
}


def classify(relpath: str, other: str = "doc") -> tuple[str | None, bool]:
    """Layer kind for a file, and whether the choice is a guess (``…mediatype.untested``).

    Returns (None, _) for a file that ``other == "refuse"`` rejects.
    """
    name = os.path.basename(relpath)
    lower = name.lower()
    if lower.endswith(".safetensors"):
        return "weight", False
    if lower in WEIGHT_CONFIG_NAMES or lower.endswith(".index.json"):
        return "weight.config", False
    if lower.endswith(OTHER_WEIGHT_SUFFIXES):
        return "weight", True
    if lower.endswith(".md") or lower.startswith(DOC_PREFIXES):
        return "doc", False
    if lower.endswith(".py"):
        return "code", False
    if other == "refuse":
        return None, True
    return other, True


@dataclass
class PackOptions:
    """Everything that shapes the artifact; every config field can be overridden."""

    include: Sequence[str] = ()
    exclude: Sequence[str] = ()
    other_files: str = "doc"
    name: str | None = None
    version: str | None = None
    family: str | None = None
    architecture: str | None = None
    param_size: str | None = None
    precision: str | None = None
    quantization: str | None = None
    vendor: str | None = None
    description: str | None = None
    licenses: Sequence[str] = ()
    created: str | None = None  # RFC 3339; None keeps the artifact reproducible
    max_file_size: int | None = None
    jobs: int = 0  # hashing threads; 0 = one per core
    progress: str = "auto"


@dataclass(frozen=True)
class PackedFile:
    relpath: str
    path: str  # absolute path of the bytes (the checkpoint file, or a re-sharded file)
    kind: str
    untested: bool
    size: int
    digest: Digest
    # Remote files (an S3 checkpoint) have no local path: ``opener(offset)`` streams their bytes.
    opener: Callable[[int], BinaryIO] | None = field(default=None, compare=False, repr=False)


@dataclass
class PackedArtifact:
    """A built artifact whose blobs are local files: a read-only Target for ``copy``."""

    manifest: Manifest
    config: ModelSpecConfig
    config_bytes: bytes
    files: list[PackedFile]
    tag: str = "latest"
    staging_dir: str | None = None
    name: str = "checkpoint"
    _by_digest: dict[str, PackedFile] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._by_digest = {f.digest: f for f in self.files}

    @property
    def digest(self) -> Digest:
        return self.manifest.digest

    # -- ReadableTarget --------------------------------------------------------------
    def resolve(self, reference: str) -> Descriptor:
        if reference in (self.tag, str(self.manifest.digest)):
            return self.manifest.descriptor()
        raise NotFoundError(f"{self.name}: {reference!r} not found (the packed artifact is {self.digest})")

    def fetch_manifest(self, reference: str) -> tuple[bytes, str]:
        self.resolve(reference)
        return self.manifest.raw, self.manifest.media_type

    def blob_source(self, descriptor: Descriptor) -> BlobSource:
        if descriptor.digest == self.manifest.config.digest:
            return bytes_blob_source(descriptor, self.config_bytes)
        f = self._by_digest.get(descriptor.digest)
        if f is None:
            raise NotFoundError(f"{self.name}: blob {descriptor.digest} not found")
        if f.opener is not None:
            return BlobSource(descriptor, f.opener)  # unverified: the writer checks the digest
        return file_blob_source(descriptor, f.path, verified=True)

    def fetch_blob(self, descriptor: Descriptor, offset: int = 0) -> BinaryIO:
        return self.blob_source(descriptor).open(offset)

    def fetch_range(self, descriptor: Descriptor, offset: int, length: int) -> bytes:
        with self.fetch_blob(descriptor, offset) as f:
            return f.read(length)

    def exists(self, descriptor: Descriptor) -> bool:
        return descriptor.digest in self._by_digest or descriptor.digest == self.manifest.config.digest

    def list_tags(self) -> Iterator[str]:
        yield self.tag

    def referrers(self, subject: Descriptor, artifact_type: str | None = None) -> list[Descriptor]:
        return []

    def cleanup(self) -> None:
        if self.staging_dir:
            shutil.rmtree(self.staging_dir, ignore_errors=True)
            self.staging_dir = None


# ------------------------------------------------------------------------- file discovery
def _matches(relpath: str, patterns: Sequence[str]) -> bool:
    return any(
        fnmatch.fnmatchcase(relpath, p) or fnmatch.fnmatchcase(os.path.basename(relpath), p) for p in patterns
    )


def discover_files(
    root: str, include: Sequence[str] = (), exclude: Sequence[str] = ()
) -> list[tuple[str, str]]:
    """(relpath, absolute path) of the regular files to pack, sorted by path parts.

    Refuses symlinks that leave ``root``, special files (devices, FIFOs, sockets) and an empty
    result. Hidden entries (``.git``, ``.cache``) are skipped: they are never model content.
    """
    root = os.path.realpath(root)
    if not os.path.isdir(root):
        raise PackError(f"{root}: not a directory")
    out: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for d in list(dirnames):
            full = os.path.join(dirpath, d)
            if os.path.islink(full):
                target = os.path.realpath(full)
                if os.path.commonpath([root, target]) != root:
                    raise PackError(f"{full}: symlink leaves the checkpoint directory (→ {target})")
                raise PackError(f"{full}: symlinked directories are not packed; copy the directory instead")
        for fname in sorted(filenames):
            if fname.startswith("."):
                continue
            full = os.path.join(dirpath, fname)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            try:
                safe_relative_path(rel, what="file path")
            except UnsafePathError as exc:
                raise PackError(str(exc)) from exc
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                target = os.path.realpath(full)
                if os.path.commonpath([root, target]) != root:
                    raise PackError(f"{full}: symlink leaves the checkpoint directory (→ {target})")
                st = os.stat(full)
                full = target
            if not stat.S_ISREG(st.st_mode):
                raise PackError(f"{full}: not a regular file (device, FIFO or socket); refusing to pack it")
            if include and not _matches(rel, include):
                continue
            if exclude and _matches(rel, exclude):
                continue
            out.append((rel, full))
    out.sort(key=lambda x: x[0].split("/"))
    if not out:
        raise PackError(f"{root}: no files to pack (empty checkpoint, or everything excluded)")
    return out


# ------------------------------------------------------------------------- re-sharding
def _shard_name(stem: str, i: int, n: int) -> str:
    return f"{stem}-{i:05d}-of-{n:05d}.safetensors"


def _copy_range(src: BinaryIO, dst: BinaryIO, offset: int, length: int) -> None:
    src_fd, dst_fd = src.fileno(), dst.fileno()
    remaining = length
    pos = offset
    try:
        while remaining > 0:
            n = os.copy_file_range(src_fd, dst_fd, remaining, pos)
            if n == 0:
                raise PackError(f"unexpected end of file while re-sharding at offset {pos}")
            pos += n
            remaining -= n
        return
    except OSError:
        pass
    buf = bytearray(8 * 1024 * 1024)
    while remaining > 0:
        n = os.preadv(src_fd, [memoryview(buf)[: min(len(buf), remaining)]], pos)
        if n <= 0:
            raise PackError(f"unexpected end of file while re-sharding at offset {pos}")
        dst.write(memoryview(buf)[:n])
        pos += n
        remaining -= n


def reshard(
    files: list[tuple[str, str]], headers: dict[str, SafetensorsHeader], max_size: int, staging: str
) -> list[tuple[str, str]]:
    """Split safetensors files larger than ``max_size`` at tensor boundaries.

    Writes valid safetensors shards (same tensor bytes, same ``__metadata__``) and a regenerated
    ``model.safetensors.index.json`` mapping every tensor to its new file. A single tensor larger
    than ``max_size`` gets a shard of its own (tensors are never split).
    """
    oversized = [rel for rel, _ in files if rel in headers and headers[rel].file_size > max_size]
    if not oversized:
        return files
    result: list[tuple[str, str]] = []
    weight_map: dict[str, str] = {}
    total_size = 0
    index_rel: str | None = None
    for rel, full in files:
        if rel.endswith(".safetensors.index.json"):
            index_rel = rel
            continue
        hdr = headers.get(rel)
        if hdr is None:
            result.append((rel, full))
            continue
        total_size += sum(t.nbytes for t in hdr.tensors)
        if rel not in oversized:
            result.append((rel, full))
            for t in hdr.tensors:
                weight_map[t.name] = os.path.basename(rel)
            continue
        # A shard's size is its data plus its header; bound each header entry generously
        # (name + dtype/shape/offsets JSON) so every shard stays under max_size.
        meta_bytes = 64 + len(json.dumps(hdr.metadata or {}))
        groups: list[list[Any]] = [[]]
        size = meta_bytes
        for t in hdr.tensors:
            entry = t.nbytes + len(t.name.encode()) + 96 + 24 * len(t.shape)
            if groups[-1] and size + entry > max_size:
                groups.append([])
                size = meta_bytes
            groups[-1].append(t)
            size += entry
        directory = os.path.dirname(rel)
        stem = os.path.basename(rel)[: -len(".safetensors")]
        with open(full, "rb") as src:
            for i, group in enumerate(groups, 1):
                shard_rel = (directory + "/" if directory else "") + _shard_name(stem, i, len(groups))
                prefix, _ = build_header(
                    ((t.name, t.dtype, t.shape, t.nbytes) for t in group), hdr.metadata or None
                )
                out_path = os.path.join(staging, shard_rel)
                os.makedirs(os.path.dirname(out_path), exist_ok=True)
                with open(out_path, "wb") as dst:
                    dst.write(prefix)
                    dst.flush()
                    # tensors are contiguous in offset order, so each group is one range
                    first, last = group[0], group[-1]
                    _copy_range(src, dst, hdr.data_start + first.begin, last.end - first.begin)
                for t in group:
                    weight_map[t.name] = os.path.basename(shard_rel)
                result.append((shard_rel, out_path))
    index_doc = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    index_rel = index_rel or "model.safetensors.index.json"
    index_path = os.path.join(staging, index_rel)
    os.makedirs(os.path.dirname(index_path), exist_ok=True)
    with open(index_path, "w") as f:
        json.dump(index_doc, f, indent=2, sort_keys=True)
        f.write("\n")
    result.append((index_rel, index_path))
    result.sort(key=lambda x: x[0].split("/"))
    return result


# ------------------------------------------------------------------------- config inference
def format_param_size(n: int) -> str:
    for div, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= div:
            value = n / div
            text = f"{value:.1f}".rstrip("0").rstrip(".")
            return f"{text}{unit}"
    return str(n)


def _read_json(path: str, limit: int = 16 * 1024 * 1024) -> Any:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise PackError(f"{path}: larger than {limit} bytes; refusing to parse")
    try:
        return json.loads(data)
    except ValueError as exc:
        raise PackError(f"{path}: invalid JSON: {exc}") from exc


def infer_config(
    files: list[PackedFile],
    headers: dict[str, SafetensorsHeader],
    hf_config: dict[str, Any] | None,
    opts: PackOptions,
    default_name: str,
) -> ModelSpecConfig:
    arch = fam = precision = quant = None
    transformer: dict[str, Any] = {}
    if hf_config:
        archs = hf_config.get("architectures")
        if isinstance(archs, list) and archs and isinstance(archs[0], str):
            arch = archs[0]
        if isinstance(hf_config.get("model_type"), str):
            fam = hf_config["model_type"]
        dtype = hf_config.get("torch_dtype") or hf_config.get("dtype")
        if isinstance(dtype, str):
            precision = dtype
        qc = hf_config.get("quantization_config")
        if isinstance(qc, dict):
            method = qc.get("quant_method") or qc.get("quantization_method")
            quant = str(method) if method else "unknown"
            if qc.get("bits"):
                quant += f"-{qc['bits']}bit"
        for src, dst in (
            ("num_hidden_layers", "numLayers"),
            ("num_attention_heads", "numAttentionHeads"),
            ("num_key_value_heads", "numKVHeads"),
            ("hidden_size", "hiddenSize"),
            ("intermediate_size", "intermediateSize"),
        ):
            v = hf_config.get(src)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
                transformer[dst] = v
        if "numAttentionHeads" in transformer:
            kv = transformer.get("numKVHeads", transformer["numAttentionHeads"])
            if hf_config.get("kv_lora_rank"):
                transformer["attentionType"] = "mla"
            else:
                transformer["attentionType"] = "gqa" if kv < transformer["numAttentionHeads"] else "mha"
        if transformer:
            moe = any(hf_config.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts"))
            transformer["mlpType"] = "moe" if moe else "dense"
    params = sum(h.param_count for h in headers.values())
    if precision is None and headers:
        by_dtype: dict[str, int] = {}
        for h in headers.values():
            for t in h.tensors:
                by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.nbytes
        top = max(by_dtype.items(), key=lambda kv: (kv[1], kv[0]))[0] if by_dtype else None
        precision = PRECISION_NAMES.get(top, top.lower()) if top else None
    weight_formats = {
        ("safetensors" if f.relpath.endswith(".safetensors") else "other")
        for f in files
        if f.kind == "weight"
    }
    fmt = "safetensors" if weight_formats == {"safetensors"} else None
    descriptor = ModelDescriptor(
        name=opts.name or default_name,
        version=opts.version,
        family=opts.family or fam,
        vendor=opts.vendor,
        description=opts.description,
        licenses=list(opts.licenses) or None,
        createdAt=opts.created,
    )
    config = ModelConfig(
        architecture=opts.architecture or arch,
        format=fmt,
        paramSize=opts.param_size or (format_param_size(params) if params else None),
        precision=opts.precision or precision,
        quantization=opts.quantization or quant,
        transformerConfig=transformer or None,
    )
    return ModelSpecConfig(descriptor, config, ModelFS(diffIds=[str(f.digest) for f in files]))


# ------------------------------------------------------------------------- build
def describe_model(
    packed: list[PackedFile],
    headers: dict[str, SafetensorsHeader],
    hf_config: dict[str, Any] | None,
    opts: PackOptions,
    default_name: str,
) -> tuple[ModelSpecConfig, bytes, Manifest]:
    """Config and manifest for hashed files, wherever they live (local directory or S3)."""
    spec = infer_config(packed, headers, hf_config, opts, default_name)
    config_bytes = spec.to_bytes()
    config_desc = Descriptor(MEDIA_TYPE_CONFIG, Digest.from_bytes(config_bytes), len(config_bytes))
    layers = []
    for f in packed:
        annotations = {
            ANNOTATION_FILEPATH: f.relpath,
            ANNOTATION_TITLE: f.relpath,
            ANNOTATION_FILE_METADATA: FileMetadata(name=f.relpath, size=f.size).to_json(),
        }
        if f.untested:
            annotations[ANNOTATION_FILE_MEDIATYPE_UNTESTED] = "true"
        layers.append(Descriptor(layer_media_type(f.kind, "raw"), f.digest, f.size, annotations=annotations))
    manifest_annotations = {ANNOTATION_CREATED: opts.created} if opts.created else None
    manifest = Manifest.build(
        config_desc, layers, artifact_type=ARTIFACT_TYPE_MODEL, annotations=manifest_annotations
    )
    return spec, config_bytes, manifest


_NAME_RE = re.compile(r"[^A-Za-z0-9._-]+")


def build_artifact(
    checkpoint_dir: str, opts: PackOptions | None = None, *, staging_parent: str | None = None
) -> PackedArtifact:
    """Validate, (re-shard,) hash and describe a checkpoint. Nothing is written except shards."""
    opts = opts or PackOptions()
    if opts.other_files not in OTHER_FILE_CHOICES:
        raise PackError(f"--other-files must be one of {', '.join(OTHER_FILE_CHOICES)}")
    root = os.path.realpath(checkpoint_dir)
    files = discover_files(root, opts.include, opts.exclude)
    headers: dict[str, SafetensorsHeader] = {}
    for rel, full in files:
        if rel.endswith(".safetensors"):
            headers[rel] = read_header(full)
    staging: str | None = None
    if opts.max_file_size:
        if opts.max_file_size < 1024 * 1024:
            raise PackError("--max-file-size must be at least 1 MiB")
        if any(h.file_size > opts.max_file_size for h in headers.values()):
            staging = tempfile.mkdtemp(prefix=".modelpack-reshard-", dir=staging_parent)
            files = reshard(files, headers, opts.max_file_size, staging)
            headers = {rel: read_header(full) for rel, full in files if rel.endswith(".safetensors")}
    try:
        kinds: list[tuple[str, str, str, bool]] = []
        for rel, full in files:
            kind, untested = classify(rel, opts.other_files)
            if kind is None:
                raise PackError(f"{full}: not a recognised model file and --other-files=refuse")
            kinds.append((rel, full, kind, untested))
        total = sum(os.path.getsize(full) for _, full, _, _ in kinds)
        jobs = opts.jobs or (os.cpu_count() or 2)
        with Progress(total, "hash", opts.progress) as prog:

            def hash_one(item: tuple[str, str, str, bool]) -> PackedFile:
                rel, full, kind, untested = item
                digest, size = sha256_file(full)
                prog.update(size)
                return PackedFile(rel, full, kind, untested, size, digest)

            # Largest files first so the two cores finish together.
            order = sorted(range(len(kinds)), key=lambda i: -os.path.getsize(kinds[i][1]))
            with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(kinds)))) as pool:
                hashed = dict(zip(order, pool.map(hash_one, [kinds[i] for i in order]), strict=True))
        packed = [hashed[i] for i in range(len(kinds))]
        hf_config = None
        for f in packed:
            if f.relpath == "config.json":
                doc = _read_json(f.path)
                hf_config = doc if isinstance(doc, dict) else None
        default_name = _NAME_RE.sub("-", os.path.basename(root)) or "model"
        spec, config_bytes, manifest = describe_model(packed, headers, hf_config, opts, default_name)
        return PackedArtifact(manifest, spec, config_bytes, packed, staging_dir=staging, name=f"dir:{root}")
    except BaseException:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def checkpoint_headers(artifact: PackedArtifact) -> dict[str, SafetensorsHeader]:
    return {f.relpath: read_header(f.path) for f in artifact.files if f.relpath.endswith(".safetensors")}


__all__ = [
    "PackOptions",
    "PackedArtifact",
    "PackedFile",
    "SafetensorsError",
    "build_artifact",
    "classify",
    "discover_files",
    "format_param_size",
    "reshard",
]
