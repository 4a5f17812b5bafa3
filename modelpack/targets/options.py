"""Connection settings every command hands to whichever backing serves its reference.

Its own module so that backings (``s3``, ``registry``) can name it without importing
``opener``, which imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TargetOptions:
    """Connection settings shared by every command; backings read what applies to them."""

    plain_http: bool = False
    ca_file: str | None = None
    insecure_skip_verify: bool = False
    username: str | None = None
    password: str | None = None
    s3_endpoint: str | None = None
    s3_region: str | None = None
    create: bool = True
    link: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict)
