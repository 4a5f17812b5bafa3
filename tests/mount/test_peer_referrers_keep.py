"""What the node cache keeps of a model's signature referrers, and what it lists.

Library level over a real OCI layout signed twice: by the key this node trusts (manifest
signature, directory signature, chunk table) and by another key. Only what verified under the
node's own keys is kept (a peer passes on what it verified, nothing else); the kept referrers
go when the model's manifest goes; the listing for a digest without any is an empty index.
"""

from __future__ import annotations

import json
from pathlib import Path

from modelpack.mount.kept_referrers import RecordingTarget, keep, kept_referrers, referrers_index
from modelpack.mount.store import Store
from modelpack.signing import sign_artifact, verify_artifact
from modelpack.signing.keys import generate_key
from modelpack.signing.referrers import ARTIFACT_TYPE_CHUNK_DIGESTS, ARTIFACT_TYPE_SIGNATURE

from tests.signing_helpers import pack_layout


def test_only_referrers_signed_by_a_trusted_key_are_kept_listed_and_dropped_with_the_model(
    checkpoint: Path, tmp_path: Path
) -> None:
    lay = pack_layout(checkpoint, tmp_path / "layout")
    trusted, other = generate_key(), generate_key()
    sign_artifact(lay.target, lay.desc, trusted)
    sign_artifact(lay.target, lay.desc, other)
    digest = str(lay.desc.digest)
    all_listed = lay.target.referrers(lay.desc)
    assert len(all_listed) == 6  # three per signer

    store = Store(str(tmp_path / "cache"))
    store.add_manifest(lay.manifest.raw, lay.desc.media_type)
    rec = RecordingTarget(lay.target)
    result = verify_artifact(rec, lay.ref, lay.desc, [trusted.public])
    assert result.chunk_table == "verified" and result.directory_signature == "verified"
    kept = keep(store, digest, rec, [trusted.public])
    assert len(kept) == 3

    listed = kept_referrers(store, digest)
    assert sorted(str(d.digest) for d in listed) == sorted(kept)
    assert {d.artifact_type for d in listed} >= {ARTIFACT_TYPE_SIGNATURE, ARTIFACT_TYPE_CHUNK_DIGESTS}
    # the kept manifests and bundles are committed blobs, byte for byte the layout's
    for d in listed:
        assert (
            store.read_small(d.digest)
            == (tmp_path / "layout" / "blobs" / "sha256" / d.digest.hex).read_bytes()
        )
    only = json.loads(referrers_index(store, digest, ARTIFACT_TYPE_CHUNK_DIGESTS))
    assert [m["artifactType"] for m in only["manifests"]] == [ARTIFACT_TYPE_CHUNK_DIGESTS]
    assert "io.modelpack.cache.subject" not in json.dumps(only)  # the cache's own note stays home
    assert json.loads(referrers_index(store, "sha256:" + "0" * 64))["manifests"] == []

    # the same reads kept under the other key: the other signer's three, none of the trusted one's
    theirs = keep(Store(str(tmp_path / "cache-2")), digest, rec, [other.public])
    assert len(theirs) == 3 and not set(theirs) & set(kept)

    store.remove_manifest(digest)
    assert kept_referrers(store, digest) == []
    assert store.manifest_digests() == []  # nothing left keeps the referrer blobs from GC
