// Verifies captured Relay deliveries of the symmetric Standard Webhooks
// scheme with the npm package `standardwebhooks` (see verify.py for the
// capture's shape). Usage: node verify.mjs CAPTURE.json
import { readFileSync } from "node:fs";
import { Webhook } from "standardwebhooks";

const capture = JSON.parse(readFileSync(process.argv[2], "utf8"));
const failures = [];
let checks = 0;
const check = (ok, what) => {
  checks += 1;
  if (!ok) failures.push(what);
};
const refusal = (fn) => {
  try {
    fn();
    return null;
  } catch (e) {
    return e;
  }
};

const realNow = Date.now;
for (const d of capture.deliveries) {
  if (d.scheme !== "standard-webhooks") continue;
  const body = Buffer.from(d.body_b64, "base64").toString("utf8");
  d.secrets.forEach((secret, i) => {
    const name = `${d.name}: secret ${i}`;
    const e = refusal(() => new Webhook(secret).verify(body, d.headers));
    check(e === null, `${name}: standardwebhooks refused it: ${e}`);
    check(refusal(() => new Webhook(secret).verify(body + " ", d.headers)) !== null, `${name}: accepted a changed body`);
    // Just past the specification's 5-minute tolerance.
    Date.now = () => realNow() + 301_000;
    const late = refusal(() => new Webhook(secret).verify(body, d.headers));
    Date.now = realNow;
    check(late !== null && /too old/.test(String(late)), `${name}: 301 s later it said ${late}, not too old`);
  });
}
for (const f of failures) console.log("FAILED", f);
console.log(`node verifiers: ${checks - failures.length} of ${checks} checks passed`);
process.exit(failures.length ? 1 : 0);
