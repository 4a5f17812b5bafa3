"""Reference string → Target. The one place that knows which backing serves which scheme."""

from __future__ import annotations

from modelpack.errors import InvalidReferenceError
from modelpack.oci.reference import Reference, parse_reference
from modelpack.targets.base import ReadableTarget, Target
from modelpack.targets.options import TargetOptions


def open_target(
    ref: Reference | str, options: TargetOptions | None = None, *, for_write: bool = False
) -> Target:
    """Open the target that holds ``ref`` (registry repository, layout directory, S3 layout)."""
    ref = parse_reference(ref) if isinstance(ref, str) else ref
    options = options or TargetOptions.from_environ()
    if ref.scheme == "oci":
        from modelpack.targets.layout import OCILayoutTarget

        return OCILayoutTarget(ref.location, create=for_write and options.create, link=options.link)
    if ref.scheme == "registry":
        from modelpack.targets.registry.target import RegistryTarget

        return RegistryTarget.from_reference(ref, options, for_write=for_write)
    if ref.scheme == "s3":
        from modelpack.targets.s3.target import S3Target

        return S3Target.from_reference(ref, options)
    raise InvalidReferenceError(f"no target for scheme {ref.scheme!r}")


def open_readable(ref: Reference | str, options: TargetOptions | None = None) -> ReadableTarget:
    return open_target(ref, options, for_write=False)


__all__ = ["TargetOptions", "open_readable", "open_target"]
