//! `mcp-run`: the gateway's command line.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use clap::{Parser, Subcommand};

use crate::config::{BackendKind, Config};
use crate::exec::Executor;
use crate::exec::local::LocalExecutor;
use crate::runner::Runner;
use crate::server::{self, AppState};

/// Kubernetes-native remote runner: runs each command in its own ephemeral pod (or as a
/// local process) and streams stdout, stderr and the exit code back.
#[derive(Debug, Parser)]
#[command(name = "mcp-run", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the gateway: HTTP `/raw`, `/healthz` and `/readyz` on one listener.
    Serve(ServeArgs),
}

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on [default: 127.0.0.1:8080, or `server.listen` in the config file].
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// Where commands run [default: local, or `server.backend` in the config file].
    #[arg(long, value_enum)]
    pub backend: Option<BackendKind>,
    /// YAML configuration file (see docs/configuration.md).
    #[arg(long, value_name = "FILE", env = "MCP_RUN_CONFIG")]
    pub config: Option<PathBuf>,
    /// Log format on stderr.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => {
            super::init_logging("info", args.log_format == LogFormat::Json);
            match run_serve(args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!("{e:#}");
                    eprintln!("mcp-run: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// Loads the configuration with the command line's overrides applied.
pub fn load_config(path: Option<&std::path::Path>) -> anyhow::Result<Config> {
    Ok(match path {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    })
}

/// Builds the configured backend.
pub fn build_executor(config: &Config) -> anyhow::Result<Arc<dyn Executor>> {
    Ok(match config.server.backend {
        BackendKind::Local => Arc::new(LocalExecutor::new(&config.local.inherit_env)),
    })
}

fn run_serve(args: ServeArgs) -> anyhow::Result<()> {
    let mut config = load_config(args.config.as_deref())?;
    if let Some(listen) = args.listen {
        config.server.listen = listen;
    }
    if let Some(backend) = args.backend {
        config.server.backend = backend;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    rt.block_on(serve(config))
}

/// Runs the gateway until SIGTERM or SIGINT.
pub async fn serve(config: Config) -> anyhow::Result<()> {
    let executor = build_executor(&config)?;
    let runner = Arc::new(Runner::new(executor, config.limits.clone()).with_policy(
        crate::policy::Policy::new(config.policy.clone(), config.limits.clone()),
    ));
    let state = AppState {
        runner: runner.clone(),
        keepalive: config.keepalive(),
    };
    let app = server::router(state, config.server.max_body_bytes);
    let listener = tokio::net::TcpListener::bind(config.server.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.server.listen))?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, backend = runner.executor().name(), version = env!("CARGO_PKG_VERSION"), "mcp-run gateway listening");
    server::serve(
        listener,
        app,
        runner,
        shutdown_signal(),
        config.shutdown_grace(),
    )
    .await?;
    tracing::info!("stopped");
    Ok(())
}

/// Resolves on SIGTERM (Kubernetes) or SIGINT (Ctrl-C).
async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot watch SIGTERM: {e}");
                std::future::pending::<()>().await
            }
        }
    };
    tokio::select! {
        _ = term => tracing::info!("SIGTERM received"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
    }
}
