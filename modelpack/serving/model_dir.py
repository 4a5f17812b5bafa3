"""``--model`` must hold exactly the pinned artifact's files, checked before vLLM reads any of them.

vLLM reads ``--model`` long before a loader runs: ``config.json`` (and, with
``trust_remote_code``, imports the ``modeling_*.py`` its ``auto_map`` names), the tokenizer files
with their chat template, ``generation_config.json`` for default sampling parameters. All of it
decides what the server does as much as the weights do. So the ``modelpack`` load format checks
the whole directory *before vLLM reads its config* (``vllm_plugin`` runs ``check_before_vllm_reads``
at the start of vLLM's ``EngineArgs.create_engine_config`` / ``create_model_config``), and again
when the weights load:

- every entry is walked without following links; a symlink or a special file is refused;
- every file must be one the pinned artifact lists — the manifest's file layers when streaming
  (``source``), the snapshot's ready marker for a node-cache snapshot — and a file nothing lists
  is refused, unless ``allow_extra_files`` is set;
- each listed file present is compared by size and sha256 (weights excepted: the loader verifies
  those; files over 256 MiB by size only), and ``config.json`` must be there;
- a ``--tokenizer`` or ``--hf-config-path`` other than ``--model`` is refused: they come from the
  artifact.

An image volume (``trust: runtime``) is read-only and its digest was verified by the container
runtime, so it is not walked here.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from modelpack.errors import ModelpackError, ServingConfigError, UnsafePathError
from modelpack.events import EventLog
from modelpack.mediatypes.annotations import layer_filepath
from modelpack.oci.descriptor import Manifest
from modelpack.oci.digest import sha256_file
from modelpack.serving.settings import ServingSettings

# config and tokenizer files are small; a larger listed file is compared by size
MAX_CHECKED_BYTES = 256 * 1024 * 1024
MAX_WALKED_ENTRIES = 100_000


@dataclass(frozen=True)
class ListedFile:
    """A file the pinned artifact lists: its path in the directory, sha256 and size."""

    path: str
    digest: str
    size: int


def manifest_files(manifest: Manifest) -> list[ListedFile]:
    """The files a manifest's file layers place (tar layers place none this check can name)."""
    out = []
    for layer in manifest.layers:
        try:
            rel = layer_filepath(layer.annotations)
        except UnsafePathError:
            continue  # the loader refuses such a manifest with its own error
        if rel:
            out.append(ListedFile(rel, str(layer.digest), layer.size))
    return out


def _walk(model_dir: str) -> list[str]:
    """Relative paths of the regular files under ``model_dir``; refuses links and special files."""
    out: list[str] = []
    stack = [""]
    seen = 0
    while stack:
        rel_dir = stack.pop()
        directory = os.path.join(model_dir, rel_dir) if rel_dir else model_dir
        if not rel_dir and os.path.islink(directory):
            directory = os.path.realpath(directory)  # --model itself may be a link; nothing inside
        try:
            with os.scandir(directory) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            raise ServingConfigError(
                f"{directory}: cannot be read ({exc.strerror or exc}); --model of the 'modelpack' "
                "load format is a local directory"
            ) from exc
        for entry in entries:
            seen += 1
            if seen > MAX_WALKED_ENTRIES:
                raise ServingConfigError(f"{model_dir}: more than {MAX_WALKED_ENTRIES} entries")
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                stack.append(rel)
            elif stat.S_ISREG(st.st_mode):
                out.append(rel)
            else:
                what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                raise ServingConfigError(
                    f"{entry.path}: {what} in --model; vLLM would read it, and nothing ties it to "
                    "the pinned artifact"
                )
    return sorted(out)


def check_files(
    model_dir: str,
    listed: list[ListedFile],
    *,
    where: str,
    allow_extra: bool = False,
    fix: str | None = None,
) -> list[str]:
    """Check ``model_dir`` against ``listed`` (see the module docstring); returns the relative
    paths compared by digest. Raises ``ServingConfigError`` naming the first file that is wrong;
    ``fix`` says how to get a good directory (default: the streamed case's ``modelpack pull``)."""
    by_path = {f.path: f for f in listed}
    present = _walk(model_dir)
    fix = fix or (
        f"materialise it again into an empty directory with 'modelpack pull {where} DIR "
        '--exclude "*.safetensors"\''
    )
    extra = [rel for rel in present if rel not in by_path]
    if extra and not allow_extra:
        shown = ", ".join(extra[:10]) + (f" … ({len(extra)} in all)" if len(extra) > 10 else "")
        raise ServingConfigError(
            f"{model_dir}: {shown}: not in {where}, and vLLM reads what --model holds (configs, "
            f"chat templates, remote code); remove them, {fix}, or set allow_extra_files if they "
            "are meant to be there"
        )
    if "config.json" not in by_path or "config.json" not in present:
        raise ServingConfigError(
            f"{model_dir}: no config.json of {where} (the artifact has none, or the directory lacks it); {fix}"
        )
    checked = []
    for rel in present:
        want = by_path.get(rel)
        if want is None or rel.endswith(".safetensors"):
            continue  # an allowed extra; weights are the loader's to verify
        path = os.path.join(model_dir, *rel.split("/"))
        if want.size > MAX_CHECKED_BYTES:
            size = os.lstat(path).st_size
            digest = "(not hashed)"
        else:
            d, size = sha256_file(path)
            digest = str(d)
        if size != want.size or (digest != "(not hashed)" and digest != want.digest):
            raise ServingConfigError(
                f"{path}: is not {where}'s {rel} (has {digest}, {size} bytes; the artifact says "
                f"{want.digest}, {want.size} bytes); {fix}"
            )
        checked.append(rel)
    return checked


