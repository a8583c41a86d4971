//! Draws the plots of BENCHMARKS.md as SVG (plotters) from recorded measurements:
//!
//! ```text
//! cargo run -p cuda-stream-pool-demo --example plot -- \
//!     docs/data/demo-h200-repeat3.json docs/data/criterion-pool-h200 docs/plots
//! ```
//!
//! * `time-per-owner.svg`: µs per owner by strategy, for each workload and thread count, log
//!   scale, from the demo's `--json` / `--json-out` rows (JSON Lines, the demo's `JsonRow`).
//! * `acquire-vs-live-owners.svg`: acquire + release latency against the number of live owners,
//!   for the pool and the global-lock baseline, from criterion's own output of the `pool`
//!   benchmark (`<dir>/live_owners/<function>/<owners>/new/{benchmark,estimates}.json`, as in
//!   `target/criterion` after `CSP_BENCH_DRIVER=cuda cargo bench --bench pool`).

use plotters::prelude::*;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::error::Error;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

type Res<T> = Result<T, Box<dyn Error>>;

const USAGE: &str = "usage: plot DEMO_ROWS.json CRITERION_DIR OUT_DIR\n  e.g. plot docs/data/demo-h200-repeat3.json docs/data/criterion-pool-h200 docs/plots";

/// The fields of the demo's JSON rows that the plot uses.
#[derive(Deserialize)]
struct DemoRow {
    workload: String,
    strategy: String,
    threads: u64,
    us_per_owner: f64,
    capped: bool,
}

/// Criterion's `benchmark.json`.
#[derive(Deserialize)]
struct BenchmarkId {
    group_id: String,
    function_id: Option<String>,
    value_str: Option<String>,
}

/// Criterion's `estimates.json` (the median, in ns).
#[derive(Deserialize)]
struct Estimates {
    median: Estimate,
}

#[derive(Deserialize)]
struct Estimate {
    point_estimate: f64,
}

fn read(path: &Path) -> Res<String> {
    std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()).into())
}

fn demo_rows(path: &Path) -> Res<Vec<DemoRow>> {
    let text = read(path)?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        rows.push(
            serde_json::from_str(line).map_err(|e| format!("{}:{}: {e}", path.display(), i + 1))?,
        );
    }
    if rows.is_empty() {
        return Err(format!("{}: no rows", path.display()).into());
    }
    Ok(rows)
}

/// Every `new/benchmark.json` under `dir` with the median of its `estimates.json`.
fn criterion_medians(dir: &Path) -> Res<Vec<(BenchmarkId, f64)>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let entries = std::fs::read_dir(&d).map_err(|e| format!("{}: {e}", d.display()))?;
        for entry in entries {
            let p: PathBuf = entry.map_err(|e| format!("{}: {e}", d.display()))?.path();
            if p.is_dir() {
                todo.push(p);
            } else if p.ends_with("new/benchmark.json") {
                let id: BenchmarkId = serde_json::from_str(&read(&p)?)
                    .map_err(|e| format!("{}: {e}", p.display()))?;
                let est_path = p.with_file_name("estimates.json");
                let est: Estimates = serde_json::from_str(&read(&est_path)?)
                    .map_err(|e| format!("{}: {e}", est_path.display()))?;
                out.push((id, est.median.point_estimate));
            }
        }
    }
    if out.is_empty() {
        return Err(format!(
            "{}: no criterion results (new/benchmark.json)",
            dir.display()
        )
        .into());
    }
    Ok(out)
}

const STRATEGIES: [&str; 6] = ["floor", "pool", "pool-tls", "fresh", "deferred", "cudarc"];

fn color(i: usize) -> RGBColor {
    [
        RGBColor(0x1b, 0x9e, 0x77),
        RGBColor(0xd9, 0x5f, 0x02),
        RGBColor(0x75, 0x70, 0xb3),
        RGBColor(0xe7, 0x29, 0x8a),
        RGBColor(0x66, 0xa6, 0x1e),
        RGBColor(0xe6, 0xab, 0x02),
    ][i % 6]
}

