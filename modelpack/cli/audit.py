"""``audit`` and ``diff``: what a registry holds, who signed it, and what changed between versions.

Read-only commands over a registry, layout or bucket (and, for ``audit --cache``, the tag history
a node cache accepted); they share ``trust_policy_from`` with the signing commands of
``modelpack.cli.trust`` and, like every command module, are imported only when they run.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import click

from modelpack.cli.options import (
    build_target_options,
    emit_json,
    handle_errors,
    human_size,
    json_option,
    target_options,
)
from modelpack.cli.trust_options import key_policy_options, trust_policy_from
from modelpack.errors import InvalidReferenceError, ModelpackError
from modelpack.exit_codes import ExitCode
from modelpack.oci.reference import Reference, parse_reference
from modelpack.targets.base import Catalog
from modelpack.targets.opener import TargetOptions, open_readable
from modelpack.terminal import for_terminal

_HOST_ONLY = re.compile(
    r"^(localhost|[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+|[A-Za-z0-9.-]+:[0-9]+|\[[0-9A-Fa-f:]+\](:[0-9]+)?)$"
)


def _adapter_cell(v: dict[str, Any]) -> str:
    """The MODEL column's adapter part: an adapter's base, or a base's adapter names (adapter
    names are checked safe: letters, digits, ``._-``)."""
    if v.get("adapter"):
        return f"(adapter of {str(v['adapter']['base'])[:19]})"
    if v.get("variants"):  # values checked by the variant rules: letters, digits, ._+- and spaces
        return "variants: " + "; ".join(
            ",".join(f"{k}={x}" for k, x in e["variant"].items()) or "-" for e in v["variants"]
        )
    return ("+adapters:" + ",".join(a["name"] for a in v["adapters"])) if v.get("adapters") else ""


def _audit_rows(repo_doc: dict[str, Any]) -> list[list[str]]:
    rows = []
    for v in repo_doc["versions"]:
        model = v["model"] or {}
        sig = v["signature"]
        keys = ",".join(k[:12] for k in sig["keyIds"])
        refs = ",".join(f"{at.rsplit('/', 1)[-1]}×{n}" for at, n in v["referrers"].items())
        rows.append(
            [
                repo_doc["repository"],
                ",".join(v["tags"]),
                v["digest"][:19],
                (v["artifactType"] or v["mediaType"]).rsplit("/", 1)[-1],
                human_size(v["totalSize"]),
                str(v["layerCount"]),
                v["created"] or "-",
                " ".join(
                    str(x)
                    for x in (
                        model.get("name"),
                        model.get("version"),
                        model.get("precision"),
                        _adapter_cell(v),
                    )
                    if x
                )
                or "-",
                sig["status"] + (f"({keys})" if keys else ""),
                refs or "-",
            ]
        )
    return rows


def _attach_tag_history(repos: list[Any], cache_dir: str) -> bool:
    """``audit --cache``: each repository's tag records from the node cache; any rollback?"""
    from modelpack.inspection.audit import CATALOG_ENTRY
    from modelpack.inspection.tag_history import attach_tag_history
    from modelpack.mount import NodeCache

    cache = NodeCache(cache_dir, create=False)
    rolled_back = False
    for r in repos:
        if r.repository == CATALOG_ENTRY:
            continue
        name = parse_reference(r.repository).canonical_name
        rolled_back = attach_tag_history(r, cache.tags.for_repository(name)) or rolled_back
    return rolled_back


def _print_tag_history(repo_doc: dict[str, Any]) -> None:
    for h in repo_doc.get("tagHistory", []):
        where = f"{repo_doc['repository']}:{h['tag']}"
        for v in h["history"]:
            flag = " (accepted with --allow-rollback)" if v.get("rollback") else ""
            click.echo(
                f"HISTORY {where}: {v['digest']} signed {v['signedAt'] or '-'}, accepted {v['acceptedAt']}{flag}"
            )
        if h["rollback"]:
            newest = h["newest"]
            click.echo(
                f"ROLLBACK {where}: the registry names {h['current']}, signed before {newest['digest']} "
                f"(signed {newest['signedAt'] or '-'}), which this node cache accepted"
            )


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    rows = [[for_terminal(c) for c in r] for r in rows]  # registry text: one inert line per row
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


