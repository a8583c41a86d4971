//! `--devices N` (issue 24): per-device rows on a simulation of two devices, its JSON rows, and
//! a clean failure when the driver has fewer devices than asked for. The GPU tests run the same
//! on the real driver (`bash .gpu/run-tests.sh` finds the bundled demo binary).

use assert_cmd::Command;
use serde_json::Value;

const BIN: &str = "cuda-stream-pool";

/// The demo's output for `args`.
fn demo(args: &[&str]) -> std::process::Output {
    Command::cargo_bin(BIN)
        .unwrap()
        .args(args)
        .output()
        .unwrap()
}

/// A run's stdout and stderr, checked to have succeeded.
fn succeeded(o: &std::process::Output) -> (String, String) {
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(o.status.success(), "{out}\n{err}");
    (out, err)
}

/// One table row of `--devices`: workload strategy device threads tasks wall_s x_floor x_spread
/// us/owner streams sync_ms.
#[derive(Debug)]
struct Row {
    workload: String,
    strategy: String,
    device: String,
    threads: usize,
    tasks: usize,
    ratio: f64,
    spread: (f64, f64),
    streams: u64,
}

/// The table's rows (lines of 11 columns that start with a workload); panics on a row that does
/// not parse.
fn table(stdout: &[u8]) -> Vec<Row> {
    let text = String::from_utf8_lossy(stdout);
    text.lines()
        .filter(|l| l.starts_with("short ") || l.starts_with("prodcons "))
        .map(|l| {
            let c: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(c.len(), 11, "not a row of 11 columns: {l}");
            let (lo, hi) = c[7]
                .split_once('-')
                .unwrap_or_else(|| panic!("x_spread: {l}"));
            Row {
                workload: c[0].into(),
                strategy: c[1].into(),
                device: c[2].into(),
                threads: c[3].parse().unwrap_or_else(|e| panic!("{e}: {l}")),
                tasks: c[4].parse().unwrap_or_else(|e| panic!("{e}: {l}")),
                ratio: c[6].parse().unwrap_or_else(|e| panic!("x_floor {e}: {l}")),
                spread: (
                    lo.parse().unwrap_or_else(|e| panic!("{e}: {l}")),
                    hi.parse().unwrap_or_else(|e| panic!("{e}: {l}")),
                ),
                streams: c[9].parse().unwrap_or_else(|e| panic!("{e}: {l}")),
            }
        })
        .collect()
}

/// Checks the rows of a `--devices 2` run of `workloads` × `threads` × floor and pool with
/// `tasks` tasks: one per device and one for all, each with a ratio to the floor of its device.
fn check_two_device_rows(rows: &[Row], workloads: &[&str], threads: &[usize], tasks: usize) {
    assert_eq!(
        rows.len(),
        workloads.len() * threads.len() * 2 * 3,
        "{rows:#?}"
    );
    for w in workloads {
        for &t in threads {
            for s in ["floor", "pool"] {
                let find = |d: &str| {
                    let found: Vec<&Row> = rows
                        .iter()
                        .filter(|r| r.workload == *w && r.strategy == s && r.device == d)
                        .filter(|r| {
                            if d == "all" {
                                r.threads == t
                            } else {
                                r.threads * 2 == t
                            }
                        })
                        .collect();
                    assert_eq!(found.len(), 1, "{w} {s} x{t} device {d}: {rows:#?}");
                    found[0]
                };
                let (d0, d1, all) = (find("0"), find("1"), find("all"));
                assert_eq!(d0.tasks + d1.tasks, tasks, "{d0:?} {d1:?}");
                assert_eq!(all.tasks, tasks, "{all:?}");
                assert_eq!(d0.tasks, d1.tasks, "half each: {d0:?} {d1:?}");
                for r in [d0, d1, all] {
                    assert!(r.ratio.is_finite() && r.ratio > 0.0, "{r:?}");
                    assert!(r.spread.0 > 0.0 && r.spread.0 <= r.spread.1, "{r:?}");
                    if s == "floor" {
                        assert_eq!(r.ratio, 1.0, "{r:?}");
                    }
                    // At least the disposal stream and one stream per thread of the device.
                    assert!(r.streams > 1, "{r:?}");
                }
                // (`all`'s peak is the sum of one run's device peaks, but each row is the median
                // run of its own device: with repeats, the rows may come from different runs.)
            }
        }
    }
}

#[test]
fn two_simulated_devices_give_a_row_per_device_with_its_own_floor() {
    let o = demo(&[
        "--driver",
        "sim",
        "--devices",
        "2",
        "--threads",
        "2,4",
        "--tasks",
        "64",
        "--repeat",
        "2",
        "--strategies",
        "floor,pool",
    ]);
    let (out, err) = succeeded(&o);
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.contains("device 0: Simulated H200"), "{out}");
    assert!(out.contains("device 1: Simulated H200"), "{out}");
    // 2 workloads × 2 thread counts × 2 strategies × 2 runs × 64 tasks, all checked.
    assert!(
        out.contains("checks passed (2 devices): 1024 tasks"),
        "{out}"
    );
    assert!(
        err.contains("note: --devices on the simulated driver"),
        "{err}"
    );
    check_two_device_rows(&table(&o.stdout), &["short", "prodcons"], &[2, 4], 64);
}