fn time_per_owner(rows: &[DemoRow], out: &Path) -> Res<()> {
    let mut groups: Vec<(String, u64)> = Vec::new();
    for r in rows {
        let g = (r.workload.clone(), r.threads);
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    let (lo, hi) = rows.iter().fold((f64::MAX, f64::MIN), |(lo, hi), r| {
        (lo.min(r.us_per_owner), hi.max(r.us_per_owner))
    });
    let root = SVGBackend::new(out, (900, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let n = groups.len();
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Time per owner by strategy (µs, log scale)",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), (lo * 0.7..hi * 1.4).log_scale())?;
    chart
        .configure_mesh()
        .x_labels(n)
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < groups.len() {
                let (w, t) = &groups[i as usize];
                format!("{w}, {t} thr")
            } else {
                String::new()
            }
        })
        .y_desc("µs per owner")
        .draw()?;
    let width = 0.8 / STRATEGIES.len() as f64;
    for (si, s) in STRATEGIES.iter().enumerate() {
        let pts: Vec<(f64, f64, bool)> = rows
            .iter()
            .filter(|r| r.strategy == *s)
            .filter_map(|r| {
                let gi = groups
                    .iter()
                    .position(|g| g.0 == r.workload && g.1 == r.threads)?;
                let x = gi as f64 - 0.4 + width * (si as f64 + 0.5);
                Some((x, r.us_per_owner, r.capped))
            })
            .collect();
        if pts.is_empty() {
            continue;
        }
        let c = color(si);
        chart
            .draw_series(pts.iter().map(|&(x, y, _)| {
                Rectangle::new(
                    [(x - width / 2.0, lo * 0.7), (x + width / 2.0, y)],
                    c.filled(),
                )
            }))?
            .label(*s)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], c.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

fn acquire_vs_live_owners(medians: &[(BenchmarkId, f64)], out: &Path) -> Res<()> {
    let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for (id, ns) in medians
        .iter()
        .filter(|(id, _)| id.group_id == "live_owners")
    {
        let (Some(f), Some(v)) = (&id.function_id, &id.value_str) else {
            continue;
        };
        let owners: f64 = v
            .parse()
            .map_err(|_| format!("live_owners/{f}: parameter {v} is not a number"))?;
        series.entry(f.clone()).or_default().push((owners, *ns));
    }
    if series.is_empty() {
        return Err("no live_owners results among the criterion results".into());
    }
    let (mut xmax, mut ylo, mut yhi) = (1.0f64, f64::MAX, f64::MIN);
    for pts in series.values_mut() {
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        for &(x, y) in pts.iter() {
            xmax = xmax.max(x);
            ylo = ylo.min(y);
            yhi = yhi.max(y);
        }
    }
    let root = SVGBackend::new(out, (720, 440)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Acquire + release against live owners (ns, log-log)",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(
            (0.7f64..xmax * 1.5).log_scale(),
            (ylo * 0.7..yhi * 1.5).log_scale(),
        )?;
    chart
        .configure_mesh()
        .x_desc("live owners")
        .y_desc("ns per acquire + release")
        .draw()?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], c.stroke_width(2)));
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, c.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

fn run(args: &[String]) -> Res<()> {
    let [demo, criterion, out] = args else {
        return Err(USAGE.into());
    };
    let out = Path::new(out);
    if !out.is_dir() {
        return Err(format!("{}: not a directory", out.display()).into());
    }
    let rows = demo_rows(Path::new(demo))?;
    let medians = criterion_medians(Path::new(criterion))?;
    let a = out.join("time-per-owner.svg");
    time_per_owner(&rows, &a).map_err(|e| format!("{}: {e}", a.display()))?;
    let b = out.join("acquire-vs-live-owners.svg");
    acquire_vs_live_owners(&medians, &b).map_err(|e| format!("{}: {e}", b.display()))?;
    println!("wrote {} and {}", a.display(), b.display());
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
