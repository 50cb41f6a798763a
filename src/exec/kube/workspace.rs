//! Workspaces on the Kubernetes backend: before the command starts, the tree is streamed into
//! the pod as a tar archive on the stdin of `tar -x -f - -C <workspace_path>` (an exec, so
//! it works for warm-pool pods that existed before the request, and as any user, e.g.
//! runAsNonRoot 65532, that can write the profile's `emptyDir`). The image needs `tar` that
//! reads `-x -f - -C DIR` (GNU tar, busybox, bsdtar all do); the end of its stdin is
//! signalled after the archive (v5), as busybox's tar reads to the end of its input.
//!
//! Sync-back: after the command, before the pod goes, a second exec sends the workspace's
//! files that may match the globs back as a tar stream on stdout ([`SYNC_BACK_SCRIPT`]:
//! `sh`, `find`, `tar -c`). The gateway trusts nothing of it: it keeps regular files
//! whose path is valid and matches the globs exactly, hashes each as it reads it, and reports
//! those whose content or executable bit differs from the manifest (no timestamps involved).

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::AttachParams;
use tokio::io::AsyncReadExt as _;
use tokio_util::sync::CancellationToken;

use super::Shared;
use super::config::Profile;
use super::error::KubeError;
use super::pod::CONTAINER;
use crate::contract::{ChangedFile, ErrorBody, Event};
use crate::workspace::WorkspaceRun;

/// The most of `tar`'s stderr kept for an error message.
const MAX_STDERR: u64 = 16 * 1024;

/// The profile's workspace path, or why it takes no workspace.
pub(super) fn workspace_path<'a>(profile_name: &str, p: &'a Profile) -> Result<&'a str, KubeError> {
    p.workspace_path
        .as_deref()
        .ok_or_else(|| KubeError::NoWorkspacePath(profile_name.to_owned()))
}

impl Shared {
    /// Writes the workspace into `pod` below `path` (only the entries `only` names, when
    /// given: a session's tree); returns the command's directory.
    pub(super) async fn place_workspace(
        &self,
        pod: &str,
        run: &WorkspaceRun,
        path: &str,
        only: Option<std::collections::HashSet<String>>,
        cancel: &CancellationToken,
    ) -> Result<String, ErrorBody> {
        let pin = run.store.pin(&run.workspace)?;
        let failed = |why: String| -> ErrorBody {
            KubeError::PlaceWorkspace {
                pod: pod.to_owned(),
                path: path.to_owned(),
                why,
            }
            .into()
        };
        let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<bytes::Bytes>>(4);
        let producer_run = run.clone();
        let producer = tokio::task::spawn_blocking(move || {
            let out = std::io::BufWriter::with_capacity(
                64 * 1024,
                crate::workspace::tarball::ChannelWriter(tx),
            );
            crate::workspace::tarball::write_tar_only(&producer_run, &pin, only.as_ref(), out)
        });
        let argv = ["tar", "-x", "-f", "-", "-C", path]
            .map(String::from)
            .to_vec();
        let fed = self.exec_fed(pod, argv, rx, 0, cancel).await;
        // Dropping the receiver (with the exec) ends a producer still writing.
        let produced = producer
            .await
            .map_err(|e| failed(format!("the tar stream failed: {e}")))?;
        let Fed {
            status,
            stderr: err_text,
            fed,
            ..
        } = fed.map_err(|e| match e {
            FedError::Cancelled => KubeError::ShuttingDown.into(),
            FedError::Exec(e) => failed(format!("cannot exec tar: {e}")),
        })?;
        let ok = status.as_ref().and_then(|s| s.status.as_deref()) == Some("Success");
        if !ok {
            let why = status
                .and_then(|s| s.message)
                .unwrap_or_else(|| "no exit status".into());
            let hint = if err_text.contains("not found") || why.contains("not found") {
                " (the image needs `tar`)"
            } else {
                ""
            };
            return Err(failed(format!("{}{hint}: {}", why.trim(), err_text.trim())));
        }
        if let Err(e) = fed {
            return Err(failed(e.to_string()));
        }
        if let Err(e) = produced {
            return Err(failed(format!("reading the cache: {e}")));
        }
        let base = path.trim_end_matches('/');
        Ok(if run.cwd.is_empty() {
            base.to_owned()
        } else {
            format!("{base}/{}", run.cwd)
        })
    }
}

