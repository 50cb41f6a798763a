//! A session's tree in its pod: brought to each call's manifest for the paths the manifest
//! covers, every other path left alone, so that ignored build outputs (`target/`,
//! `node_modules/`) stay between calls. The rules are the local backend's
//! ([`crate::workspace::kept`]); what differs is where the files are: the gateway cannot
//! `lstat` the pod's files, so one exec of [`SYNC_SCRIPT`] does the checks in the pod, and a
//! second exec (`tar -x`, as a one-shot placement) writes what is missing, only when
//! something is.
//!
//! The script reads NUL-separated records on stdin, in this order:
//! - `r PATH`: a file an earlier manifest had and this one has not (deleted in the caller's
//!   checkout): removed, unless a parent on the way is not a real directory (then nothing of
//!   the tree is there);
//! - `d PATH`: a directory of the manifest, parents first: a symlink or file in the way (a
//!   command may have put one there) is removed and a real directory made, so nothing is
//!   ever written through a link;
//! - `f PATH` / `x PATH`: a file that may be intact: when it is a regular, readable file (not
//!   a symlink) with the manifest's executable bit, its name goes to `sha256sum`; otherwise
//!   it is removed, to be written;
//! - `w PATH`: an entry written in any case (a symlink of the manifest, a name `sha256sum`
//!   would escape): removed.
//!
//! `sha256sum`'s lines name the files whose content the gateway compares with the manifest's
//! hashes; the differing ones and the removed ones go into the `tar` stream, whose extraction
//! unlinks what is at a destination before writing (GNU tar, busybox, bsdtar), below
//! parents that are real directories now. An unchanged rerun writes nothing: one exec that
//! reads the tracked files. Only the gateway writes while the tree syncs: a session's calls
//! run one at a time and a call's processes are killed when it ends.
//!
//! The image needs a POSIX `sh`, `xargs` (`-0 -r`), `sha256sum`, `rm`, `mkdir` and `tar`
//! (coreutils or busybox).

use std::collections::{BTreeSet, HashMap, HashSet};

use tokio_util::sync::CancellationToken;

use super::Shared;
use super::error::KubeError;
use crate::contract::ErrorBody;
use crate::workspace::WorkspaceRun;
use crate::workspace::kept::KeptSync;
use crate::workspace::manifest::{EntryKind, MODE_EXEC};

/// Run as `SHELL -c SYNC_SCRIPT sh ROOT SHELL CHECK`: the records on stdin go to [`CHECK`]
/// (as many at a time as `xargs` passes), the names it prints to `sha256sum`.
pub(super) const SYNC_SCRIPT: &str = r#"cd -- "$1" || exit 1
xargs -0 -r "$2" -c "$3" "$2" | xargs -0 -r sha256sum --"#;

