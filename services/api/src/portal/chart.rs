//! The endpoint page's charts, drawn on the server as SVG: success rate and
//! p50/p99 latency per 5-minute bucket over the last 24 h. Only numbers and
//! fixed words go into the drawing (no tenant string), which is why the
//! template may insert it unescaped.

use std::fmt::Write;

use crate::app::attempt_stats::{BUCKET, BucketSums, Chart};

const WIDTH: f64 = 864.0;
const HEIGHT: f64 = 160.0;
const LEFT: f64 = 48.0;
const TOP: f64 = 10.0;
const BOTTOM: f64 = 22.0;

/// Both drawings and the window's totals.
pub struct Charts {
    pub success_svg: String,
    pub latency_svg: String,
    pub attempts: i64,
    pub success_rate: String,
    pub p50: String,
    pub p99: String,
}

fn ms(v: Option<f64>) -> String {
    match v {
        None => "–".into(),
        Some(v) if v >= 1000.0 => format!("{:.2} s", v / 1000.0),
        Some(v) => format!("{v:.0} ms"),
    }
}

/// A round number at or above `v`, for the latency axis.
fn nice_ceiling(v: f64) -> f64 {
    [10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10_000.0, 20_000.0].into_iter().find(|&c| v <= c).unwrap_or(30_000.0)
}

impl Charts {
    pub fn of(chart: &Chart) -> Self {
        let mut total = BucketSums::default();
        for b in &chart.buckets {
            total.merge(b);
        }
        let success_rate =
            if total.attempts == 0 { "–".into() } else { format!("{:.1} %", 100.0 * total.succeeded as f64 / total.attempts as f64) };
        Self {
            success_svg: success(chart),
            latency_svg: latency(chart),
            attempts: total.attempts,
            success_rate,
            p50: ms(total.latency_quantile_ms(0.5)),
            p99: ms(total.latency_quantile_ms(0.99)),
        }
    }
}

fn plot_width() -> f64 {
    WIDTH - LEFT - 8.0
}

fn plot_height() -> f64 {
    HEIGHT - TOP - BOTTOM
}

fn x_of(i: usize, n: usize) -> f64 {
    LEFT + plot_width() * i as f64 / n.max(1) as f64
}

/// The frame: the y axis's labels and grid lines, and the time axis.
fn frame(svg: &mut String, chart: &Chart, label: &str, ticks: &[(f64, String)]) {
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{label}">"#
    );
    for (frac, text) in ticks {
        let y = TOP + plot_height() * (1.0 - frac);
        let _ = write!(
            svg,
            r##"<line x1="{LEFT}" x2="{x2}" y1="{y:.1}" y2="{y:.1}" stroke="#d9dde3" stroke-width="1"/><text x="{tx}" y="{ty:.1}" font-size="10" text-anchor="end" fill="#5b6470">{text}</text>"##,
            x2 = WIDTH - 8.0,
            tx = LEFT - 4.0,
            ty = y + 3.0,
        );
    }
    let n = chart.buckets.len();
    // A label every 6 hours, at the bucket that starts it.
    for (i, _) in chart.buckets.iter().enumerate() {
        let at = chart.from + BUCKET * i as i32;
        if at.format("%M").to_string() == "00" && at.format("%H").to_string().parse::<u32>().unwrap_or(1) % 6 == 0 {
            let x = x_of(i, n);
            let _ = write!(
                svg,
                r##"<text x="{x:.1}" y="{y}" font-size="10" text-anchor="middle" fill="#5b6470">{t}</text>"##,
                y = HEIGHT - 6.0,
                t = at.format("%H:%M"),
            );
        }
    }
}

fn success(chart: &Chart) -> String {
    let mut svg = String::with_capacity(16 * 1024);
    let ticks = [(0.0, "0 %".to_owned()), (0.5, "50 %".to_owned()), (1.0, "100 %".to_owned())];
    frame(&mut svg, chart, "success rate per 5 minutes", &ticks);
    let n = chart.buckets.len();
    let w = (plot_width() / n.max(1) as f64).max(1.0);
    for (i, b) in chart.buckets.iter().enumerate() {
        if b.attempts == 0 {
            continue;
        }
        let rate = b.succeeded as f64 / b.attempts as f64;
        let h = (plot_height() * rate).max(1.0);
        let fill = if rate >= 0.99 {
            "#1a7f37"
        } else if rate >= 0.5 {
            "#9a6700"
        } else {
            "#cf222e"
        };
        let at = chart.from + BUCKET * i as i32;
        let _ = write!(
            svg,
            r#"<rect class="bucket" x="{x:.1}" y="{y:.1}" width="{w:.2}" height="{h:.1}" fill="{fill}"><title>{t}: {a} attempts, {r:.1} % succeeded</title></rect>"#,
            x = x_of(i, n),
            y = TOP + plot_height() - h,
            t = at.format("%H:%M UTC"),
            a = b.attempts,
            r = rate * 100.0,
        );
    }
    svg.push_str("</svg>");
    svg
}