/// What an exec fed with input ended with.
pub(super) struct Fed {
    pub(super) status: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Status>,
    /// Its stderr (at most [`MAX_STDERR`] bytes).
    pub(super) stderr: String,
    /// Its stdout, when asked for (at most the limit asked for), and whether it was more.
    pub(super) stdout: Vec<u8>,
    pub(super) stdout_cut: bool,
    /// Whether the whole input was sent, or why not.
    pub(super) fed: Result<(), FeedError>,
}

/// Why an exec's input was not all sent.
#[derive(Debug, thiserror::Error)]
pub(super) enum FeedError {
    #[error("reading the cache: {0}")]
    Cache(std::io::Error),
    #[error("writing to stdin: {0}")]
    Write(tokio_tungstenite::tungstenite::Error),
    #[error("closing stdin: {0}")]
    Close(tokio_tungstenite::tungstenite::Error),
    #[error("it ended before it read all of its input")]
    Unread,
}

pub(super) enum FedError {
    Cancelled,
    /// Why the exec could not be opened.
    Exec(String),
}

const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const STATUS: u8 = 3;
const CLOSE: u8 = 255;

impl Shared {
    /// Runs `argv` in `pod` with `input` on its stdin (keeping at most `stdout_limit` bytes
    /// of its stdout; none asked for when 0), then signals the end of stdin (the v5
    /// protocol's close): `tar -x -f -` of busybox (the README's image) reads its stdin to
    /// the end, not only to the archive's end marker as GNU tar does, and would wait forever
    /// for an end that never comes. On v4 (clusters before 1.30) the end cannot be signalled
    /// without closing the whole stream, so stdin then stays open until the status came.
    pub(super) async fn exec_fed(
        &self,
        pod: &str,
        argv: Vec<String>,
        mut input: tokio::sync::mpsc::Receiver<std::io::Result<bytes::Bytes>>,
        stdout_limit: usize,
        cancel: &CancellationToken,
    ) -> Result<Fed, FedError> {
        use futures_util::{SinkExt as _, StreamExt as _};
        use tokio_tungstenite::tungstenite::Message;
        let params = AttachParams {
            container: Some(CONTAINER.into()),
            stdin: true,
            stdout: stdout_limit > 0,
            stderr: true,
            tty: false,
            ..Default::default()
        };
        let budget = super::backoff::Budget {
            end: tokio::time::Instant::now() + super::backoff::EXEC_UPGRADE_TIMEOUT,
            attempt: super::backoff::EXEC_UPGRADE_TIMEOUT,
            retry_internal: false,
        };
        let connect = super::backoff::call("opening an exec stream", budget, || {
            let request = kube::core::Request::new(<Pod as kube::Resource>::url_path(
                &(),
                Some(&self.namespace),
            ))
            .exec(pod, argv.clone(), &params);
            async move {
                self.throttle.acquire().await;
                self.client
                    .connect(request.map_err(kube::Error::BuildRequest)?)
                    .await
            }
        });
        let connection = tokio::select! {
            r = connect => r.map_err(|f| FedError::Exec(match f {
                super::backoff::Failure::Api(e) => super::backoff::describe(&e),
                super::backoff::Failure::OutOfTime { attempts, last } => {
                    format!("no exec stream in {attempts} attempts: {last}")
                }
                super::backoff::Failure::Unreachable(why) => format!(
                    "the Kubernetes API server at {} is not reachable: {why}",
                    self.server
                ),
            }))?,
            _ = cancel.cancelled() => return Err(FedError::Cancelled),
        };
        let can_close = connection.supports_stream_close();
        let (mut sink, mut frames) = connection.into_stream().split();
        let frame = |ch: u8, data: &[u8]| {
            let mut v = Vec::with_capacity(data.len() + 1);
            v.push(ch);
            v.extend_from_slice(data);
            Message::Binary(v.into())
        };
        let feed = async {
            while let Some(chunk) = input.recv().await {
                let chunk = chunk.map_err(FeedError::Cache)?;
                sink.send(frame(STDIN, &chunk))
                    .await
                    .map_err(FeedError::Write)?;
            }
            if can_close {
                sink.send(Message::Binary(vec![CLOSE, STDIN].into()))
                    .await
                    .map_err(FeedError::Close)?;
            }
            Ok::<_, FeedError>(())
        };
        let read = async {
            let (mut status, mut stderr) = (None, Vec::new());
            let (mut stdout, mut cut) = (Vec::new(), false);
            while let Some(Ok(m)) = frames.next().await {
                let data = match m {
                    Message::Binary(b) => b,
                    Message::Text(t) => bytes::Bytes::copy_from_slice(t.as_bytes()),
                    Message::Close(_) => break,
                    _ => continue,
                };
                match data.split_first() {
                    Some((&STDOUT, rest)) => {
                        let room = stdout_limit.saturating_sub(stdout.len());
                        cut |= rest.len() > room;
                        stdout.extend_from_slice(&rest[..rest.len().min(room)]);
                    }
                    Some((&STDERR, rest)) => {
                        let room = (MAX_STDERR as usize).saturating_sub(stderr.len());
                        stderr.extend_from_slice(&rest[..rest.len().min(room)]);
                    }
                    Some((&STATUS, rest)) if !rest.is_empty() => {
                        status = serde_json::from_slice(rest).ok();
                    }
                    _ => {}
                }
            }
            let stderr = String::from_utf8_lossy(&stderr).into_owned();
            (status, stderr, stdout, cut)
        };
        tokio::pin!(feed, read);
        let mut fed = None;
        // Until the command has ended (its status came, the stream closed): a command that
        // fails early stops reading, and feeding it must not wait forever.
        let (status, stderr, stdout, stdout_cut) = loop {
            tokio::select! {
                r = &mut feed, if fed.is_none() => fed = Some(r),
                r = &mut read => break r,
                _ = cancel.cancelled() => return Err(FedError::Cancelled),
            }
        };
        let fed = fed.unwrap_or(Err(FeedError::Unread));
        Ok(Fed {
            status,
            stderr,
            stdout,
            stdout_cut,
            fed,
        })
    }
}

