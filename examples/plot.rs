//! Draws the plots of BENCHMARKS.md as SVG from the recorded measurements:
//!
//!   cargo run --example plot -- docs/data/demo-h200.json docs/data/bench-pool-h200.txt docs/plots
//!
//! * `time-per-owner.svg`: µs per owner by strategy, for each workload and thread count (from the
//!   demo's `--json` rows), log scale.
//! * `acquire-vs-live-owners.svg`: acquire + release latency against the number of live owners,
//!   for the pool and the global-lock baseline (from the `pool` benchmark's output).

use std::fmt::Write as _;

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let k = format!("\"{key}\":");
    let start = line.find(&k)? + k.len();
    let rest = &line[start..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    Some(rest[..end].trim_matches('"'))
}

/// Parses criterion's `name time: [lo mid hi]` lines into (name, mid in ns).
fn criterion_points(text: &str) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    let mut pending: Option<String> = None;
    for line in text.lines() {
        let t = line.trim();
        let (name, rest) = match t.find("time:") {
            Some(i) => {
                let name = t[..i].trim();
                let name = if name.is_empty() {
                    pending.take()
                } else {
                    Some(name.to_string())
                };
                (name, &t[i + 5..])
            }
            None => {
                if !t.is_empty() && !t.starts_with("benchmarks") {
                    pending = Some(t.to_string());
                }
                continue;
            }
        };
        let nums: Vec<&str> = rest
            .trim_matches(|c| c == '[' || c == ']' || c == ' ')
            .split_whitespace()
            .collect();
        if let (Some(name), true) = (name, nums.len() >= 4) {
            let v: f64 = nums[2].parse().unwrap_or(f64::NAN);
            let scale = match nums[3] {
                "ns" => 1.0,
                "µs" | "us" => 1e3,
                "ms" => 1e6,
                "s" => 1e9,
                _ => f64::NAN,
            };
            out.push((name, v * scale));
        }
    }
    out
}

fn svg_header(w: f64, h: f64, title: &str) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{title}</text>\n",
        w / 2.0
    )
}

const COLORS: [&str; 6] = [
    "#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02",
];

fn time_per_owner(json: &str) -> String {
    let rows: Vec<&str> = json.lines().filter(|l| l.starts_with('{')).collect();
    let strategies = ["floor", "pool", "pool-tls", "fresh", "deferred", "cudarc"];
    let mut groups: Vec<(String, String)> = Vec::new();
    for r in &rows {
        let g = (
            field(r, "workload").unwrap_or("").to_string(),
            field(r, "threads").unwrap_or("").to_string(),
        );
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    let (w, h, left, top, bottom) = (900.0, 460.0, 70.0, 40.0, 90.0);
    let plot_h = h - top - bottom;
    let (lo, hi) = (1.0f64.log10(), 10_000f64.log10());
    let y = |v: f64| top + plot_h * (1.0 - (v.max(1.0).log10() - lo) / (hi - lo));
    let gw = (w - left - 20.0) / groups.len().max(1) as f64;
    let bw = gw / (strategies.len() as f64 + 1.5);
    let mut s = svg_header(
        w,
        h,
        "Time per owner by strategy (H200, lower is better, log scale)",
    );
    for v in [1.0, 10.0, 100.0, 1000.0, 10000.0] {
        let _ = writeln!(s, "<line x1=\"{left}\" x2=\"{}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{v} µs</text>", w - 20.0, left - 6.0, y(v) + 4.0, yy = y(v));
    }
    for (gi, (wl, th)) in groups.iter().enumerate() {
        let x0 = left + gi as f64 * gw + bw * 0.75;
        for (si, st) in strategies.iter().enumerate() {
            let Some(r) = rows.iter().find(|r| {
                field(r, "workload") == Some(wl)
                    && field(r, "threads") == Some(th)
                    && field(r, "strategy") == Some(st)
            }) else {
                continue;
            };
            let v: f64 = field(r, "us_per_owner")
                .and_then(|x| x.parse().ok())
                .unwrap_or(0.0);
            let x = x0 + si as f64 * bw;
            let _ = writeln!(
                s,
                "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\"><title>{st}: {v:.1} µs</title></rect>",
                y(v),
                bw * 0.9,
                top + plot_h - y(v),
                COLORS[si]
            );
        }
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{wl}, {th} thread{}</text>",
            x0 + bw * 2.5,
            top + plot_h + 18.0,
            if th == "1" { "" } else { "s" }
        );
    }
    for (si, st) in strategies.iter().enumerate() {
        let x = left + si as f64 * 130.0;
        let _ = writeln!(s, "<rect x=\"{x}\" y=\"{}\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{}\" y=\"{}\">{st}</text>", h - 40.0, COLORS[si], x + 16.0, h - 30.0);
    }
    s.push_str("</svg>\n");
    s
}