fn latency(chart: &Chart) -> String {
    let p: Vec<(Option<f64>, Option<f64>)> =
        chart.buckets.iter().map(|b| (b.latency_quantile_ms(0.5), b.latency_quantile_ms(0.99))).collect();
    let top = nice_ceiling(p.iter().filter_map(|(_, p99)| *p99).fold(0.0, f64::max));
    let mut svg = String::with_capacity(16 * 1024);
    let ticks = [(0.0, "0".to_owned()), (0.5, ms(Some(top / 2.0))), (1.0, ms(Some(top)))];
    frame(&mut svg, chart, "p50 and p99 latency per 5 minutes", &ticks);
    let n = chart.buckets.len();
    let half = plot_width() / n.max(1) as f64 / 2.0;
    for (which, colour, class) in [(0usize, "#2457c5", "p50"), (1, "#cf222e", "p99")] {
        // A line broken where nothing was attempted.
        let mut d = String::new();
        let mut open = false;
        for (i, v) in p.iter().enumerate() {
            let v = if which == 0 { v.0 } else { v.1 };
            match v {
                Some(v) => {
                    let x = x_of(i, n) + half;
                    let y = TOP + plot_height() * (1.0 - (v / top).min(1.0));
                    let _ = write!(d, "{}{x:.1},{y:.1} ", if open { "L" } else { "M" });
                    open = true;
                }
                None => open = false,
            }
        }
        if !d.is_empty() {
            let _ = write!(svg, r#"<path class="{class}" d="{d}" fill="none" stroke="{colour}" stroke-width="1.5"/>"#);
        }
        // A dot per bucket as well: a bucket between two empty ones is no line.
        for (i, v) in p.iter().enumerate() {
            if let Some(v) = if which == 0 { v.0 } else { v.1 } {
                let _ = write!(
                    svg,
                    r#"<circle cx="{x:.1}" cy="{y:.1}" r="2" fill="{colour}"><title>{t}: {class} {v}</title></circle>"#,
                    x = x_of(i, n) + half,
                    y = TOP + plot_height() * (1.0 - (v / top).min(1.0)),
                    t = (chart.from + BUCKET * i as i32).format("%H:%M UTC"),
                    v = ms(Some(v)),
                );
            }
        }
    }
    let _ = write!(
        svg,
        r##"<text x="{x}" y="{y}" font-size="10" fill="#2457c5">p50</text><text x="{x2}" y="{y}" font-size="10" fill="#cf222e">p99</text>"##,
        x = LEFT + 4.0,
        x2 = LEFT + 30.0,
        y = TOP + 10.0,
    );
    svg.push_str("</svg>");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart_with(bucket: usize, attempts: &[(bool, u64)]) -> Chart {
        let mut buckets = vec![BucketSums::default(); 288];
        for &(ok, latency_ms) in attempts {
            buckets[bucket].add(ok, latency_ms);
        }
        Chart { from: chrono::Utc::now(), buckets }
    }

    #[test]
    fn a_bucket_with_attempts_is_a_bar_and_a_point_and_an_empty_one_nothing() {
        let c = Charts::of(&chart_with(100, &[(true, 40), (false, 40), (true, 900), (true, 40)]));
        assert_eq!(c.success_svg.matches("<rect class=\"bucket\"").count(), 1);
        assert!(c.success_svg.contains("4 attempts, 75.0 % succeeded"), "{}", c.success_svg);
        assert!(c.latency_svg.contains("class=\"p50\"") && c.latency_svg.contains("class=\"p99\""));
        assert_eq!((c.attempts, c.success_rate.as_str()), (4, "75.0 %"));
        let empty = Charts::of(&chart_with(0, &[]));
        assert_eq!(empty.success_svg.matches("<rect").count(), 0);
        assert!(!empty.latency_svg.contains("<path"));
        assert_eq!((empty.p50.as_str(), empty.success_rate.as_str()), ("–", "–"));
    }
}
