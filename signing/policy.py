"""Trust policy: which keys are trusted for which repositories, and whether a signature is required.

YAML::

    version: 1
    default:                      # used when no rule matches (optional; default: refuse unsigned)
      require_signature: true
    rules:                        # first match wins; globs match Reference.canonical_name
      - match: ["registry.example.com/models/*", "oci:/srv/models*"]
        require_signature: true
        keys:
          - path: keys/ci.pub     # relative to the policy file
          - env: MODELPACK_TRUSTED_KEY
          - pem: |
              -----BEGIN PUBLIC KEY-----
              …
        require_directory_signature: false
        require_chunk_table: false
      - match: ["registry.example.com/ci/*"]
        identities:               # keyless (Sigstore) signers, as cosign's --certificate-identity
          - issuer: https://token.actions.githubusercontent.com
            subject: https://github.com/acme/models/.github/workflows/release.yml@refs/heads/main
        trusted_root: sigstore/trusted_root.json   # optional: default Sigstore's public-good root

Like sigstore-python's policies, a ``RepositoryPolicy`` is a small object that answers with a
decision and a reason a person can act on; it never raises for a policy "no".

Rules match canonical names (``Reference.canonical``), and the globs are canonicalised the same
way when the policy is loaded: ``LOCALHOST:5000/models/x``, ``index.docker.io/acme/x`` or
``oci:/srv/./models/x`` are the places a rule names, not strangers that fall through to a more
permissive rule. A layout also matches through the path its symlinks resolve to, so a link to a
protected directory is not a way around its rule. ``oci:`` globs must be absolute.
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml
from modelpack.signing.keyless_trust import KeylessTrust, keyless_from_policy
from modelpack.signing.keys import PublicKey, load_public_key

from modelpack.errors import ModelpackError, PolicyError
from modelpack.oci.reference import OCI_REGISTRY_SCHEME, Reference, canonical_host, parse_reference

MAX_POLICY_BYTES = 1024 * 1024


@dataclass(frozen=True)
class PolicyDecision:
    allowed: bool
    reason: str


@dataclass(frozen=True)
class RepositoryPolicy:
    """The requirements for one repository: trusted keys and what must be present."""

    keys: tuple[PublicKey, ...] = ()
    require_signature: bool = True
    require_directory_signature: bool = False
    require_chunk_table: bool = False
    rule: str = "default"
    keyless: KeylessTrust | None = None

    @property
    def key_ids(self) -> list[str]:
        """What a verified signature is recorded by: key ids, and ``keyless:ISSUER SUBJECT`` ids."""
        return [k.key_id for k in self.keys] + (self.keyless.ids if self.keyless else [])

    def decide(self, verified_key_ids: Sequence[str], problems: Sequence[str]) -> PolicyDecision:
        if verified_key_ids:
            signer = verified_key_ids[0]
            who = signer if signer.startswith("keyless:") else f"trusted key {signer[:16]}"
            return PolicyDecision(True, f"signed by {who} (rule {self.rule})")
        if not self.require_signature:
            why = "; ".join(problems) if problems else "no signature"
            return PolicyDecision(True, f"signature not required by rule {self.rule} ({why})")
        if not self.keys and not self.keyless:
            return PolicyDecision(
                False, f"rule {self.rule} requires a signature but trusts no key or identity"
            )
        if not problems:
            return PolicyDecision(
                False, f"unsigned: no signature referrer, and rule {self.rule} requires one"
            )
        return PolicyDecision(False, "; ".join(problems))


@dataclass
class TrustPolicy:
    rules: list[tuple[tuple[str, ...], RepositoryPolicy]] = field(default_factory=list)
    default: RepositoryPolicy = field(default_factory=RepositoryPolicy)
    path: str = ""

    @classmethod
    def from_keys(cls, keys: Sequence[PublicKey], *, require_signature: bool = True) -> TrustPolicy:
        return cls(default=RepositoryPolicy(tuple(keys), require_signature, rule="--key"))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TrustPolicy:
        p = os.fspath(path)
        try:
            with open(p, "rb") as f:
                raw = f.read(MAX_POLICY_BYTES + 1)
        except OSError as exc:
            raise PolicyError(f"{p}: cannot read policy: {exc.strerror or exc}") from exc
        if len(raw) > MAX_POLICY_BYTES:
            raise PolicyError(f"{p}: larger than {MAX_POLICY_BYTES} bytes")
        try:
            doc = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise PolicyError(f"{p}: not YAML: {exc}") from exc
        except RecursionError:  # the YAML composer recurses per nesting level
            raise PolicyError(f"{p}: nested too deeply to be a policy") from None
        return cls.from_dict(doc, base_dir=os.path.dirname(os.path.abspath(p)), path=p)

    @classmethod
    def from_text(cls, text: str, where: str) -> TrustPolicy:
        """A policy given as YAML text (``$MODELPACK_POLICY_YAML``, a ConfigMap key); ``where``
        names its origin in every error. Relative key paths are relative to the working directory."""
        if len(text.encode()) > MAX_POLICY_BYTES:
            raise PolicyError(f"{where}: larger than {MAX_POLICY_BYTES} bytes")
        try:
            doc = yaml.safe_load(text)
        except (yaml.YAMLError, RecursionError) as exc:
            raise PolicyError(f"{where}: not a YAML policy: {exc}") from None
        return cls.from_dict(doc, path=where)

    @classmethod
    def from_dict(cls, doc: Any, *, base_dir: str = ".", path: str = "<policy>") -> TrustPolicy:
        if not isinstance(doc, dict):
            raise PolicyError(f"{path}: a policy is a mapping with 'rules' (and optional 'default')")
        unknown = set(doc) - {"version", "rules", "default"}
        if unknown:
            raise PolicyError(f"{path}: unknown top-level keys {sorted(unknown)}")
        if doc.get("version", 1) != 1:
            raise PolicyError(f"{path}: unsupported policy version {doc.get('version')!r}")
        rules_doc = doc.get("rules")
        rules_doc = [] if rules_doc is None else rules_doc
        if not isinstance(rules_doc, list):
            raise PolicyError(f"{path}: 'rules' must be a list")
        rules = []
        for i, r in enumerate(rules_doc):
            where = f"{path}: rules[{i}]"
            if not isinstance(r, dict):
                raise PolicyError(f"{where}: must be a mapping")
            match = r.get("match")
            globs = (match,) if isinstance(match, str) else tuple(match) if isinstance(match, list) else ()
            if not globs or not all(isinstance(g, str) and g for g in globs):
                raise PolicyError(f"{where}: 'match' must be a glob or a list of globs")
            canonical = tuple(canonical_glob(g, where) for g in globs)
            rules.append((canonical, _repo_policy(r, where, base_dir, name=f"{i} ({globs[0]})")))
        default_doc = doc.get("default")
        default = (
            _repo_policy(default_doc, f"{path}: default", base_dir, name="default")
            if default_doc is not None
            else RepositoryPolicy(rule="default")
        )
        return cls(rules, default, path)

    def for_reference(self, ref: Reference | str) -> RepositoryPolicy:
        """The requirements for ``ref``: the first rule with a glob matching one of its names
        (the canonical name, and for a layout also the path with symlinks resolved)."""
        ref = parse_reference(ref) if isinstance(ref, str) else ref
        names = policy_names(ref)
        for globs, rp in self.rules:
            if any(fnmatch.fnmatchcase(name, g) for g in globs for name in names):
                return rp
        return self.default


def policy_from_environ(environ: Mapping[str, str] | None = None) -> TrustPolicy | None:
    """The node's configured policy: ``$MODELPACK_POLICY`` (a file) or ``$MODELPACK_POLICY_YAML``
    (its text), else None. Fails closed: either set but empty (``SettingsError``), both set, or a
    file that is not there (``PolicyError``) never reads as "no policy"."""
    from modelpack import settings

    path = settings.POLICY.get(environ)
    text = settings.POLICY_YAML.get(environ)
    if path is not None and text is not None:
        raise PolicyError(f"set ${settings.POLICY.name} or ${settings.POLICY_YAML.name}, not both")
    if path is not None:
        return TrustPolicy.load(path)
    if text is not None:
        return TrustPolicy.from_text(text, f"${settings.POLICY_YAML.name}")
    return None


def policy_names(ref: Reference) -> list[str]:
    """The names of ``ref`` a rule may match: one, or two for a layout reached through a symlink."""
    canonical = ref.canonical()
    names = [canonical.repo_name]
    if canonical.scheme == "oci":
        resolved = f"oci:{os.path.realpath(canonical.location)}"
        if resolved != names[0]:
            names.append(resolved)
    return names


_GLOB_CHARS = frozenset("*?[")


def canonical_glob(glob: str, where: str) -> str:
    """A rule's glob in the spelling references are matched in (see ``Reference.canonical``);
    ``oci://HOST/REPO*`` is a registry glob, as ``oci://`` is a registry in a reference."""
    glob = glob.removeprefix(OCI_REGISTRY_SCHEME)
    if glob.startswith("oci:"):
        path = glob[4:]
        if path[:1] in _GLOB_CHARS:
            return glob
        if not path.startswith("/"):
            raise PolicyError(
                f"{where}: {glob!r}: oci: globs must be absolute paths (references are matched "
                "by their absolute path)"
            )
        normal = posixpath.normpath(path)
        return "oci:" + ("/" + normal.lstrip("/") if normal.startswith("//") else normal)
    if glob.startswith("s3://"):
        return glob
    if not _GLOB_CHARS & set(glob):
        try:
            return parse_reference(glob).canonical_name
        except ModelpackError:
            pass
    host, sep, rest = glob.partition("/")
    if not sep:
        return glob.lower()
    host = host.lower() if _GLOB_CHARS & set(host) else canonical_host(host)
    return f"{host}/{rest}"


