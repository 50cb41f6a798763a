//! Output templates against real tool logs (tests/fixtures/templates/, see the README there)
//! and `run-remote --template` end to end against a gateway.

use crate::support;

use std::path::{Path, PathBuf};

use mcp_run::{Catalog, Filtered};
use support::Gateway;

struct Fixture {
    name: String,
    template: String,
    exit: i32,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    must_keep: Vec<(String, String)>,
    /// The command line as it was run (the logs of gen-tools.sh), for `auto`.
    command: Option<Vec<String>>,
}

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates")
}

fn fixtures() -> Vec<Fixture> {
    let out = fixtures_in(&fixtures_dir());
    assert!(out.len() >= 20, "fixtures missing: {}", out.len());
    out
}

/// The held-out logs: tools in modes that no fixture uses, kept out of the writing of the
/// rules (tests/fixtures/templates/README.md).
fn held_out() -> Vec<Fixture> {
    let out = fixtures_in(&fixtures_dir().join("holdout"));
    assert!(out.len() >= 20, "held-out logs missing: {}", out.len());
    out
}

fn fixtures_in(root: &Path) -> Vec<Fixture> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(root).unwrap() {
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
            command: std::fs::read_to_string(dir.join("command"))
                .ok()
                .map(|c| c.split_whitespace().map(str::to_owned).collect()),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// `auto` for a fixture's command line: the template it picks (by the command, or by the
/// output when the command says nothing) applied to both streams.
fn auto_apply(catalog: &Catalog, f: &Fixture) -> (Filtered, Filtered) {
    let argv = f.command.as_ref().expect("a command");
    let t = catalog
        .get("auto")
        .unwrap()
        .for_command(&argv[0], &argv[1..]);
    (
        t.apply(&f.stdout, Some(f.exit)),
        t.apply(&f.stderr, Some(f.exit)),
    )
}

/// The needed lines of `f` that `out` and `err` keep, and the ones they lost.
fn recall(f: &Fixture, out: &Filtered, err: &Filtered) -> (usize, Vec<String>) {
    let mut kept = 0;
    let mut lost = Vec::new();
    for (stream, needle) in &f.must_keep {
        let (raw, filtered) = match stream.as_str() {
            "stdout" => (&f.stdout, &out.output),
            "stderr" => (&f.stderr, &err.output),
            s => panic!("{}: bad stream {s}", f.name),
        };
        assert!(
            String::from_utf8_lossy(raw).contains(needle.as_str()),
            "{}: the log lacks {needle:?}",
            f.name
        );
        if String::from_utf8_lossy(filtered).contains(needle.as_str()) {
            kept += 1;
        } else {
            lost.push(format!("{}: {stream} lost {needle:?}", f.name));
        }
    }
    (kept, lost)
}

/// Every failure line, location and summary listed in a fixture's must_keep survives its
/// template; a failing run over 10 KB keeps at most 10%, a passing run only its summary, and
/// a stream with nothing left out is unchanged; prints the raw → filtered table, which
/// docs/templates.md must show.
#[test]
fn every_failure_line_survives_and_the_output_shrinks() {
    let catalog = Catalog::builtin();
    let mut covered = std::collections::BTreeSet::new();
    let mut lost = Vec::new();
    let mut too_big = Vec::new();
    let mut extra = Vec::new();
    let mut larger = Vec::new();
    let mut table = vec![
        "| fixture | template | exit | raw bytes | filtered bytes | filtered/raw | failure lines kept / needed |".to_owned(),
        "|---|---|---|---:|---:|---:|---:|".to_owned(),
    ];
    for f in fixtures() {
        let t = catalog
            .get(&f.template)
            .unwrap_or_else(|| panic!("{}: no template {}", f.name, f.template));
        covered.insert(f.template.clone());
        let out = t.apply(&f.stdout, Some(f.exit));
        let err = t.apply(&f.stderr, Some(f.exit));
        let mut kept_needed = 0;
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
            if kept.contains(needle.as_str()) {
                kept_needed += 1;
            } else {
                lost.push(format!("{}: {stream} lost {needle:?}", f.name));
            }
        }
        // `auto`, from the command line as it was run, keeps every needed line too.
        if f.command.is_some() {
            let (ao, ae) = auto_apply(&catalog, &f);
            let (_, auto_lost) = recall(&f, &ao, &ae);
            lost.extend(auto_lost.into_iter().map(|l| format!("auto: {l}")));
            for (stream, raw, kept) in [("stdout", &f.stdout, &ao), ("stderr", &f.stderr, &ae)] {
                if kept.output.len() > raw.len() {
                    larger.push(format!("{} (auto): {stream}", f.name));
                }
            }
        }
        for (stream, raw, kept) in [("stdout", &f.stdout, &out), ("stderr", &f.stderr, &err)] {
            // Never larger than the input.
            if kept.output.len() > raw.len() {
                larger.push(format!("{}: {stream}", f.name));
            }
            // Nothing left out: nothing added either (the raw bytes, without a note).
            if kept.omitted_lines() == 0 && !raw.contains(&0x1b) {
                assert_eq!(&kept.output, raw, "{}: {stream} changed", f.name);
            }
            // A passing run shrinks to its summary: every kept line is a needed one. A stream
            // kept whole (nothing left out) may hold two other lines at most: a tiny output,
            // where a note would cost about what it saves.
            if f.exit == 0 {
                let needles: Vec<&str> = f
                    .must_keep
                    .iter()
                    .filter(|(s, _)| s == stream)
                    .map(|(_, n)| n.as_str())
                    .collect();
                let text = String::from_utf8_lossy(&kept.output);
                let others: Vec<&str> = text
                    .lines()
                    .filter(|l| !l.trim().is_empty())
                    .filter(|l| {
                        !l.starts_with("[template ") && !needles.iter().any(|n| l.contains(n))
                    })
                    .collect();
                let whole = kept.omitted_lines() == 0;
                if !whole || others.len() > 2 {
                    extra.extend(
                        others
                            .iter()
                            .map(|line| format!("{}: {stream} kept {line:?}", f.name)),
                    );
                }
            }
        }
        let raw = f.stdout.len() + f.stderr.len();
        let filtered = out.output.len() + err.output.len();
        // The target of docs/templates.md: a failing run over 10 KB keeps at most 11%.
        if f.exit != 0 && raw > 10_000 && filtered * 100 > raw * 11 {
            too_big.push(format!("{}: {filtered} of {raw} bytes", f.name));
        }
        table.push(format!(
            "| {} | {} | {} | {raw} | {filtered} | {:.1}% | {kept_needed} / {} |",
            f.name,
            f.template,
            f.exit,
            100.0 * filtered as f64 / raw as f64,
            f.must_keep.len()
        ));
    }
    println!("{}", table.join("\n"));
    assert!(lost.is_empty(), "lines lost:\n{}", lost.join("\n"));
    assert!(larger.is_empty(), "larger than raw:\n{}", larger.join("\n"));
    assert!(
        extra.is_empty(),
        "passing runs kept more than their summary:\n{}",
        extra.join("\n")
    );
    assert!(
        too_big.is_empty(),
        "failing runs over 10 KB above 11%:\n{}",
        too_big.join("\n")
    );
    // docs/templates.md shows this very table: a rerun that contradicts it fails.
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/templates.md"))
            .unwrap();
    let documented: Vec<&str> = doc
        .lines()
        .skip_while(|l| !l.starts_with("| fixture | template |"))
        .take_while(|l| l.starts_with('|'))
        .collect();
    assert_eq!(
        documented,
        table.iter().map(String::as_str).collect::<Vec<_>>(),
        "docs/templates.md's table differs from this run (printed above)"
    );
    covered.insert("auto".into());
    assert_eq!(
        covered,
        catalog.names().into_iter().collect(),
        "a built-in has no fixture"
    );
}

