//! `mcp-run`: the gateway.

fn main() -> std::process::ExitCode {
    mcp_run::serve_main()
}
