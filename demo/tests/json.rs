//! `--json` and `--json-out` print valid JSON Lines in the documented schema (`JsonRow`).

use assert_cmd::Command;
use serde_json::Value;

fn rows(stdout: &[u8]) -> Vec<Value> {
    let text = std::str::from_utf8(stdout).unwrap();
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

fn demo(args: &[&str]) -> std::process::Output {
    Command::cargo_bin("cuda-stream-pool")
        .unwrap()
        .args([
            "--driver",
            "sim",
            "--tasks",
            "8",
            "--threads",
            "1",
            "--json",
        ])
        .args(args)
        .output()
        .unwrap()
}

const FIELDS: [&str; 15] = [
    "workload",
    "strategy",
    "threads",
    "tasks",
    "wall_s",
    "ratio_to_floor",
    "us_per_owner",
    "peak_streams",
    "peak_mem_bytes",
    "final_sync_s",
    "capped",
    "repeats",
    "ratio_min",
    "ratio_max",
    "driver",
];

#[test]
fn without_floor_the_ratio_is_null() {
    let o = demo(&["--strategies", "pool,fresh", "--workloads", "short"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rows = rows(&o.stdout);
    assert_eq!(rows.len(), 2);
    for (r, strategy) in rows.iter().zip(["pool", "fresh"]) {
        let obj = r.as_object().unwrap();
        for f in FIELDS {
            assert!(obj.contains_key(f), "missing {f}: {r}");
        }
        assert_eq!(r["strategy"], strategy);
        assert_eq!(r["workload"], "short");
        assert_eq!(r["driver"], "sim");
        assert_eq!(r["threads"], 1);
        assert_eq!(r["tasks"], 8);
        assert_eq!(r["capped"], false);
        assert!(r["ratio_to_floor"].is_null(), "{r}");
        assert!(r["ratio_min"].is_null() && r["ratio_max"].is_null(), "{r}");
        assert!(r["us_per_owner"].as_f64().unwrap() > 0.0, "{r}");
    }
}

#[test]
fn with_floor_every_row_has_a_ratio_and_json_out_matches_stdout() {
    let dir = std::env::temp_dir().join(format!("csp-demo-json-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("rows.json");
    let o = demo(&[
        "--strategies",
        "pool,floor",
        "--json-out",
        file.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let printed = rows(&o.stdout);
    // Two workloads, floor first in each.
    let order: Vec<(&str, &str)> = printed
        .iter()
        .map(|r| {
            (
                r["workload"].as_str().unwrap(),
                r["strategy"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        order,
        [
            ("short", "floor"),
            ("short", "pool"),
            ("prodcons", "floor"),
            ("prodcons", "pool")
        ]
    );
    for r in &printed {
        let ratio = r["ratio_to_floor"]
            .as_f64()
            .unwrap_or_else(|| panic!("{r}"));
        assert!(ratio.is_finite() && ratio > 0.0, "{r}");
        if r["strategy"] == "floor" {
            assert_eq!(ratio, 1.0);
        }
    }
    let written = rows(&std::fs::read(&file).unwrap());
    assert_eq!(written, printed);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// With `--repeat`, every row reports the spread of its paired ratios (run i over the floor's
/// run i); the floor's own is exactly 1.
#[test]
fn repeats_report_the_spread_of_the_paired_ratios() {
    let o = demo(&[
        "--strategies",
        "floor,pool",
        "--workloads",
        "short",
        "--repeat",
        "3",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rows = rows(&o.stdout);
    assert_eq!(rows.len(), 2);
    for r in &rows {
        assert_eq!(r["repeats"], 3, "{r}");
        let (lo, mid, hi) = (
            r["ratio_min"].as_f64().unwrap_or_else(|| panic!("{r}")),
            r["ratio_to_floor"].as_f64().unwrap(),
            r["ratio_max"].as_f64().unwrap_or_else(|| panic!("{r}")),
        );
        if r["strategy"] == "floor" {
            assert_eq!((lo, mid, hi), (1.0, 1.0, 1.0), "{r}");
        } else {
            assert!(lo > 0.0 && lo <= hi, "{r}");
        }
    }
}