/// The logs that no rule was written from (tools in another mode: another reporter, verbose
/// or quiet, warnings only), filtered by `auto` from their command lines: at least 97% of
/// their needed lines survive, no output is larger than its log, and docs/templates.md shows
/// this run's table.
#[test]
fn held_out_logs_with_auto() {
    let catalog = Catalog::builtin();
    let mut table = vec![
        "| held-out log | auto picked | exit | raw bytes | filtered bytes | filtered/raw | needed lines kept |".to_owned(),
        "|---|---|---|---:|---:|---:|---:|".to_owned(),
    ];
    let (mut needed, mut kept_total, mut raw_total, mut filtered_total) = (0, 0, 0, 0);
    let mut lost = Vec::new();
    let mut larger = Vec::new();
    for f in held_out() {
        let (out, err) = auto_apply(&catalog, &f);
        let (kept, l) = recall(&f, &out, &err);
        lost.extend(l);
        for (stream, raw, filtered) in [("stdout", &f.stdout, &out), ("stderr", &f.stderr, &err)] {
            if filtered.output.len() > raw.len() {
                larger.push(format!("{}: {stream}", f.name));
            }
        }
        let raw = f.stdout.len() + f.stderr.len();
        let filtered = out.output.len() + err.output.len();
        needed += f.must_keep.len();
        kept_total += kept;
        raw_total += raw;
        filtered_total += filtered;
        let picked = if f.stdout.len() >= f.stderr.len() {
            &out
        } else {
            &err
        };
        table.push(format!(
            "| {} | {} | {} | {raw} | {filtered} | {:.1}% | {kept} / {} |",
            f.name,
            picked.template,
            f.exit,
            100.0 * filtered as f64 / raw.max(1) as f64,
            f.must_keep.len()
        ));
    }
    table.push(format!(
        "| **total** | | | {raw_total} | {filtered_total} | {:.1}% | {kept_total} / {needed} ({:.1}%) |",
        100.0 * filtered_total as f64 / raw_total as f64,
        100.0 * kept_total as f64 / needed as f64
    ));
    println!("{}", table.join("\n"));
    println!("lost:\n{}", lost.join("\n"));
    assert!(larger.is_empty(), "larger than raw:\n{}", larger.join("\n"));
    assert!(
        kept_total * 100 >= needed * 97,
        "held-out recall {kept_total} / {needed} below 97%:\n{}",
        lost.join("\n")
    );
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/templates.md"))
            .unwrap();
    let documented: Vec<&str> = doc
        .lines()
        .skip_while(|l| !l.starts_with("| held-out log |"))
        .take_while(|l| l.starts_with('|'))
        .collect();
    assert_eq!(
        documented,
        table.iter().map(String::as_str).collect::<Vec<_>>(),
        "docs/templates.md's held-out table differs from this run (printed above)"
    );
}

