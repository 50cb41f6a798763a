//! `run-remote`: run a command on an mcp-run gateway as if it ran here.

fn main() {
    std::process::exit(mcp_run::run_remote_main());
}
