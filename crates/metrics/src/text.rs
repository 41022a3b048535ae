//! The Prometheus text exposition format, version 0.0.4
//! (<https://prometheus.io/docs/instrumenting/exposition_formats/>).
//!
//! One [`Encoder`] builds one scrape. Each metric family is declared once with [`Encoder::family`]
//! (`# HELP` and `# TYPE`), and its samples follow at once; a family declared again in the same
//! scrape is ignored, so its samples still land under the first declaration only if written
//! right after it: collectors write each family in one go.

use crate::HistogramSnapshot;
use std::collections::HashSet;
use std::fmt::Write;

/// The type of a metric family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
    /// Here always without quantiles: `_sum` and `_count` only (a total time and how many).
    Summary,
}

impl Kind {
    fn word(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
            Kind::Summary => "summary",
        }
    }
}

/// Builds the text of one scrape.
#[derive(Default)]
pub struct Encoder {
    out: String,
    declared: HashSet<String>,
}

impl Encoder {
    /// Declare a family: `# HELP name help` and `# TYPE name kind`. False (and nothing
    /// written) if it was declared already in this scrape.
    pub fn family(&mut self, name: &str, help: &str, kind: Kind) -> bool {
        if !self.declared.insert(name.to_string()) {
            return false;
        }
        self.out.push_str("# HELP ");
        self.out.push_str(name);
        self.out.push(' ');
        escape_help(&mut self.out, help);
        self.out.push_str("\n# TYPE ");
        self.out.push_str(name);
        self.out.push(' ');
        self.out.push_str(kind.word());
        self.out.push('\n');
        true
    }

    /// One sample line: `name{label="value",…} value`.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.sample_with(name, labels, None, value);
    }

    fn sample_with(
        &mut self,
        name: &str,
        labels: &[(&str, &str)],
        extra: Option<(&str, &str)>,
        value: f64,
    ) {
        self.out.push_str(name);
        let mut all = labels.iter().copied().chain(extra).peekable();
        if all.peek().is_some() {
            self.out.push('{');
            for (i, (k, v)) in all.enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                self.out.push_str(k);
                self.out.push_str("=\"");
                escape_label(&mut self.out, v);
                self.out.push('"');
            }
            self.out.push('}');
        }
        self.out.push(' ');
        push_value(&mut self.out, value);
        self.out.push('\n');
    }

    /// A counter family with a single unlabelled sample.
    pub fn counter(&mut self, name: &str, help: &str, value: u64) {
        if self.family(name, help, Kind::Counter) {
            self.sample(name, &[], value as f64);
        }
    }

    /// A gauge family with a single unlabelled sample.
    pub fn gauge(&mut self, name: &str, help: &str, value: f64) {
        if self.family(name, help, Kind::Gauge) {
            self.sample(name, &[], value);
        }
    }

    /// The samples of one histogram (its family declared before): cumulative
    /// `NAME_bucket{…,le="B"}` for each bound, `le="+Inf"`, then `NAME_sum` and `NAME_count`.
    pub fn histogram(&mut self, name: &str, labels: &[(&str, &str)], h: &HistogramSnapshot) {
        let bucket = format!("{name}_bucket");
        let mut le = String::new();
        for &(bound, count) in &h.buckets {
            le.clear();
            push_value(&mut le, bound);
            self.sample_with(&bucket, labels, Some(("le", &le)), count as f64);
        }
        self.sample_with(&bucket, labels, Some(("le", "+Inf")), h.count as f64);
        self.sample(&format!("{name}_sum"), labels, h.sum);
        self.sample(&format!("{name}_count"), labels, h.count as f64);
    }

    /// The samples of one summary without quantiles (its family declared before).
    pub fn summary(&mut self, name: &str, labels: &[(&str, &str)], sum: f64, count: u64) {
        self.sample(&format!("{name}_sum"), labels, sum);
        self.sample(&format!("{name}_count"), labels, count as f64);
    }

    /// The scrape's text.
    pub fn finish(self) -> String {
        self.out
    }
}

