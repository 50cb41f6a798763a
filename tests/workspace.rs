//! Workspaces through the real binaries on the local backend: `run-remote --workspace`
//! sends the tree (git's rules), the command runs in a fresh copy in the same relative
//! directory, uploads are incremental, `--sync-back` brings results home, concurrent runs
//! do not see each other, and nothing is left behind.

mod support;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Output;

use support::{Gateway, config_file};

/// A gateway whose workspace directories and cache are in `dir`.
fn gateway(dir: &tempfile::TempDir, extra: &str) -> Gateway {
    let runs = dir.path().join("runs");
    let cache = dir.path().join("cache");
    let cfg = config_file(
        dir,
        &format!(
            "workspaces:\n  local_dir: {}\n  cache_dir: {}\n{extra}",
            runs.display(),
            cache.display()
        ),
    );
    Gateway::start(&["--config", cfg.to_str().unwrap()])
}

/// `run-remote` in `cwd` with its own hash cache.
fn run_remote(gw: &Gateway, home: &Path, cwd: &Path, args: &[&str]) -> Output {
    gw.run_remote()
        .env("XDG_CACHE_HOME", home)
        .current_dir(cwd)
        .args(args)
        .output()
        .unwrap()
}

fn write(root: &Path, rel: &str, data: &[u8]) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, data).unwrap();
}