/// Run in the pod after the command (`sh -c SCRIPT sh WORKSPACE PATTERN...`): the regular
/// files below the workspace whose `./path` matches one of the `case` patterns, as a tar
/// stream on stdout (nothing at all when none does). The patterns match more than the globs
/// (in `case`, `*` also matches `/`); the gateway applies the globs exactly. The names go to
/// one `tar -c` as arguments (busybox's tar, as Debian builds it, has no `-T`); a name with
/// a newline splits into lines that name no file and is skipped.
pub(super) const SYNC_BACK_SCRIPT: &str = r#"cd "$1" || exit 1
shift
list=$(find . -type f | while IFS= read -r f; do
  [ -f "$f" ] || continue
  for p in "$@"; do
    case "$f" in ./$p) printf '%s\n' "$f"; break;; esac
  done
done)
[ -n "$list" ] || exit 0
IFS='
'
set -f
set -- $list
exec tar -c -f - "$@""#;

/// A sync-back glob as a `case` pattern matching at least what the glob matches (`*`
/// matches `/` in `case`; `a/**/b` also matches `a/b`, hence `a/*b`).
fn widen(glob: &str) -> String {
    if glob.starts_with("**") || glob.contains(['{', '\\']) {
        "*".into()
    } else {
        glob.replace("/**/", "/*").replace("**", "*")
    }
}

/// After the command: the files of the workspace matching the run's globs that the command
/// created or changed, stored in the cache; a `workspace_changes` event (and a line on
/// stderr when the pod could not send them all).
pub(super) async fn sync_back(
    pods: &Api<Pod>,
    pod: &str,
    path: &str,
    shell: &str,
    run: &WorkspaceRun,
    cancel: &CancellationToken,
) -> Vec<Event> {
    let Changes {
        files,
        truncated,
        problem,
    } = match fetch_changes(pods, pod, path, shell, run, cancel).await {
        Ok(changes) => changes,
        Err(e) => Changes {
            files: Vec::new(),
            truncated: true,
            problem: Some(e.to_string()),
        },
    };
    let mut events = Vec::new();
    if let Some(p) = problem {
        tracing::warn!(pod, "sync-back: {p}");
        events.push(Event::Stderr {
            data: format!("mcp-run: sync-back from runner pod {pod}: {p}\n").into(),
        });
    }
    events.push(Event::WorkspaceChanges {
        workspace: run.workspace.id.clone(),
        files,
        truncated,
    });
    events
}

/// What a sync-back read from the pod.
struct Changes {
    files: Vec<ChangedFile>,
    /// Whether the list is cut short.
    truncated: bool,
    /// What went wrong in the pod after the files were read.
    problem: Option<String>,
}

