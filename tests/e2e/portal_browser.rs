//! The portal in headless Chromium: an endpoint created, a delivery seen, a
//! dead letter replayed, hostile strings kept as text; and the page telling a
//! receiver whose retries succeed from one that is down.

use crate::portal::{CSP, browser, enter, mint, page};
use std::time::Duration;

use fantoccini::{Locator, elements::Element};
use relay_tests::{Browser, Options, Receiver, Reply, Rest, Stack};
use reqwest::header;
use serde_json::json;

pub(crate) async fn text_of(el: &Element) -> anyhow::Result<String> {
    el.text().await.map_err(|e| anyhow::anyhow!("reading text: {e}"))
}

/// Reloads `path` until an element matches `css` (bounded); its text.
async fn wait_for_text(browser: &Browser, url: &str, css: &str, want: &str, within: Duration) -> anyhow::Result<String> {
    let deadline = std::time::Instant::now() + within;
    let mut last = String::new();
    loop {
        browser.client.goto(url).await.map_err(|e| anyhow::anyhow!("goto {url}: {e}"))?;
        if let Ok(found) = browser.client.find_all(Locator::Css(css)).await {
            for el in found {
                // An element gone stale (the page replaced it while it was
                // read) is read again after the next load.
                let Ok(text) = text_of(&el).await else { break };
                last = text;
                if last.contains(want) {
                    return Ok(last);
                }
            }
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "{css} on {url} never said {want:?} (last: {last:?})");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The issue's walk, in headless Chromium: a link opens the portal; an
/// endpoint is created in the page (its secret shown once, with a working
/// copy button); an event published through REST is seen delivered (200)
/// and its signature verifies with that secret; the receiver fails, the
/// dead letter shows, is replayed from the page and is delivered; the
/// charts draw the attempts; hostile strings render inert; signing out
/// ends the session. Screenshots of each page are saved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_browser_an_endpoint_is_created_a_delivery_seen_a_dead_letter_replayed_and_hostile_strings_stay_text() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default().tiers("0,50,50").circuit_off()).await?;
    let tenant = stack.tenant("portal-browser").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let browser = Browser::start().await?;
    let c = &browser.client;
    let e = |what: &'static str| move |err: fantoccini::error::CmdError| anyhow::anyhow!("{what}: {err}");

    // The link: the page moves on to the portal by itself, signed in.
    let link = mint(&rest).await?;
    c.goto(&link).await.map_err(e("opening the link"))?;
    let heading =
        c.wait().at_most(Duration::from_secs(10)).for_element(Locator::Css("a.button.primary")).await.map_err(e("the endpoints page"))?;
    assert_eq!(text_of(&heading).await?, "Add endpoint");
    assert_eq!(c.current_url().await.map_err(e("url"))?.path(), "/portal/");
    let cookie = c.get_named_cookie("relay_portal").await.map_err(e("the session cookie"))?;
    assert_eq!((cookie.http_only(), format!("{:?}", cookie.same_site())), (Some(true), "Some(Strict)".to_owned()));
    assert_eq!(cookie.path(), Some("/portal"));
    // The CSP as the browser got it, read with the browser's own cookie.
    let headers = browser_get(&stack.rest_url, "/portal/", cookie.value()).await?;
    assert_eq!(headers.get(header::CONTENT_SECURITY_POLICY).and_then(|v| v.to_str().ok()), Some(CSP));
    browser.screenshot("01-endpoints-empty").await?;

    // Create an endpoint with a hostile event type.
    let hostile_type = "<img/src=x/onerror=alert(1)>";
    heading.click().await.map_err(e("add endpoint"))?;
    let form = c.wait().for_element(Locator::Css("form#create-endpoint")).await.map_err(e("the form"))?;
    form.find(Locator::Css("input[name=url]")).await.map_err(e("url"))?.send_keys(&receiver.url("/hook")).await.map_err(e("typing"))?;
    form.find(Locator::Css("textarea[name=event_types]"))
        .await
        .map_err(e("types"))?
        .send_keys(&format!("order.paid\n{hostile_type}"))
        .await
        .map_err(e("typing"))?;
    browser.screenshot("02-endpoint-new").await?;
    form.find(Locator::Css("button[type=submit]")).await.map_err(e("submit"))?.click().await.map_err(e("submit"))?;
    let secret_field = c.wait().for_element(Locator::Css("input#secret")).await.map_err(e("the secret page"))?;
    let secret = secret_field.prop("value").await.map_err(e("secret"))?.unwrap_or_default();
    assert!(secret.starts_with("whsec_") && secret.len() > 40, "{secret:?}");
    // The copy button is the script's: shown only when the script ran.
    let copy = c.find(Locator::Css("button.copy")).await.map_err(e("copy"))?;
    assert!(copy.is_displayed().await.map_err(e("copy shown"))?, "the portal's script did not run under its CSP");
    copy.click().await.map_err(e("copy"))?;
    browser.screenshot("03-secret-shown-once").await?;
    c.find(Locator::Css("a.button")).await.map_err(e("continue"))?.click().await.map_err(e("continue"))?;
    c.wait().for_element(Locator::Css("form#edit-endpoint")).await.map_err(e("the endpoint page"))?;
    let endpoint_url = c.current_url().await.map_err(e("url"))?.to_string();
    let source = c.source().await.map_err(e("source"))?;
    assert!(!source.contains(&secret), "the secret is shown once only");
    // The hostile type is text: no image element anywhere, the tag shows it verbatim.
    assert!(c.find_all(Locator::Css("img")).await.map_err(e("img"))?.is_empty(), "a tenant string became markup");
    let tags: Vec<String> = futures::future::try_join_all(
        c.find_all(Locator::Css("dl.facts .tag")).await.map_err(e("tags"))?.iter().map(|t| async move { text_of(t).await }),
    )
    .await?;
    assert!(tags.contains(&hostile_type.to_owned()) && tags.contains(&"order.paid".to_owned()), "{tags:?}");
    let endpoint_id = endpoint_url.rsplit('/').next().unwrap_or_default().to_owned();
    let listed = rest.get(&format!("/v1/webhooks/{endpoint_id}")).await?;
    assert_eq!(listed["url"].as_str(), Some(receiver.url("/hook").as_str()), "created through the page: {listed}");

    // An event through REST, delivered with status 200, signed with that secret.
    let payload = json!({"order": 42, "note": "</pre><script>alert(1)</script>"});
    let first = rest.publish("order.paid", payload).await?;
    let event_url = format!("{}/portal/events/{first}", stack.rest_url);
    let state = wait_for_text(&browser, &event_url, ".delivery-state", "delivered", Duration::from_secs(20)).await?;
    assert_eq!(state, "delivered");
    assert_eq!(text_of(&c.find(Locator::Css(".attempt-outcome")).await.map_err(e("outcome"))?).await?, "HTTP 200");
    let got = receiver.wait_at("/hook", 1, Duration::from_secs(5)).await;
    let ts = got[0].header("relay-webhook-timestamp");
    assert!(got[0].header("relay-webhook-signature").contains(&relay_tests::contract_signature(&secret, &ts, &got[0].body)));
    // The payload shows as sent, its markup as text.
    let shown = text_of(&c.find(Locator::Css("pre.payload")).await.map_err(e("payload"))?).await?;
    assert!(shown.contains("</pre><script>alert(1)</script>") && shown.contains(&first), "{shown}");
    let scripts = c.find_all(Locator::Css("script")).await.map_err(e("scripts"))?;
    assert_eq!(scripts.len(), 1, "only the portal's own script element");
    browser.screenshot("04-event-delivered").await?;

    // The event log lists it; a filter by another type does not.
    c.goto(&format!("{}/portal/events", stack.rest_url)).await.map_err(e("events"))?;
    c.find(Locator::Css(&format!("tr[data-event-id='{first}']"))).await.map_err(e("the event's row"))?;
    browser.screenshot("05-events").await?;
    // A hostile endpoint URL (registered through REST) renders inert on the
    // list: no element made of it, its text as stored.
    let hostile_url = format!("{}?q='><img src=x onerror=alert(1)>&r=\"x\"", receiver.url("/odd"));
    let (status, odd) = rest.call(reqwest::Method::POST, "/v1/webhooks", Some(json!({"url": hostile_url, "event_types": ["odd"]}))).await?;
    assert_eq!(status, 201, "{odd}");
    let stored = odd["endpoint"]["url"].as_str().expect("a url").to_owned();
    c.goto(&format!("{}/portal/", stack.rest_url)).await.map_err(e("endpoints"))?;
    let odd_id = odd["endpoint"]["id"].as_str().expect("an id").to_owned();
    let cell = c.find(Locator::Css(&format!("tr[data-endpoint-id='{odd_id}'] td.url code"))).await.map_err(e("the odd row"))?;
    assert_eq!(text_of(&cell).await?, stored);
    assert!(c.find_all(Locator::Css("img")).await.map_err(e("img"))?.is_empty(), "a tenant URL became markup");
    assert!(c.get_alert_text().await.is_err(), "no script ran");
    let (status, _) = rest.call(reqwest::Method::DELETE, &format!("/v1/webhooks/{odd_id}"), None).await?;
    assert_eq!(status, 204);
    c.goto(&format!("{}/portal/events", stack.rest_url)).await.map_err(e("events"))?;
    let filters = c.find(Locator::Css("form#event-filters")).await.map_err(e("filters"))?;
    filters.find(Locator::Css("input[name=type]")).await.map_err(e("type"))?.send_keys("invoice.sent").await.map_err(e("typing"))?;
    filters.find(Locator::Css("button[type=submit]")).await.map_err(e("filter"))?.click().await.map_err(e("filter"))?;
    c.wait().for_element(Locator::Css("p.empty")).await.map_err(e("an empty, filtered log"))?;
    assert!(c.find_all(Locator::Css("tr[data-event-id]")).await.map_err(e("rows"))?.is_empty());

    // The receiver fails: the dead letter shows; replayed from the page once
    // it answers again, it is delivered.
    receiver.reply("/hook", Reply::Status(503));
    let second = rest.publish("order.paid", json!({"order": 43})).await?;
    let letters = format!("{}/portal/dead-letters", stack.rest_url);
    wait_for_text(&browser, &letters, &format!("tr[data-event-id='{second}']"), "HTTP 503", Duration::from_secs(20)).await?;
    browser.screenshot("06-dead-letters").await?;
    let failed =
        wait_for_text(&browser, &format!("{}/portal/events/{second}", stack.rest_url), ".delivery-state", "failed", Duration::from_secs(5))
            .await?;
    assert_eq!(failed, "failed: dead letter");
    assert_eq!(c.find_all(Locator::Css("li.attempt")).await.map_err(e("attempts"))?.len(), 3, "three attempts on the timeline");
    browser.screenshot("07-event-dead").await?;
    receiver.reply("/hook", Reply::Status(200));
    c.goto(&letters).await.map_err(e("dead letters"))?;
    c.find(Locator::Css(&format!("tr[data-event-id='{second}'] form.replay button")))
        .await
        .map_err(e("replay"))?
        .click()
        .await
        .map_err(e("replay"))?;
    c.wait().for_element(Locator::Css(".delivery-state")).await.map_err(e("the event page after a replay"))?;
    assert_eq!(c.current_url().await.map_err(e("url"))?.path(), format!("/portal/events/{second}"));
    let replayed = wait_for_text(
        &browser,
        &format!("{}/portal/events/{second}", stack.rest_url),
        ".delivery-state",
        "delivered",
        Duration::from_secs(20),
    )
    .await?;
    assert_eq!(replayed, "delivered");
    let newest = text_of(&c.find(Locator::Css("li.attempt")).await.map_err(e("newest attempt"))?).await?;
    assert!(newest.contains("replay 1") && newest.contains("HTTP 200"), "{newest}");
    assert_eq!(receiver.at("/hook").iter().filter(|r| r.json()["id"] == second.as_str()).count(), 4, "three failures and the replay");
    browser.screenshot("08-event-replayed").await?;

    // The charts: the attempts of the last minutes, drawn (sums are written every 5 s).
    let totals = wait_for_text(&browser, &endpoint_url, "p.totals", "5 attempts", Duration::from_secs(20)).await?;
    assert!(totals.starts_with("5 attempts · success 40.0 % · p50 "), "{totals}");
    assert!(!c.find_all(Locator::Css("svg rect.bucket")).await.map_err(e("bars"))?.is_empty(), "the success chart draws the attempts");
    assert_eq!(c.find_all(Locator::Css("svg path.p50")).await.map_err(e("p50"))?.len(), 1);
    assert_eq!(c.find_all(Locator::Css("svg path.p99")).await.map_err(e("p99"))?.len(), 1);
    browser.screenshot("09-endpoint-charts").await?;

    // The dead letter now says it was replayed, and offers no second replay.
    c.goto(&letters).await.map_err(e("dead letters"))?;
    let row = c.find(Locator::Css(&format!("tr[data-event-id='{second}']"))).await.map_err(e("the row"))?;
    assert_eq!(text_of(&row.find(Locator::Css(".replayed")).await.map_err(e("replayed"))?).await?, "replayed");
    assert!(row.find_all(Locator::Css("form.replay")).await.map_err(e("forms"))?.is_empty());

    // Edit, rotate, disable, enable, delete — each through its form.
    c.goto(&endpoint_url).await.map_err(e("the endpoint"))?;
    let types = c.find(Locator::Css("form#edit-endpoint textarea[name=event_types]")).await.map_err(e("types"))?;
    types.send_keys("\ninvoice.sent").await.map_err(e("typing"))?;
    c.find(Locator::Css("form#edit-endpoint button[type=submit]")).await.map_err(e("save"))?.click().await.map_err(e("save"))?;
    let notice = c.wait().for_element(Locator::Css("p.notice")).await.map_err(e("saved"))?;
    assert_eq!(text_of(&notice).await?, "Saved.");
    let after = rest.get(&format!("/v1/webhooks/{endpoint_id}")).await?;
    assert_eq!(after["event_types"], json!(["order.paid", hostile_type, "invoice.sent"]), "{after}");
    c.find(Locator::Css("form#rotate-secret button")).await.map_err(e("rotate"))?.click().await.map_err(e("rotate"))?;
    let rotated = c.wait().for_element(Locator::Css("input#secret")).await.map_err(e("the rotated secret"))?;
    let new_secret = rotated.prop("value").await.map_err(e("secret"))?.unwrap_or_default();
    assert!(new_secret.starts_with("whsec_") && new_secret != secret, "{new_secret:?}");
    c.goto(&endpoint_url).await.map_err(e("the endpoint"))?;
    assert!(!c.source().await.map_err(e("source"))?.contains(&new_secret), "a rotated secret is shown once only");
    c.find(Locator::Css("form#disable-endpoint button")).await.map_err(e("disable"))?.click().await.map_err(e("disable"))?;
    c.wait().for_element(Locator::Css("form#enable-endpoint")).await.map_err(e("disabled"))?;
    assert_eq!(text_of(&c.find(Locator::Css("#endpoint-status")).await.map_err(e("status"))?).await?, "disabled");
    c.find(Locator::Css("form#enable-endpoint button")).await.map_err(e("enable"))?.click().await.map_err(e("enable"))?;
    c.wait().for_element(Locator::Css("form#disable-endpoint")).await.map_err(e("enabled"))?;
    assert_eq!(text_of(&c.find(Locator::Css("#endpoint-status")).await.map_err(e("status"))?).await?, "active");
    // Deleting asks first (the portal's script): dismissed, nothing happens.
    c.find(Locator::Css("form#delete-endpoint button")).await.map_err(e("delete"))?.click().await.map_err(e("delete"))?;
    assert!(c.get_alert_text().await.map_err(e("the confirmation"))?.starts_with("Delete this endpoint?"));
    c.dismiss_alert().await.map_err(e("dismiss"))?;
    assert_eq!(rest.get(&format!("/v1/webhooks/{endpoint_id}")).await?["id"].as_str(), Some(endpoint_id.as_str()));
    c.find(Locator::Css("form#delete-endpoint button")).await.map_err(e("delete"))?.click().await.map_err(e("delete"))?;
    c.accept_alert().await.map_err(e("accept"))?;
    c.wait().for_element(Locator::Css("p.empty")).await.map_err(e("the list without it"))?;
    let (status, _) = rest.call(reqwest::Method::GET, &format!("/v1/webhooks/{endpoint_id}"), None).await?;
    assert_eq!(status, 404, "deleted through the page");

    // Signing out ends it.
    c.find(Locator::Css("form.inline button")).await.map_err(e("sign out"))?.click().await.map_err(e("sign out"))?;
    // The page's h1 is found before the click's navigation replaces it (and
    // then goes stale): read it until the new page's says so (bounded).
    let mut heading = String::new();
    for _ in 0..100 {
        if let Ok(h1) = c.find(Locator::Css("h1")).await
            && let Ok(text) = text_of(&h1).await
        {
            heading = text;
            if heading == "Signed out" {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(heading, "Signed out");
    c.goto(&format!("{}/portal/", stack.rest_url)).await.map_err(e("after sign-out"))?;
    let h1 = c.find(Locator::Css("h1")).await.map_err(e("ended"))?;
    assert_eq!(text_of(&h1).await?, "Your session has ended");
    browser.close().await?;
    stack.stop().await
}

async fn browser_get(base: &str, path: &str, cookie: &str) -> anyhow::Result<header::HeaderMap> {
    let resp = reqwest::Client::new().get(format!("{base}{path}")).header(header::COOKIE, format!("relay_portal={cookie}")).send().await?;
    anyhow::ensure!(resp.status() == 200, "{path} answered {}", resp.status());
    Ok(resp.headers().clone())
}

/// The portal tells a receiver that fails sometimes (its retries get
/// through) from one that is down: only the second is shown as down, with
/// its deliveries held; the first is active, with its recent failures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_portal_tells_a_receiver_whose_retries_succeed_from_one_that_is_down() -> anyhow::Result<()> {
    use relay_tests::flaky::{Behaviour, Flaky};
    let stack = Stack::start(Options::default().probes(Duration::from_secs(30), Duration::from_secs(30))).await?;
    let tenant = stack.tenant("truth").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/not-ready", Reply::Flaky(Flaky::new(Behaviour::FailFirst(503))));
    receiver.reply("/down", Reply::Status(500));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (not_ready, _) = rest.endpoint(&receiver.url("/not-ready"), &["t"]).await?;
    let (down, _) = rest.endpoint(&receiver.url("/down"), &["t"]).await?;
    let mut opened = false;
    for n in 0..200 {
        rest.publish("t", json!({"n": n})).await?;
        tokio::time::sleep(Duration::from_millis(50)).await;
        if rest.get(&format!("/v1/webhooks/{down}")).await?["health"]["state"] == "open" {
            opened = true;
            break;
        }
    }
    assert!(opened, "the endpoint that is down opened");
    let ep = rest.get(&format!("/v1/webhooks/{not_ready}")).await?;
    assert_eq!(ep["health"]["state"], "closed", "{ep}");

    let http = browser();
    let session = enter(&http, &mint(&rest).await?).await?;
    let (status, _, html) = page(&http, format!("{}/portal/endpoints/{not_ready}", stack.rest_url), Some(&session)).await?;
    assert_eq!(status, 200);
    assert!(html.contains(r#"id="endpoint-status">active<"#), "{html}");
    assert!(html.contains("Recent attempts") && html.contains("failed in the last 2 minutes"), "its failures are shown: {html}");
    assert!(!html.contains("Down since"), "{html}");
    let (_, _, html) = page(&http, format!("{}/portal/endpoints/{down}", stack.rest_url), Some(&session)).await?;
    assert!(html.contains(r#"id="endpoint-status">down: deliveries held<"#), "{html}");
    assert!(html.contains("Down since"), "{html}");
    let (_, _, list) = page(&http, format!("{}/portal/", stack.rest_url), Some(&session)).await?;
    assert_eq!(list.matches("down: deliveries held").count(), 1, "{list}");
    stack.stop().await
}