/// Help text: backslash and newline escaped.
fn escape_help(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// Label values: backslash, double quote and newline escaped.
fn escape_label(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// A value as Go's ParseFloat reads it: integers without a fraction, `NaN`, `+Inf`, `-Inf`.
fn push_value(out: &mut String, v: f64) {
    if v.is_nan() {
        out.push_str("NaN");
    } else if v.is_infinite() {
        out.push_str(if v > 0.0 { "+Inf" } else { "-Inf" });
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        let _ = write!(out, "{}", v as i64);
    } else {
        let _ = write!(out, "{v}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Histogram;

    #[test]
    fn family_header_and_plain_samples() {
        let mut e = Encoder::default();
        e.counter("a_total", "Things.", 3);
        e.gauge("b_ratio", "A share.", 0.25);
        assert_eq!(
            e.finish(),
            "# HELP a_total Things.\n# TYPE a_total counter\na_total 3\n\
             # HELP b_ratio A share.\n# TYPE b_ratio gauge\nb_ratio 0.25\n"
        );
    }

    #[test]
    fn help_and_label_values_are_escaped() {
        let mut e = Encoder::default();
        assert!(e.family("x", "back\\slash\nnew \"line\"", Kind::Gauge));
        e.sample("x", &[("volume", "a\"b\\c\nd"), ("k", "v")], 1.0);
        assert_eq!(
            e.finish(),
            "# HELP x back\\\\slash\\nnew \"line\"\n# TYPE x gauge\n\
             x{volume=\"a\\\"b\\\\c\\nd\",k=\"v\"} 1\n"
        );
    }

    #[test]
    fn a_family_is_declared_once() {
        let mut e = Encoder::default();
        assert!(e.family("x", "h", Kind::Counter));
        assert!(!e.family("x", "h", Kind::Counter));
        e.counter("x", "h", 1); // ignored: declared already
        assert_eq!(e.finish(), "# HELP x h\n# TYPE x counter\n");
    }

    #[test]
    fn special_values() {
        let mut s = String::new();
        for v in [
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            -2.0,
            1e-5,
            1.5,
            1e20,
        ] {
            push_value(&mut s, v);
            s.push(' ');
        }
        assert_eq!(s, "NaN +Inf -Inf -2 0.00001 1.5 100000000000000000000 ");
    }

    #[test]
    fn histogram_is_cumulative_with_inf_sum_and_count() {
        let h = Histogram::seconds(&[0.001, 0.01, 0.1]);
        for ms in [0.5, 0.5, 5.0, 50.0, 2000.0] {
            h.observe(std::time::Duration::from_secs_f64(ms / 1000.0));
        }
        let mut e = Encoder::default();
        e.family("lat_seconds", "Latency.", Kind::Histogram);
        e.histogram("lat_seconds", &[("command", "read")], &h.snapshot());
        let text = e.finish();
        let lines: Vec<&str> = text.lines().skip(2).collect();
        assert_eq!(
            lines,
            [
                "lat_seconds_bucket{command=\"read\",le=\"0.001\"} 2",
                "lat_seconds_bucket{command=\"read\",le=\"0.01\"} 3",
                "lat_seconds_bucket{command=\"read\",le=\"0.1\"} 4",
                "lat_seconds_bucket{command=\"read\",le=\"+Inf\"} 5",
                "lat_seconds_sum{command=\"read\"} 2.056",
                "lat_seconds_count{command=\"read\"} 5",
            ]
        );
    }

    #[test]
    fn summary_has_sum_and_count() {
        let mut e = Encoder::default();
        e.family("sync_seconds", "Syncs.", Kind::Summary);
        e.summary("sync_seconds", &[], 0.5, 2);
        assert!(e.finish().ends_with(
            "# TYPE sync_seconds summary\nsync_seconds_sum 0.5\nsync_seconds_count 2\n"
        ));
    }
}
