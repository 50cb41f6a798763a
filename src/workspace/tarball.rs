//! A workspace as a tar stream: how a tree reaches a runner that has no access to the
//! gateway's disk (`tar -x` in a Kubernetes pod reads it on stdin).

use std::io::Write;

use super::WorkspaceRun;
use super::manifest::EntryKind;
use super::store::Pinned;

/// Writes the workspace as a tar stream: every directory (0755, the run's `cwd` included),
/// then files with their modes and symlinks, all with the current time.
///
/// The stream is padded with zeros to a multiple of 10 KiB (tar's default record), so that
/// a tar that reads whole records ends at the archive's end marker without waiting for the
/// end of its input (an exec's stdin cannot be closed over the older exec protocol).
///
/// With `only`, just the entries it names and the directories above them (what a
/// session's tree lacks).
pub(crate) fn write_tar_only(
    run: &WorkspaceRun,
    pin: &Pinned,
    only: Option<&std::collections::HashSet<String>>,
    out: impl Write,
) -> std::io::Result<()> {
    let mut out = Counting(out, 0);
    write_entries(run, pin, only, &mut out)?;
    let pad = (RECORD - out.1 % RECORD) % RECORD;
    out.write_all(&vec![0u8; pad as usize])?;
    out.flush()
}

/// tar's default record size (20 blocks of 512 bytes).
const RECORD: u64 = 10240;

/// Counts the bytes written through it.
struct Counting<W>(W, u64);

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.0.write(buf)?;
        self.1 += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// The directories a tree of `run` has: every parent of an entry `wanted` says yes to, and
/// the command's directory with its parents; parents before children.
pub(crate) fn dirs_of(
    run: &WorkspaceRun,
    wanted: impl Fn(&str) -> bool,
) -> std::collections::BTreeSet<String> {
    let mut dirs = std::collections::BTreeSet::new();
    let cwd = (!run.cwd.is_empty()).then(|| format!("{}/", run.cwd));
    let paths = run
        .workspace
        .manifest
        .entries
        .iter()
        .map(|e| e.path.as_str())
        .filter(|p| wanted(p))
        .chain(cwd.as_deref());
    for p in paths {
        let mut end = 0;
        while let Some(i) = p[end..].find('/') {
            end += i;
            dirs.insert(p[..end].to_owned());
            end += 1;
        }
    }
    dirs
}

fn write_entries(
    run: &WorkspaceRun,
    pin: &Pinned,
    only: Option<&std::collections::HashSet<String>>,
    out: impl Write,
) -> std::io::Result<()> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut tar = tar::Builder::new(out);
    let wanted = |p: &str| only.is_none_or(|o| o.contains(p));
    let dirs = dirs_of(run, wanted);
    for d in &dirs {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_mode(0o755);
        h.set_size(0);
        h.set_mtime(now);
        tar.append_data(&mut h, format!("{d}/"), std::io::empty())?;
    }
    for e in run
        .workspace
        .manifest
        .entries
        .iter()
        .filter(|e| wanted(&e.path))
    {
        let mut h = tar::Header::new_gnu();
        h.set_mtime(now);
        match e.kind {
            EntryKind::File => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(e.mode);
                h.set_size(e.size);
                let file = std::fs::File::open(run.store.path_of(pin, &e.hash))?;
                use std::io::Read as _;
                tar.append_data(&mut h, &e.path, file.take(e.size))?;
            }
            EntryKind::Symlink => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_mode(0o777);
                h.set_size(0);
                let target = e.target.as_deref().unwrap_or_default();
                tar.append_link(&mut h, &e.path, target)?;
            }
        }
    }
    tar.into_inner()?.flush()
}

/// A blocking writer into an async channel (a request body, an exec's stdin).
pub(crate) struct ChannelWriter(pub tokio::sync::mpsc::Sender<std::io::Result<bytes::Bytes>>);

impl Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .blocking_send(Ok(bytes::Bytes::copy_from_slice(buf)))
            .map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the reader is gone")
            })?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
