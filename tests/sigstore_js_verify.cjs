// Verify one Sigstore bundle (v0.3, DSSE, key-based, no tlog) with sigstore-js, offline.
//
//   node tests/sigstore_js_verify.cjs SIGSTORE_JS_DIR BUNDLE.json TRUSTED.pub PREDICATE_TYPE [SUBJECT_SHA256]
//
// The trusted key is the only key material: its key id (hex sha256 of its SPKI PEM, computed
// here by node) is the only hint the key finder answers. After the signature, the in-toto
// statement is checked: _type, predicateType and (when given) the subject digest. Prints one JSON
// line: {"ok": true, "keyId", "predicateType", "subjects", "signedAt"} or {"ok": false, "code",
// "error"} (exit 1). Used by tests/test_interop_sigstore_js.py.
'use strict';
const crypto = require('crypto');
const fs = require('fs');
const path = require('path');
const { createRequire } = require('module');

function fail(code, error) {
  process.stdout.write(JSON.stringify({ ok: false, code, error: String(error) }) + '\n');
  process.exit(1);
}

const [dir, bundlePath, keyPath, predicateType, subject] = process.argv.slice(2);
if (!dir || !bundlePath || !keyPath || !predicateType) fail('USAGE', 'see the header of this script');
const req = createRequire(path.join(path.resolve(dir), 'package.json'));
const { bundleFromJSON } = req('@sigstore/bundle');
const { Verifier, toSignedEntity } = req('@sigstore/verify');

const pem = fs.readFileSync(keyPath, 'utf8');
const publicKey = crypto.createPublicKey(pem);
const spki = publicKey.export({ type: 'spki', format: 'pem' });
const keyId = crypto.createHash('sha256').update(spki).digest('hex');
const trustMaterial = {
  certificateAuthorities: [],
  timestampAuthorities: [],
  tlogs: [],
  ctlogs: [],
  publicKey: (hint) => {
    if (hint !== keyId) fail('PUBLIC_KEY_ERROR', `key not found: ${hint}`);
    return { publicKey, validFor: () => true };
  },
};

let bundle;
try {
  bundle = bundleFromJSON(JSON.parse(fs.readFileSync(bundlePath, 'utf8')));
} catch (e) {
  fail('BUNDLE_ERROR', e.message);
}
try {
  // key-based and offline: no transparency-log entry, no timestamp authority, no certificate
  const verifier = new Verifier(trustMaterial, { tlogThreshold: 0, ctlogThreshold: 0, timestampThreshold: 0 });
  verifier.verify(toSignedEntity(bundle));
} catch (e) {
  fail(e.code || 'VERIFICATION_ERROR', e.message);
}
const envelope = bundle.content.dsseEnvelope;
if (envelope.payloadType !== 'application/vnd.in-toto+json') fail('PAYLOAD_TYPE', envelope.payloadType);
const statement = JSON.parse(Buffer.from(envelope.payload).toString('utf8'));
if (statement._type !== 'https://in-toto.io/Statement/v1') fail('STATEMENT', statement._type);
if (statement.predicateType !== predicateType) fail('PREDICATE_TYPE', statement.predicateType);
const subjects = (statement.subject || []).map((s) => (s.digest || {}).sha256);
if (subject && (subjects.length !== 1 || subjects[0] !== subject)) fail('SUBJECT', subjects.join(','));
const annotations = (statement.subject[0] || {}).annotations || {};
process.stdout.write(
  JSON.stringify({
    ok: true,
    keyId,
    predicateType: statement.predicateType,
    subjects,
    signedAt: annotations['dev.modelpack.signed-at'] || null,
  }) + '\n',
);