/// Why no changed files could be read.
#[derive(Debug, thiserror::Error)]
enum SyncBackError {
    #[error("cannot exec: {0}")]
    Exec(kube::Error),
    #[error("cancelled")]
    Cancelled,
    #[error("no stdout on the exec")]
    NoStdout,
    #[error("the archive is not valid: {0}")]
    Archive(std::io::Error),
    #[error("reading the archive failed: {0}")]
    Reader(tokio::task::JoinError),
}

/// The changed files, whether the list is cut short, and what went wrong in the pod.
async fn fetch_changes(
    pods: &Api<Pod>,
    pod: &str,
    path: &str,
    shell: &str,
    run: &WorkspaceRun,
    cancel: &CancellationToken,
) -> Result<Changes, SyncBackError> {
    let params = AttachParams {
        container: Some(CONTAINER.into()),
        stdin: false,
        stdout: true,
        stderr: true,
        tty: false,
        ..Default::default()
    };
    // The profile's shell, as the exec wrapper's.
    let mut argv = vec![
        shell.to_owned(),
        "-c".into(),
        SYNC_BACK_SCRIPT.into(),
        "sh".into(),
        path.to_owned(),
    ];
    argv.extend(run.sync_back.iter().map(|g| widen(g)));
    let mut attached = tokio::select! {
        r = pods.exec(pod, argv, &params) => r.map_err(SyncBackError::Exec)?,
        _ = cancel.cancelled() => return Err(SyncBackError::Cancelled),
    };
    let Some(stdout) = attached.stdout() else {
        attached.abort();
        return Err(SyncBackError::NoStdout);
    };
    let stderr = attached.stderr();
    let status = attached.take_status();
    // Drained to the end (the first bytes kept): an unread stderr would hold up stdout.
    let err_text = tokio::spawn(async move {
        let mut kept = Vec::new();
        if let Some(mut e) = stderr {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = e.read(&mut buf).await {
                let room = (MAX_STDERR as usize).saturating_sub(kept.len());
                kept.extend_from_slice(&buf[..n.min(room)]);
            }
        }
        String::from_utf8_lossy(&kept).into_owned()
    });
    let reader = tokio_util::io::SyncIoBridge::new(stdout);
    let parse_run = run.clone();
    let parse = tokio::task::spawn_blocking(move || read_changes(reader, &parse_run));
    let parsed = tokio::select! {
        r = parse => r,
        _ = cancel.cancelled() => {
            attached.abort();
            return Err(SyncBackError::Cancelled);
        }
    };
    let parsed = match parsed {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            attached.abort();
            return Err(SyncBackError::Archive(e));
        }
        Err(e) => {
            attached.abort();
            return Err(SyncBackError::Reader(e));
        }
    };
    let (files, truncated, complete) = parsed;
    if !complete {
        // Cut short at the limits: the rest of the stream is not wanted.
        attached.abort();
        return Ok(Changes {
            files,
            truncated,
            problem: None,
        });
    }
    let err_text = tokio::select! {
        t = err_text => t.unwrap_or_default(),
        _ = cancel.cancelled() => {
            attached.abort();
            return Err(SyncBackError::Cancelled);
        }
    };
    let status = match status {
        Some(s) => tokio::select! {
            s = s => s,
            _ = cancel.cancelled() => {
                attached.abort();
                return Err(SyncBackError::Cancelled);
            }
        },
        None => None,
    };
    let ok = status.as_ref().and_then(|s| s.status.as_deref()) == Some("Success");
    if ok {
        return Ok(Changes {
            files,
            truncated,
            problem: None,
        });
    }
    let why = status
        .and_then(|s| s.message)
        .unwrap_or_else(|| "no exit status".into());
    let hint = if err_text.contains("not found") {
        " (the image needs `sh`, `find` and `tar`)"
    } else {
        ""
    };
    Ok(Changes {
        files,
        truncated: true,
        problem: Some(format!("{}{hint}: {}", why.trim(), err_text.trim())),
    })
}

