//! Hand-written SVG charts for the bench report: grouped horizontal bars and a CPU/RAM timeline.
//! Plain SVG 1.1 with inline attributes, readable in any browser and on GitHub.

use std::fmt::Write;

pub const CONDENSE_COLOR: &str = "#2b6cb0";
pub const BASELINE_COLOR: &str = "#a0aec0";
pub const EXTRA_COLOR: &str = "#dd6b20";

pub struct Series<'a> {
    pub label: &'a str,
    pub color: &'a str,
    pub values: Vec<f64>,
}

pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A compact number: 1234567 → "1.23M", 12.5 → "12.5".
pub fn short(v: f64) -> String {
    let a = v.abs();
    if a >= 1e9 {
        format!("{:.2}G", v / 1e9)
    } else if a >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.1}k", v / 1e3)
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// The smallest of 1, 2, 2.5, 5 × 10^k at least `v` (a round axis maximum).
pub fn nice_ceil(v: f64) -> f64 {
    if !(v.is_finite() && v > 0.0) {
        return 1.0;
    }
    let p = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * p)
        .find(|c| *c >= v * 0.999_999)
        .unwrap_or(10.0 * p)
}

/// Grouped horizontal bars: one group per category, one bar per series, value at the bar's end.
pub fn bars(title: &str, unit: &str, categories: &[String], series: &[Series]) -> String {
    let (label_w, plot_w, right) = (230.0, 440.0, 90.0);
    let bar_h = 16.0;
    let group_gap = 12.0;
    let top = 60.0;
    let group_h = bar_h * series.len() as f64 + group_gap;
    let height = top + group_h * categories.len() as f64 + 30.0;
    let width = label_w + plot_w + right;
    let max = series
        .iter()
        .flat_map(|s| s.values.iter().copied())
        .fold(0.0_f64, f64::max)
        .max(f64::MIN_POSITIVE);
    let mut o = String::new();
    let _ = write!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="10" y="22" font-size="15" font-weight="bold">{}</text>
"#,
        escape(title)
    );
    // Legend.
    let mut lx = label_w;
    for s in series {
        let _ = writeln!(
            o,
            r#"<rect x="{lx}" y="34" width="12" height="12" fill="{}"/><text x="{}" y="45">{}</text>"#,
            s.color,
            lx + 16.0,
            escape(s.label)
        );
        lx += 24.0 + 7.0 * s.label.len() as f64;
    }
    let _ = writeln!(
        o,
        r##"<text x="{}" y="45" text-anchor="end" fill="#555">{}</text>"##,
        width - 10.0,
        escape(unit)
    );
    for (ci, cat) in categories.iter().enumerate() {
        let gy = top + ci as f64 * group_h;
        let _ = writeln!(
            o,
            r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
            label_w - 8.0,
            gy + bar_h * series.len() as f64 / 2.0 + 4.0,
            escape(cat)
        );
        for (si, s) in series.iter().enumerate() {
            let v = s.values.get(ci).copied().unwrap_or(0.0);
            let w = if v.is_finite() && v > 0.0 {
                (v / max * plot_w).max(1.0)
            } else {
                0.0
            };
            let y = gy + si as f64 * bar_h;
            let _ = writeln!(
                o,
                r##"<rect x="{label_w}" y="{y}" width="{w:.1}" height="{}" fill="{}"><title>{}: {}</title></rect><text x="{:.1}" y="{}" fill="#333">{}</text>"##,
                bar_h - 2.0,
                s.color,
                escape(s.label),
                short(v),
                label_w + w + 4.0,
                y + bar_h - 5.0,
                short(v)
            );
        }
    }
    let _ = writeln!(
        o,
        r##"<line x1="{label_w}" y1="{}" x2="{label_w}" y2="{}" stroke="#333"/>"##,
        top - 4.0,
        height - 30.0
    );
    o.push_str("</svg>\n");
    o
}

/// One point of the timeline: seconds, CPU percent, RSS bytes.
pub struct Point {
    pub t: f64,
    pub cpu: f64,
    pub rss: u64,
}

/// The timeline's geometry: where the plots are and the time they span.
struct Frame<'a> {
    left: f64,
    plot_w: f64,
    panel_h: f64,
    t0: f64,
    t1: f64,
    points: &'a [Point],
}

impl Frame<'_> {
    /// The x coordinate of time `t`.
    fn x(&self, t: f64) -> f64 {
        self.left + (t - self.t0) / (self.t1 - self.t0) * self.plot_w
    }

    /// The phases as shaded bands across both panels, each named at its top.
    fn phases(&self, o: &mut String, phases: &[(f64, f64, String)], top1: f64, top2: f64) {
        let panel_h = self.panel_h;
        for (i, (a, b, name)) in phases.iter().enumerate() {
            let (xa, xb) = (self.x(*a), self.x(*b));
            let fill = if i % 2 == 0 { "#edf2f7" } else { "#f7fafc" };
            for top in [top1, top2] {
                let _ = writeln!(
                    o,
                    r#"<rect x="{xa:.1}" y="{top}" width="{:.1}" height="{panel_h}" fill="{fill}"/>"#,
                    (xb - xa).max(0.5)
                );
            }
            let (cx, cy) = ((xa + xb) / 2.0 + 4.0, top1 + 6.0);
            let _ = writeln!(
                o,
                r##"<text x="{cx:.1}" y="{cy:.1}" transform="rotate(90 {cx:.1} {cy:.1})" fill="#4a5568" font-size="10">{}</text>"##,
                escape(name)
            );
        }
    }

    /// One panel at `top`: its frame, label, axis ticks up to `max`, and the line of `vals`.
    fn panel(&self, o: &mut String, top: f64, label: &str, max: f64, vals: &[f64], color: &str) {
        let (left, plot_w, panel_h) = (self.left, self.plot_w, self.panel_h);
        let y = |v: f64| top + panel_h - v / max * panel_h;
        let _ = writeln!(
            o,
            r##"<rect x="{left}" y="{top}" width="{plot_w}" height="{panel_h}" fill="none" stroke="#333"/>
<text x="{left}" y="{}" font-weight="bold">{}</text>"##,
            top - 6.0,
            escape(label)
        );
        for k in 0..=4 {
            let v = max * k as f64 / 4.0;
            let _ = writeln!(
                o,
                r##"<line x1="{}" y1="{:.1}" x2="{left}" y2="{:.1}" stroke="#333"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
                left - 4.0,
                y(v),
                y(v),
                left - 6.0,
                y(v) + 4.0,
                short(v)
            );
        }
        let pts: Vec<String> = self
            .points
            .iter()
            .zip(vals)
            .map(|(p, v)| format!("{:.1},{:.1}", self.x(p.t), y(*v)))
            .collect();
        let _ = writeln!(
            o,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/>"#,
            pts.join(" ")
        );
    }
}

