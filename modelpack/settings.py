"""Every ``MODELPACK_*`` environment setting, in one place (as huggingface_hub's ``constants.py``).

Each name has one ``Setting``: its parser, its default, one line of documentation, and two flags:
``secret`` (its value is never printed, not even in an error) and ``protective`` (its absence
switches a protection off, so a value that is present but empty is refused instead of meaning
"unset": a ConfigMap key that rendered empty must not disable the trust policy).

Nothing else in modelpack reads the environment for a ``MODELPACK_*`` name (a test greps for it):
the entry points build their options from here (``TargetOptions.from_environ``,
``InitializerSettings.from_environ``, ``ServingSettings.from_extra_config``), the CLI's flags
override them, and the few node-wide settings read at the point of use (the cache directory, lock
timeouts, upload state) call ``Setting.get``. Every reader takes the mapping to read, default
``os.environ``, so a caller (a test, the vLLM plugin) can pass its own and no entry point ever
has to mutate the process environment.

A malformed value is a ``SettingsError`` naming the variable. ``python -m modelpack.settings
--markdown`` prints ``docs/configuration.md`` (a test keeps the checked-in file equal to it).
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Mapping

from modelpack.setting_parsers import (
    boolean,
    choice,
    debug_flag,
    integer,
    number,
    pairs_list,
    parse_duration,
    positive_duration,
    text,
    url_list,
    word,
)
from modelpack.setting_record import SETTINGS as SETTINGS  # re-exported: where callers find it
from modelpack.setting_record import Setting as Setting  # re-exported
from modelpack.setting_record import markdown
from modelpack.setting_record import register as _setting

_NO_WORDS: tuple[str, ...] = ()
_CONN = "Registry and bucket connections"
_MIRROR = "Mirrors and peers"
_S3 = "S3 tuning"
_CREDS = "Credentials and signing"
_NODE = "Node cache, locks and local state"
_SERVE = "Serving (vLLM load format, KServe storage initializer)"
_EVENTS = "Events and diagnostics"

# ---- connections (TargetOptions.from_environ)
TIMEOUT = _setting(
    "MODELPACK_TIMEOUT",
    positive_duration,
    None,
    "How long one registry request may wait to connect, for each read and for a whole document "
    "(``--timeout``); default 300 s.",
    kind="duration",
    group=_CONN,
)
RETRY_FOR = _setting(
    "MODELPACK_RETRY_FOR",
    parse_duration,
    None,
    "How long to keep retrying through a network or registry outage (``--retry-for``; 0: never); "
    "default 60 s.",
    kind="duration",
    group=_CONN,
)
S3_ENDPOINT = _setting(
    "MODELPACK_S3_ENDPOINT",
    word,
    None,
    "S3-compatible endpoint URL, may carry ``KEY:SECRET@`` (``--s3-endpoint``; else "
    "``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``).",
    kind="URL",
    group=_CONN,
    secret=True,
)
PLAIN_HTTP = _setting(
    "MODELPACK_PLAIN_HTTP",
    boolean,
    False,
    "Speak plain HTTP to a registry that is not on loopback (``--plain-http``; the storage "
    "initializer's only way; the generated Kubernetes objects set it).",
    kind="boolean",
    group=_CONN,
)
CA_FILE = _setting(
    "MODELPACK_CA_FILE",
    text,
    None,
    "PEM CA bundle for registry TLS (``--ca-file``; the storage initializer's default is KServe's "
    "CA bundle mount; the generated Kubernetes objects mount it from a ConfigMap).",
    kind="path",
    group=_CONN,
    protective=True,
)

# ---- mirrors and peers
MIRRORS = _setting(
    "MODELPACK_MIRRORS",
    url_list,
    _NO_WORDS,
    "Mirrors or peers asked for blobs before the origin, in order, space or comma separated "
    "(``--mirror`` replaces the list).",
    kind="URLs",
    group=_MIRROR,
)
PEER_TOKEN = _setting(
    "MODELPACK_PEER_TOKEN",
    text,
    None,
    "The bearer token this node presents to peers (``cache serve`` of other nodes, the same value "
    "as their ``MODELPACK_SERVE_TOKEN``); sent to peers only, never to an origin registry.",
    kind="secret",
    group=_MIRROR,
    secret=True,
    protective=True,
)
HOSTS_DIR = _setting(
    "MODELPACK_HOSTS_DIR",
    text,
    None,
    "containerd-style mirror config ``DIR/<host[:port]>/hosts.toml`` (``--hosts-dir``); "
    "default ``/etc/containerd/certs.d``.",
    kind="path",
    group=_MIRROR,
)
MIRROR_STALL = _setting(
    "MODELPACK_MIRROR_STALL",
    number(0),
    None,
    "Seconds without a byte before a mirror is left for the next one (0: the default, 10 s).",
    kind="seconds",
    group=_MIRROR,
)
MIRROR_MIN_RATE = _setting(
    "MODELPACK_MIRROR_MIN_RATE",
    number(0),
    None,
    "Bytes per second a mirror must deliver over each window, else the rest comes from the next "
    "one (0 turns the floor off).",
    kind="bytes/s",
    group=_MIRROR,
)
MIRROR_RATE_WINDOW = _setting(
    "MODELPACK_MIRROR_RATE_WINDOW",
    number(0),
    None,
    "The window, in seconds, over which ``MODELPACK_MIRROR_MIN_RATE`` is measured.",
    kind="seconds",
    group=_MIRROR,
)
PEER_ORDER = _setting(
    "MODELPACK_PEER_ORDER",
    choice("node", "blob"),
    "node",
    "``blob``: each blob is asked first of its owner peer (``cache serve --fill``); ``node``: peers "
    "ranked per node.",
    kind="node, blob",
    group=_MIRROR,
)
NODE_NAME = _setting(
    "MODELPACK_NODE_NAME",
    word,
    None,
    "This node's name for peer ranking (the downward API's ``spec.nodeName``); else the host name.",
    kind="name",
    group=_MIRROR,
)
NODE_IP = _setting(
    "MODELPACK_NODE_IP",
    word,
    "",
    "This node's own peer address, left out of its peers (except with ``MODELPACK_PEER_ORDER=blob``).",
    kind="address",
    group=_MIRROR,
)

# ---- S3 tuning
S3_PART_SIZE = _setting(
    "MODELPACK_S3_PART_SIZE",
    integer(1),
    None,
    "Bytes per multipart part (≥ 5 MiB on AWS and MinIO); default 16 MiB.",
    kind="bytes",
    group=_S3,
)
S3_MULTIPART_THRESHOLD = _setting(
    "MODELPACK_S3_MULTIPART_THRESHOLD",
    integer(0),
    None,
    "Blobs larger than this many bytes go multipart; default the part size.",
    kind="bytes",
    group=_S3,
)
S3_CONCURRENCY = _setting(
    "MODELPACK_S3_CONCURRENCY",
    integer(1),
    None,
    "Parts in flight per S3 target (bounds memory); default 8.",
    kind="count",
    group=_S3,
)
S3_CONDITIONAL_WRITES = _setting(
    "MODELPACK_S3_CONDITIONAL_WRITES",
    choice("auto", "on", "off"),
    None,
    "Use ``If-None-Match`` writes: auto (probe), on, off; default auto.",
    kind="auto, on, off",
    group=_S3,
)

# ---- credentials and signing
REGISTRY_USERNAME = _setting(
    "MODELPACK_REGISTRY_USERNAME",
    text,
    None,
    "Registry user (for CI), bound to ``MODELPACK_REGISTRY_HOST`` or else to the command's registry.",
    kind="name",
    group=_CREDS,
)
REGISTRY_PASSWORD = _setting(
    "MODELPACK_REGISTRY_PASSWORD",
    text,
    None,
    "The password of ``MODELPACK_REGISTRY_USERNAME``.",
    kind="secret",
    group=_CREDS,
    secret=True,
)
REGISTRY_HOST = _setting(
    "MODELPACK_REGISTRY_HOST",
    word,
    None,
    "The one registry host the environment's credentials belong to.",
    kind="host",
    group=_CREDS,
)
TOKEN_HOSTS = _setting(
    "MODELPACK_TOKEN_HOSTS",
    text,
    "",
    "``REGISTRY=TOKEN_HOST`` pairs: token services on another host that may receive a registry's "
    "credentials.",
    kind="pairs",
    group=_CREDS,
)
SRC_CREDS = _setting(
    "MODELPACK_SRC_CREDS",
    text,
    None,
    "``cp --src-creds USER:PASSWORD``.",
    kind="USER:PASSWORD",
    group=_CREDS,
    secret=True,
)
DEST_CREDS = _setting(
    "MODELPACK_DEST_CREDS",
    text,
    None,
    "``cp --dest-creds USER:PASSWORD``.",
    kind="USER:PASSWORD",
    group=_CREDS,
    secret=True,
)
SIGNING_PASSPHRASE = _setting(
    "MODELPACK_SIGNING_PASSPHRASE",
    text,
    None,
    "Passphrase of an encrypted signing key (else ``--passphrase-stdin``, else none).",
    kind="secret",
    group=_CREDS,
    secret=True,
)
SERVE_TOKEN = _setting(
    "MODELPACK_SERVE_TOKEN",
    text,
    None,
    "``cache serve``: the bearer token peers must present (never on the command line); required "
    "to listen beyond loopback.",
    kind="secret",
    group=_CREDS,
    secret=True,
    protective=True,
)

IMAGE = _setting(
    "MODELPACK_IMAGE",
    word,
    None,
    "``k8s …``: the modelpack image the generated objects run (``--modelpack-image``), best pinned "
    "by digest; there is no default (build it with ``make image`` and push it where your nodes pull).",
    kind="image reference",
    group=_SERVE,
)

# ---- node cache, locks and local state
CACHE = _setting(
    "MODELPACK_CACHE",
    text,
    None,
    "Node cache directory (``--cache``); else ``$XDG_CACHE_HOME/modelpack``, else ``~/.cache/modelpack``.",
    kind="path",
    group=_NODE,
)
LOCK_TIMEOUT = _setting(
    "MODELPACK_LOCK_TIMEOUT",
    number(0),
    None,
    "Seconds to wait for a cache or destination lock (0 or unset: 120 s for the cache, 600 s for a "
    "pull's destination).",
    kind="seconds",
    group=_NODE,
)
UPLOAD_STATE_DIR = _setting(
    "MODELPACK_UPLOAD_STATE_DIR",
    text,
    None,
    "Where resumable upload sessions and the pushed-blobs record live; else "
    "``$XDG_CACHE_HOME/modelpack/uploads``.",
    kind="path",
    group=_NODE,
)
PUSH_RECORD = _setting(
    "MODELPACK_PUSH_RECORD",
    text,
    None,
    "The pushed-blobs record file (cross-repository mounts); else ``pushed-blobs.json`` in the "
    "upload state directory.",
    kind="path",
    group=_NODE,
)
STAGING_DIR = _setting(
    "MODELPACK_STAGING_DIR",
    text,
    None,
    "Where ``pack`` stages files; else ``$TMPDIR/modelpack-staging-<uid>`` (0700).",
    kind="path",
    group=_NODE,
)

# ---- serving
POLICY = _setting(
    "MODELPACK_POLICY",
    text,
    None,
    "Storage initializer: path of the trust policy every reference must satisfy (a refusal exits 1); "
    "``cache lora-args``: the policy base and adapters must have passed (without ``--key``/``--policy``); "
    "set but empty is refused.",
    kind="path",
    group=_SERVE,
    protective=True,
)
POLICY_YAML = _setting(
    "MODELPACK_POLICY_YAML",
    text,
    None,
    "Storage initializer and ``cache lora-args``: the trust policy's YAML text (e.g. from a ConfigMap "
    "key); not with ``MODELPACK_POLICY``; set but empty is refused.",
    kind="YAML",
    group=_SERVE,
    protective=True,
)
JOBS = _setting(
    "MODELPACK_JOBS",
    integer(1),
    4,
    "Storage initializer: concurrent blob downloads.",
    kind="count",
    group=_SERVE,
)
PROGRESS_INTERVAL = _setting(
    "MODELPACK_PROGRESS_INTERVAL",
    number(0),
    10.0,
    "Storage initializer: seconds between progress lines.",
    kind="seconds",
    group=_SERVE,
)
LINK = _setting(
    "MODELPACK_LINK",
    choice("auto", "reflink", "copy"),
    "auto",
    "Storage initializer: how node-cache files reach DEST (auto: reflink, hard link, copy).",
    kind="auto, reflink, copy",
    group=_SERVE,
)
VARIANT = _setting(
    "MODELPACK_VARIANT",
    pairs_list,
    _NO_WORDS,
    "Serving: ``KEY=VALUE,…`` fields the index-of-variants entry must have.",
    kind="pairs",
    group=_SERVE,
)
TP_SIZE = _setting(
    "MODELPACK_TP_SIZE",
    integer(1),
    None,
    "Serving: the tensor-parallel size a variant is selected for (the initializer runs before vLLM); "
    "default 1.",
    kind="count",
    group=_SERVE,
)
ENGINE = _setting(
    "MODELPACK_ENGINE",
    word,
    None,
    "Serving: the engine a variant is selected for (e.g. vllm).",
    kind="name",
    group=_SERVE,
)
ACCELERATOR = _setting(
    "MODELPACK_ACCELERATOR",
    word,
    None,
    "Serving: the device arch a variant is selected for; else this node's first device.",
    kind="name",
    group=_SERVE,
)
GROUP_PROGRESS_TIMEOUT = _setting(
    "MODELPACK_GROUP_PROGRESS_TIMEOUT",
    positive_duration,
    None,
    "Loading with a process group (ranks sharing reads): how long a rank waits for the others' "
    "next step before it fails naming the rank it waited for; default 120 s (a rank that stops "
    "but stays alive would hold the group for the backend's 30-minute timeout).",
    kind="duration",
    group=_SERVE,
)

# ---- events and diagnostics
EVENTS = _setting(
    "MODELPACK_EVENTS",
    text,
    None,
    "JSON-lines event log for serving, the storage initializer and ``load`` (``--events``).",
    kind="path",
    group=_EVENTS,
)
START_ID = _setting(
    "MODELPACK_START_ID",
    word,
    None,
    "Groups one model start's events across processes (init container → engine; the pod UID in "
    "the generated manifests); else a fresh id (32 hex characters) made by each entry point.",
    kind="id",
    group=_EVENTS,
)
T0 = _setting(
    "MODELPACK_T0",
    number(0),
    None,
    "Serving: the start's t0 as UNIX seconds (the pod's creation); else the process start.",
    kind="seconds",
    group=_EVENTS,
)
DEBUG = _setting(
    "MODELPACK_DEBUG",
    debug_flag,
    False,
    "Any value but 0: print tracebacks (``--debug``).",
    kind="flag",
    group=_EVENTS,
)


def resolve_start_id(given: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The start id: ``given`` (a flag, a setting), else ``MODELPACK_START_ID`` verbatim, else a
    fresh one (32 lowercase hex characters, a uuid4). The one place a start id is read or made,
    so a pull's, a load's and an asset lookup's ids have one form whichever made them."""
    return given or START_ID.get(environ) or uuid.uuid4().hex


def share_with_child_processes(*, t0: float, start_id: str) -> None:
    """The one write: the vLLM plugin's first process fixes this start's t0 and id for the engine
    core and TP workers it spawns, which inherit the environment (vLLM offers no other channel).
    ``setdefault``: values set by the caller (a pod's creation time, its UID) always win."""
    os.environ.setdefault(T0.name, f"{t0:.6f}")
    os.environ.setdefault(START_ID.name, start_id)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["--markdown"]:
        print("usage: python -m modelpack.settings --markdown", file=sys.stderr)
        return 2
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised through tests/core/test_settings.py
    raise SystemExit(main())
