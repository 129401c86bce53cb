//! Result rows and their two renderings: an aligned table and a JSON list.
//!
//! A row compares two figures in one unit, `a` (the engine, or the case under test) and `b`
//! (the baseline), measured in pairs: sample `i` of `a` and sample `i` of `b` ran back to back
//! (in alternating order where the measurement allows it). `a` and `b` are the medians of
//! their samples; `ratio` is the median of the per-pair ratios `a[i] / b[i]`, so drift of the
//! machine between pairs cancels out; `spread` is the interquartile range of those per-pair
//! ratios divided by their median (0.03: the middle half of the pairs lie within 3 % of the
//! ratio). A row has an optional target on the ratio or on `a`. JSON keys: `name`, `a`, `b`,
//! `unit`, `ratio`, `spread`, `target` (a string such as `"ratio >= 0.95"`, or null) and
//! `met` (a bool, or null without a target).

use super::median;
use serde_json::json;

/// What a row must reach.
#[derive(Clone, Copy, Debug)]
pub enum Target {
    /// `ratio >= x`.
    RatioAtLeast(f64),
    /// `ratio <= x`.
    RatioAtMost(f64),
    /// `a < x` (in the row's unit).
    ABelow(f64),
}

impl Target {
    fn met(self, row: &Row) -> bool {
        match self {
            Target::RatioAtLeast(x) => row.ratio >= x,
            Target::RatioAtMost(x) => row.ratio <= x,
            Target::ABelow(x) => row.a < x,
        }
    }

    fn describe(self, unit: &str) -> String {
        match self {
            Target::RatioAtLeast(x) => format!("ratio >= {x}"),
            Target::RatioAtMost(x) => format!("ratio <= {x}"),
            Target::ABelow(x) => format!("a < {x} {unit}"),
        }
    }
}

/// One comparison.
#[derive(Clone, Debug)]
pub struct Row {
    /// What is compared, `a` vs `b`.
    pub name: String,
    /// The case under test (median).
    pub a: f64,
    /// The baseline (median).
    pub b: f64,
    /// Unit of `a` and `b`.
    pub unit: &'static str,
    /// The median of the per-pair ratios `a[i] / b[i]`.
    pub ratio: f64,
    /// Interquartile range of the per-pair ratios over their median.
    pub spread: f64,
    /// What the ratio or `a` must reach, if anything.
    pub target: Option<Target>,
}

impl Row {
    /// A row from paired samples: `a[i]` and `b[i]` were measured together.
    pub fn new(name: impl Into<String>, a: &[f64], b: &[f64], unit: &'static str) -> Row {
        assert_eq!(a.len(), b.len(), "samples come in pairs");
        let ratios: Vec<f64> = a
            .iter()
            .zip(b)
            .map(|(&a, &b)| if b == 0.0 { 0.0 } else { a / b })
            .collect();
        let ratio = median(ratios.clone());
        let spread = if ratio == 0.0 {
            0.0
        } else {
            ((quantile(&ratios, 0.75) - quantile(&ratios, 0.25)) / ratio).abs()
        };
        Row {
            name: name.into(),
            a: median(a.to_vec()),
            b: median(b.to_vec()),
            unit,
            ratio,
            spread,
            target: None,
        }
    }

    /// Set the target.
    pub fn target(mut self, target: Target) -> Row {
        self.target = Some(target);
        self
    }

    /// Whether the target is met (None without one).
    pub fn met(&self) -> Option<bool> {
        self.target.map(|t| t.met(self))
    }

    fn target_text(&self) -> Option<String> {
        self.target.map(|t| t.describe(self.unit))
    }
}

/// The `q` quantile of some samples (0.5 the median), interpolating linearly between the two
/// nearest samples.
pub fn quantile(samples: &[f64], q: f64) -> f64 {
    assert!(!samples.is_empty(), "a quantile of no samples");
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let position = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let (low, high) = (position.floor() as usize, position.ceil() as usize);
    sorted[low] + (sorted[high] - sorted[low]) * (position - low as f64)
}

