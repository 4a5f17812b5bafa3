"""Every place an artifact lives, behind one ``Target`` protocol (oras-go's ``Target``).

``base`` is the protocol; ``options`` the connection settings; ``opener`` maps a reference to
its backing; the backings are ``layout`` (an OCI image layout directory), ``registry`` (OCI
distribution) and ``s3`` (an OCI layout in a bucket). ``fetch`` reads manifests and configs
verified from any of them.
"""

from __future__ import annotations

from modelpack.targets.base import BlobSource, ReadableTarget, Target
from modelpack.targets.opener import open_readable, open_target
from modelpack.targets.options import TargetOptions

__all__ = ["BlobSource", "ReadableTarget", "Target", "TargetOptions", "open_readable", "open_target"]
