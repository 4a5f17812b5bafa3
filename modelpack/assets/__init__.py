"""Runtime assets: compile caches shipped as fingerprinted, signed referrers of the model.

After the weights land, a replica still spends its start compiling (Inductor, Triton, vLLM's
torch.compile). The first replica's cache can serve the rest, but only where it is valid: the
same weights, dtype, quantization, TP layout, device architecture and software. So a cache is
pushed as an OCI referrer of the model manifest recording the environment fingerprint it was
built under (``push_asset``), and a start pulls only an exact match, verified and signed under the
model's trust policy, or proceeds cold (``pull_asset``, ``fetch_before_compile`` + ``compile_stage``
for engines). See docs/assets.md.
"""

from modelpack.assets.environment import fingerprint_from_prepared, normalize_dtype, running_fingerprint
from modelpack.assets.fingerprint import (
    ASSET_FORMAT_VERSION,
    EnvironmentFingerprint,
    describe,
    differences,
)
from modelpack.assets.format import ARTIFACT_TYPE_RUNTIME_ASSET, MEDIA_TYPE_ASSET_CONFIG, AssetRecord
from modelpack.assets.kinds import AssetKind, get_kind, kind_names, register_kind
from modelpack.assets.pull import AssetPullResult, pull_asset, pull_asset_from
from modelpack.assets.push import AssetPushResult, push_asset
from modelpack.assets.startup import compile_stage, fetch_before_compile
from modelpack.assets.stored import StoredAsset, list_assets

__all__ = [
    "ARTIFACT_TYPE_RUNTIME_ASSET",
    "ASSET_FORMAT_VERSION",
    "MEDIA_TYPE_ASSET_CONFIG",
    "AssetKind",
    "AssetPullResult",
    "AssetPushResult",
    "AssetRecord",
    "EnvironmentFingerprint",
    "StoredAsset",
    "compile_stage",
    "describe",
    "differences",
    "fetch_before_compile",
    "fingerprint_from_prepared",
    "get_kind",
    "kind_names",
    "list_assets",
    "normalize_dtype",
    "pull_asset",
    "pull_asset_from",
    "push_asset",
    "register_kind",
    "running_fingerprint",
]