def check_model_dir(
    model_dir: str, manifest: Manifest, *, where: str, allow_extra: bool = False
) -> list[str]:
    """``check_files`` against a manifest's file layers (the streamed case)."""
    return check_files(model_dir, manifest_files(manifest), where=where, allow_extra=allow_extra)


def _snapshot_files(model_dir: str, settings: ServingSettings) -> tuple[str, list[ListedFile], str]:
    """(where, files) of the node-cache snapshot ``model_dir``: its ready marker's files, read
    only when the cache owner wrote it; the snapshot must be the pinned digest."""
    from modelpack.errors import ExpectedDigestError, UnverifiedSourceError
    from modelpack.loader import snapshot_binding
    from modelpack.mount.snapshots import Snapshots
    from modelpack.mount.store import Store

    real = os.path.realpath(model_dir)
    found = snapshot_binding.claim(real)
    if found is None:
        raise UnverifiedSourceError(
            f"{real}: not a node-cache snapshot; --model of the 'modelpack' load format is the path "
            "printed by 'modelpack pull --cache DIR REF', or a config directory with a pinned 'source'"
        )
    pinned = settings.pinned_digest
    if pinned and pinned != found.digest:
        raise ExpectedDigestError(pinned, found.digest, source=real)
    snapshot_binding.require_store(found)
    info = Snapshots(Store(found.root, create=False)).ready(found.digest)
    if info is None:
        raise UnverifiedSourceError(
            f"{real}: not ready in its cache (no ready marker the cache owner wrote and nobody else "
            f"can write); pull it again with 'modelpack pull --cache {found.root} REF@{found.digest}'"
        )
    fix = (
        f"repair the snapshot with 'modelpack cache verify --cache {found.root}' and pull it again "
        f"('modelpack pull --cache {found.root} REF@{found.digest}')"
    )
    return f"snapshot {found.digest}", [ListedFile(f.path, f.digest, f.size) for f in info.files], fix


def check_snapshot_dir(model_dir: str, settings: ServingSettings) -> list[str]:
    """``check_files`` of a node-cache snapshot against its ready marker."""
    where, listed, fix = _snapshot_files(model_dir, settings)
    return check_files(model_dir, listed, where=where, allow_extra=settings.allow_extra_files, fix=fix)


def _source_files(settings: ServingSettings) -> tuple[str, list[ListedFile]]:
    """(where, files) of the pinned manifest of ``source``, its policy checked first."""
    from modelpack.oci.reference import parse_reference
    from modelpack.targets.fetch import fetch_manifest
    from modelpack.targets.opener import open_readable

    assert settings.source is not None
    ref = parse_reference(settings.source)
    pinned = settings.pinned_digest
    assert pinned is not None
    target = open_readable(ref, settings.target_options())
    policy = None
    if settings.policy:
        from modelpack.signing.policy import TrustPolicy

        policy = TrustPolicy.load(settings.policy)
    # the trusted-resolve step; a pin naming an index of variants gives the entry for this node
    # (vLLM's TP size is not known yet here: $MODELPACK_TP_SIZE, else 1; the loader checks again
    # with vLLM's own)
    from modelpack.mount.resolve import resolve_trusted

    trusted = resolve_trusted(
        ref.with_digest(pinned), policy=policy, selector=settings.variant_selector(), target=target
    )
    pinned = trusted.digest
    manifest, _ = fetch_manifest(target, pinned)
    return str(ref.with_digest(pinned)), manifest_files(manifest)


def check_before_vllm_reads(
    model_dir: str,
    extra_config: Mapping[str, Any] | str | None,
    *,
    tokenizer: str | None = None,
    hf_config_path: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """The check vLLM's config hook runs for the ``modelpack`` load format (module docstring).
    Writes ``serving.refused`` to the start's event log before raising."""
    env = os.environ if environ is None else environ
    if isinstance(extra_config, str):
        try:
            extra_config = json.loads(extra_config) if extra_config.strip() else {}
        except ValueError as exc:
            raise ServingConfigError(f"--model-loader-extra-config: not JSON: {exc}") from exc
    if extra_config is not None and not isinstance(extra_config, Mapping):
        raise ServingConfigError("--model-loader-extra-config must be a JSON object")
    settings = ServingSettings.from_extra_config(extra_config, env)
    if settings.trust == "runtime":
        return []  # an image volume: read-only, its digest verified by the container runtime
    try:
        if tokenizer and os.path.realpath(tokenizer) != os.path.realpath(model_dir):
            raise ServingConfigError(
                f"--tokenizer {tokenizer}: the 'modelpack' load format serves the tokenizer of the "
                f"pinned artifact in --model ({model_dir}); drop --tokenizer"
            )
        if hf_config_path and os.path.realpath(hf_config_path) != os.path.realpath(model_dir):
            raise ServingConfigError(
                f"--hf-config-path {hf_config_path}: the 'modelpack' load format builds the model "
                f"from the pinned artifact's config.json in --model ({model_dir}); drop it"
            )
        if not settings.source:
            return check_snapshot_dir(model_dir, settings)
        where, listed = _source_files(settings)
        return check_files(model_dir, listed, where=where, allow_extra=settings.allow_extra_files)
    except ModelpackError as exc:
        if settings.events:
            EventLog(settings.events).emit(
                "serving.refused",
                start_id=settings.start_id,
                stage="config",
                model=model_dir,
                reference=settings.source,
                digest=settings.pinned_digest,
                reason=f"{type(exc).__name__}: {exc}"[:2000],
            )
        raise
