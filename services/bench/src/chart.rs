//! One SVG per run, next to its JSON: the latency CDF of the healthy
//! deliveries (log time axis) and healthy deliveries per second over the run.
//! Plain SVG written directly: two polylines with axes need no plotting
//! library, and plotters' SVG text needs a font backend a headless CI
//! machine may not have.

use std::{fmt::Write as _, time::Duration};

const W: f64 = 460.0;
const H: f64 = 300.0;
const PAD: (f64, f64, f64, f64) = (56.0, 16.0, 34.0, 44.0); // left, right, top, bottom

/// What a run's chart draws.
pub struct Series {
    /// Publish→arrival of each healthy delivery, sorted.
    pub latencies: Vec<Duration>,
    /// Arrival of each healthy delivery, from the first publish.
    pub arrivals: Vec<Duration>,
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// A panel's frame, title and axis labels, offset by `dx`.
fn frame(out: &mut String, dx: f64, title: &str, x_label: &str, y_label: &str) {
    let (l, r, t, b) = PAD;
    let _ = write!(
        out,
        r##"<g transform="translate({dx},0)"><rect x="{l}" y="{t}" width="{}" height="{}" fill="none" stroke="#888"/><text x="{}" y="20" text-anchor="middle" font-weight="bold">{}</text><text x="{}" y="{}" text-anchor="middle">{}</text><text transform="translate(14,{}) rotate(-90)" text-anchor="middle">{}</text></g>"##,
        W - l - r,
        H - t - b,
        W / 2.0,
        esc(title),
        l + (W - l - r) / 2.0,
        H - 8.0,
        esc(x_label),
        t + (H - t - b) / 2.0,
        esc(y_label),
    );
}

/// Maps a value in `0..=1` of each axis to the panel's plot area.
fn xy(dx: f64, fx: f64, fy: f64) -> (f64, f64) {
    let (l, r, t, b) = PAD;
    (dx + l + fx.clamp(0.0, 1.0) * (W - l - r), t + (1.0 - fy.clamp(0.0, 1.0)) * (H - t - b))
}

fn tick(out: &mut String, (x, y): (f64, f64), label: &str, vertical_axis: bool) {
    let _ = if vertical_axis {
        write!(
            out,
            r##"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" stroke="#888"/><text x="{}" y="{}" text-anchor="end">{label}</text>"##,
            x - 4.0,
            x - 6.0,
            y + 4.0
        )
    } else {
        write!(
            out,
            r##"<line x1="{x}" y1="{y}" x2="{x}" y2="{}" stroke="#888"/><text x="{x}" y="{}" text-anchor="middle">{label}</text>"##,
            y + 4.0,
            y + 16.0
        )
    };
}

fn polyline(out: &mut String, points: &[(f64, f64)], colour: &str) {
    out.push_str(r#"<polyline fill="none" stroke-width="1.5" stroke=""#);
    out.push_str(colour);
    out.push_str(r#"" points=""#);
    for (x, y) in points {
        let _ = write!(out, "{x:.1},{y:.1} ");
    }
    out.push_str(r#""/>"#);
}

/// The chart of one run as an SVG document.
pub fn svg(name: &str, s: &Series) -> String {
    let mut out = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{H}" font-family="sans-serif" font-size="11"><rect width="100%" height="100%" fill="white"/>"#,
        2.0 * W
    );
    // Latency CDF over log10(ms), from the decade below the fastest to the
    // decade above the slowest.
    frame(&mut out, 0.0, &format!("{name}: publish → arrival, healthy deliveries"), "latency (ms, log)", "share delivered");
    let ms: Vec<f64> = s.latencies.iter().map(|d| (d.as_secs_f64() * 1000.0).max(0.01)).collect();
    if let (Some(first), Some(last)) = (ms.first(), ms.last()) {
        let (lo, hi) = (first.log10().floor(), last.log10().ceil().max(first.log10().floor() + 1.0));
        let fx = |v: f64| (v.log10() - lo) / (hi - lo);
        for e in lo as i32..=hi as i32 {
            tick(&mut out, xy(0.0, fx(10f64.powi(e)), 0.0), &format!("{}", 10f64.powi(e)), false);
        }
        for q in [0.0, 0.25, 0.5, 0.75, 1.0] {
            tick(&mut out, xy(0.0, 0.0, q), &format!("{q}"), true);
        }
        let n = ms.len() as f64;
        let pts: Vec<(f64, f64)> = ms.iter().enumerate().map(|(i, v)| xy(0.0, fx(*v), (i + 1) as f64 / n)).collect();
        polyline(&mut out, &pts, "#1f6feb");
    }
    // Healthy deliveries per second, in quarter-second buckets.
    frame(&mut out, W, "healthy deliveries per second", "seconds since the first publish", "deliveries/s");
    if let Some(end) = s.arrivals.iter().max() {
        let bucket = 0.25;
        let buckets = ((end.as_secs_f64() / bucket).floor() as usize) + 1;
        let mut counts = vec![0usize; buckets];
        for a in &s.arrivals {
            counts[((a.as_secs_f64() / bucket) as usize).min(buckets - 1)] += 1;
        }
        let rates: Vec<f64> = counts.iter().map(|c| *c as f64 / bucket).collect();
        let top = rates.iter().copied().fold(1.0, f64::max) * 1.1;
        let span = (buckets as f64 * bucket).max(bucket);
        for i in 0..=4 {
            let v = top * f64::from(i) / 4.0;
            tick(&mut out, xy(W, 0.0, v / top), &format!("{v:.0}"), true);
        }
        for i in 0..=4 {
            let t = span * f64::from(i) / 4.0;
            tick(&mut out, xy(W, t / span, 0.0), &format!("{t:.1}"), false);
        }
        let pts: Vec<(f64, f64)> = rates.iter().enumerate().map(|(i, r)| xy(W, (i as f64 + 0.5) * bucket / span, r / top)).collect();
        polyline(&mut out, &pts, "#d9480f");
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_is_one_svg_with_both_curves_and_escaped_titles() {
        let s = Series {
            latencies: (1..=100).map(Duration::from_millis).collect(),
            arrivals: (0..100).map(|i| Duration::from_millis(i * 20)).collect(),
        };
        let doc = svg("w1<&>", &s);
        assert!(doc.starts_with("<svg ") && doc.trim_end().ends_with("</svg>"));
        assert_eq!(doc.matches("<polyline").count(), 2, "a CDF and a rate curve");
        assert!(doc.contains("w1&lt;&amp;&gt;") && !doc.contains("w1<&>"), "titles are escaped");
        let empty = svg("idle", &Series { latencies: vec![], arrivals: vec![] });
        assert_eq!(empty.matches("<polyline").count(), 0, "nothing to draw, no curve, still a document");
    }
}
