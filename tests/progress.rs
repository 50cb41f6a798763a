//! What `run-remote` shows while a command is being prepared: phases on stderr only when
//! stderr is a terminal (driven here with a pseudo-terminal through `script(1)`) or with `-v`,
//! and with `-v` where the command ran. Never anything extra on stdout.
//!
//! The gateway is a scripted double that answers like a Kubernetes gateway whose pod takes a
//! while (the local backend reports no phases); it sends phases only when asked for them
//! with `Mcp-Run-Progress: 1`, as the real one does.

use crate::support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::{Command, Stdio};

const PHASES: &str = concat!(
    r#"{"type":"phase","phase":"scheduled","message":"node worker-2"}"#,
    "\n",
    r#"{"type":"phase","phase":"pulling_image","message":"busybox:1.36"}"#,
    "\n",
);
const RUN: &str = concat!(
    r#"{"type":"started","context":{"backend":"kubernetes","namespace":"runs","pod":"mcp-run-abc12","node":"worker-2","image":"busybox:1.36","pod_start_ms":2400}}"#,
    "\n",
    r#"{"type":"stdout","data":"aGkK"}"#,
    "\n",
    r#"{"type":"exit","code":0,"signal":null,"duration_ms":3,"timed_out":false}"#,
    "\n",
);

/// Serves `/raw` on a loopback port from a thread; returns its URL.
fn scripted_gateway() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/raw", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            std::thread::spawn(move || answer(conn));
        }
    });
    url
}

fn answer(conn: std::net::TcpStream) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut progress = false;
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let lower = line.to_ascii_lowercase();
        if lower.starts_with("mcp-run-progress: 1") {
            progress = true;
        }
        if let Some(v) = lower.strip_prefix("content-length:") {
            length = v.trim().parse().unwrap_or(0);
        }
        if line == "\r\n" {
            break;
        }
    }
    let mut body = vec![0u8; length];
    let _ = reader.read_exact(&mut body);
    let mut out = conn;
    let events = if progress {
        format!("{PHASES}{RUN}")
    } else {
        RUN.to_string()
    };
    let _ = write!(
        out,
        "HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{events}",
        events.len()
    );
}

fn run_remote(url: &str) -> Command {
    let mut cmd = Command::new(support::run_remote_bin());
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RUN_REMOTE_SERVER", url)
        .current_dir("/")
        .stdin(Stdio::null());
    cmd
}

#[test]
fn nothing_extra_when_stderr_is_not_a_terminal() {
    let url = scripted_gateway();
    let out = run_remote(&url).args(["--", "x"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(out.stdout, b"hi\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "");
}

#[test]
fn verbose_shows_phases_and_where_it_ran_on_stderr_only() {
    let url = scripted_gateway();
    let out = run_remote(&url).args(["-v", "--", "x"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(out.stdout, b"hi\n", "stdout is the command's alone");
    let err = String::from_utf8_lossy(&out.stderr);
    for want in [
        "scheduled",
        "node worker-2",
        "pulling image",
        "busybox:1.36",
        "pod=mcp-run-abc12",
        "namespace=runs",
        "node=worker-2",
        "image=busybox:1.36",
    ] {
        assert!(err.contains(want), "{want:?} missing in {err:?}");
    }
    assert!(err.lines().all(|l| l.starts_with("run-remote: ")), "{err}");
}

/// On a terminal the phases show without `-v`, and stdout (redirected to a file inside the
/// pseudo-terminal session) still holds only the command's output.
#[test]
fn phases_show_on_a_terminal() {
    if Command::new("script").arg("--version").output().is_err() {
        panic!("script(1) from util-linux is needed for this test");
    }
    let url = scripted_gateway();
    let dir = tempfile::tempdir().unwrap();
    let out_file = dir.path().join("out");
    let line = format!(
        "{} -- x > {}",
        mcp_run::contract::shell_quote(&support::run_remote_bin().to_string_lossy()),
        mcp_run::contract::shell_quote(&out_file.to_string_lossy()),
    );
    let out = Command::new("script")
        .args(["-q", "-e", "-c", &line, "/dev/null"])
        .env("RUN_REMOTE_SERVER", &url)
        .env("SHELL", "/bin/sh")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let screen = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{screen}");
    assert!(screen.contains("pulling image"), "{screen:?}");
    assert!(
        !screen.contains("pod=mcp-run-abc12"),
        "context only with -v: {screen:?}"
    );
    assert_eq!(std::fs::read(&out_file).unwrap(), b"hi\n");
}