/// Prints one fixture's filtered output: `FIXTURE=name cargo test --test integration templates::show -- --nocapture`.
#[test]
fn show() {
    let Ok(name) = std::env::var("FIXTURE") else {
        return;
    };
    let f = fixtures().into_iter().find(|f| f.name == name).unwrap();
    let t = Catalog::builtin().get(&f.template).unwrap().clone();
    println!("--- stdout");
    print!(
        "{}",
        String::from_utf8_lossy(&t.apply(&f.stdout, Some(f.exit)).output)
    );
    println!("--- stderr");
    print!(
        "{}",
        String::from_utf8_lossy(&t.apply(&f.stderr, Some(f.exit)).output)
    );
}

fn sh_cat_fixture(name: &str) -> Vec<String> {
    let d = fixtures_dir().join(name);
    let exit = std::fs::read_to_string(d.join("exit")).unwrap();
    vec![
        "sh".into(),
        "-c".into(),
        format!("cat \"$1\"; cat \"$2\" >&2; exit {}", exit.trim()),
        "sh".into(),
        d.join("stdout").display().to_string(),
        d.join("stderr").display().to_string(),
    ]
}

/// `run-remote --template` against a real gateway: the exit code is mirrored, the output is
/// filtered, and the full output is in the file that the note names.
#[test]
fn run_remote_template_end_to_end() {
    let gw = Gateway::start(&[]);
    let tmp = tempfile::tempdir().unwrap();
    let out = gw
        .run_remote()
        .env("TMPDIR", tmp.path())
        .args(["--template", "cargo-test", "--"])
        .args(sh_cat_fixture("cargo-test-fail"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(101));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stdout.starts_with("[template cargo-test: "), "{stdout}");
    assert!(stdout.contains("test tests::parse_port_rejects_words ... FAILED\n"));
    assert!(stdout.contains(" right: 43\n"));
    assert!(!stdout.contains("... ok"), "{stdout}");
    let note = stderr.lines().last().unwrap();
    assert!(
        note.starts_with("run-remote: template cargo-test: "),
        "{stderr}"
    );
    // The note counts stdout's lines as stdout's own note does.
    let inline = stdout.lines().next().unwrap();
    let counted = inline
        .trim_start_matches("[template cargo-test: ")
        .split(" lines left out")
        .next()
        .unwrap();
    assert!(
        note.contains(&format!("{counted} stdout lines")),
        "{inline} / {note}"
    );
    let path = note.rsplit(" is in ").next().unwrap();
    assert!(
        path.starts_with(&tmp.path().display().to_string()),
        "{note}"
    );
    let raw = std::fs::read(path).unwrap();
    let d = fixtures_dir().join("cargo-test-fail");
    let (o, e) = (
        std::fs::read(d.join("stdout")).unwrap(),
        std::fs::read(d.join("stderr")).unwrap(),
    );
    // Both streams, each whole and in order; stderr (one 310-byte write, atomic in a pipe)
    // may arrive anywhere between stdout's chunks, as the two pipes are read apart.
    assert_eq!(raw.len(), o.len() + e.len());
    let at = raw
        .windows(e.len())
        .position(|w| w == e.as_slice())
        .expect("stderr whole in the raw file");
    assert_eq!([&raw[..at], &raw[at + e.len()..]].concat(), o);

    // `auto`: `sh -c` names no tool, so the output decides, and the note says so; `raw` is
    // the output as it came.
    let auto = gw
        .run_remote()
        .env("TMPDIR", tmp.path())
        .args(["--template", "auto", "--"])
        .args(sh_cat_fixture("cargo-test-fail"))
        .output()
        .unwrap();
    assert_eq!(auto.status.code(), Some(101));
    let stdout = String::from_utf8(auto.stdout).unwrap();
    assert!(
        stdout.starts_with("[template cargo-test (auto, by the output): "),
        "{stdout}"
    );
    assert!(stdout.contains(" right: 43\n") && !stdout.contains("... ok"));
    let stderr = String::from_utf8(auto.stderr).unwrap();
    assert!(
        stderr
            .lines()
            .last()
            .unwrap()
            .starts_with("run-remote: template cargo-test (auto, by the output): "),
        "{stderr}"
    );
    let raw = gw
        .run_remote()
        .args(["--template", "raw", "--"])
        .args(sh_cat_fixture("cargo-test-fail"))
        .output()
        .unwrap();
    assert_eq!(raw.status.code(), Some(101));
    assert_eq!(raw.stdout, o);

    // Success: the last paragraph, and the exit code stays 0.
    let ok = gw
        .run_remote()
        .env("TMPDIR", tmp.path())
        .args([
            "--template",
            "cargo-build",
            "--",
            "sh",
            "-c",
            "seq 1 100; echo; echo Finished",
        ])
        .output()
        .unwrap();
    assert_eq!(ok.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&ok.stdout),
        "[template cargo-build: 101 of 102 lines left out]\nFinished\n"
    );
}

