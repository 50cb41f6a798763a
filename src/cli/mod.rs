//! The logic behind the binaries, kept in the library so that it is tested like the rest.

pub mod exit_codes;
pub mod run_remote;
pub mod run_remote_templates;
pub mod run_remote_workspace;
pub mod serve;

/// Sets up logging on stderr (stdout may carry a protocol). `RUST_LOG` overrides the level.
pub fn init_logging(default_level: &str, json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    use std::io::IsTerminal as _;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}
