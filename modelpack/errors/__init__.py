"""Typed errors, one hierarchy: each carries the reference, digest, file or status a person needs to act.

The classes live in one module per layer of the delivery chain (base, targets, transfer, trust,
node, loading, serving); every name is re-exported here, so `from modelpack.errors import X` is the
one import callers use and the split is invisible to them.
"""

from __future__ import annotations

from modelpack.errors.adapters import (
    AdapterBaseMismatchError as AdapterBaseMismatchError,
)
from modelpack.errors.adapters import (
    AdapterError as AdapterError,
)
from modelpack.errors.adapters import (
    AdapterSubjectError as AdapterSubjectError,
)
from modelpack.errors.adapters import (
    AdapterUntrustedError as AdapterUntrustedError,
)
from modelpack.errors.base import (
    ConfigError as ConfigError,
)
from modelpack.errors.base import (
    DigestMismatchError as DigestMismatchError,
)
from modelpack.errors.base import (
    DocumentError as DocumentError,
)
from modelpack.errors.base import (
    FileSelectionError as FileSelectionError,
)
from modelpack.errors.base import (
    HFRevisionNotFoundError as HFRevisionNotFoundError,
)
from modelpack.errors.base import (
    HFSourceError as HFSourceError,
)
from modelpack.errors.base import (
    InvalidDigestError as InvalidDigestError,
)
from modelpack.errors.base import (
    InvalidReferenceError as InvalidReferenceError,
)
from modelpack.errors.base import (
    ManifestError as ManifestError,
)
from modelpack.errors.base import (
    MissingRankError as MissingRankError,
)
from modelpack.errors.base import (
    ModelfileError as ModelfileError,
)
from modelpack.errors.base import (
    ModelpackError as ModelpackError,
)
from modelpack.errors.base import (
    NotFoundError as NotFoundError,
)
from modelpack.errors.base import (
    PackError as PackError,
)
from modelpack.errors.base import (
    SafetensorsError as SafetensorsError,
)
from modelpack.errors.base import (
    SettingsError as SettingsError,
)
from modelpack.errors.base import (
    ShardedStateError as ShardedStateError,
)
from modelpack.errors.base import (
    SizeMismatchError as SizeMismatchError,
)
from modelpack.errors.base import (
    UnsafePathError as UnsafePathError,
)
from modelpack.errors.base import (
    VariantIndexError as VariantIndexError,
)
from modelpack.errors.base import (
    VariantSelectionError as VariantSelectionError,
)
from modelpack.errors.loading import (
    CacheFillStalledError as CacheFillStalledError,
)
from modelpack.errors.loading import (
    ExpectedDigestError as ExpectedDigestError,
)
from modelpack.errors.loading import (
    FingerprintFileError as FingerprintFileError,
)
from modelpack.errors.loading import (
    FingerprintMismatchError as FingerprintMismatchError,
)
from modelpack.errors.loading import (
    GroupStalledError as GroupStalledError,
)
from modelpack.errors.loading import (
    HeaderMismatchError as HeaderMismatchError,
)
from modelpack.errors.loading import (
    LayoutMismatchError as LayoutMismatchError,
)
from modelpack.errors.loading import (
    LoaderError as LoaderError,
)
from modelpack.errors.loading import (
    PlanError as PlanError,
)
from modelpack.errors.loading import (
    SourceError as SourceError,
)
from modelpack.errors.loading import (
    TimelineError as TimelineError,
)
from modelpack.errors.loading import (
    TpSizeMismatchError as TpSizeMismatchError,
)
from modelpack.errors.loading import (
    TruncatedSourceError as TruncatedSourceError,
)
from modelpack.errors.loading import (
    UnpinnedReferenceError as UnpinnedReferenceError,
)
from modelpack.errors.loading import (
    UnsignedSourceError as UnsignedSourceError,
)
from modelpack.errors.loading import (
    UnsupportedDtypeError as UnsupportedDtypeError,
)
from modelpack.errors.loading import (
    UnverifiedSourceError as UnverifiedSourceError,
)
from modelpack.errors.node import (
    CacheError as CacheError,
)
from modelpack.errors.node import (
    CacheServeError as CacheServeError,
)
from modelpack.errors.node import (
    EventLogError as EventLogError,
)
from modelpack.errors.node import (
    InsufficientSpaceError as InsufficientSpaceError,
)
from modelpack.errors.node import (
    K8sError as K8sError,
)
from modelpack.errors.node import (
    LockTimeoutError as LockTimeoutError,
)
from modelpack.errors.node import (
    QuotaExceededError as QuotaExceededError,
)
from modelpack.errors.node import (
    SnapshotError as SnapshotError,
)
from modelpack.errors.node import (
    SnapshotInUseError as SnapshotInUseError,
)
from modelpack.errors.node import (
    StorageInitializerError as StorageInitializerError,
)
from modelpack.errors.node import (
    StoreError as StoreError,
)
from modelpack.errors.serving import (
    AssetError as AssetError,
)
from modelpack.errors.serving import (
    AssetFingerprintError as AssetFingerprintError,
)
from modelpack.errors.serving import (
    AssetKindError as AssetKindError,
)
from modelpack.errors.serving import (
    AssetRefused as AssetRefused,
)
from modelpack.errors.serving import (
    ReadinessError as ReadinessError,
)
from modelpack.errors.serving import (
    ServingConfigError as ServingConfigError,
)
from modelpack.errors.serving import (
    ServingError as ServingError,
)
from modelpack.errors.targets import (
    AuthenticationError as AuthenticationError,
)
from modelpack.errors.targets import (
    InsecureRegistryError as InsecureRegistryError,
)
from modelpack.errors.targets import (
    LayoutError as LayoutError,
)
from modelpack.errors.targets import (
    ListingCutError as ListingCutError,
)
from modelpack.errors.targets import (
    ManifestTooLargeError as ManifestTooLargeError,
)
from modelpack.errors.targets import (
    MirrorConfigError as MirrorConfigError,
)
from modelpack.errors.targets import (
    MirrorTooSlowError as MirrorTooSlowError,
)
from modelpack.errors.targets import (
    PermissionDeniedError as PermissionDeniedError,
)
from modelpack.errors.targets import (
    RangeListError as RangeListError,
)
from modelpack.errors.targets import (
    RegistryConnectionError as RegistryConnectionError,
)
from modelpack.errors.targets import (
    RegistryError as RegistryError,
)
from modelpack.errors.targets import (
    RegistryNotFoundError as RegistryNotFoundError,
)
from modelpack.errors.targets import (
    RegistryTLSError as RegistryTLSError,
)
from modelpack.errors.targets import (
    S3Error as S3Error,
)
from modelpack.errors.targets import (
    S3LayoutError as S3LayoutError,
)
from modelpack.errors.targets import (
    UploadError as UploadError,
)
from modelpack.errors.targets import (
    UploadSourceError as UploadSourceError,
)
from modelpack.errors.transfer import (
    DestinationConflictError as DestinationConflictError,
)
from modelpack.errors.transfer import (
    DiskFullError as DiskFullError,
)
from modelpack.errors.transfer import (
    ExpansionLimitError as ExpansionLimitError,
)
from modelpack.errors.transfer import (
    FileWriteError as FileWriteError,
)
from modelpack.errors.transfer import (
    LayerFormatError as LayerFormatError,
)
from modelpack.errors.transfer import (
    OutputClosedError as OutputClosedError,
)
from modelpack.errors.transfer import (
    PullError as PullError,
)
from modelpack.errors.transfer import (
    TransferCancelled as TransferCancelled,
)
from modelpack.errors.transfer import (
    TransferInterrupted as TransferInterrupted,
)
from modelpack.errors.transfer import (
    UnsafeTarError as UnsafeTarError,
)
from modelpack.errors.transfer import (
    UnsupportedLayerError as UnsupportedLayerError,
)
from modelpack.errors.trust import (
    BundleError as BundleError,
)
from modelpack.errors.trust import (
    ChunkDigestMismatch as ChunkDigestMismatch,
)
from modelpack.errors.trust import (
    ChunkTableError as ChunkTableError,
)
from modelpack.errors.trust import (
    DirectorySignatureError as DirectorySignatureError,
)
from modelpack.errors.trust import (
    KeyLoadError as KeyLoadError,
)
from modelpack.errors.trust import (
    KeyTextArgumentError as KeyTextArgumentError,
)
from modelpack.errors.trust import (
    PolicyError as PolicyError,
)
from modelpack.errors.trust import (
    RollbackRefused as RollbackRefused,
)
from modelpack.errors.trust import (
    SignatureRefused as SignatureRefused,
)
from modelpack.errors.trust import (
    SigningError as SigningError,
)
from modelpack.errors.trust import (
    TagHistoryError as TagHistoryError,
)