#[test]
fn two_simulated_devices_as_json_lines() {
    let o = demo(&[
        "--driver",
        "sim",
        "--devices",
        "2",
        "--threads",
        "2",
        "--tasks",
        "10",
        "--workloads",
        "short",
        "--json",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("checks passed (2 devices)"), "{err}");
    let rows: Vec<Value> = std::str::from_utf8(&o.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    // floor, pool and pool-tls (the default strategies), for device 0, 1 and all.
    assert_eq!(rows.len(), 9, "{rows:#?}");
    let mut devices: Vec<Value> = rows.iter().map(|r| r["device"].clone()).collect();
    devices.dedup();
    assert_eq!(devices, [Value::from(0), Value::from(1), Value::Null]);
    for r in &rows {
        assert_eq!(r["devices"], 2, "{r}");
        assert_eq!(r["driver"], "sim", "{r}");
        let ratio = r["ratio_to_floor"]
            .as_f64()
            .unwrap_or_else(|| panic!("{r}"));
        assert!(ratio.is_finite() && ratio > 0.0, "{r}");
        let want = if r["device"].is_null() { 10 } else { 5 };
        assert_eq!(r["tasks"], want, "{r}");
    }
}

/// Runs `args` and checks a clean failure: exit code 1, a last stderr line `error: <starts>...`,
/// no table, no panic.
fn fails_cleanly(args: &[&str], starts: &str) {
    let o = demo(args);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert_eq!(o.status.code(), Some(1), "{args:?}: {out}\n{err}");
    let last = err.lines().last().unwrap_or("");
    assert!(
        last.starts_with(&format!("error: {starts}")),
        "{args:?}: {err}"
    );
    assert!(!out.contains("workload"), "{args:?}: a table: {out}");
    assert!(
        !err.contains("panicked") && !err.contains("backtrace"),
        "{args:?}: {err}"
    );
}

#[test]
fn more_devices_than_the_simulation_has_is_a_clean_error() {
    fails_cleanly(
        &["--driver", "sim", "--devices", "3", "--sim-devices", "2"],
        "--devices 3: the simulated driver has only 2 device(s)",
    );
}

#[test]
fn too_few_threads_or_another_strategy_is_a_clean_error() {
    fails_cleanly(
        &["--driver", "sim", "--devices", "2", "--threads", "1"],
        "--devices 2 needs at least 2 threads per row",
    );
    fails_cleanly(
        &[
            "--driver",
            "sim",
            "--devices",
            "2",
            "--strategies",
            "pool,fresh",
        ],
        "--devices 2 runs the strategies floor, pool and pool-tls only, not fresh",
    );
}

#[test]
fn bad_device_counts_are_usage_errors() {
    for args in [
        &["--devices", "0"][..],
        &["--devices", "65"],
        &["--devices", "two"],
        &["--driver", "sim", "--sim-devices", "0"],
    ] {
        let o = demo(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.starts_with("error: "), "{args:?}: {err}");
    }
}

/// The GPU's device count, from the crate.
fn gpus() -> i32 {
    use cuda_stream_pool::driver::{self, Choice};
    let d = driver::load(Choice::Cuda)
        .unwrap_or_else(|e| panic!("GPU test without a usable CUDA driver: {e}"))
        .0;
    d.init().unwrap();
    d.device_count().unwrap()
}

/// The GPU tests of this file run one at a time (each runs the demo on every device).
static GPU: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_more_devices_than_the_machine_has_is_a_clean_error() {
    let _serial = GPU.lock().unwrap_or_else(|p| p.into_inner());
    let n = gpus();
    let ask = (n + 1).to_string();
    fails_cleanly(
        &["--driver", "cuda", "--devices", &ask, "--tasks", "8"],
        &format!("--devices {ask}: the CUDA driver has only {n} device(s)"),
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_two_devices_give_a_row_per_device() {
    let _serial = GPU.lock().unwrap_or_else(|p| p.into_inner());
    let n = gpus();
    if n < 2 {
        eprintln!("gpu_two_devices_give_a_row_per_device: skipped, only {n} device(s)");
        return;
    }
    let o = demo(&[
        "--driver",
        "cuda",
        "--devices",
        "2",
        "--threads",
        "4",
        "--tasks",
        "2000",
        "--strategies",
        "floor,pool",
    ]);
    let (out, _) = succeeded(&o);
    assert!(out.contains("checks passed (2 devices)"), "{out}");
    check_two_device_rows(&table(&o.stdout), &["short", "prodcons"], &[4], 2000);
}