fn acquire_vs_live(bench: &str) -> String {
    let pts = criterion_points(bench);
    let live = [1.0, 100.0, 1000.0, 10000.0];
    let series = ["pool", "global_lock"];
    let (w, h, left, top, bottom) = (640.0, 400.0, 80.0, 40.0, 70.0);
    let plot_h = h - top - bottom;
    let plot_w = w - left - 30.0;
    let x = |n: f64| left + plot_w * n.log10() / 4.0;
    let (lo, hi) = (100f64.log10(), 10_000f64.log10());
    let y = |ns: f64| top + plot_h * (1.0 - (ns.log10() - lo) / (hi - lo));
    let mut s = svg_header(w, h, "Acquire + release vs live owners (H200, log-log)");
    for v in [100.0, 1000.0, 10000.0] {
        let _ = writeln!(s, "<line x1=\"{left}\" x2=\"{}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{} ns</text>", left + plot_w, left - 6.0, y(v) + 4.0, v, yy = y(v));
    }
    for n in live {
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{n}</text>",
            x(n),
            top + plot_h + 18.0
        );
    }
    let _ = writeln!(
        s,
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">live owners</text>",
        left + plot_w / 2.0,
        top + plot_h + 38.0
    );
    for (si, name) in series.iter().enumerate() {
        let mut path = String::new();
        for n in live {
            let key = format!("live_owners/{name}/{}", n as u64);
            if let Some((_, ns)) = pts.iter().find(|(k, _)| *k == key) {
                let _ = write!(
                    path,
                    "{}{:.1},{:.1} ",
                    if path.is_empty() { "M" } else { "L" },
                    x(n),
                    y(*ns)
                );
                let _ = writeln!(s, "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"4\" fill=\"{}\"><title>{key}: {ns:.0} ns</title></circle>", x(n), y(*ns), COLORS[si]);
            }
        }
        let _ = writeln!(
            s,
            "<path d=\"{path}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"/>",
            COLORS[si]
        );
        let _ = writeln!(s, "<rect x=\"{}\" y=\"{}\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{}\" y=\"{}\">{}</text>", left + 10.0 + si as f64 * 200.0, top + 5.0, COLORS[si], left + 26.0 + si as f64 * 200.0, top + 15.0, if *name == "pool" { "this crate's pool" } else { "one global lock + linear scan" });
    }
    s.push_str("</svg>\n");
    s
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [json, bench, out] = args.as_slice() else {
        return Err("usage: plot DEMO.json BENCH-POOL.txt OUTDIR".into());
    };
    std::fs::create_dir_all(out)?;
    let a = format!("{out}/time-per-owner.svg");
    let b = format!("{out}/acquire-vs-live-owners.svg");
    std::fs::write(&a, time_per_owner(&std::fs::read_to_string(json)?))?;
    std::fs::write(&b, acquire_vs_live(&std::fs::read_to_string(bench)?))?;
    println!("wrote {a} and {b}");
    Ok(())
}
