//! The demo binary as a user runs it: bad input is a one-line error with a non-zero exit, never a
//! panic; a closed standard output ends the run quietly.

use assert_cmd::Command;
use std::process::Stdio;

const BIN: &str = "cuda-stream-pool";

/// Runs the demo with `args` and checks a one-line `error: ...` on stderr, exit code 2 (a usage
/// error), nothing on stdout, no panic.
fn rejects(args: &[&str], mentions: &str) {
    let o = Command::cargo_bin(BIN)
        .unwrap()
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert!(o.stdout.is_empty(), "{args:?}: stdout {:?}", o.stdout);
    assert_eq!(err.lines().count(), 1, "{args:?}: not one line: {err}");
    assert!(err.starts_with("error: "), "{args:?}: {err}");
    assert!(
        err.contains(mentions),
        "{args:?}: {err} does not mention {mentions}"
    );
    assert!(
        !err.contains("panicked") && !err.contains("backtrace"),
        "{args:?}: {err}"
    );
}

#[test]
fn deferred_cap_must_be_a_positive_finite_number_of_seconds() {
    for bad in ["nan", "NaN", "inf", "-inf", "1e30", "-1", "0", "abc", ""] {
        rejects(
            &["--driver", "sim", "--deferred-cap", bad],
            "--deferred-cap",
        );
        rejects(
            &["--driver", "sim", &format!("--deferred-cap={bad}")],
            "--deferred-cap",
        );
    }
}

#[test]
fn thread_counts_are_capped() {
    rejects(&["--driver", "sim", "--threads", "100000"], "1..=1024");
    rejects(&["--driver", "sim", "--threads", "1,1025"], "1..=1024");
    rejects(&["--driver", "sim", "--threads", "0"], "--threads");
    rejects(&["--driver", "sim", "--threads", "-3"], "--threads");
    rejects(
        &["--driver", "sim", "--threads", "99999999999999999999999"],
        "--threads",
    );
}

#[test]
fn other_bad_values() {
    rejects(&["--driver", "gpu"], "--driver");
    rejects(&["--tasks", "0"], "--tasks");
    rejects(&["--tasks", "many"], "--tasks");
    rejects(&["--repeat", "0"], "--repeat");
    rejects(&["--strategies", "pool,bogus"], "--strategies");
    rejects(&["--workloads", "long"], "--workloads");
    rejects(&["--no-such-flag"], "--no-such-flag");
}

#[test]
fn unwritable_json_out_is_a_one_line_error() {
    let o = Command::cargo_bin(BIN)
        .unwrap()
        .args([
            "--driver",
            "sim",
            "--tasks",
            "1",
            "--threads",
            "1",
            "--strategies",
            "pool",
        ])
        .args([
            "--workloads",
            "short",
            "--json-out",
            "/nonexistent-dir/x.json",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let last = err.lines().last().unwrap_or("");
    assert!(
        last.starts_with("error: --json-out /nonexistent-dir/x.json"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn closed_stdout_ends_quietly() {
    // The read end is closed before the demo writes its first line: every write fails with EPIPE.
    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin(BIN))
        .args([
            "--driver",
            "sim",
            "--tasks",
            "20",
            "--threads",
            "1",
            "--strategies",
            "pool",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{:?}: {err}", o.status);
    assert!(!err.contains("panicked") && !err.contains("error"), "{err}");
}

#[test]
fn help_and_version_succeed() {
    for flag in ["--help", "-h", "--version"] {
        let o = Command::cargo_bin(BIN).unwrap().arg(flag).output().unwrap();
        assert!(o.status.success(), "{flag}");
        assert!(!o.stdout.is_empty(), "{flag}");
    }
}

#[test]
fn help_and_table_explain_the_strategies_and_the_seed() {
    let help = Command::cargo_bin(BIN)
        .unwrap()
        .arg("--help")
        .output()
        .unwrap();
    let table = Command::cargo_bin(BIN)
        .unwrap()
        .args([
            "--driver",
            "sim",
            "--tasks",
            "4",
            "--threads",
            "1",
            "--strategies",
            "floor,pool",
        ])
        .args(["--workloads", "short"])
        .output()
        .unwrap();
    assert!(table.status.success());
    for text in [&help.stdout, &table.stdout] {
        let text = String::from_utf8_lossy(text);
        for term in [
            "floor ",
            "pool ",
            "pool-tls ",
            "fresh ",
            "deferred ",
            "cudarc ",
        ] {
            assert!(
                text.contains(&format!("\n  {term}")),
                "{term} not explained:\n{text}"
            );
        }
        assert!(
            text.contains("https://github.com/JuliaGPU/CUDA.jl/pull/3317"),
            "{text}"
        );
        assert!(text.contains("\"the seed\""), "{text}");
    }
}