/// What the script runs on each batch of records (see the module's documentation).
pub(super) const CHECK: &str = r#"gone() { [ -e "$1" ] || [ -L "$1" ]; }
for a do
  p=${a#?}
  case $a in
  r*)
    q=$p ok=1
    while :; do
      case $q in */*) q=${q%/*} ;; *) break ;; esac
      if [ -L "$q" ] || [ ! -d "$q" ]; then ok=; break; fi
    done
    if [ -n "$ok" ] && gone "$p"; then rm -rf -- "$p" || exit 1; fi ;;
  d*)
    if [ -L "$p" ] || { [ -e "$p" ] && [ ! -d "$p" ]; }; then rm -rf -- "$p" || exit 1; fi
    if [ -d "$p" ]; then
      { [ -w "$p" ] && [ -x "$p" ]; } || chmod u+rwx -- "$p" || exit 1
    else
      mkdir -- "$p" || exit 1
    fi ;;
  f*|x*)
    if [ -f "$p" ] && [ ! -L "$p" ] && [ -r "$p" ]; then
      m=f
      if [ -x "$p" ]; then m=x; fi
      case $a in "$m"*) printf '%s\0' "$p"; continue ;; esac
    fi
    if gone "$p"; then rm -rf -- "$p" || exit 1; fi ;;
  w*)
    if gone "$p"; then rm -rf -- "$p" || exit 1; fi ;;
  esac
done"#;

/// One sync's input for the pod and what the gateway compares its answer with.
pub(super) struct Plan {
    /// The records, NUL-separated.
    pub(super) input: Vec<u8>,
    /// Files that may be intact: path → the manifest's hash.
    candidates: HashMap<String, String>,
    /// Files deleted in the checkout since an earlier call.
    removed: usize,
}

/// The records for bringing a tree that held `before` (the paths earlier manifests put
/// there) to `run`'s manifest.
pub(super) fn plan(run: &WorkspaceRun, before: &BTreeSet<String>) -> Plan {
    let entries = &run.workspace.manifest.entries;
    let mut input = Vec::new();
    let mut record = |kind: u8, path: &str| {
        input.push(kind);
        input.extend_from_slice(path.as_bytes());
        input.push(0);
    };
    let gone = crate::workspace::kept::gone(before, entries);
    for p in &gone {
        record(b'r', p);
    }
    for d in crate::workspace::tarball::dirs_of(run, |_| true) {
        record(b'd', &d);
    }
    let mut candidates = HashMap::new();
    for e in entries {
        // sha256sum escapes names with a backslash or newline: such files are just written.
        let plain = !e.path.contains(['\n', '\\']);
        match e.kind {
            EntryKind::File if plain => {
                record(if e.mode == MODE_EXEC { b'x' } else { b'f' }, &e.path);
                candidates.insert(e.path.clone(), e.hash.clone());
            }
            _ => record(b'w', &e.path),
        }
    }
    Plan {
        input,
        candidates,
        removed: gone.len(),
    }
}

impl Plan {
    /// The most `sha256sum` prints for the candidates.
    fn output_limit(&self) -> usize {
        self.candidates.keys().map(|p| p.len() + 68).sum::<usize>() + 4096
    }

    /// The candidates `sha256sum`'s output shows with the manifest's content.
    fn intact(&self, out: &[u8]) -> HashSet<String> {
        let mut intact = HashSet::new();
        for line in out.split(|b| *b == b'\n') {
            // `HASH  NAME` (text mode) or `HASH *NAME` (binary mode).
            if line.len() < 67 || !matches!(&line[64..66], b"  " | b" *") {
                continue;
            }
            let (Ok(hash), Ok(name)) = (
                std::str::from_utf8(&line[..64]),
                std::str::from_utf8(&line[66..]),
            ) else {
                continue;
            };
            if self.candidates.get(name).is_some_and(|h| h == hash) {
                intact.insert(name.to_owned());
            }
        }
        intact
    }
}

impl Shared {
    /// Brings the tree below `root` in session pod `pod` to `run`'s manifest; `tracked` holds
    /// the paths earlier manifests put there and becomes this manifest's. Returns the
    /// command's directory and what was done.
    pub(super) async fn sync_kept_tree(
        &self,
        pod: &str,
        shell: &str,
        root: &str,
        run: &WorkspaceRun,
        tracked: &mut BTreeSet<String>,
        cancel: &CancellationToken,
    ) -> Result<(String, KeptSync), ErrorBody> {
        let failed = |why: String| -> ErrorBody {
            KubeError::SyncKeptTree {
                pod: pod.to_owned(),
                root: root.to_owned(),
                why,
            }
            .into()
        };
        let plan = plan(run, tracked);
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        // Capacity 1: the one message is queued before the exec reads it.
        let _ = tx.try_send(Ok(bytes::Bytes::from(plan.input.clone())));
        drop(tx);
        let argv = vec![
            shell.to_owned(),
            "-c".into(),
            SYNC_SCRIPT.into(),
            "sh".into(),
            root.to_owned(),
            shell.to_owned(),
            CHECK.into(),
        ];
        let fed = self
            .exec_fed(pod, argv, rx, plan.output_limit(), cancel)
            .await
            .map_err(|e| match e {
                super::workspace::FedError::Cancelled => KubeError::ShuttingDown.into(),
                super::workspace::FedError::Exec(e) => failed(format!("cannot exec: {e}")),
            })?;
        let ok = fed.status.as_ref().and_then(|s| s.status.as_deref()) == Some("Success");
        if !ok || !fed.stderr.trim().is_empty() || fed.stdout_cut {
            let why = fed
                .status
                .and_then(|s| s.message)
                .unwrap_or_else(|| "the check ended".into());
            let hint = if fed.stderr.contains("not found") {
                " (the image needs `sh`, `xargs`, `sha256sum`, `rm`, `mkdir` and `tar`)"
            } else {
                ""
            };
            return Err(failed(format!(
                "{}{hint}: {}",
                why.trim(),
                fed.stderr.trim()
            )));
        }
        if let Err(e) = fed.fed {
            return Err(failed(e.to_string()));
        }
        let intact = plan.intact(&fed.stdout);
        let entries = &run.workspace.manifest.entries;
        let write: HashSet<String> = entries
            .iter()
            .filter(|e| !intact.contains(&e.path))
            .map(|e| e.path.clone())
            .collect();
        let stats = KeptSync {
            kept: intact.len(),
            written: write.len(),
            removed: plan.removed,
        };
        let base = root.trim_end_matches('/');
        let cwd = if write.is_empty() {
            if run.cwd.is_empty() {
                base.to_owned()
            } else {
                format!("{base}/{}", run.cwd)
            }
        } else {
            self.place_workspace(pod, run, root, Some(write), cancel)
                .await?
        };
        *tracked = entries.iter().map(|e| e.path.clone()).collect();
        Ok((cwd, stats))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::workspace::manifest::{Manifest, ManifestEntry};
    use crate::workspace::{WorkspaceConfig, WorkspaceStore, hash_bytes};

    fn run(entries: Vec<ManifestEntry>, cwd: &str) -> (tempfile::TempDir, WorkspaceRun) {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(
            WorkspaceStore::open(WorkspaceConfig {
                cache_dir: Some(dir.path().to_owned()),
                ..Default::default()
            })
            .unwrap(),
        );
        let mut entries = entries;
        entries.sort_by(|a, b| a.path.cmp(&b.path));
        let posted = store.post(Manifest { entries }, &None).unwrap();
        let run = WorkspaceRun {
            workspace: posted.workspace,
            store,
            cwd: cwd.into(),
            sync_back: Vec::new(),
        };
        (dir, run)
    }

    fn file(path: &str, data: &str, exec: bool) -> ManifestEntry {
        ManifestEntry::file(path, exec, data.len() as u64, hash_bytes(data.as_bytes()))
    }

    /// Runs the pod's script on this host with `shell` in `root`.
    fn check(shell: &str, root: &std::path::Path, plan: &Plan) -> (Vec<u8>, String) {
        use std::io::Write as _;
        let mut child = std::process::Command::new(shell)
            .args([
                "-c",
                SYNC_SCRIPT,
                "sh",
                root.to_str().unwrap(),
                shell,
                CHECK,
            ])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(&plan.input).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{shell}: {out:?}");
        (
            out.stdout,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// The checks in the pod, under dash, bash and busybox's ash (the shells of runner
    /// images, when present): intact files named, changed ones and what is in the way
    /// removed, symlinked directories replaced by real ones (nothing written or removed
    /// through them), deleted files removed, and untracked paths left alone.
    #[test]
    fn the_pod_s_check_finds_intact_files_and_clears_the_way() {
        let dir = tempfile::tempdir().unwrap();
        let mut shells = vec!["/bin/sh".to_string()];
        for (name, path) in [("bash", "/bin/bash"), ("busybox", "/bin/busybox")] {
            if std::path::Path::new(path).exists() {
                let bin = dir.path().join(name);
                std::fs::create_dir_all(&bin).unwrap();
                // busybox runs the applet it is called as; its PATH has its applets.
                std::os::unix::fs::symlink(path, bin.join("sh")).unwrap();
                std::os::unix::fs::symlink(path, bin.join("bash")).unwrap();
                shells.push(bin.join("sh").to_str().unwrap().to_owned());
            } else {
                eprintln!("skipped: {path} is not installed");
            }
        }
        for shell in shells {
            one_shell(&shell);
        }
    }

    fn one_shell(shell: &str) {
        use std::os::unix::fs::PermissionsExt as _;
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let r = root.path();
        let (_d, run) = run(
            vec![
                file("src/main.rs", "fn main() {}\n", false),
                file("src/lib.rs", "new\n", false),
                file("run.sh", "#!/bin/sh\n", true),
                file("mode.sh", "x\n", true),
                file("deep/in/a.txt", "a\n", false),
                file("weird\nname", "w\n", false),
                ManifestEntry::symlink("link", "run.sh".into()),
            ],
            "deep/in",
        );
        std::fs::create_dir_all(r.join("src")).unwrap();
        std::fs::create_dir_all(r.join("target/debug")).unwrap();
        std::fs::write(r.join("target/debug/out"), "build output").unwrap();
        std::fs::write(r.join("src/main.rs"), "fn main() {}\n").unwrap();
        std::fs::write(r.join("src/lib.rs"), "old\n").unwrap();
        std::fs::write(r.join("run.sh"), "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(r.join("run.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(r.join("mode.sh"), "x\n").unwrap();
        std::fs::write(r.join("gone.txt"), "deleted in the checkout").unwrap();
        // A command replaced `deep` by a link out of the tree, with a file of the same name.
        std::fs::create_dir_all(outside.path().join("in")).unwrap();
        std::fs::write(outside.path().join("in/a.txt"), "a\n").unwrap();
        std::fs::write(outside.path().join("old.txt"), "keep me").unwrap();
        std::os::unix::fs::symlink(outside.path(), r.join("deep")).unwrap();
        let before: BTreeSet<String> = ["gone.txt", "deep/old.txt", "src/main.rs"]
            .map(String::from)
            .into();
        let plan = plan(&run, &before);
        let (out, err) = check(shell, r, &plan);
        assert_eq!(err, "", "{shell}");
        let intact = plan.intact(&out);
        let mut got: Vec<&str> = intact.iter().map(String::as_str).collect();
        got.sort();
        assert_eq!(got, ["run.sh", "src/main.rs"], "{shell}");
        assert!(!r.join("gone.txt").exists(), "{shell}");
        assert!(!r.join("mode.sh").exists(), "{shell}: wrong mode, removed");
        // The link is gone, replaced by a real directory; nothing outside was touched.
        let deep = r.join("deep").symlink_metadata().unwrap();
        assert!(deep.is_dir(), "{shell}");
        assert!(r.join("deep/in").is_dir(), "{shell}");
        assert!(outside.path().join("old.txt").exists(), "{shell}");
        assert!(outside.path().join("in/a.txt").exists(), "{shell}");
        assert_eq!(
            std::fs::read_to_string(r.join("target/debug/out")).unwrap(),
            "build output",
            "{shell}"
        );
        // A second check of the same tree (after the writes) removes nothing more.
        std::fs::write(r.join("src/lib.rs"), "new\n").unwrap();
        let plan = super::plan(
            &run,
            &run.workspace
                .manifest
                .entries
                .iter()
                .map(|e| e.path.clone())
                .collect(),
        );
        let (out, _) = check(shell, r, &plan);
        assert!(plan.intact(&out).contains("src/lib.rs"), "{shell}");
        assert!(plan.intact(&out).contains("src/main.rs"), "{shell}");
    }
}