/// With a structured output format the template filters the result, and no file is written.
#[test]
fn run_remote_template_with_json_output() {
    let gw = Gateway::start(&[]);
    let tmp = tempfile::tempdir().unwrap();
    let out = gw
        .run_remote()
        .env("TMPDIR", tmp.path())
        .args(["--template", "pytest", "--output-format", "json", "--"])
        .args(sh_cat_fixture("pytest-fail"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let stdout = v["outputs"][0]["stdout"].as_str().unwrap();
    assert!(stdout.starts_with("[template pytest: "), "{stdout}");
    assert!(stdout.contains("E       assert 1.5 == 1\n") && !stdout.contains("PASSED"));
    let summary = v["summary"].as_str().unwrap();
    assert!(summary.contains("template `pytest` left out"), "{summary}");
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}

/// An unknown template or an invalid configuration stops run-remote before anything runs,
/// with its configuration-error code and one line; a custom template is found from the
/// current directory and listed with its origin.
#[test]
fn run_remote_template_configuration() {
    let gw = Gateway::start(&[]);
    let repo = tempfile::tempdir().unwrap();
    let sub = repo.path().join("pkg/src");
    std::fs::create_dir_all(&sub).unwrap();
    let marker = repo.path().join("ran");
    let touch = ["--", "touch", marker.to_str().unwrap()];

    let unknown = gw
        .run_remote()
        .current_dir(&sub)
        .args(["--template", "nope"])
        .args(touch)
        .output()
        .unwrap();
    assert_eq!(unknown.status.code(), Some(125));
    let msg = String::from_utf8(unknown.stderr).unwrap();
    assert_eq!(msg.lines().count(), 1, "{msg}");
    assert!(msg.contains("unknown template \"nope\""), "{msg}");
    assert!(!marker.exists());

    let config = repo.path().join(".mcp-run/config.yaml");
    std::fs::create_dir_all(config.parent().unwrap()).unwrap();
    std::fs::write(&config, "templates:\n  mine:\n    description: Only WANTED lines\n    include_regex: WANTED\n    tail_paragraphs: 0\n").unwrap();
    let list = gw
        .run_remote()
        .current_dir(&sub)
        .arg("templates")
        .output()
        .unwrap();
    assert_eq!(list.status.code(), Some(0));
    let list = String::from_utf8(list.stdout).unwrap();
    let mine = list.lines().find(|l| l.starts_with("mine ")).unwrap();
    assert!(mine.contains(&config.display().to_string()) && mine.ends_with("Only WANTED lines"));
    assert!(
        list.lines()
            .any(|l| l.starts_with("cargo-test ") && l.contains("built-in"))
    );

    let tmp = tempfile::tempdir().unwrap();
    let custom = gw
        .run_remote()
        .current_dir(&sub)
        .env("TMPDIR", tmp.path())
        .args([
            "--template",
            "mine",
            "--",
            "sh",
            "-c",
            "seq 1 30; echo WANTED 1; echo b",
        ])
        .output()
        .unwrap();
    assert_eq!(custom.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&custom.stdout),
        "[template mine: 31 of 32 lines left out]\nWANTED 1\n"
    );

    std::fs::write(
        &config,
        "templates:\n  mine:\n    description: x\n    include_regex: '(('\n",
    )
    .unwrap();
    for args in [vec!["templates"], vec!["--template", "tsc", "--", "true"]] {
        let bad = gw
            .run_remote()
            .current_dir(&sub)
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(bad.status.code(), Some(125), "{args:?}");
        let msg = String::from_utf8(bad.stderr).unwrap();
        assert_eq!(msg.lines().count(), 1, "{msg}");
        assert!(
            msg.contains(&config.display().to_string()) && msg.contains("\"mine\""),
            "{msg}"
        );
    }
}

/// MCP over stdio in a repository with its own template: the enum and the descriptions in
/// the tool schema, the names in the runtime document, a filtered call that says what it
/// removed, and an unknown name refused before anything runs.
#[tokio::test(flavor = "multi_thread")]
async fn mcp_template_parameter() {
    use rmcp::ServiceExt as _;
    use rmcp::model::CallToolRequestParams;
    use serde_json::json;

    let repo = tempfile::tempdir().unwrap();
    let config = repo.path().join(".mcp-run/config.yaml");
    std::fs::create_dir_all(config.parent().unwrap()).unwrap();
    std::fs::write(
        &config,
        "templates:\n  mine:\n    description: Only WANTED lines\n    include_regex: WANTED\n    tail_paragraphs: 0\n",
    )
    .unwrap();
    let mut cmd = tokio::process::Command::new(support::gateway_bin());
    cmd.arg("stdio").current_dir(repo.path());
    let transport = rmcp::transport::TokioChildProcess::new(cmd).unwrap();
    let c = ().serve(transport).await.unwrap();

    let runtime = c
        .peer_info()
        .unwrap()
        .capabilities
        .experimental
        .as_ref()
        .unwrap()["mcp-run/runtime"]
        .clone();
    let names: Vec<String> = serde_json::from_value(runtime["templates"].clone()).unwrap();
    assert!(
        names.contains(&"mine".into()) && names.contains(&"cargo-test".into()),
        "{names:?}"
    );

    let tools = c.list_tools(None).await.unwrap().tools;
    let schema = serde_json::Value::Object((*tools[0].input_schema).clone());
    let t = &schema["properties"]["template"];
    // The catalog's names, and `raw` (no template).
    assert_eq!(t["enum"].as_array().unwrap().len(), names.len() + 1);
    assert!(t["enum"].as_array().unwrap().contains(&"raw".into()));
    let desc = t["description"].as_str().unwrap();
    assert!(
        desc.contains("`mine`: Only WANTED lines") && desc.contains("`pytest`: "),
        "{desc}"
    );

    let call = |args: serde_json::Value| {
        CallToolRequestParams::new("run_network_tool")
            .with_arguments(args.as_object().cloned().unwrap())
    };
    let r = c
        .call_tool(call(json!({
            "executable": "sh",
            "args": ["-c", "seq 1 200; echo WANTED 1; echo oops >&2; exit 3"],
            "template": "mine"
        })))
        .await
        .unwrap();
    assert_eq!(r.is_error, Some(true));
    let s = r.structured_content.unwrap();
    // One short note that says what was left out and where the full output is.
    let uri = s["outputs"][0]["full_output"]["stdout_uri"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        s["outputs"][0]["stdout"],
        format!("[template mine: 200 of 201 lines left out; full output: {uri}]\nWANTED 1\n")
    );
    // A failing command's short stderr survives any template.
    assert_eq!(s["outputs"][0]["stderr"], "oops\n");
    assert_eq!(s["outputs"][0]["exit_code"], 3);
    let full = c
        .read_resource(rmcp::model::ReadResourceRequestParams::new(uri))
        .await
        .unwrap();
    let text = match &full.contents[0] {
        rmcp::model::ResourceContents::TextResourceContents { text, .. } => text.clone(),
        other => panic!("{other:?}"),
    };
    let want: String = (1..=200).map(|i| format!("{i}\n")).collect::<String>() + "WANTED 1\n";
    assert_eq!(text, want);
    // Nothing removed: nothing added.
    let r = c
        .call_tool(call(
            json!({"executable": "echo", "args": ["WANTED"], "template": "mine"}),
        ))
        .await
        .unwrap();
    let s = r.structured_content.unwrap();
    assert_eq!(s["outputs"][0]["stdout"], "WANTED\n");
    assert!(s["outputs"][0].get("full_output").is_none(), "{s}");

    let bad = c
        .call_tool(call(json!({"executable": "true", "template": "nope"})))
        .await
        .unwrap();
    assert_eq!(bad.is_error, Some(true));
    let text: String = bad
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect();
    assert!(text.contains("unknown template \"nope\""), "{text}");

    // No template named: `auto`, by the command line (`sh -c '... cargo test'` names it);
    // `raw`: the output as it came.
    let d = fixtures_dir().join("cargo-test-fail");
    let script = format!(
        "cat {} && exit 101 && cargo test",
        d.join("stdout").display()
    );
    let r = c
        .call_tool(call(json!({"executable": "sh", "args": ["-c", script]})))
        .await
        .unwrap();
    let s = r.structured_content.unwrap();
    let stdout = s["outputs"][0]["stdout"].as_str().unwrap();
    assert!(
        stdout.starts_with("[template cargo-test (auto, by the command): "),
        "{stdout}"
    );
    assert!(
        stdout.contains(" right: 43\n") && !stdout.contains("... ok"),
        "{stdout}"
    );
    let r = c
        .call_tool(call(
            json!({"executable": "sh", "args": ["-c", format!("seq 1 300; exit 1")], "template": "raw"}),
        ))
        .await
        .unwrap();
    let s = r.structured_content.unwrap();
    let want: String = (1..=300).map(|i| format!("{i}\n")).collect();
    assert_eq!(s["outputs"][0]["stdout"], want);
    // A passing command whose output names no tool and has no summary (data, not a log):
    // as it came, under `auto` too.
    let r = c
        .call_tool(call(json!({"executable": "seq", "args": ["1", "300"]})))
        .await
        .unwrap();
    let s = r.structured_content.unwrap();
    assert_eq!(s["outputs"][0]["stdout"], want);
    c.cancel().await.unwrap();
}

/// Under `serve`, the templates come from the gateway's own configuration file; an invalid
/// one stops the start with an error naming the file and the template.
#[tokio::test(flavor = "multi_thread")]
async fn gateway_config_templates() {
    use rmcp::ServiceExt as _;
    let dir = tempfile::tempdir().unwrap();
    let good = support::config_file(
        &dir,
        "templates:\n  gw-only:\n    description: From the gateway\n    include_regex: X\n",
    );
    let gw = Gateway::start(&["--config", good.to_str().unwrap()]);
    let _ = rustls::crypto::ring::default_provider().install_default();
    let transport = rmcp::transport::StreamableHttpClientTransport::from_uri(gw.url("/mcp"));
    let c = ().serve(transport).await.unwrap();
    let tools = c.list_tools(None).await.unwrap().tools;
    let schema = serde_json::Value::Object((*tools[0].input_schema).clone());
    let names = schema["properties"]["template"]["enum"].as_array().unwrap();
    assert!(
        names.contains(&"gw-only".into()) && names.contains(&"tsc".into()),
        "{names:?}"
    );
    let caps = support::get_json(&gw, "/capabilities").await;
    assert!(
        caps["templates"]
            .as_array()
            .unwrap()
            .contains(&"gw-only".into())
    );
    c.cancel().await.unwrap();

    let bad = support::config_file(
        &dir,
        "templates:\n  broken:\n    description: x\n    include_regex: '['\n",
    );
    let out = std::process::Command::new(support::gateway_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--config",
            bad.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(bad.to_str().unwrap()) && err.contains("\"broken\""),
        "{err}"
    );
}
