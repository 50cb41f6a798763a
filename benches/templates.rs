//! Filtering speed: a template applied to 100,000 lines as they stream in, in 32 KiB chunks
//! (as `StreamFilter` is fed by the MCP server and run-remote). Target: at most twice the
//! baseline (docs/performance.md). Baseline, in the same run: the same bytes split into lines
//! with the template's `include_regex` matched on each, the least a line filter does (for
//! `generic`, whose pattern matches nothing, `(?i)error|fail|warn`, what one would grep).
//!
//! Two kinds of logs:
//! - `cargo-test` and `pytest`: generated, 100,000 lines of passing tests with a few
//!   failures, after a failure, after a success, and through `auto` picking by the output;
//! - `fixture:NAME`: one real log per family of tools from tests/fixtures/templates (stdout
//!   then stderr, as `2>&1` gives them), repeated to 100,000 lines, with its own template and
//!   its own exit code.
//!
//! `bench/templates_report.py` prints the medians from criterion's estimates. With
//! `TEMPLATES_BENCH_REVERSE=1` each log's filter runs before its baseline (to alternate the
//! order across runs on a loaded machine).

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use mcp_run::{Catalog, Filtered, StreamFilter, Template};

/// 100,000 lines shaped like `cargo test` output with a few failures among the passes.
fn cargo_test_log() -> Vec<u8> {
    let mut out = String::from("\nrunning 99990 tests\n");
    for i in 0..100_000 {
        if i % 20_000 == 7 {
            out.push_str(&format!("test tests::case_{i:05} ... FAILED\n"));
        } else {
            out.push_str(&format!(
                "test tests::module_{}::case_{i:05} ... ok\n",
                i % 37
            ));
        }
    }
    out.push_str("\nfailures:\n\n---- tests::case_00007 stdout ----\n");
    out.push_str("thread 'tests::case_00007' panicked at src/lib.rs:26:9:\n");
    out.push_str("assertion `left == right` failed\n  left: 1\n right: 2\n\nfailures:\n");
    out.push_str("    tests::case_00007\n\n");
    out.push_str("test result: FAILED. 99975 passed; 5 failed; 0 ignored; finished in 3.1s\n");
    out.into_bytes()
}

/// 100,000 lines of pytest -v output.
fn pytest_log() -> Vec<u8> {
    let mut out = String::from(
        "============================= test session starts ==============================\ncollected 99990 items\n\n",
    );
    for i in 0..100_000 {
        let r = if i % 25_000 == 3 { "FAILED" } else { "PASSED" };
        out.push_str(&format!(
            "tests/test_mod{}.py::test_case[{i}] {r}                       [ {:>2}%]\n",
            i % 53,
            i / 1000
        ));
    }
    out.push_str(
        "\n=========================== short test summary info ============================\n",
    );
    out.push_str("FAILED tests/test_mod3.py::test_case[3] - assert 1 == 2\n");
    out.push_str(
        "======================== 4 failed, 99986 passed in 91.2s =========================\n",
    );
    out.into_bytes()
}

/// The chunk size the filter is fed with.
const CHUNK: usize = 32 * 1024;

fn stream(t: &Template, log: &[u8], exit: i32) -> Filtered {
    let mut f = StreamFilter::new(t);
    for chunk in log.chunks(CHUNK) {
        f.push(chunk);
    }
    f.finish(Some(exit), None)
}

/// The baseline: lines matched against the include pattern alone; returns the kept bytes.
fn grep(include: &regex::bytes::Regex, log: &[u8]) -> usize {
    let mut start = 0;
    let mut kept = 0;
    for end in memchr::memchr_iter(b'\n', log) {
        let line = &log[start..end];
        if include.is_match(line) {
            kept += line.len() + 1;
        }
        start = end + 1;
    }
    kept
}

/// The real logs benchmarked: the largest fixture of each family of tools.
const FIXTURES: &[&str] = &[
    "cargo-test-fail",
    "cargo-clippy",
    "go-test-fail",
    "pytest-fail",
    "unittest-fail",
    "jest-fail",
    "vitest-fail",
    "mocha-fail",
    "node-test-fail",
    "tsc-pretty-errors",
    "eslint-errors",
    "mypy-errors",
    "ruff-errors",
    "make-gcc-error",
    "ctest-fail",
    "maven-test-surefire-fail",
    "gradle-test-junit-fail",
    "shellcheck-errors",
    "cmake-configure-error",
];

