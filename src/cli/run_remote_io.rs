//! run-remote's side channels: the command's stdin (`-i`), the hint when data is piped in
//! without `-i`, and the status lines on stderr (phases while the gateway prepares the
//! command, and with `-v` where it runs). Nothing here ever writes to stdout.

use std::io::{IsTerminal, Read, Write};
use std::os::fd::AsFd;

use bytes::Bytes;
use tokio::sync::mpsc;

use crate::contract::{Event, Phase, RunContext};

/// The size of one read from our stdin, and of one chunk in the request body.
const STDIN_CHUNK: usize = 256 * 1024;

/// Chunks read ahead of the connection (the rest waits in our stdin's pipe).
const STDIN_QUEUE: usize = 4;

/// Reads our stdin on a thread (reads block) into a channel that ends at EOF, byte for byte.
/// A read error ends it too, after one line on stderr: the command then sees end of input.
pub(crate) fn forward_stdin() -> mpsc::Receiver<Bytes> {
    let (tx, rx) = mpsc::channel(STDIN_QUEUE);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        loop {
            let mut buf = vec![0u8; STDIN_CHUNK];
            match stdin.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    buf.truncate(n);
                    if tx.blocking_send(Bytes::from(buf)).is_err() {
                        // The run ended; whatever is left is not needed.
                        return;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    eprintln!("run-remote: cannot read stdin ({e}); the command gets end of input");
                    return;
                }
            }
        }
    });
    rx
}

/// Whether our stdin is a pipe, socket or file that holds unread data right now (a terminal
/// or `/dev/null` never does): data someone meant for the command, which is not sent
/// without `-i`.
pub(crate) fn stdin_has_data() -> bool {
    use nix::sys::stat::SFlag;
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        return false;
    }
    let fd = stdin.as_fd();
    let Ok(st) = nix::sys::stat::fstat(fd) else {
        return false;
    };
    let kind = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT;
    if kind == SFlag::S_IFREG {
        let offset = nix::unistd::lseek(fd, 0, nix::unistd::Whence::SeekCur).unwrap_or(0);
        return st.st_size > offset;
    }
    if kind == SFlag::S_IFIFO || kind == SFlag::S_IFSOCK {
        use std::os::fd::AsRawFd;
        let mut pending: nix::libc::c_int = 0;
        // SAFETY: FIONREAD writes one c_int through the pointer, which lives across the call.
        let r = unsafe { nix::libc::ioctl(fd.as_raw_fd(), nix::libc::FIONREAD, &mut pending) };
        return r == 0 && pending > 0;
    }
    false
}

/// The one-line hint for data piped in without `-i`.
pub(crate) const STDIN_HINT: &str =
    "run-remote: stdin has data that was not sent to the command; use -i (--stdin) to send it";

/// Whether phases go to stderr: on a terminal, or when asked for with `-v`.
pub(crate) fn show_progress(verbose: bool) -> bool {
    verbose || std::io::stderr().is_terminal()
}

/// Prints each phase on stderr as it arrives, until the sender is dropped; await the handle
/// to have every phase printed before what follows.
pub(crate) fn print_phases(mut phases: mpsc::Receiver<Event>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(event) = phases.recv().await {
            if let Event::Phase { phase, message } = event {
                let _ = writeln!(
                    std::io::stderr(),
                    "{}",
                    phase_line(phase, message.as_deref())
                );
            }
        }
    })
}

pub(crate) fn phase_line(phase: Phase, message: Option<&str>) -> String {
    let what = match phase {
        Phase::Queued => "queued",
        Phase::Scheduling => "waiting for a node",
        Phase::Scheduled => "scheduled",
        Phase::PullingImage => "pulling image",
        Phase::Starting => "starting",
        Phase::Running => "running",
    };
    match message.filter(|m| !m.is_empty()) {
        Some(m) => format!("run-remote: {what}: {m}"),
        None => format!("run-remote: {what}"),
    }
}

/// Where the command runs, for `-v`: every field the gateway reported, and our clock's time.
pub(crate) fn started_line(context: &RunContext) -> String {
    let mut s = format!("run-remote: started on {}", context.backend);
    let fields: [(&str, Option<String>); 9] = [
        ("host", context.host.clone()),
        ("pid", context.pid.map(|p| p.to_string())),
        ("namespace", context.namespace.clone()),
        ("pod", context.pod.clone()),
        ("node", context.node.clone()),
        ("container", context.container.clone()),
        ("image", context.image.clone()),
        ("profile", context.profile.clone()),
        ("pod_start_ms", context.pod_start_ms.map(|p| p.to_string())),
    ];
    for (name, value) in fields {
        if let Some(v) = value {
            s.push_str(&format!(" {name}={v}"));
        }
    }
    for (name, state) in &context.caches {
        let state = serde_json::to_value(state)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        s.push_str(&format!(" cache:{name}={state}"));
    }
    s.push_str(&format!(" at {}", utc_time(std::time::SystemTime::now())));
    s
}

/// `HH:MM:SS UTC` of a time (the day is today's: this is a status line).
fn utc_time(t: std::time::SystemTime) -> String {
    let secs = t
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!(
        "{:02}:{:02}:{:02} UTC",
        secs / 3600 % 24,
        secs / 60 % 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines() {
        assert_eq!(
            phase_line(Phase::PullingImage, Some("busybox:1.36")),
            "run-remote: pulling image: busybox:1.36"
        );
        assert_eq!(phase_line(Phase::Scheduled, None), "run-remote: scheduled");
        let line = started_line(&RunContext {
            backend: "kubernetes".into(),
            namespace: Some("runs".into()),
            pod: Some("p-1".into()),
            node: Some("n".into()),
            image: Some("busybox".into()),
            ..Default::default()
        });
        assert!(
            line.starts_with(
                "run-remote: started on kubernetes namespace=runs pod=p-1 node=n image=busybox at "
            ),
            "{line}"
        );
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(86400 * 3 + 3723);
        assert_eq!(utc_time(t), "01:02:03 UTC");
    }
}
