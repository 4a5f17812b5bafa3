"""``storage-initializer`` (KServe's ClusterStorageContainer entry point) and ``k8s kserve``.

``modelpack storage-initializer SRC_URI DEST [SRC_URI DEST …]`` is what a ClusterStorageContainer
runs (``command: [modelpack, storage-initializer]``; KServe supplies the argv pairs). Progress and
summaries are plain lines on stdout, so ``kubectl logs`` reads well; a failure is one line on
stderr and a non-zero exit, which KServe's ``FallbackToLogsOnError`` turns into the
termination message.
"""

from __future__ import annotations

import click

from modelpack.cli.options import DURATION, global_timeout, handle_errors


def _say(line: str) -> None:
    click.echo(line)


@click.command(
    "storage-initializer",
    context_settings={"ignore_unknown_options": True},  # a URI or path starting with '-' is an argument
)
@click.argument("pairs", nargs=-1, required=True, metavar="SRC_URI DEST [SRC_URI DEST]...")
@click.option(
    "--retry-for",
    type=DURATION,
    default=None,
    help="Keep retrying through a registry outage this long (30s, 2m). Else MODELPACK_RETRY_FOR; default 60s.",
)
@handle_errors
def storage_initializer_cmd(pairs: tuple[str, ...], retry_for: float | None) -> None:
    """Put each SRC_URI's verified files at DEST, as KServe's storage initializer (ClusterStorageContainer).

    SRC_URI is modelpack://HOST[:PORT]/REPO(:TAG|@sha256:…), oci://HOST/REPO…, oci:DIR[:TAG] or
    s3://BUCKET/PREFIX[:TAG]. Settings come from the environment: MODELPACK_CACHE (node cache:
    one download per node, DEST gets links or copies), MODELPACK_POLICY (trust policy; a refusal
    exits 1), MODELPACK_PLAIN_HTTP=true (plain HTTP to a registry), KSERVE_OCI_DOCKER_CONFIG
    (registry credentials), CA_BUNDLE_VOLUME_MOUNT_POINT or MODELPACK_CA_FILE (CA bundle),
    MODELPACK_EVENTS, MODELPACK_JOBS, MODELPACK_PROGRESS_INTERVAL (seconds between progress lines).

    \b
    Examples:
      modelpack storage-initializer modelpack://registry.example/models/llama@sha256:… /mnt/models
      MODELPACK_CACHE=/var/cache/modelpack modelpack storage-initializer \\
          modelpack://registry.example/models/llama:v1 /mnt/models/llama \\
          modelpack://registry.example/models/lora:v1 /mnt/models/lora
    """
    from modelpack.serving.kserve.initializer import StorageInitializer, parse_pairs
    from modelpack.serving.kserve.settings import InitializerSettings

    parsed = parse_pairs(pairs)
    initializer = StorageInitializer(
        InitializerSettings.from_environ(), say=_say, timeout=global_timeout(), retry_for=retry_for
    )
    from modelpack.cli.pull import signals_interrupt

    with signals_interrupt():
        initializer.run(parsed)