/// A fixture's log repeated to at least 100,000 lines, its template and its exit code.
fn fixture(name: &str) -> (Vec<u8>, String, i32) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/templates")
        .join(name);
    assert!(dir.is_dir(), "no fixture {}", dir.display());
    let read = |f: &str| std::fs::read(dir.join(f)).unwrap_or_default();
    let mut one = read("stdout");
    one.extend(read("stderr"));
    if !one.ends_with(b"\n") {
        one.push(b'\n');
    }
    let lines = one.iter().filter(|b| **b == b'\n').count();
    let log = one.repeat(100_000_usize.div_ceil(lines));
    let text = |f: &str| String::from_utf8(read(f)).unwrap().trim().to_owned();
    (log, text("template"), text("exit").parse().unwrap())
}

/// The baseline's pattern for a template.
fn baseline_pattern(t: &Template) -> &str {
    if t.name == "generic" {
        "(?i)error|fail|warn"
    } else {
        &t.include_regex
    }
}

fn reverse() -> bool {
    std::env::var_os("TEMPLATES_BENCH_REVERSE").is_some_and(|v| v == "1")
}

fn bench(c: &mut Criterion) {
    let catalog = Catalog::builtin();
    for name in FIXTURES {
        let (log, template, exit) = fixture(name);
        let t = catalog.get(&template).unwrap().clone();
        let include = regex::bytes::Regex::new(baseline_pattern(&t)).unwrap();
        assert_eq!(stream(&t, &log, exit), t.apply(&log, Some(exit)));
        let mut cases: Vec<(String, Box<dyn Fn() -> usize>)> = vec![
            (
                format!("fixture:{name} 100k lines, baseline grep"),
                Box::new(|| grep(&include, black_box(&log))),
            ),
            (
                format!("fixture:{name} 100k lines, failed"),
                Box::new(|| stream(&t, black_box(&log), exit).output.len()),
            ),
        ];
        if reverse() {
            cases.reverse();
        }
        for (id, f) in cases {
            c.bench_function(&id, |b| b.iter(|| black_box(f())));
        }
    }
    for (name, log) in [("cargo-test", cargo_test_log()), ("pytest", pytest_log())] {
        let lines = log.iter().filter(|b| **b == b'\n').count();
        assert!(lines >= 100_000, "{name}: {lines} lines");
        let t = catalog.get(name).unwrap().clone();
        let include = regex::bytes::Regex::new(&t.include_regex).unwrap();
        // The streamed filter and the whole-buffer one agree (the bench measures the former).
        assert_eq!(stream(&t, &log, 1), t.apply(&log, Some(1)));
        // `auto` when the command says nothing: it reads the first lines, picks, then
        // filters the same way.
        let auto = catalog.get("auto").unwrap().clone();
        assert_eq!(stream(&auto, &log, 1).output, {
            let mut o = stream(&t, &log, 1).output;
            let note = format!("[template {name}: ");
            let by = format!("[template {name} (auto, by the output): ");
            o.splice(..note.len(), by.bytes());
            o
        });
        let mut cases: Vec<(String, Box<dyn Fn() -> usize>)> = vec![
            (
                format!("{name} 100k lines, baseline grep"),
                Box::new(|| grep(&include, black_box(&log))),
            ),
            (
                format!("{name} 100k lines, failed"),
                Box::new(|| stream(&t, black_box(&log), 1).output.len()),
            ),
            (
                format!("{name} 100k lines, passed"),
                Box::new(|| stream(&t, black_box(&log), 0).output.len()),
            ),
            (
                format!("{name} 100k lines, auto failed"),
                Box::new(|| stream(&auto, black_box(&log), 1).output.len()),
            ),
        ];
        if reverse() {
            cases.reverse();
        }
        for (id, f) in cases {
            c.bench_function(&id, |b| b.iter(|| black_box(f())));
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
