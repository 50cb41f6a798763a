//! Workspaces through the real binaries on the local backend: `run-remote --workspace`
//! sends the tree (git's rules), the command runs in a fresh copy in the same relative
//! directory, uploads are incremental, `--sync-back` brings results home, concurrent runs
//! do not see each other, and nothing is left behind.

use crate::support;

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

/// The files and symlinks (relative paths) of the trees the gateway keeps between runs,
/// once `done` holds of them (they are cleaned after the run's exit went out), after
/// checking there are at most `local_idle_trees` (2) of them.
fn idle_tree_files(
    dir: &tempfile::TempDir,
    done: impl Fn(&std::collections::BTreeSet<String>) -> bool,
) -> std::collections::BTreeSet<String> {
    let mut files = tree_files(dir);
    if support::wait_until(std::time::Duration::from_secs(10), || {
        files = tree_files(dir);
        leftover_runs(dir).len() <= 2 && done(&files)
    }) {
        return files;
    }
    panic!("the idle trees are not as expected: {files:?}");
}

fn tree_files(dir: &tempfile::TempDir) -> std::collections::BTreeSet<String> {
    let trees = leftover_runs(dir);
    let mut files = std::collections::BTreeSet::new();
    for t in trees {
        // (A tree being cleaned changes under the walk: what cannot be read is skipped.)
        for e in walkdir::WalkDir::new(&t).min_depth(1).into_iter().flatten() {
            if !e.file_type().is_dir() {
                let rel = e.path().strip_prefix(&t).unwrap();
                files.insert(rel.to_str().unwrap().to_owned());
            }
        }
    }
    files
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
        .map(|(p, (mode, data))| format!("F ./{p} {mode:o} {}", mcp_run::hash_bytes(data)))
        .collect();
    expected.push("L ./lib/link ../run.sh".into());
    expected.sort();
    let mut got: Vec<&str> = lines.collect();
    got.sort();
    assert_eq!(got, expected);
    // The tree is kept for the next run, holding nothing but the workspace.
    let mut files: Vec<String> = want.keys().cloned().collect();
    files.push("lib/link".into());
    let files: std::collections::BTreeSet<String> = files.into_iter().collect();
    idle_tree_files(&dir, |kept| *kept == files);
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
    // (out/r.txt and lib/bin.dat came back into the caller's tree: part of the last manifest.)
    idle_tree_files(&dir, |kept| {
        ["out/two", "out/r.log", "other.txt"]
            .iter()
            .all(|f| !kept.contains(*f))
    });
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
    idle_tree_files(&dir, |kept| kept.iter().all(|f| f == "name"));
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
    idle_tree_files(&dir, |kept| !kept.contains("lib/r.out"));
}

/// The tree kept between runs: an unchanged rerun reuses its files (same inodes), and
/// whatever a run did to the tree (in-place edits with the mtime put back, new files,
/// deletions, chmods, hard links, a file replaced by a directory, an unreadable directory)
/// is gone before the next run, which sees exactly its manifest again.
#[test]
fn a_rerun_reuses_the_tree_and_sees_exactly_its_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, "");
    let (tree, want) = sample_tree();
    let r = tree.path();
    let listing = r#"pwd; find . \( -type f -o -type l \) | sort | while read -r f; do
        if [ -L "$f" ]; then echo "L $f $(readlink "$f")"; else echo "F $f $(stat -c %a "$f") $(sha256sum < "$f" | cut -c1-64)"; fi; done;
        find . -type d | sort | while read -r d; do echo "D $d $(stat -c %a "$d")"; done; stat -c %i run.sh"#;
    let list = || {
        let out = run_remote(
            &gw,
            dir.path(),
            r,
            &["--workspace", "--", "sh", "-c", listing],
        );
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
        let inode = lines.pop().unwrap();
        let pwd = lines.remove(0);
        (pwd, lines, inode)
    };
    let (pwd, first, inode) = list();
    let mut expected: Vec<String> = want
        .iter()
        .map(|(p, (mode, data))| format!("F ./{p} {mode:o} {}", mcp_run::hash_bytes(data)))
        .collect();
    expected.push("L ./lib/link ../run.sh".into());
    for d in [".", "./lib", "./lib/a", "./lib/a/b"] {
        expected.push(format!("D {d} {}", if d == "." { 700 } else { 755 }));
    }
    expected.sort();
    let mut sorted = first.clone();
    sorted.sort();
    assert_eq!(sorted, expected);
    let (pwd2, second, inode2) = list();
    assert_eq!(
        (&pwd2, &second, &inode2),
        (&pwd, &first, &inode),
        "reused as is"
    );

    // A run that does everything it can to the tree, putting mtimes back where it edits.
    let vandal = r#"set -e
        t=$(stat -c %y lib/bin.dat)
        printf 'XXXXX' | dd of=lib/bin.dat conv=notrunc 2>/dev/null; touch -d "$t" lib/bin.dat
        test "$(stat -c %y lib/bin.dat)" = "$t"
        printf 'x' >> .gitignore
        chmod 600 run.sh
        rm 'untracked new.txt'
        ln lib/.gitignore hard
        rm -r lib/a && echo file > lib/a
        mkdir -p new/deep && echo n > new/deep/f && chmod 000 new
        chmod 555 lib
        ln -s /etc/passwd lib2
        mkfifo fifo"#;
    let out = run_remote(
        &gw,
        dir.path(),
        r,
        &["--workspace", "--", "sh", "-c", vandal],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (pwd3, third, _) = list();
    assert_eq!(
        (&pwd3, &third),
        (&pwd, &first),
        "the same tree, as the manifest says"
    );

    // Without idle trees, every run gets a fresh tree, removed afterwards.
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, "  local_idle_trees: 0\n");
    let out = run_remote(
        &gw,
        dir.path(),
        r,
        &["--workspace", "--", "sh", "-c", "pwd"],
    );
    assert_eq!(out.status.code(), Some(0));
    let again = run_remote(
        &gw,
        dir.path(),
        r,
        &["--workspace", "--", "sh", "-c", "pwd"],
    );
    assert_ne!(out.stdout, again.stdout);
    assert!(support::wait_until(
        std::time::Duration::from_secs(10),
        || { leftover_runs(&dir).is_empty() }
    ));
}

/// Idle trees go when the gateway stops.
#[test]
fn idle_trees_are_removed_at_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let mut gw = gateway(&dir, "");
    let (tree, _) = sample_tree();
    let out = run_remote(&gw, dir.path(), tree.path(), &["--workspace", "--", "true"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(leftover_runs(&dir).len(), 1);
    assert!(gw.terminate().is_some());
    assert!(leftover_runs(&dir).is_empty(), "{:?}", leftover_runs(&dir));
}