/// A number with about four significant digits.
pub(crate) fn figure(x: f64) -> String {
    let magnitude = x.abs();
    if magnitude >= 1000.0 {
        format!("{x:.0}")
    } else if magnitude >= 100.0 {
        format!("{x:.1}")
    } else if magnitude >= 10.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

/// The rows as an aligned text table.
pub fn table(rows: &[Row]) -> String {
    let header = [
        "comparison (a vs b)",
        "a",
        "b",
        "unit",
        "ratio",
        "spread",
        "target",
        "met",
    ];
    let cells: Vec<[String; 8]> = rows
        .iter()
        .map(|r| {
            [
                r.name.clone(),
                figure(r.a),
                figure(r.b),
                r.unit.to_string(),
                figure(r.ratio),
                format!("{:.1}%", r.spread * 100.0),
                r.target_text().unwrap_or_else(|| "-".to_string()),
                match r.met() {
                    Some(true) => "yes".to_string(),
                    Some(false) => "NO".to_string(),
                    None => "-".to_string(),
                },
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &cells {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &[String]| {
        let mut text = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            // Names and units left-aligned, figures right-aligned.
            if matches!(i, 0 | 3 | 6 | 7) {
                text.push_str(&format!("{cell:<w$}  "));
            } else {
                text.push_str(&format!("{cell:>w$}  "));
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&header.map(String::from));
    line(&widths.map(|w| "-".repeat(w)));
    for row in &cells {
        line(row);
    }
    out
}

/// The rows as a JSON list of objects.
pub fn json(rows: &[Row]) -> String {
    let list: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            json!({
                "name": r.name,
                "a": r.a,
                "b": r.b,
                "unit": r.unit,
                "ratio": r.ratio,
                "spread": r.spread,
                "target": r.target_text(),
                "met": r.met(),
            })
        })
        .collect();
    serde_json::to_string_pretty(&list).expect("a list of plain values serializes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_compare_ratio_or_a() {
        let row = Row::new("x", &[96.0], &[100.0], "kIOPS").target(Target::RatioAtLeast(0.95));
        assert_eq!(row.met(), Some(true));
        let row = Row::new("x", &[2.0], &[1.0], "bytes").target(Target::RatioAtMost(1.25));
        assert_eq!(row.met(), Some(false));
        let row = Row::new("x", &[120.0], &[3.0], "ms").target(Target::ABelow(500.0));
        assert_eq!(row.met(), Some(true));
        assert_eq!(Row::new("x", &[1.0], &[0.0], "ms").ratio, 0.0);
    }

    #[test]
    fn ratio_is_the_median_of_pair_ratios_and_spread_their_iqr() {
        // Pair ratios 0.5, 1.0, 1.0, 1.0, 2.0: the machine doubled its speed between pairs,
        // which the medians of a and b alone would mix up.
        let a = [1.0, 10.0, 20.0, 40.0, 160.0];
        let b = [2.0, 10.0, 20.0, 40.0, 80.0];
        let row = Row::new("x", &a, &b, "ms");
        assert_eq!((row.a, row.b, row.ratio), (20.0, 20.0, 1.0));
        // Quartiles of [0.5, 1, 1, 1, 2] are 1 and 1.
        assert_eq!(row.spread, 0.0);
        let row = Row::new("x", &[1.0, 2.0, 3.0, 4.0, 5.0], &[1.0; 5], "ms");
        // Quartiles 2 and 4 around a median of 3.
        assert!((row.spread - 2.0 / 3.0).abs() < 1e-12, "{}", row.spread);
        assert_eq!(quantile(&[3.0, 1.0], 0.5), 2.0);
    }

    #[test]
    fn json_has_every_key() {
        let rows = [Row::new("x", &[1.0], &[2.0], "ms")];
        let value: serde_json::Value = serde_json::from_str(&json(&rows)).unwrap();
        let object = value[0].as_object().unwrap();
        for key in ["name", "a", "b", "unit", "ratio", "spread", "target", "met"] {
            assert!(object.contains_key(key), "{key}");
        }
        assert!(table(&rows).contains("0.500"));
    }
}
