//! Filtering speed: a template applied to 100,000 lines as they stream in, in 32 KiB chunks
//! (as `StreamFilter` is fed by the MCP server and run-remote), after a failure and after a
//! success, and through `auto` picking by the output. Targets: ≤ 50 ms, and at most twice the
//! baseline (docs/performance.md). Baseline, in the same run: the same bytes split into lines
//! with the template's `include_regex` matched on each, the least a line filter does. `bench/templates_report.py` prints the medians from criterion's estimates.

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

fn bench(c: &mut Criterion) {
    let catalog = Catalog::builtin();
    for (name, log) in [("cargo-test", cargo_test_log()), ("pytest", pytest_log())] {
        let lines = log.iter().filter(|b| **b == b'\n').count();
        assert!(lines >= 100_000, "{name}: {lines} lines");
        let t = catalog.get(name).unwrap().clone();
        let include = regex::bytes::Regex::new(&t.include_regex).unwrap();
        // The streamed filter and the whole-buffer one agree (the bench measures the former).
        assert_eq!(stream(&t, &log, 1), t.apply(&log, Some(1)));
        c.bench_function(&format!("{name} 100k lines, baseline grep"), |b| {
            b.iter(|| black_box(grep(&include, black_box(&log))))
        });
        c.bench_function(&format!("{name} 100k lines, failed"), |b| {
            b.iter(|| black_box(stream(&t, black_box(&log), 1)))
        });
        c.bench_function(&format!("{name} 100k lines, passed"), |b| {
            b.iter(|| black_box(stream(&t, black_box(&log), 0)))
        });
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
        c.bench_function(&format!("{name} 100k lines, auto failed"), |b| {
            b.iter(|| black_box(stream(&auto, black_box(&log), 1)))
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
