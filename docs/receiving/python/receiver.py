"""A minimal Relay webhook receiver in Python (standard library + the
`standardwebhooks` package): verifies either symmetric scheme, deduplicates
on the event id, answers at once and processes later.

    pip install standardwebhooks==1.1.0
    RELAY_SECRET=whsec_... PORT=8000 python receiver.py
"""

import hashlib
import hmac
import json
import os
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks import Webhook, WebhookVerificationError

SECRET = os.environ["RELAY_SECRET"]
TOLERANCE_SECS = 5 * 60
# Every secret Relay mints is also a Standard Webhooks secret; one minted
# before Relay supported that scheme is not, and then signs relay-v1 only.
try:
    STANDARD = Webhook(SECRET)
except Exception:  # noqa: BLE001
    STANDARD = None

work = queue.Queue()
seen = set()  # in production: a table with a unique key on the event id
seen_lock = threading.Lock()


def verify_relay_v1(headers, body):
    """relay-v1: HMAC-SHA256 keyed with the secret's text over
    v1:<timestamp>:<raw body>, lowercase hex; any v1= entry may match."""
    ts = headers.get("relay-webhook-timestamp", "")
    if not ts.isdigit() or abs(time.time() - int(ts)) > TOLERANCE_SECS:
        raise ValueError("timestamp missing or outside 5 minutes")
    expected = hmac.new(SECRET.encode(), b"v1:" + ts.encode() + b":" + body, hashlib.sha256).hexdigest()
    entries = [e.strip()[3:] for e in headers.get("relay-webhook-signature", "").split(",") if e.strip().startswith("v1=")]
    if not any(hmac.compare_digest(expected, e) for e in entries):
        raise ValueError("no signature matches")
    return headers["relay-webhook-id"]


def verify(headers, body):
    """The event id of a verified request; raises otherwise."""
    if "webhook-signature" in headers:
        if STANDARD is None:
            raise ValueError("this secret cannot verify standard-webhooks")
        STANDARD.verify(body, headers)  # raises WebhookVerificationError
        return headers["webhook-id"]
    return verify_relay_v1(headers, body)


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        headers = {k.lower(): v for k, v in self.headers.items()}
        try:
            event_id = verify(headers, body)
        except (ValueError, KeyError, WebhookVerificationError) as e:
            print(f"rejected: {e}", flush=True)
            self.send_response(401)
            self.end_headers()
            return
        with seen_lock:
            duplicate = event_id in seen
            seen.add(event_id)
        if duplicate:
            print(f"duplicate {event_id}", flush=True)
        else:
            work.put((event_id, body))
        # Answer fast: Relay counts anything slower than its timeout as a failure.
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def worker():
    while True:
        event_id, body = work.get()
        event = json.loads(body)
        print(f"processed {event_id} {event['type']}", flush=True)


if __name__ == "__main__":
    threading.Thread(target=worker, daemon=True).start()
    server = ThreadingHTTPServer(("127.0.0.1", int(os.environ.get("PORT", "8000"))), Handler)
    print(f"listening on {server.server_address[1]}", flush=True)
    server.serve_forever()
