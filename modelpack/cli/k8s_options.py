"""Flags every ``k8s`` command shares: the images and the pull settings the objects carry.

The modelpack image is the user's (``--modelpack-image``, else ``MODELPACK_IMAGE``; no default):
a tag is accepted with a warning, a digest silently. The pull settings (``--mirror``,
``--plain-http``, ``--ca-configmap``, ``--retry-for``, the global ``--timeout``) become a
``PodPullSettings``; a setting the pod cannot be given as it was (a local ``--ca-file`` with no
ConfigMap, ``--hosts-dir``, ``-u``) is a usage error that says what to use instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from modelpack.cli.options import global_timeout

F = TypeVar("F", bound=Callable[..., Any])

SERVING_IMAGE_HELP = (
    "Serving container image (required; no default). With --vllm it must hold vLLM and "
    "modelpack-oci[vllm] (the 'modelpack' load format registers through its entry point): stock "
    "vllm/vllm-openai cannot run --load-format modelpack. Best pinned by digest."
)


def modelpack_image_option(*aliases: str) -> Any:
    """``--modelpack-image`` (and ``aliases``), default None: ``modelpack_image`` resolves it."""
    return click.option(
        "--modelpack-image",
        *aliases,
        "modelpack_image",
        default=None,
        metavar="IMAGE",
        help="The modelpack image the objects run (else MODELPACK_IMAGE; no default): build it with "
        "'make image', push it where the nodes pull, and pin it by digest (a tag is warned about).",
    )


def serving_image_option(f: F) -> F:
    return click.option("--image", required=True, metavar="IMAGE", help=SERVING_IMAGE_HELP)(f)


def served_model_name_option(f: F) -> F:
    return click.option(
        "--served-model-name",
        default=None,
        help="The model id vLLM serves (default: the reference's repository, e.g. team-a/llama, "
        "the same for every version).",
    )(f)


def ca_options(f: F) -> F:
    f = click.option(
        "--ca-key",
        default="ca.crt",
        show_default=True,
        help="Key of the CA bundle in --ca-configmap.",
    )(f)
    return click.option(
        "--ca-configmap",
        default=None,
        metavar="NAME",
        help="ConfigMap holding the registry's PEM CA bundle: mounted read-only into every container "
        "that pulls, named by MODELPACK_CA_FILE (kubectl create configmap NAME --from-file=ca.crt=PEM).",
    )(f)


def mirror_retry_options(f: F) -> F:
    """``--mirror``, ``--retry-for`` and ``--plain-http`` for a command without ``target_options``."""
    from modelpack.cli.options import DURATION

    f = click.option("--plain-http", is_flag=True, help="Speak plain HTTP to the registry (no TLS).")(f)
    f = click.option(
        "--retry-for", type=DURATION, default=None, help="Retry budget of every pull (30s, 2m; 0: never)."
    )(f)
    return click.option(
        "--mirror",
        "mirrors",
        multiple=True,
        metavar="URL",
        help="Mirror asked before the origin (repeatable).",
    )(f)


def modelpack_image(value: str | None) -> str:
    """``--modelpack-image``, else ``MODELPACK_IMAGE``; a usage error when neither is given."""
    from modelpack import settings

    image = value or settings.IMAGE.get()
    if not image:
        raise click.UsageError(
            "no modelpack image: pass --modelpack-image HOST/REPO@sha256:… or set MODELPACK_IMAGE "
            "(build it with 'make image' and push it where your nodes pull; there is no default)"
        )
    return _checked_image(image, "--modelpack-image")


def serving_image(value: str) -> str:
    """The serving image as given; a tag is warned about, a non-reference refused."""
    return _checked_image(value, "--image")


def _checked_image(image: str, flag: str) -> str:
    """``image`` if it is an image reference (a tag warned about on stderr), else a usage error."""
    from modelpack.errors import K8sError
    from modelpack.mount.k8s_settings import image_pin_warning

    try:
        warning = image_pin_warning(image, flag=flag)
    except K8sError as exc:
        raise click.BadParameter(str(exc), param_hint=flag) from None
    if warning:
        click.echo(warning, err=True)
    return image


def pod_pull_settings(kwargs: dict[str, Any], *, registry_secret: str | None) -> Any:
    """The pull settings of ``kwargs`` (left in place for ``build_target_options``, which uses
    them to ``--resolve`` now) as a ``PodPullSettings``; what the pod cannot carry is refused."""
    from modelpack.errors import K8sError
    from modelpack.mount.k8s_settings import PodPullSettings

    if kwargs.get("ca_file") and not kwargs.get("ca_configmap"):
        raise click.UsageError(
            "--ca-file is a file on this machine, which the pod cannot read: put it in a ConfigMap "
            "(kubectl create configmap registry-ca --from-file=ca.crt=PEM) and name it with "
            "--ca-configmap registry-ca (--ca-file is then used only to --resolve now)"
        )
    if kwargs.get("hosts_dir"):
        raise click.UsageError(
            "--hosts-dir is this machine's mirror configuration, which the pod cannot read: "
            "name the mirrors with --mirror URL"
        )
    if kwargs.get("s3_endpoint"):
        raise click.UsageError("--s3-endpoint: the generated objects pull from registries only")
    if (kwargs.get("username") or kwargs.get("password_stdin")) and not registry_secret:
        raise click.UsageError(
            "-u/--password-stdin are this machine's credentials, never written into an object: "
            "name a kubernetes.io/dockerconfigjson Secret with --registry-secret for the pod "
            "(-u is then used only to --resolve now)"
        )
    pull = PodPullSettings(
        mirrors=tuple(kwargs.get("mirrors") or ()),
        plain_http=bool(kwargs.get("plain_http")),
        ca_configmap=kwargs.pop("ca_configmap", None),
        ca_key=kwargs.pop("ca_key", "ca.crt"),
        retry_for=kwargs.get("retry_for"),
        timeout=global_timeout(),
    )
    try:
        pull.check()
    except K8sError as exc:
        raise click.UsageError(str(exc)) from None
    return pull
