//! The event catalogue in the portal, in headless Chromium: each type with
//! its description, its schema printed readably with every number as
//! written, its examples and its deprecation; the endpoint form offering
//! the catalogue's types; an event's page linking to its type.

use std::time::Duration;

use crate::{portal::mint, portal_browser::text_of};
use fantoccini::Locator;
use relay_tests::{Browser, Options, Rest, Stack};
use reqwest::Method;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catalogue_page_shows_types_schemas_and_examples_and_events_link_to_their_type() -> anyhow::Result<()> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("portal-catalogue").await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let hostile = "<img src=x onerror=alert(1)> paid";
    let body = format!(
        r#"{{"name": "invoice.paid", "description": "{hostile}", "schema": {{"type": "object", "properties": {{"amount": {{"type": "integer", "maximum": 18446744073709551615}}}}}}, "examples": [{{"amount": 1200}}, {{"amount": 7}}]}}"#
    );
    let (status, created) = rest.raw(Method::POST, "/v1/event-types", body).await?;
    assert_eq!(status, 201, "{created}");
    let (status, _) = rest.post("/v1/event-types", json!({"name": "invoice.voided", "deprecated": true})).await?;
    assert_eq!(status, 201);
    let event = rest.publish("invoice.paid", json!({"amount": 5})).await?;

    let browser = Browser::start().await?;
    let c = &browser.client;
    let e = |what: &'static str| move |err: fantoccini::error::CmdError| anyhow::anyhow!("{what}: {err}");
    c.goto(&mint(&rest).await?).await.map_err(e("opening the link"))?;
    c.wait().at_most(Duration::from_secs(10)).for_element(Locator::Css("a.button.primary")).await.map_err(e("the endpoints page"))?;

    // The catalogue, from the navigation.
    c.find(Locator::LinkText("Event catalogue")).await.map_err(e("the nav link"))?.click().await.map_err(e("clicking"))?;
    let paid = c.wait().for_element(Locator::Css("section[data-event-type='invoice.paid']")).await.map_err(e("the type"))?;
    assert_eq!(c.current_url().await.map_err(e("url"))?.path(), "/portal/event-types");
    let description = text_of(&paid.find(Locator::Css("p.description")).await.map_err(e("description"))?).await?;
    assert_eq!(description, hostile, "the description is text, not markup");
    let schema = text_of(&paid.find(Locator::Css("pre.schema")).await.map_err(e("schema"))?).await?;
    assert!(schema.contains("\"maximum\": 18446744073709551615"), "the bound's digits as written: {schema}");
    assert!(schema.contains("\n    \"amount\": {"), "indented for reading: {schema}");
    let examples = paid.find_all(Locator::Css("pre.example")).await.map_err(e("examples"))?;
    assert_eq!(examples.len(), 2);
    assert!(text_of(&examples[0]).await?.contains("\"amount\": 1200"));
    let voided = c.find(Locator::Css("section[data-event-type='invoice.voided']")).await.map_err(e("the other type"))?;
    assert_eq!(text_of(&voided.find(Locator::Css(".deprecated")).await.map_err(e("deprecated"))?).await?, "deprecated");
    assert!(voided.find(Locator::Css("p.no-schema")).await.is_ok(), "a type without a schema says so");
    browser.screenshot("catalogue-01-page").await?;

    // The new-endpoint form offers the catalogue's types.
    c.goto(&format!("{}/portal/endpoints/new", stack.rest_url)).await.map_err(e("the form"))?;
    let offered = text_of(&c.wait().for_element(Locator::Css("p.catalogue-types")).await.map_err(e("offered types"))?).await?;
    assert!(offered.contains("invoice.paid") && offered.contains("invoice.voided"), "{offered}");

    // An event's type links to its entry.
    c.goto(&format!("{}/portal/events/{event}", stack.rest_url)).await.map_err(e("the event"))?;
    let link = c.wait().for_element(Locator::Css("a#event-type")).await.map_err(e("the type link"))?;
    link.click().await.map_err(e("following it"))?;
    c.wait().for_element(Locator::Css("section#type-invoice\\.paid")).await.map_err(e("landing on the type"))?;
    let at = c.current_url().await.map_err(e("url"))?;
    assert_eq!((at.path(), at.fragment()), ("/portal/event-types", Some("type-invoice.paid")));
    browser.close().await
}