_RULE_KEYS = {
    "match",
    "keys",
    "identities",
    "trusted_root",
    "require_signature",
    "require_directory_signature",
    "require_chunk_table",
}


def _repo_policy(doc: Any, where: str, base_dir: str, *, name: str) -> RepositoryPolicy:
    if not isinstance(doc, dict):
        raise PolicyError(f"{where}: must be a mapping")
    unknown = set(doc) - _RULE_KEYS
    if unknown:
        raise PolicyError(f"{where}: unknown keys {sorted(unknown)}")
    keys = []
    for j, k in enumerate(doc.get("keys") or []):
        kw = f"{where}.keys[{j}]"
        if isinstance(k, str):
            k = {"path": k}
        if not isinstance(k, dict) or len(k) != 1:
            raise PolicyError(f"{kw}: one of path / env / pem")
        ((kind, value),) = k.items()
        if not isinstance(value, str):
            raise PolicyError(f"{kw}: {kind} must be a string")
        try:
            if kind == "path":
                keys.append(load_public_key(os.path.join(base_dir, os.path.expanduser(value))))
            elif kind == "env":
                keys.append(load_public_key(f"env:{value}"))
            elif kind == "pem":
                keys.append(load_public_key(value.encode()))
            else:
                raise PolicyError(f"{kw}: unknown key source {kind!r} (path, env, pem)")
        except ModelpackError as exc:
            if isinstance(exc, PolicyError):
                raise
            raise PolicyError(f"{kw}: {exc}") from exc
    flags = {}
    for flag in ("require_signature", "require_directory_signature", "require_chunk_table"):
        v = doc.get(flag, flag == "require_signature")
        if not isinstance(v, bool):
            raise PolicyError(f"{where}: {flag} must be true or false")
        flags[flag] = v
    return RepositoryPolicy(
        tuple(keys), rule=name, keyless=keyless_from_policy(doc, where, base_dir), **flags
    )