/// Reads the pod's tar stream: `(files, truncated, read to the end)`. Blocking.
fn read_changes(
    reader: impl std::io::Read,
    run: &WorkspaceRun,
) -> std::io::Result<(Vec<ChangedFile>, bool, bool)> {
    use crate::workspace::manifest::{self, EntryKind, MODE_EXEC, MODE_FILE};
    let set = crate::workspace::local::globs(&run.sync_back).map_err(std::io::Error::other)?;
    let cfg = run.store.config();
    let entries = &run.workspace.manifest.entries;
    let owner = &run.workspace.owner;
    let mut out: Vec<ChangedFile> = Vec::new();
    // Every regular file read, for hard-link entries naming one: (hash, size).
    let mut read: std::collections::HashMap<String, (String, u64)> = Default::default();
    let mut bytes = 0u64;
    let mut truncated = false;
    // A runner is untrusted: extended headers are capped before the tar crate reads them.
    let mut archive = tar::Archive::new(crate::workspace::tarcap::CappedHeaders::new(reader));
    for entry in archive.entries()? {
        let mut entry = entry?;
        let raw = entry.path_bytes().into_owned();
        let Ok(name) = std::str::from_utf8(&raw) else {
            continue;
        };
        let rel = name.strip_prefix("./").unwrap_or(name).to_owned();
        if manifest::check_path(&rel, cfg.max_path_bytes).is_err()
            || crate::workspace::results::check_result_path(&rel).is_err()
            || !set.is_match(&rel)
        {
            continue;
        }
        let header = entry.header();
        let mode = if header.mode().unwrap_or(0) & 0o111 != 0 {
            MODE_EXEC
        } else {
            MODE_FILE
        };
        let kind = header.entry_type();
        let before = entries
            .binary_search_by(|e| e.path.as_str().cmp(&rel))
            .ok()
            .map(|i| &entries[i]);
        let unchanged = |hash: &str| {
            before.is_some_and(|b| b.kind == EntryKind::File && b.hash == hash && b.mode == mode)
        };
        let size = entry.size();
        if out.len() >= cfg.max_files || bytes + size > cfg.max_bytes {
            return Ok((out, true, false));
        }
        let got = if kind.is_file() {
            match run
                .store
                .add_stream(&mut entry, &rel, owner, cfg.max_file_bytes, &|h| {
                    !unchanged(h)
                }) {
                Ok(Some((hash, size))) => {
                    read.insert(rel.clone(), (hash.clone(), size));
                    Some((hash, size))
                }
                Ok(None) => {
                    if let Some(b) = before {
                        read.insert(rel.clone(), (b.hash.clone(), b.size));
                    }
                    None
                }
                Err(e) => {
                    tracing::warn!("sync-back of {rel:?} skipped: {e}");
                    truncated = true;
                    None
                }
            }
        } else if kind.is_hard_link() {
            let target = entry
                .link_name_bytes()
                .and_then(|t| String::from_utf8(t.into_owned()).ok())
                .map(|t| t.strip_prefix("./").map(str::to_owned).unwrap_or(t));
            target
                .and_then(|t| read.get(&t).cloned())
                .filter(|(hash, _)| !unchanged(hash))
        } else {
            None
        };
        if let Some((hash, size)) = got {
            bytes += size;
            out.push(ChangedFile {
                path: rel,
                mode,
                size,
                hash,
            });
        }
    }
    // The stream goes on after the end marker (tar pads to its record size): read to its
    // end, or the exec would wait for a reader to take it.
    std::io::copy(&mut archive.into_inner(), &mut std::io::sink())?;
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok((out, truncated, true))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::workspace::manifest::{Manifest, ManifestEntry};
    use crate::workspace::{WorkspaceConfig, WorkspaceStore, hash_bytes};

    /// An entry written as a hostile pod could (tar-rs's own builder refuses `..`).
    fn entry(tar: &mut tar::Builder<Vec<u8>>, name: &[u8], kind: tar::EntryType, mode: u32) {
        entry_with(tar, name, kind, mode, b"", None);
    }

    fn entry_with(
        tar: &mut tar::Builder<Vec<u8>>,
        name: &[u8],
        kind: tar::EntryType,
        mode: u32,
        data: &[u8],
        link: Option<&str>,
    ) {
        let mut h = tar::Header::new_gnu();
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(data.len() as u64);
        if let Some(l) = link {
            h.set_link_name(l).unwrap();
        }
        h.set_cksum();
        tar.append(&h, data).unwrap();
    }

    fn sync_run(max_files: usize) -> (tempfile::TempDir, WorkspaceRun) {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(
            WorkspaceStore::open(WorkspaceConfig {
                cache_dir: Some(dir.path().to_owned()),
                max_files,
                ..Default::default()
            })
            .unwrap(),
        );
        let same = hash_bytes(b"same\n");
        let m = Manifest {
            entries: vec![
                ManifestEntry::file("out/mode.sh", false, 5, same.clone()),
                ManifestEntry::file("out/same.txt", false, 5, same),
            ],
        };
        let posted = store.post(m, &None).unwrap();
        let run = WorkspaceRun {
            workspace: posted.workspace,
            store,
            cwd: String::new(),
            sync_back: vec!["out/**".into()],
        };
        (dir, run)
    }

    fn archive() -> Vec<u8> {
        use tar::EntryType::{Link, Regular, Symlink};
        let mut tar = tar::Builder::new(Vec::new());
        entry_with(&mut tar, b"out/../../evil", Regular, 0o644, b"x", None);
        entry_with(&mut tar, b"/out/abs.txt", Regular, 0o644, b"x", None);
        entry_with(&mut tar, b"./out/mode.sh", Regular, 0o755, b"same\n", None);
        entry_with(&mut tar, b"./out/new.txt", Regular, 0o644, b"new\n", None);
        entry_with(&mut tar, b"./out/same.txt", Regular, 0o644, b"same\n", None);
        entry_with(&mut tar, b"./other.txt", Regular, 0o644, b"no glob", None);
        entry_with(
            &mut tar,
            b"./out/link",
            Symlink,
            0o777,
            b"",
            Some("/etc/passwd"),
        );
        entry(&mut tar, b"./out/dir/", tar::EntryType::Directory, 0o755);
        entry_with(
            &mut tar,
            b"./out/hard.txt",
            Link,
            0o644,
            b"",
            Some("./out/new.txt"),
        );
        tar.into_inner().unwrap()
    }

    /// What a pod sends back is trusted for nothing: paths leaving the tree or absolute,
    /// names outside the globs, symlinks and directories are dropped; unchanged files are
    /// not reported; the rest is stored under the hash of its bytes.
    #[test]
    fn only_valid_matching_changed_regular_files_come_back() {
        let (_d, run) = sync_run(100);
        let (files, truncated, complete) = read_changes(&archive()[..], &run).unwrap();
        assert!(complete && !truncated);
        let got: Vec<(&str, u32, u64)> = files
            .iter()
            .map(|f| (f.path.as_str(), f.mode, f.size))
            .collect();
        assert_eq!(
            got,
            [
                ("out/hard.txt", 0o644, 4),
                ("out/mode.sh", 0o755, 5),
                ("out/new.txt", 0o644, 4)
            ]
        );
        assert_eq!(files[0].hash, hash_bytes(b"new\n"));
        for f in &files {
            assert!(run.store.open_blob(&f.hash, &None).is_ok(), "{}", f.path);
        }
        // Cut at the workspace's file limit.
        let (_d, run) = sync_run(2);
        let (files, truncated, complete) = read_changes(&archive()[..], &run).unwrap();
        assert!(truncated && !complete);
        assert_eq!(files.len(), 2);
        // Not a tar stream at all.
        assert!(read_changes(&b"garbage that is no tar header"[..], &run).is_err());
    }

    /// Every path a glob matches, the widened pattern matches in `sh`'s `case` as the pod's
    /// script uses it.
    #[test]
    fn globs_widen_to_case_patterns_matching_at_least_as_much() {
        let paths = [
            "target/b.xml",
            "target/a/b.xml",
            "target/a/c/b.xml",
            "out/r.txt",
            "out/sub/r.txt",
            "a/x",
            "x",
            "src/deep/f",
        ];
        let globs = [
            "target/**/*.xml",
            "target/**",
            "out/*.txt",
            "**/x",
            "{a,b}/x",
            "src/*/f",
            "*",
        ];
        for g in globs {
            let set = crate::workspace::local::globs(&[g.to_owned()]).unwrap();
            let pattern = widen(g);
            for p in paths.iter().filter(|p| set.is_match(p)) {
                let matched = std::process::Command::new("sh")
                    .args([
                        "-c",
                        r#"case "$1" in ./$2) exit 0;; esac; exit 1"#,
                        "sh",
                        &format!("./{p}"),
                        &pattern,
                    ])
                    .status()
                    .unwrap()
                    .success();
                assert!(matched, "{g} matches {p}, but {pattern} does not in sh");
            }
        }
        assert_eq!(widen("target/**/*.xml"), "target/*.xml");
        assert_eq!(widen("{a,b}/x"), "*");
    }
}