@click.command("audit")
@click.argument("location")
@key_policy_options(key_help="Trusted public key to check signatures with; repeatable.")
@click.option("--repo", "repo_glob", help="With a bare REGISTRY: only repositories matching this glob.")
@click.option(
    "--since-digests",
    type=click.Path(exists=True, dir_okay=False),
    help="JSON {tag: digest} (or a previous audit --json) to flag tags that moved.",
)
@click.option(
    "--page-size", type=click.IntRange(1, 10000), default=100, show_default=True, help="Catalog page size."
)
@click.option(
    "--max-tags",
    type=click.IntRange(1),
    default=10_000,
    show_default=True,
    help="Audit at most this many tags per repository; a longer listing is cut and says so "
    "(CUT line, 'cut' in --json).",
)
@click.option(
    "--cache",
    "cache_dir",
    type=click.Path(exists=True, file_okay=False),
    help="Also show the tag history this node cache accepted, and flag tags the registry moved back.",
)
@target_options
@json_option
@handle_errors
def audit_cmd(
    location: str,
    keys: tuple[str, ...],
    policy: str | None,
    repo_glob: str | None,
    since_digests: str | None,
    page_size: int,
    max_tags: int,
    as_json: bool,
    cache_dir: str | None,
    **kwargs: Any,
) -> None:
    """Audit REGISTRY/REPO (or oci:DIR, s3://…), or every repository of a bare REGISTRY host.

    \b
    Per version: tags (tags sharing a digest are grouped), digest, artifact type, size, layer
    count, created, model name/version/precision, signature state in verify's words (verified /
    untrusted: signed by a key not given / invalid / unsigned; 'signed' when no --key/--policy
    was given) with key ids, referrers by type.
    Exit status 1 when a tag moved since --since-digests, or (with --cache) when the registry
    names a version signed before the newest one the node cache accepted for the tag.

    \b
    Examples:
      modelpack audit registry.example.com/models/llama --key ./keys/modelpack-ci.pub
      modelpack audit registry.example.com --repo 'models/*' --policy policy.yaml --json
      modelpack audit registry.example.com/models/llama --key ./keys/modelpack-ci.pub --cache /var/cache/modelpack
    """
    from modelpack.inspection.audit import audit_registry, audit_repository, load_since

    pol = trust_policy_from(keys, policy)
    since = load_since(since_digests) if since_digests else None
    topts = build_target_options(kwargs)
    repos = []
    if not location.startswith(("oci:", "s3://")) and _HOST_ONLY.match(location):
        catalog_target = open_readable(parse_reference(f"{location}/catalog"), topts)
        if not isinstance(catalog_target, Catalog):
            raise ModelpackError(f"{location}: this target cannot list a catalog")

        def open_repo(repo: str) -> tuple[Any, Reference]:
            r = parse_reference(f"{location}/{repo}")
            return open_readable(r, topts), r

        repos = audit_registry(
            catalog_target.catalog(page_size=page_size),
            open_repo,
            repo_glob=repo_glob,
            policy_or_keys=pol,
            since=since,
            max_tags=max_tags,
        )
    else:
        if repo_glob:
            raise click.UsageError("--repo only applies to a bare REGISTRY host")
        ref = parse_reference(location)
        if ref.tag or ref.digest:
            raise InvalidReferenceError(f"{location}: audit takes a repository, not a tag or digest")
        target = open_readable(ref, topts)
        name = ref.repo_name
        repos = [
            audit_repository(target, name, policy_or_keys=pol, since=since, reference=ref, max_tags=max_tags)
        ]
    rolled_back = _attach_tag_history(repos, cache_dir) if cache_dir else False
    docs = [r.to_json() for r in repos]
    moved = any(r.moved for r in repos) or rolled_back
    if as_json:
        emit_json({"repositories": docs})
    else:
        header = [
            "REPOSITORY",
            "TAGS",
            "DIGEST",
            "TYPE",
            "SIZE",
            "LAYERS",
            "CREATED",
            "MODEL",
            "SIGNATURE",
            "REFERRERS",
        ]
        _print_table(header, [row for d in docs for row in _audit_rows(d)])
        for d in docs:
            for m in d["moved"]:
                click.echo(
                    f"MOVED {d['repository']}:{m['tag']}: {m['previous']} → {m['current'] or '(deleted)'}"
                )
            _print_tag_history(d)
            if d["error"]:
                click.echo(f"ERROR {d['repository']}: {d['error']}", err=True)
            if d.get("cut"):
                click.echo(f"CUT {d['repository']}: {d['cut']}", err=True)
    if moved:
        sys.exit(ExitCode.FAILURE)


@click.command("diff")
@click.argument("ref_a")
@click.argument("ref_b")
@click.option("--no-tensors", is_flag=True, help="Skip per-tensor digests (no blob downloads).")
@target_options
@json_option
@handle_errors
def diff_cmd(ref_a: str, ref_b: str, no_tensors: bool, as_json: bool, **kwargs: Any) -> None:
    """Compare two artifacts: config, files, and tensors of changed safetensors files.

    \b
    Examples:
      modelpack diff registry.example.com/models/llama:v1 registry.example.com/models/llama:v2
      modelpack diff oci:./layout:v1 oci:./layout:v2 --no-tensors --json
    """
    from modelpack.inspection.diff import diff

    topts: TargetOptions = build_target_options(kwargs)
    d = diff(ref_a, ref_b, topts, tensors=not no_tensors)
    if as_json:
        emit_json(d.to_json())
        return
    click.echo(f"a: {d.a} {d.digest_a}\nb: {d.b} {d.digest_b}")
    if d.identical:
        click.echo("identical")
        return
    for c in d.config:
        click.echo(f"config {for_terminal(c['path'])}: {c['before']!r} → {c['after']!r}")
    for f in d.files:
        sizes = " → ".join(human_size(x["size"]) for x in (f.before, f.after) if x)
        click.echo(f"{f.change:<8} {for_terminal(f.path)} ({sizes})")
        for t in f.tensors or []:
            b, a = t.before or {}, t.after or {}
            desc = " → ".join(f"{x['dtype']}{x['shape']} {x['digest'][7:19]}" for x in (b, a) if x)
            # tensor names come from the files' headers: one inert line each
            click.echo(f"    {t.change:<8} {for_terminal(t.name)}: {for_terminal(desc)}")
        if f.tensors is not None:
            click.echo(f"    ({f.unchanged_tensors} tensors unchanged)")
