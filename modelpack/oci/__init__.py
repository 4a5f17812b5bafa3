"""The OCI vocabulary: digests, descriptors, manifests and indexes, references.

Pure data and parsing with no I/O; everything else in modelpack speaks in these types
(go-containerregistry's ``pkg/name`` and ``pkg/v1``).
"""