/// A git-like tree: ignored files of every kind beside the files that count.
fn sample_tree() -> (tempfile::TempDir, BTreeMap<String, (u32, Vec<u8>)>) {
    let d = tempfile::tempdir().unwrap();
    let r = d.path();
    write(r, ".git/HEAD", b"ref: refs/heads/main\n");
    write(r, ".git/info/exclude", b"secret.txt\n");
    write(r, ".gitignore", b"*.o\n/build\n");
    write(r, "secret.txt", b"never sent");
    write(r, "build/out.bin", b"ignored dir");
    write(r, "lib/x.o", b"ignored by pattern");
    write(r, "lib/.gitignore", b"gen/\n");
    write(r, "lib/gen/g.rs", b"nested ignore");
    let mut want = BTreeMap::new();
    for (rel, data, mode) in [
        (".gitignore", &b"*.o\n/build\n"[..], 0o644),
        ("lib/.gitignore", b"gen/\n", 0o644),
        ("lib/a/b/deep.txt", b"deep\n", 0o644),
        ("lib/bin.dat", &[0u8, 255, 10, 13, 0][..], 0o644),
        ("run.sh", b"#!/bin/sh\necho ran\n", 0o755),
        ("untracked new.txt", b"spaces and all", 0o644),
    ] {
        write(r, rel, data);
        std::fs::set_permissions(r.join(rel), std::fs::Permissions::from_mode(mode)).unwrap();
        want.insert(rel.to_string(), (mode, data.to_vec()));
    }
    std::os::unix::fs::symlink("../run.sh", r.join("lib/link")).unwrap();
    (d, want)
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn leftover_runs(dir: &tempfile::TempDir) -> Vec<PathBuf> {
    std::fs::read_dir(dir.path().join("runs"))
        .map(|r| r.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

#[test]
fn the_runner_gets_exactly_the_tree_in_the_same_relative_directory() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, "");
    let (tree, want) = sample_tree();
    let script = r#"pwd; cd ../../..; find . \( -type f -o -type l \) | sort | while read -r f; do
        if [ -L "$f" ]; then echo "L $f $(readlink "$f")"; else echo "F $f $(stat -c %a "$f") $(sha256sum < "$f" | cut -c1-64)"; fi; done"#;
    let out = run_remote(
        &gw,
        dir.path(),
        &tree.path().join("lib/a/b"),
        &["--workspace", "--", "sh", "-c", script],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines = stdout.lines();
    assert!(lines.next().unwrap().ends_with("/lib/a/b"), "{stdout}");
    let mut expected: Vec<String> = want
        .iter()
        .map(|(p, (mode, data))| {
            format!("F ./{p} {mode:o} {}", mcp_run::workspace::hash_bytes(data))
        })
        .collect();
    expected.push("L ./lib/link ../run.sh".into());
    expected.sort();
    let mut got: Vec<&str> = lines.collect();
    got.sort();
    assert_eq!(got, expected);
    assert!(
        leftover_runs(&dir).is_empty(),
        "the run's directory is removed"
    );
}

#[test]
fn uploads_are_incremental_and_results_come_back() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, "");
    let (tree, want) = sample_tree();
    let r = tree.path();
    let ws = |args: &[&str]| {
        let mut a = vec!["--workspace", "--output-format", "json"];
        a.extend_from_slice(args);
        run_remote(&gw, dir.path(), r, &a)
    };
    let first = json(&ws(&["--", "true"]));
    assert_eq!(first["workspace"]["uploaded_files"], want.len());
    let second = json(&ws(&["--", "true"]));
    assert_eq!(second["workspace"]["uploaded_files"], 0);
    assert_eq!(second["workspace"]["uploaded_bytes"], 0);
    assert_eq!(
        second["workspace"]["workspace"],
        first["workspace"]["workspace"]
    );
    write(r, "lib/a/b/deep.txt", b"edited, longer\n");
    let third = json(&ws(&["--", "true"]));
    assert_eq!(third["workspace"]["uploaded_files"], 1);
    assert_eq!(third["workspace"]["uploaded_bytes"], 15);
    assert_ne!(third["workspace"]["version"], first["workspace"]["version"]);

    // Sync-back: only new or changed files matching the globs, into the tree.
    let script = "mkdir -p out && echo new > out/r.txt && echo no > out/r.log \
                  && echo changed > lib/bin.dat && echo x > other.txt && chmod +x out/r.txt";
    let out = ws(&[
        "--sync-back",
        "out/*.txt",
        "lib/**",
        "--",
        "sh",
        "-c",
        script,
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json(&out);
    let back: Vec<&str> = v["workspace"]["synced_back"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    assert_eq!(back, ["lib/bin.dat", "out/r.txt"]);
    assert_eq!(std::fs::read(r.join("out/r.txt")).unwrap(), b"new\n");
    assert_eq!(
        std::fs::metadata(r.join("out/r.txt"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o755
    );
    assert_eq!(std::fs::read(r.join("lib/bin.dat")).unwrap(), b"changed\n");
    assert!(!r.join("out/r.log").exists() && !r.join("other.txt").exists());

    // Stream format: a one-line summary on stderr.
    let out = run_remote(
        &gw,
        dir.path(),
        r,
        &[
            "--workspace",
            "--sync-back",
            "out/*",
            "--",
            "sh",
            "-c",
            "echo 2 > out/two",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("sync-back: 1 file (2 B) copied into"),
        "{stderr}"
    );
    assert_eq!(std::fs::read(r.join("out/two")).unwrap(), b"2\n");
    assert!(leftover_runs(&dir).is_empty());
}

#[test]
fn a_symlink_leaving_the_tree_is_refused_before_anything_is_sent() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, "");
    let tree = tempfile::tempdir().unwrap();
    write(tree.path(), "a.txt", b"a");
    std::os::unix::fs::symlink("/etc/passwd", tree.path().join("escape")).unwrap();
    let out = run_remote(&gw, dir.path(), tree.path(), &["--workspace", "--", "true"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("escape") && stderr.contains("outside"),
        "{stderr}"
    );
}

#[test]
fn concurrent_runs_each_get_a_clean_copy() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, "");
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    write(a.path(), "name", b"a");
    write(b.path(), "name", b"b");
    // Each run writes a marker and checks that no other run's marker is there.
    let script = "test ! -e marker || exit 9; echo $$ > marker; sleep 0.3; cat name";
    let children: Vec<_> = (0..6)
        .map(|i| {
            let tree = if i % 2 == 0 { a.path() } else { b.path() };
            gw.run_remote()
                .env("XDG_CACHE_HOME", dir.path())
                .current_dir(tree)
                .args(["--workspace", "--", "sh", "-c", script])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (i, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let want = if i % 2 == 0 { "a" } else { "b" };
        assert_eq!(String::from_utf8_lossy(&out.stdout), want);
    }
    assert!(!a.path().join("marker").exists());
    assert!(leftover_runs(&dir).is_empty());
}

#[test]
fn a_remote_backend_gateway_forwards_workspaces_and_results() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = gateway(&dir, "");
    let front_dir = tempfile::tempdir().unwrap();
    let cfg = config_file(
        &front_dir,
        &format!(
            "workspaces:\n  cache_dir: {}\n",
            front_dir.path().join("cache").display()
        ),
    );
    let front = Gateway::start(&[
        "--config",
        cfg.to_str().unwrap(),
        "--backend",
        "remote",
        "--server",
        &upstream.raw_url(),
    ]);
    let (tree, _) = sample_tree();
    let out = run_remote(
        &front,
        dir.path(),
        &tree.path().join("lib"),
        &[
            "--workspace",
            "--sync-back",
            "lib/*.out",
            "--",
            "sh",
            "-c",
            "cat bin.dat | wc -c > r.out; ../run.sh",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ran\n");
    assert!(stderr.contains("sync-back: 1 file"), "{stderr}");
    assert_eq!(
        std::fs::read_to_string(tree.path().join("lib/r.out"))
            .unwrap()
            .trim(),
        "5"
    );
    assert!(leftover_runs(&dir).is_empty());
}
