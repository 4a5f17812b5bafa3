"""The ``modelpack`` command: a thin click skin over the library.

``main`` is a lazily loading group: ``COMMANDS`` names the module of each command (one module
per area: pack, transfer, pull, trust, audit, cache, k8s, loader, assets), imported only when
that command runs, so a node's ``modelpack pull … --cache DIR`` hit does not pay for the
registry client, signing or torch. Shared options and output helpers live in
``modelpack.cli.options``; the command modules never import this package's ``main``.
Exit codes: 0 ok, 1 a modelpack error (bad input, verification refused, not found), 2 usage.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from modelpack._version import __version__
from modelpack.cli.lazy_group import LazyCommand, LazyGroup
from modelpack.cli.options import PASS_THROUGH, TIMEOUT, parse_size, report_failure
from modelpack.terminal import terminal_safe_output

# name → where the command lives and its short help for ``modelpack --help`` (kept equal to
# the command's own docstring by tests/cli/test_cli_structure.py).
COMMANDS = {
    "assets": LazyCommand(
        "modelpack.cli.assets:assets_group",
        "Ship compile caches (Inductor, Triton, vLLM) as fingerprinted, signed referrers of a model.",
    ),
    "audit": LazyCommand(
        "modelpack.cli.audit:audit_cmd",
        "Audit REGISTRY/REPO (or oci:DIR, s3://…), or every repository of a bare REGISTRY host.",
    ),
    "cache": LazyCommand(
        "modelpack.cli.cache:cache_group", "Inspect and maintain the node cache (snapshots of pulled models)."
    ),
    "cp": LazyCommand(
        "modelpack.cli.transfer:cp_cmd",
        "Copy an artifact between any two places (registry, oci:DIR, s3://…), digests unchanged.",
    ),
    "diff": LazyCommand(
        "modelpack.cli.audit:diff_cmd",
        "Compare two artifacts: config, files, and tensors of changed safetensors files.",
    ),
    "index": LazyCommand(
        "modelpack.cli.index:index_group",
        "Write and show variant indexes: one reference, several layouts of a model.",
    ),
    "inspect": LazyCommand(
        "modelpack.cli.pack:inspect_cmd",
        "Show an artifact: manifest digest, model config, layers and total size.",
    ),
    "k8s": LazyCommand(
        "modelpack.cli.k8s:k8s_group",
        "Kubernetes YAML (stdout) for image volumes, init-container pulls and pre-warming.",
    ),
    "keygen": LazyCommand(
        "modelpack.cli.trust:keygen_cmd",
        "Generate an ECDSA P-256 signing key pair (PKCS#8 PEM private key, SPKI PEM public key).",
    ),
    "load": LazyCommand(
        "modelpack.cli.loader:load_cmd",
        "Load SOURCE's weights for one tensor-parallel (and expert-parallel) rank and report what it cost.",
    ),
    "login": LazyCommand(
        "modelpack.cli.transfer:login_cmd",
        "Check credentials against REGISTRY and store them in Docker's config.json.",
    ),
    "logout": LazyCommand("modelpack.cli.transfer:logout_cmd", "Remove stored credentials for REGISTRY."),
    "ls": LazyCommand(
        "modelpack.cli.pack:ls_cmd", "List the tags of a layout, repository or bucket, with their digests."
    ),
    "pack": LazyCommand(
        "modelpack.cli.pack:pack_cmd", "Pack CHECKPOINT_DIR into a ModelPack artifact at DESTINATION."
    ),
    "pull": LazyCommand(
        "modelpack.cli.pull:pull_cmd",
        "Materialise the model at REFERENCE as files under DEST_DIR, each verified before it appears.",
    ),
    "push": LazyCommand(
        "modelpack.cli.transfer:push_cmd",
        "Push SOURCE (a checkpoint directory, or oci:LAYOUT:TAG / s3://…) to DESTINATION.",
    ),
    "sign": LazyCommand(
        "modelpack.cli.trust:sign_cmd",
        "Sign an artifact that is already stored: manifest signature, directory signature and chunk "
        "table, each a referrer bound to the manifest digest (tags are not changed).",
    ),
    "storage-initializer": LazyCommand(
        "modelpack.cli.kserve:storage_initializer_cmd",
        "Put each SRC_URI's verified files at DEST, as KServe's storage initializer (ClusterStorageContainer).",
    ),
    "tag": LazyCommand(
        "modelpack.cli.transfer:tag_cmd", "Point NEW_TAG (same repository) at the manifest REFERENCE names."
    ),
    "timeline": LazyCommand(
        "modelpack.cli.loader:timeline_cmd",
        "Per-stage start-up latency (count, p50, p95) from EVENT_LOGS, per cache state.",
    ),
    "verify": LazyCommand(
        "modelpack.cli.trust:verify_cmd",
        "Verify REFERENCE's signature against trusted keys or a policy; exit 1 when refused.",
    ),
}


class MainGroup(LazyGroup):
    """The root group, and the net under every command: whatever escapes a command (or loading
    it, or writing its last output to a closed pipe) becomes one line, never a traceback; and
    while it runs, stdout and stderr escape every control character (``modelpack.terminal``), so
    text from a registry or an artifact is shown, never obeyed by the terminal."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        with terminal_safe_output():
            return super().main(*args, **kwargs)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            result = super().invoke(ctx)
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
            return result
        except PASS_THROUGH:
            raise
        except BaseException as exc:
            report_failure(exc)


@click.group(
    cls=MainGroup,
    lazy_commands=COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)
@click.version_option(__version__, prog_name="modelpack")  # modelpack/_version.py, not the metadata
@click.option(
    "--debug",
    is_flag=True,
    help="Log requests and decisions to stderr, and a failure's traceback (credentials are never logged).",
)
@click.option(
    "--timeout",
    type=TIMEOUT,
    default=None,
    metavar="SECONDS",
    help="How long one registry request may wait for an answer (connect at most 30 s, each read, "
    "a whole manifest or tag list); each retry within --retry-for waits this long again. "
    "Durations as 2, 30s, 5m. Else MODELPACK_TIMEOUT; default 300 s.",
)
def main(debug: bool, timeout: float | None) -> None:
    """modelpack: safetensors checkpoints as verified, signed CNCF ModelPack OCI artifacts.

    \b
    Examples (the typical flow):
      modelpack pack ./ckpt oci:./layout:v1           # build an artifact (no server needed)
      modelpack push ./ckpt registry.example/m:v1     # CI: pack + upload straight from the files
      modelpack pull registry.example/m:v1 ./model    # node: verified files at their paths
      modelpack --debug pull registry.example/m:v1 ./model   # a failure's traceback and requests
      modelpack --timeout 30s ls registry.example/m   # give up on a registry silent for 30 s

    References: host[:port]/repo[:tag][@sha256:…], oci:DIR[:TAG|@DIGEST], s3://BUCKET/PREFIX[:TAG].

    Every failure is one line on stderr and a non-zero exit (1: refused or failed, 2: usage);
    --debug adds the traceback of an unexpected one.
    """
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING,
        stream=sys.stderr,
        format="%(levelname)s %(name)s: %(message)s",
    )


# parse_size is re-exported for the benchmarks, which read sizes the way the CLI does.
__all__ = ["COMMANDS", "main", "parse_size"]
