"""Streamed weights and ``--model``'s config/tokenizer files must come from the same artifact.

When vLLM streams weights from a registry, ``--model`` is only a directory of small files
(config.json, tokenizer…) materialised beforehand (``modelpack pull REF DIR --exclude
'*.safetensors'``). A directory left over from another model or version would build a model that
the weights do not fit, or one that fits but tokenizes differently; so before any weight is read,
each small file of the pinned manifest that is present in the directory is compared by size and
sha256, and config.json must be there.
"""

from __future__ import annotations

import os

from modelpack.errors import ServingConfigError, UnsafePathError
from modelpack.mediatypes.annotations import layer_filepath
from modelpack.oci.descriptor import Manifest
from modelpack.oci.digest import sha256_file

# config and tokenizer files are small; a larger non-weight file is not this check's business
MAX_CHECKED_BYTES = 256 * 1024 * 1024


def check_model_dir(model_dir: str, manifest: Manifest, *, where: str) -> list[str]:
    """Relative paths checked; raises ``ServingConfigError`` naming the first file that differs."""
    checked = []
    saw_config = False
    for layer in manifest.layers:
        try:
            rel = layer_filepath(layer.annotations)
        except UnsafePathError:
            continue  # the loader refuses such a manifest with its own error
        if not rel or rel.endswith(".safetensors") or layer.size > MAX_CHECKED_BYTES:
            continue
        path = os.path.join(model_dir, *rel.split("/"))
        if not os.path.isfile(path):
            if rel == "config.json":
                break
            continue
        digest, size = sha256_file(path)
        if size != layer.size or digest != layer.digest:
            raise ServingConfigError(
                f"{path}: is not {where}'s {rel} (has {digest}, {size} bytes; the manifest says "
                f"{layer.digest}, {layer.size} bytes); materialise it again with "
                f"'modelpack pull {where} {model_dir} --exclude \"*.safetensors\"'"
            )
        saw_config = saw_config or rel == "config.json"
        checked.append(rel)
    if not saw_config:
        raise ServingConfigError(
            f"{model_dir}: no config.json of {where} (the manifest has none, or the directory lacks it); "
            f"materialise it with 'modelpack pull {where} {model_dir} --exclude \"*.safetensors\"'"
        )
    return checked
