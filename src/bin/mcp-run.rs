//! `mcp-run`: the gateway.

fn main() -> std::process::ExitCode {
    mcp_run::cli::serve::main()
}
