//! `run-remote`: run a command on an mcp-run gateway as if it ran here.

fn main() {
    std::process::exit(mcp_run::cli::run_remote::main());
}