/// The time the timeline spans: from the first point or phase to the last, at least 1 s.
fn time_span(points: &[Point], phases: &[(f64, f64, String)]) -> (f64, f64) {
    let t0 = points
        .first()
        .map(|p| p.t)
        .into_iter()
        .chain(phases.first().map(|p| p.0))
        .fold(f64::INFINITY, f64::min);
    let t0 = if t0.is_finite() { t0 } else { 0.0 };
    let t1 = points
        .last()
        .map(|p| p.t)
        .into_iter()
        .chain(phases.last().map(|p| p.1))
        .fold(t0 + 1.0, f64::max);
    (t0, t1)
}

/// CPU percent and RSS over time, two panels sharing the time axis, with the phases shaded
/// and named. `phases` are (start, end, name).
pub fn timeline(title: &str, points: &[Point], phases: &[(f64, f64, String)]) -> String {
    let (left, plot_w, right) = (70.0, 780.0, 20.0);
    let panel_h = 170.0;
    let top1 = 50.0;
    let top2 = top1 + panel_h + 50.0;
    let height = top2 + panel_h + 45.0;
    let width = left + plot_w + right;
    let (t0, t1) = time_span(points, phases);
    let frame = Frame {
        left,
        plot_w,
        panel_h,
        t0,
        t1,
        points,
    };
    let cpu_max = nice_ceil(points.iter().map(|p| p.cpu).fold(100.0, f64::max));
    let rss_mib: Vec<f64> = points.iter().map(|p| p.rss as f64 / 1048576.0).collect();
    let rss_max = nice_ceil(rss_mib.iter().copied().fold(1.0, f64::max));
    let mut o = String::new();
    let _ = write!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">
<rect width="100%" height="100%" fill="white"/>
<text x="10" y="22" font-size="15" font-weight="bold">{}</text>
"#,
        escape(title)
    );
    frame.phases(&mut o, phases, top1, top2);
    let cpu: Vec<f64> = points.iter().map(|p| p.cpu).collect();
    frame.panel(
        &mut o,
        top1,
        "CPU, % of one core",
        cpu_max,
        &cpu,
        CONDENSE_COLOR,
    );
    frame.panel(
        &mut o,
        top2,
        "Resident memory (RSS), MiB",
        rss_max,
        &rss_mib,
        EXTRA_COLOR,
    );
    for k in 0..=5 {
        let t = t0 + (t1 - t0) * k as f64 / 5.0;
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{:.0} s</text>"#,
            frame.x(t),
            top2 + panel_h + 16.0,
            t - t0
        );
    }
    o.push_str("</svg>\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_have_one_rect_per_value_and_escape_labels() {
        let cats = vec!["a<b".to_string(), "c".to_string()];
        let s = [
            Series {
                label: "Condense",
                color: CONDENSE_COLOR,
                values: vec![1.0, 2.0],
            },
            Series {
                label: "plain & co",
                color: BASELINE_COLOR,
                values: vec![3.0, 0.0],
            },
        ];
        let svg = bars("T", "MiB/s", &cats, &s);
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("a&lt;b"));
        assert!(svg.contains("plain &amp; co"));
        // background + 2 legend + 4 bars
        assert_eq!(svg.matches("<rect").count(), 7);
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
    }

    #[test]
    fn timeline_draws_both_panels() {
        let pts: Vec<Point> = (0..10)
            .map(|i| Point {
                t: i as f64 * 0.25,
                cpu: i as f64 * 20.0,
                rss: (i + 1) << 20,
            })
            .collect();
        let svg = timeline(
            "R",
            &pts,
            &[(0.0, 1.0, "idle".into()), (1.0, 2.25, "job".into())],
        );
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains(">idle<") && svg.contains(">job<"));
        assert!(!svg.contains("NaN"));
        let empty = timeline("R", &[], &[]);
        assert!(!empty.contains("NaN"));
    }

    #[test]
    fn short_numbers() {
        assert_eq!(short(1_234_567.0), "1.23M");
        assert_eq!(short(12.345), "12.3");
        assert_eq!(short(0.5), "0.50");
        assert_eq!(short(15_000.0), "15.0k");
        assert_eq!(nice_ceil(119.9), 200.0);
        assert_eq!(nice_ceil(100.0), 100.0);
        assert_eq!(nice_ceil(22.4), 25.0);
        assert_eq!(nice_ceil(0.0), 1.0);
    }
}
