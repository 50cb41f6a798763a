//! The logic behind the binaries, kept in the library so that it is tested like the rest.

pub(crate) mod outcome;
pub(crate) mod run_remote;
pub(crate) mod run_remote_io;
pub(crate) mod run_remote_sessions;
pub(crate) mod run_remote_templates;
pub(crate) mod run_remote_workspace;
pub(crate) mod serve;

/// Keeps freed memory in the process instead of handing it back to the kernel at once
/// (glibc's malloc). Streaming allocates and frees a few 256-350 KiB buffers per chunk; with
/// glibc's defaults each was fresh memory, page-faulted in and unmapped again, about a third
/// of the gateway's CPU and most of the client's system time on a large stream
/// (docs/performance.md). Memory stays bounded: at most 8 MiB of freed heap is kept per arena.
pub(crate) fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; it is called at the start of main,
    // before any other thread exists.
    unsafe {
        nix::libc::mallopt(nix::libc::M_MMAP_THRESHOLD, 1 << 20);
        nix::libc::mallopt(nix::libc::M_TRIM_THRESHOLD, 8 << 20);
    }
}

/// Sets up logging on stderr (stdout may carry a protocol). `RUST_LOG` overrides the level.
pub(crate) fn init_logging(default_level: &str, json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter(default_level)));
    use std::io::IsTerminal as _;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        // Secrets are redacted from every line, whichever crate logs it.
        .with_writer(crate::redact::log_writer);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// The default log filter: `level` for mcp-run, but the MCP library only from `warn` (at
/// `info` it logs every session's start, its whole peer info, and its end), and its
/// per-request service errors (a client's unknown run id, a malformed call: answered to the
/// client, not an operator's concern) only from `error`. `RUST_LOG` replaces all of it.
fn default_filter(level: &str) -> String {
    format!("{level},rmcp=warn,rmcp::service=error")
}

/// The shells `completions` knows, for usage messages.
pub(crate) const SHELLS: &str = "bash|zsh|fish|elvish|powershell";

/// The shell named `name`.
pub(crate) fn shell(name: &str) -> Option<clap_complete::Shell> {
    <clap_complete::Shell as clap::ValueEnum>::from_str(name, true).ok()
}

/// Prints the completion script of `cmd` for `shell` on stdout.
pub(crate) fn write_completions(
    shell: clap_complete::Shell,
    mut cmd: clap::Command,
) -> outcome::Outcome {
    let name = cmd.get_name().to_owned();
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut cmd, name, &mut script);
    let mut stdout = std::io::stdout().lock();
    match std::io::Write::write_all(&mut stdout, &script) {
        Ok(()) => outcome::Outcome::Done,
        Err(e) => outcome::write_failed(&e, "the completion script"),
    }
}
