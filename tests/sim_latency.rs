//! The simulated driver's latency model (`Latency::default`, the demo's simulation) against the
//! H200 figures recorded in `docs/data/h200-latency.json`: fails when the model drifts more than
//! 25% from a figure, or when a figure's value is not the median of its recorded runs.

use cuda_stream_pool::driver::sim::Latency;
use serde_json::Value;

const DATA: &str = include_str!("../docs/data/h200-latency.json");

/// The model's value for a figure of the data file, by the figure's `model` expression.
fn model(l: &Latency, expr: &str) -> Option<f64> {
    let ns = match expr {
        "stream_create + stream_destroy" => l.stream_create + l.stream_destroy,
        "stream_create + stream_destroy + stream_first_pool_use" => {
            l.stream_create + l.stream_destroy + l.stream_first_pool_use
        }
        "query" => l.query,
        "2 * alloc" => 2 * l.alloc,
        "capture_mode_exchange" => l.capture_mode_exchange,
        _ => return None,
    };
    Some(ns as f64)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[test]
fn latency_model_within_25_percent_of_the_h200() {
    let data: Value = serde_json::from_str(DATA).expect("docs/data/h200-latency.json parses");
    let figures = data["figures"].as_array().expect("figures");
    assert!(figures.len() >= 5, "{} figures", figures.len());
    let l = Latency::default();
    let mut off = Vec::new();
    for f in figures {
        let name = f["name"].as_str().unwrap();
        let value = f["value"].as_f64().unwrap();
        let runs: Vec<f64> = f["runs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["ns"].as_f64().unwrap())
            .collect();
        assert!(!runs.is_empty(), "{name}: no runs");
        let m = median(runs);
        assert!(
            (value - m).abs() <= 1.0,
            "{name}: value {value} is not the median of its runs ({m})"
        );
        let expr = f["model"].as_str().unwrap();
        let got = model(&l, expr).unwrap_or_else(|| panic!("{name}: unknown model {expr}"));
        let drift = (got - value).abs() / value;
        if drift > 0.25 {
            off.push(format!(
                "{name}: model {got} ns ({expr}), H200 {value} ns, {:.0}% off",
                drift * 100.0
            ));
        }
    }
    assert!(off.is_empty(), "{off:#?}");
}

#[test]
fn the_check_fails_on_a_drifted_model() {
    // The 39 us create of the model before the calibration would be caught.
    let old = Latency {
        stream_create: 39_000,
        stream_destroy: 5_000,
        query: 600,
        ..Latency::default()
    };
    let got = model(&old, "stream_create + stream_destroy").unwrap();
    assert!((got - 5662.0).abs() / 5662.0 > 0.25);
    let q = model(&old, "query").unwrap();
    assert!((q - 205.0).abs() / 205.0 > 0.25);
}
