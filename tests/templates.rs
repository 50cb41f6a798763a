//! Output templates against real tool logs (tests/fixtures/templates/, see the README there)
//! and `run-remote --template` end to end against a gateway.

mod support;

use std::path::{Path, PathBuf};

use mcp_run::templates::Catalog;

struct Fixture {
    name: String,
    template: String,
    exit: i32,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    must_keep: Vec<(String, String)>,
}

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates")
}

fn fixtures() -> Vec<Fixture> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(fixtures_dir()).unwrap() {
        let dir = entry.unwrap().path();
        if !dir.join("template").is_file() {
            continue;
        }
        let read = |f: &str| std::fs::read(dir.join(f)).unwrap();
        let text = |f: &str| String::from_utf8(read(f)).unwrap().trim().to_owned();
        let must_keep = text("must_keep")
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .map(|l| {
                let (stream, needle) = l.split_once('|').unwrap();
                (stream.to_owned(), needle.to_owned())
            })
            .collect();
        out.push(Fixture {
            name: dir.file_name().unwrap().to_string_lossy().into_owned(),
            template: text("template"),
            exit: text("exit").parse().unwrap(),
            stdout: read("stdout"),
            stderr: read("stderr"),
            must_keep,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    assert!(out.len() >= 14, "fixtures missing: {}", out.len());
    out
}

/// Every failure line, location and summary listed in a fixture's must_keep survives its
/// template; prints the raw → filtered table of docs/performance.md.
#[test]
fn every_failure_line_survives_and_the_output_shrinks() {
    let catalog = Catalog::builtin();
    let mut covered = std::collections::BTreeSet::new();
    let mut lost = Vec::new();
    println!(
        "| fixture | template | exit | raw bytes | filtered bytes | filtered/raw | failure lines kept |"
    );
    println!("|---|---|---|---:|---:|---:|---|");
    for f in fixtures() {
        let t = catalog
            .get(&f.template)
            .unwrap_or_else(|| panic!("{}: no template {}", f.name, f.template));
        covered.insert(f.template.clone());
        let out = t.apply(&f.stdout, Some(f.exit));
        let err = t.apply(&f.stderr, Some(f.exit));
        for (stream, needle) in &f.must_keep {
            let (raw, kept) = match stream.as_str() {
                "stdout" => (&f.stdout, &out.output),
                "stderr" => (&f.stderr, &err.output),
                s => panic!("{}: bad stream {s}", f.name),
            };
            let raw = String::from_utf8_lossy(raw);
            let kept = String::from_utf8_lossy(kept);
            assert!(
                raw.contains(needle.as_str()),
                "{}: fixture lacks {needle:?}",
                f.name
            );
            if !kept.contains(needle.as_str()) {
                lost.push(format!("{}: {stream} lost {needle:?}", f.name));
            }
        }
        let raw = f.stdout.len() + f.stderr.len();
        let filtered = out.output.len() + err.output.len();
        println!(
            "| {} | {} | {} | {raw} | {filtered} | {:.1}% | all {} |",
            f.name,
            f.template,
            f.exit,
            100.0 * filtered as f64 / raw as f64,
            f.must_keep.len()
        );
    }
    assert!(lost.is_empty(), "lines lost:\n{}", lost.join("\n"));
    assert_eq!(
        covered,
        catalog.names().into_iter().collect(),
        "a built-in has no fixture"
    );
}
