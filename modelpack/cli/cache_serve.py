"""``cache serve``: the node cache as a read-only OCI registry mirror for peers (a thin skin over
``modelpack.mount.serve``; ``--fill`` over ``modelpack.mount.serve_fill``)."""

from __future__ import annotations

import click

from modelpack import settings as env_settings
from modelpack.cli.cache import cache_dir_option
from modelpack.cli.options import SIZE, handle_errors
from modelpack.mount.cache import default_cache_dir


@click.command("serve")
@cache_dir_option
@click.option(
    "--listen",
    default="127.0.0.1:5050",
    show_default=True,
    metavar="HOST:PORT",
    help="Address to bind (port 0: any free port; the URL is printed on stdout).",
)
@click.option(
    "--tls-cert", type=click.Path(exists=True, dir_okay=False), help="PEM certificate (chain) for HTTPS."
)
@click.option(
    "--tls-key", type=click.Path(exists=True, dir_okay=False), help="PEM private key for --tls-cert."
)
@click.option(
    "--token-file",
    type=click.Path(exists=True, dir_okay=False),
    help="Require 'Authorization: Bearer <token>' with the token in this file "
    "(env MODELPACK_SERVE_TOKEN); never on the command line.",
)
@click.option(
    "--insecure-no-auth",
    is_flag=True,
    help="Listen beyond loopback without a token: anyone who reaches the port reads every model "
    "in this cache (and, with --fill, has it fetched with this node's credentials). Without a "
    "token, an address other than loopback is refused.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(1, 4096),
    default=64,
    show_default=True,
    help="Connections served at once; the next is answered 503 with Retry-After.",
)
@click.option(
    "--max-per-address",
    type=click.IntRange(1, 4096),
    default=16,
    show_default=True,
    help="Connections at once from one client address; the next is answered 503.",
)
@click.option(
    "--head-timeout",
    type=click.FloatRange(0.1, 600),
    default=10.0,
    show_default=True,
    metavar="SECONDS",
    help="Time for a whole request head (and the TLS handshake), however slowly it trickles; "
    "the connection is closed after it.",
)
@click.option(
    "--fill",
    "fill_refs",
    multiple=True,
    metavar="REF@sha256:…",
    help="Fill on miss: a request for a blob of this pinned manifest (or the manifest) that is not "
    "in the cache is fetched once from REF's registry with this node's own credentials and "
    "streamed to its requesters as it arrives (the last byte only once verified), then committed. "
    "Repeatable. Only these manifests' digests are ever fetched.",
)
@click.option("--fill-plain-http", is_flag=True, help="Reach the --fill registry over plain HTTP.")
@click.option(
    "--fill-concurrency",
    type=click.IntRange(1, 64),
    default=4,
    show_default=True,
    help="Fills at once; a miss beyond that is answered 503 (the requester asks its next source).",
)
@click.option(
    "--fill-quota",
    type=SIZE,
    default=None,
    help="Bytes fetched from the origin by fills over this process's life "
    "(default: twice the pinned manifests' total).",
)
@handle_errors
def cache_serve(
    cache_dir: str | None,
    listen: str,
    tls_cert: str | None,
    tls_key: str | None,
    token_file: str | None,
    insecure_no_auth: bool,
    max_connections: int,
    max_per_address: int,
    head_timeout: float,
    fill_refs: tuple[str, ...],
    fill_plain_http: bool,
    fill_concurrency: int,
    fill_quota: int | None,
) -> None:
    """Serve the node cache to peers as a read-only OCI registry mirror.

    GET /v2/, blobs by digest (HEAD, GET, Range) and manifests by digest; never tags, listings
    or writes (405). Only committed, read-only store blobs (and --fill's fills in flight) are
    reachable. Use it as another
    node's --mirror, or in containerd's hosts.toml with capabilities = ["pull"].

    Beyond loopback it needs a token (MODELPACK_SERVE_TOKEN or --token-file; pulling nodes
    present it as MODELPACK_PEER_TOKEN): requests without it are 401 before anything is read or
    filled.

    \b
    Examples:
      MODELPACK_SERVE_TOKEN=… modelpack cache serve --cache /var/cache/modelpack --listen 0.0.0.0:5050
      MODELPACK_PEER_TOKEN=… modelpack pull reg.example/models/llama@sha256:<hex> --cache /var/cache/modelpack --mirror http://node-a:5050
      modelpack cache serve --listen 0.0.0.0:5050 --token-file /run/secrets/peer-token --fill reg.example/models/llama@sha256:<hex>

    With --fill, a release storm costs the origin about one copy: pulling nodes set
    MODELPACK_PEER_ORDER=blob so every node asks each blob's owner peer first, and the owner
    fetches it once and streams it on (docs/distribution.md).
    """

    from modelpack.errors import TransferInterrupted
    from modelpack.mount.serve import CacheServer, ServeSettings
    from modelpack.mount.serve_fill import FillSettings

    host, sep, port = listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise click.BadParameter(
            f"{listen!r}: expected HOST:PORT, e.g. 127.0.0.1:5050", param_hint="--listen"
        )
    token = env_settings.SERVE_TOKEN.get()  # protective: set but empty is refused, never "no token"
    if token_file:
        with open(token_file, encoding="utf-8") as f:
            token = f.read(4096).strip() or None
        if token is None:
            raise click.BadParameter(f"{token_file}: the file is empty", param_hint="--token-file")
    settings = ServeSettings(
        host=host,
        port=int(port),
        tls_cert=tls_cert,
        tls_key=tls_key,
        token=token,
        max_connections=max_connections,
        max_per_address=max_per_address,
        head_timeout=head_timeout,
        allow_no_token=insecure_no_auth,
    )
    fill = None
    if fill_refs:
        from modelpack.targets.options import TargetOptions

        fill = FillSettings(
            references=fill_refs,
            plain_http=fill_plain_http,
            concurrency=fill_concurrency,
            quota=fill_quota,
            # the origin is reached as every pull reaches it: CA bundle, plain HTTP, timeout
            options=TargetOptions.from_environ(),
        )
    server = CacheServer(cache_dir or default_cache_dir(), settings, fill)
    click.echo(server.url)
    what = f"filling misses for {len(fill_refs)} pinned manifest(s)" if fill_refs else "read-only"
    click.echo(f"serving {server.store.root} {what} on {server.url}", err=True)
    try:
        server.serve_forever()
    except TransferInterrupted as exc:  # SIGTERM/SIGHUP is how a server is stopped: not an error
        click.echo(f"cache serve: stopped ({str(exc).split(';')[0]})", err=True)
        raise SystemExit(exc.exit_code) from None  # 128 + signal, as every command exits on one


__all__ = ["cache_serve"]
