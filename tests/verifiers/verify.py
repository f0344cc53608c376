"""Verifies captured Relay deliveries with other people's code: the PyPI
packages `standardwebhooks` and `svix` for the symmetric Standard Webhooks
scheme, and for the ed25519 scheme a check written from the specification
with `cryptography` (the Standard Webhooks libraries verify only "v1").

Usage: python verify.py CAPTURE.json   (written by tests/e2e/schemes.rs)

Each capture lists a delivery's headers, its body (base64), the secrets or
public keys it must verify under (current first) and how many signature
entries it carries. Every check that fails is printed; the exit status is 1
if any did. The last line counts the checks.
"""

import base64
import json
import sys
from datetime import datetime, timedelta, timezone
from unittest import mock

import standardwebhooks
import standardwebhooks.webhooks
import svix.webhooks
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

failures = []
checks = 0


def check(ok, what):
    global checks
    checks += 1
    if not ok:
        failures.append(what)


def raises(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - any refusal counts, its kind is printed
        return e
    return None


class LaterClock(datetime):
    """`datetime` whose now() is 301 s ahead: a delivery replayed just past
    the specification's 5-minute tolerance."""

    @classmethod
    def now(cls, tz=None):
        return datetime.now(tz=tz or timezone.utc) + timedelta(seconds=301)


def symmetric(d, body, headers):
    for i, secret in enumerate(d["secrets"]):
        name = f"{d['name']}: secret {i}"
        e = raises(lambda: standardwebhooks.Webhook(secret).verify(body, headers))
        check(e is None, f"{name}: standardwebhooks refused it: {e!r}")
        e = raises(lambda: svix.webhooks.Webhook(secret).verify(body, headers))
        check(e is None, f"{name}: svix refused it: {e!r}")
        tampered = body[:-1] + (b" " if body[-1:] != b" " else b"\t")
        check(raises(lambda: standardwebhooks.Webhook(secret).verify(tampered, headers)) is not None,
              f"{name}: standardwebhooks accepted a changed body")
        check(raises(lambda: svix.webhooks.Webhook(secret).verify(tampered, headers)) is not None,
              f"{name}: svix accepted a changed body")
        with mock.patch.object(standardwebhooks.webhooks, "datetime", LaterClock):
            e = raises(lambda: standardwebhooks.Webhook(secret).verify(body, headers))
        check(e is not None and "too old" in str(e), f"{name}: 301 s later standardwebhooks said {e!r}, not too old")


def ed25519(d, body, headers):
    entries = headers["webhook-signature"].split(" ")
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    for i, public in enumerate(d["public_keys"]):
        name = f"{d['name']}: public key {i}"
        check(public.startswith("whpk_"), f"{name}: {public!r} is not whpk_")
        key = Ed25519PublicKey.from_public_bytes(base64.b64decode(public[len("whpk_"):]))
        version, sig = entries[i].split(",", 1)
        check(version == "v1a", f"{name}: entry {i} is {version!r}, not v1a")
        try:
            key.verify(base64.b64decode(sig), signed)
            ok = True
        except InvalidSignature:
            ok = False
        check(ok, f"{name}: entry {i} does not verify under it (current first)")
        try:
            key.verify(base64.b64decode(sig), signed + b" ")
            tampered_ok = True
        except InvalidSignature:
            tampered_ok = False
        check(not tampered_ok, f"{name}: a changed body verified")


def main(path):
    with open(path) as f:
        capture = json.load(f)
    for d in capture["deliveries"]:
        body = base64.b64decode(d["body_b64"])
        headers = d["headers"]
        check(len(headers.get("webhook-signature", "").split(" ")) == d["entries"],
              f"{d['name']}: {d['entries']} entries expected in {headers.get('webhook-signature')!r}")
        ts = int(headers["webhook-timestamp"])
        now = datetime.now(timezone.utc).timestamp()
        check(abs(now - ts) < 300, f"{d['name']}: webhook-timestamp {ts} is not unix seconds near {now:.0f}")
        if d["scheme"] == "standard-webhooks":
            symmetric(d, body, headers)
        elif d["scheme"] == "standard-webhooks-ed25519":
            ed25519(d, body, headers)
        else:
            check(False, f"{d['name']}: unknown scheme {d['scheme']!r}")
    for f in failures:
        print("FAILED", f)
    print(f"python verifiers: {checks - len(failures)} of {checks} checks passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main(sys.argv[1])
