// A minimal Relay webhook receiver in Node.js (node:http + the
// `standardwebhooks` package): verifies either symmetric scheme,
// deduplicates on the event id, answers at once and processes later.
//
//   npm install standardwebhooks@1.1.1
//   RELAY_SECRET=whsec_... PORT=8000 node receiver.mjs
import { createHmac, timingSafeEqual } from "node:crypto";
import { createServer } from "node:http";
import { Webhook } from "standardwebhooks";

const SECRET = process.env.RELAY_SECRET;
const TOLERANCE_SECS = 5 * 60;
const seen = new Set(); // in production: a table with a unique key on the event id
const work = [];

// relay-v1: HMAC-SHA256 keyed with the secret's text over
// v1:<timestamp>:<raw body>, lowercase hex; any v1= entry may match.
function verifyRelayV1(headers, body) {
  const ts = headers["relay-webhook-timestamp"] ?? "";
  if (!/^\d+$/.test(ts) || Math.abs(Date.now() / 1000 - Number(ts)) > TOLERANCE_SECS) {
    throw new Error("timestamp missing or outside 5 minutes");
  }
  const expected = Buffer.from(
    createHmac("sha256", SECRET).update(`v1:${ts}:`).update(body).digest("hex"),
  );
  const entries = (headers["relay-webhook-signature"] ?? "")
    .split(",")
    .map((e) => e.trim())
    .filter((e) => e.startsWith("v1="))
    .map((e) => Buffer.from(e.slice(3)));
  if (!entries.some((e) => e.length === expected.length && timingSafeEqual(e, expected))) {
    throw new Error("no signature matches");
  }
  return headers["relay-webhook-id"];
}

function verify(headers, body) {
  if (headers["webhook-signature"]) {
    new Webhook(SECRET).verify(body.toString("utf8"), headers); // throws on failure
    return headers["webhook-id"];
  }
  return verifyRelayV1(headers, body);
}

const server = createServer((req, res) => {
  const chunks = [];
  req.on("data", (c) => chunks.push(c));
  req.on("end", () => {
    const body = Buffer.concat(chunks);
    let id;
    try {
      id = verify(req.headers, body);
    } catch (e) {
      console.log(`rejected: ${e.message}`);
      res.writeHead(401).end();
      return;
    }
    if (seen.has(id)) {
      console.log(`duplicate ${id}`);
    } else {
      seen.add(id);
      work.push([id, body]);
      setImmediate(processQueued);
    }
    // Answer fast: Relay counts anything slower than its timeout as a failure.
    res.writeHead(204).end();
  });
});

function processQueued() {
  for (let next = work.shift(); next; next = work.shift()) {
    const [id, body] = next;
    console.log(`processed ${id} ${JSON.parse(body).type}`);
  }
}

server.listen(Number(process.env.PORT ?? 8000), "127.0.0.1", () => {
  console.log(`listening on ${server.address().port}`);
});
