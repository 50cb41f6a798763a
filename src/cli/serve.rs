//! `mcp-run`: the gateway's command line.
//!
//! Size: about 600 lines: the flags of `serve` and `stdio`, and the one start-up path both
//! share (configuration, backend, runner, templates, capabilities, router); split, the two
//! commands would each need the other half.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};

use crate::capabilities::Capabilities;
use crate::config::{BackendKind, Config};
use crate::exec::Executor;
use crate::exec::kube::{KubeExecutor, KubeSetupError};
use crate::exec::local::LocalExecutor;
use crate::exec::remote::RemoteExecutor;
use crate::mcp::McpService;
use crate::runner::Runner;
use crate::server::{self, AppState, McpSettings};

const AFTER_HELP: &str = "\
Examples:
  mcp-run serve                                  # local processes, on 127.0.0.1:8080
  mcp-run serve --backend kube --image busybox:1.36
  mcp-run serve --config gateway.yaml --log-format json
  mcp-run stdio                                  # MCP on stdin/stdout, for Claude Desktop/Code
  mcp-run completions zsh > ~/.zfunc/_mcp-run

Then, in another terminal: RUN_REMOTE_SERVER=http://127.0.0.1:8080/raw run-remote -- uname -a
Docs: README.md and docs/ (configuration.md, mcp.md, protocol.md).";

/// The mcp-run gateway: runs each command in its own ephemeral Kubernetes pod (or as a local
/// process) and streams stdout, stderr and the exit code back, over HTTP (/raw) and MCP.
#[derive(Debug, Parser)]
#[command(name = "mcp-run", version, after_help = AFTER_HELP)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run the gateway: HTTP `/raw`, MCP at `/mcp`, `/capabilities`, `/healthz`, `/readyz`
    /// and `/metrics` on one listener.
    Serve(ServeArgs),
    /// Serve MCP on stdin/stdout (logs on stderr), for agents that start their MCP servers
    /// as child processes.
    Stdio(StdioArgs),
    /// Internal: started by the gateway, kills what its commands left once it is gone.
    #[command(name = "reap-on-exit", hide = true)]
    ReapOnExit { prefix: String },
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell) on stdout.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    /// Address to listen on [default: 127.0.0.1:8080, or `server.listen` in the config file].
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// Allow a non-loopback `--listen` address without auth tokens (`server.insecure_no_auth`):
    /// anyone who can reach the port can then run commands.
    #[arg(long)]
    pub insecure_no_auth: bool,
    /// Another replica of this gateway, by base URL (repeatable; added to `server.peers`):
    /// kept MCP outputs are read through any replica. Needs MCP_RUN_PEER_SECRET (or
    /// `server.peer_secret_file`), the same on every replica.
    #[arg(long = "peer", value_name = "URL")]
    pub peers: Vec<String>,
    /// Serve the replicas' peer channel on this address only (`server.peer_listen`), so that
    /// a NetworkPolicy can admit it from the gateway's pods alone.
    #[arg(long, value_name = "ADDR")]
    pub peer_listen: Option<SocketAddr>,
    /// Log format on stderr.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    #[command(flatten)]
    pub backend: BackendArgs,
}

#[derive(Debug, clap::Args)]
pub(crate) struct StdioArgs {
    /// Log format on stderr (stdout carries the protocol).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    #[command(flatten)]
    pub backend: BackendArgs,
    /// With `--backend remote`: sync this directory to the gateway (incrementally) before
    /// every command, which runs in it (docs/workspaces.md).
    #[arg(long, value_name = "DIR")]
    pub workspace: Option<PathBuf>,
    /// Run every call that names no session in this session: one runner (and its build
    /// outputs) for the client's lifetime, ended when stdin closes (docs/sessions.md).
    #[arg(long, value_name = "NAME")]
    pub session: Option<String>,
}

/// Where commands run: shared by `serve` and `stdio`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct BackendArgs {
    /// Where commands run [default: local, or `server.backend` in the config file].
    #[arg(long, value_enum)]
    pub backend: Option<BackendKind>,
    /// YAML configuration file (see docs/configuration.md).
    #[arg(long, value_name = "FILE", env = "MCP_RUN_CONFIG")]
    pub config: Option<PathBuf>,
    /// The gateway's /raw URL for `--backend remote` [default: `remote.server`, or
    /// RUN_REMOTE_SERVER]; RUN_REMOTE_TOKEN is sent as its bearer token.
    #[arg(long, value_name = "URL", env = "RUN_REMOTE_SERVER")]
    pub server: Option<String>,
    #[command(flatten)]
    pub kube: KubeArgs,
}

impl BackendArgs {
    /// The configuration file with these flags applied, validated.
    pub(crate) fn load(&self) -> anyhow::Result<Config> {
        let mut config = load_config(self.config.as_deref())?;
        if let Some(backend) = self.backend {
            config.server.backend = backend;
        }
        // `--server` / RUN_REMOTE_SERVER only matter to the remote backend: a stray
        // variable must not stop a local or kube gateway.
        if let Some(server) = &self.server
            && config.server.backend == BackendKind::Remote
        {
            // Checked here so that the message names where the URL came from.
            crate::exec::remote::parse_server_url(server)
                .map_err(|e| anyhow::anyhow!("{}: {e}", server_source()))?;
            config.remote.server = Some(server.clone());
        }
        self.kube.apply(&mut config)?;
        Ok(config)
    }
}

/// Which of `--server` and `RUN_REMOTE_SERVER` gave the remote backend's URL (the flag wins).
fn server_source() -> &'static str {
    if std::env::args().any(|a| a == "--server" || a.starts_with("--server=")) {
        "--server"
    } else {
        "RUN_REMOTE_SERVER"
    }
}

/// Flags of the Kubernetes backend; each overrides its key in the config file.
#[derive(Debug, Clone, Default, clap::Args)]
#[command(next_help_heading = "Kubernetes backend (--backend kube)")]
pub(crate) struct KubeArgs {
    /// Kubeconfig file [default: in-cluster account, else KUBECONFIG or ~/.kube/config].
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// Kubeconfig context [default: the current context].
    #[arg(long, value_name = "NAME")]
    pub context: Option<String>,
    /// Namespace of the runner pods [default: the gateway's own in-cluster, else the
    /// context's, else `default`].
    #[arg(long, value_name = "NS")]
    pub namespace: Option<String>,
    /// Image of the `default` profile [default: busybox:1.36].
    #[arg(long, value_name = "IMAGE")]
    pub image: Option<String>,
    /// Runner pods at once; more requests get 429 [default: 32].
    #[arg(long, value_name = "N")]
    pub max_concurrent_pods: Option<usize>,
}

impl KubeArgs {
    /// Applies the flags over the file's values, then validates the result again.
    pub(crate) fn apply(&self, config: &mut Config) -> anyhow::Result<()> {
        let k = &mut config.kubernetes;
        if let Some(v) = &self.kubeconfig {
            k.kubeconfig = Some(v.clone());
        }
        if let Some(v) = &self.context {
            k.context = Some(v.clone());
        }
        if let Some(v) = &self.namespace {
            k.namespace = Some(v.clone());
        }
        if let Some(v) = self.max_concurrent_pods {
            k.max_concurrent_pods = v;
        }
        config.ensure_default_profile();
        if let Some(image) = &self.image
            && let Some(p) = config.profiles.get_mut("default")
        {
            p.image = Some(image.clone());
        }
        config.validate()?;
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogFormat {
    Text,
    Json,
}

pub fn main() -> ExitCode {
    super::tune_allocator();
    let cli = Cli::parse();
    let json_logs;
    let result = match cli.command {
        Command::Serve(args) => {
            json_logs = args.log_format == LogFormat::Json;
            super::init_logging("info", json_logs);
            run_serve(args)
        }
        Command::ReapOnExit { prefix } => return crate::exec::reaper::run(&prefix),
        Command::Stdio(args) => {
            // stdout carries the protocol: logs go to stderr, quietly by default.
            json_logs = args.log_format == LogFormat::Json;
            super::init_logging("warn", json_logs);
            run_stdio(args)
        }
        Command::Completions { shell } => {
            use clap::CommandFactory as _;
            return match super::write_completions(shell, Cli::command()) {
                super::outcome::Outcome::Done => ExitCode::SUCCESS,
                _ => ExitCode::FAILURE,
            };
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Once: a JSON log line for log collectors, else one line for a person.
            if json_logs {
                tracing::error!("{}", startup_error(&e));
            } else {
                eprintln!("mcp-run: {}", startup_error(&e));
            }
            ExitCode::FAILURE
        }
    }
}

/// A start-up error as one line: the causes in order, each said once (kube's configuration
/// errors repeat their cause at every level of the chain).
pub(crate) fn startup_error(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let text = cause.to_string();
        // A level that only repeats what the previous one said adds nothing.
        if parts.last().is_some_and(|p| p.contains(&text)) {
            continue;
        }
        parts.push(text);
    }
    parts.join(": ")
}

/// Loads the configuration with the command line's overrides applied.
pub(crate) fn load_config(path: Option<&std::path::Path>) -> anyhow::Result<Config> {
    Ok(match path {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    })
}

/// Builds the configured backend; the Kubernetes backend also checks its permissions and
/// deletes what a previous run left behind.
pub(crate) async fn build_executor(
    config: &Config,
    metrics: &crate::metrics::Metrics,
    replicas: Option<tokio::sync::watch::Receiver<Vec<String>>>,
) -> anyhow::Result<Arc<dyn Executor>> {
    Ok(match config.server.backend {
        BackendKind::Local => Arc::new(
            LocalExecutor::new(&config.local.inherit_env)
                .with_profiles(config.profiles.keys().cloned())
                .with_reaper()
                .with_workspaces(&config.workspaces)
                .with_caches(
                    crate::exec::cache::local::LocalCaches::start(
                        &config.caches,
                        config
                            .profiles
                            .iter()
                            .map(|(n, p)| (n.clone(), p.caches.clone()))
                            .collect(),
                        tokio_util::sync::CancellationToken::new(),
                    )
                    .with_context(|| {
                        format!(
                            "cannot use the cache directory {} (caches.local_dir)",
                            config.caches.local_dir().display()
                        )
                    })?,
                ),
        ),
        BackendKind::Remote => {
            let url = config.remote.server.as_deref().context(
                "--backend remote needs the gateway's /raw URL: --server URL, remote.server or RUN_REMOTE_SERVER",
            )?;
            let token = std::env::var("RUN_REMOTE_TOKEN")
                .ok()
                .filter(|t| !t.is_empty());
            let remote = RemoteExecutor::new(url, token)?;
            match &config.remote.workspace {
                Some(dir) => Arc::new(crate::exec::remote::workspace::SyncedRemote::new(
                    remote, dir,
                )?),
                None => Arc::new(remote),
            }
        }
        BackendKind::Kube => {
            let mut profiles = config.profiles.clone();
            profiles.entry("default".into()).or_default();
            let kube = KubeExecutor::connect(config.kubernetes.clone(), profiles, metrics.clone())
                .await
                .map_err(kube_setup_error)?
                .with_caches(&config.caches)
                .with_replicas(replicas);
            kube.prepare(Duration::from_secs(config.limits.max_timeout_secs))
                .await;
            Arc::new(kube)
        }
    })
}

/// The Kubernetes backend's set-up error, short and with the fix. kube's "cannot infer a
/// configuration" names both sources it tried (in-cluster, kubeconfig) and repeats them in
/// its source chain; the kubeconfig's reason is the one a person can act on.
fn kube_setup_error(e: KubeSetupError) -> anyhow::Error {
    match &e {
        KubeSetupError::Infer(infer) => {
            let kubeconfig = std::error::Error::source(infer)
                .map(|s| s.to_string())
                .unwrap_or_else(|| infer.to_string());
            anyhow::anyhow!(
                "--backend kube: no Kubernetes credentials (not in a cluster, and {kubeconfig}): \
                 pass --kubeconfig PATH or set KUBECONFIG, or use --backend local"
            )
        }
        _ => anyhow::Error::new(e).context("--backend kube"),
    }
}

fn run_serve(args: ServeArgs) -> anyhow::Result<()> {
    let mut config = args.backend.load()?;
    if let Some(listen) = args.listen {
        config.server.listen = listen;
    }
    config.server.insecure_no_auth |= args.insecure_no_auth;
    for peer in &args.peers {
        crate::peers::parse_url(peer).map_err(|e| anyhow::anyhow!("--peer: {e}"))?;
    }
    config.server.peers.extend(args.peers);
    if let Some(peer_listen) = args.peer_listen {
        config.server.peer_listen = Some(peer_listen);
    }
    block_on(serve(config))
}

/// Runs `fut` on a multi-threaded runtime.
fn block_on(fut: impl std::future::Future<Output = anyhow::Result<()>>) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the runtime")?
        .block_on(fut)
}

/// The gateway's HTTP application and what serving it needs besides.
pub struct App {
    pub router: axum::Router,
    pub(crate) runner: Arc<Runner>,
    /// Fired once running commands were drained at shutdown: ends the MCP sessions.
    pub(crate) drained: tokio_util::sync::CancellationToken,
    /// Whether bearer tokens are required (connections then count as unauthenticated until
    /// a request passed auth).
    pub(crate) auth_on: bool,
    /// The peer port's router (`server.peer_listen`), when the peer channel has its own port.
    pub(crate) peer_router: Option<axum::Router>,
}

/// Builds the whole gateway from its configuration: backend, runner, auth, router. `serve`
/// binds it to a listener; tests drive the router in-process.
pub async fn app(config: &Config) -> anyhow::Result<App> {
    // First: the warm pools share their size among the replicas it finds.
    let discovery = match &config.server.peer_service {
        Some(service) => Some(
            crate::peers::discovery::Discovery::start(&config.kubernetes, service, pod_name())
                .await
                .map_err(anyhow::Error::msg)?,
        ),
        None => None,
    };
    let Prepared {
        runner,
        templates,
        capabilities,
    } = {
        let replicas = discovery.as_ref().map(|d| d.replicas());
        prepare(config, false, peers(config, discovery)?, replicas).await?
    };
    let drained = tokio_util::sync::CancellationToken::new();
    let state = AppState {
        runner: runner.clone(),
        keepalive: config.keepalive(),
        capabilities,
        mcp: McpSettings {
            config: config.mcp.clone(),
            stop: drained.clone(),
            tools: Arc::new(config.tools.clone()),
            templates,
        },
        auth: crate::auth::Auth::load(&config.auth, |k| std::env::var(k).ok())?.map(Arc::new),
        guard: Arc::new(
            crate::server::guard::Guard::new(
                &config.server.allowed_hosts,
                config.server.max_body_bytes,
            )
            .with_body_timeout(Duration::from_secs(config.server.body_timeout_secs))
            .with_metrics(runner.metrics().clone()),
        ),
        peers: runner.peers().cloned(),
    };
    check_exposure(config, state.auth.is_some())?;
    if let Some(auth) = &state.auth {
        check_tenancy(config, auth)?;
    }
    if let Some(auth) = &state.auth {
        auth.watch(Duration::from_secs(config.auth.reload_secs));
        tracing::info!(
            tokens = auth.len(),
            "bearer-token auth on for every path but /healthz, /readyz and /metrics"
        );
    }
    let auth_on = state.auth.is_some();
    let (router, peer_router) = server::routers(
        state,
        config.server.max_body_bytes,
        config.server.peer_listen.is_some(),
    );
    Ok(App {
        auth_on,
        router,
        peer_router,
        runner,
        drained,
    })
}

/// The other replicas (`server.peers`, and those `server.peer_service` lists) with the peer
/// secret, or `None` without peers.
fn peers(
    config: &Config,
    discovery: Option<crate::peers::discovery::Discovery>,
) -> anyhow::Result<Option<Arc<crate::peers::Peers>>> {
    if let Some(peer) = config.server.peer_listen
        && peer.port() != 0
        && peer == config.server.listen
    {
        anyhow::bail!(
            "server.peer_listen (--peer-listen) must differ from server.listen ({peer}): the peer channel needs its own port"
        );
    }
    if config.server.peers.is_empty() && discovery.is_none() {
        if config.server.peer_listen.is_some() {
            anyhow::bail!(
                "server.peer_listen (--peer-listen) serves the replicas' peer channel: it needs server.peers (--peer) or server.peer_service"
            );
        }
        return Ok(None);
    }
    let secret = crate::peers::load_secret(config.server.peer_secret_file.as_deref(), |k| {
        std::env::var(k).ok()
    })
    .map_err(anyhow::Error::msg)?
    .with_context(|| {
        format!(
            "server.peers (--peer) and server.peer_service need the replicas' shared secret: set {} or server.peer_secret_file",
            crate::peers::SECRET_ENV
        )
    })?;
    let mut peers =
        crate::peers::Peers::new(&config.server.peers, secret).map_err(anyhow::Error::msg)?;
    if let Some(discovery) = discovery {
        peers = peers.with_discovery(discovery);
    }
    tracing::info!(
        replica = peers.tag(),
        peers = peers.len(),
        discovered = peers.discovers(),
        "replica of a gateway with peers: MCP is stateless; kept outputs, workspaces and sessions are served through any replica"
    );
    Ok(Some(Arc::new(peers)))
}

/// This gateway's pod (`MCP_RUN_POD_NAME`, set by the chart), else the host name: how its
/// own endpoint is told apart from the other replicas'.
fn pod_name() -> Option<String> {
    std::env::var("MCP_RUN_POD_NAME")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| {
            nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
        })
}

/// Runs the gateway until SIGTERM or SIGINT.
pub(crate) async fn serve(config: Config) -> anyhow::Result<()> {
    // The lock before any directory it vouches for (the MCP outputs are made in `app`): a
    // gateway starting meanwhile must not take them for a dead gateway's, as it would when
    // a SIGKILLed gateway of the same (reused) pid left its lock file.
    crate::leftovers::claim_and_sweep(&[config.workspaces.local_dir()]);
    let App {
        router,
        runner,
        drained,
        auth_on,
        peer_router,
    } = match app(&config).await {
        Ok(app) => app,
        Err(e) => {
            crate::leftovers::release(&std::env::temp_dir());
            return Err(e);
        }
    };
    // Commands run as this user: without this, they could read the gateway's environment
    // (tokens) and memory through /proc/PID/environ and /proc/PID/mem, or ptrace it.
    if let Err(e) = nix::sys::prctl::set_dumpable(false) {
        tracing::warn!("cannot make the gateway non-dumpable: {e}");
    }
    let listener = tokio::net::TcpListener::bind(config.server.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.server.listen))?;
    let addr = listener.local_addr()?;
    let limits = crate::server::connections::ConnectionLimits {
        max_connections: config.server.max_connections,
        max_unauthenticated: config.server.max_unauthenticated_connections,
        header_timeout: Duration::from_secs(config.server.header_timeout_secs),
        auth_on,
    };
    if let (Some(peer_addr), Some(peer_router)) = (config.server.peer_listen, peer_router) {
        serve_peer_port(peer_addr, peer_router, &runner, &limits, drained.clone()).await?;
    }
    tracing::info!(%addr, backend = runner.executor().name(), version = env!("CARGO_PKG_VERSION"), "mcp-run gateway listening");
    server::serve(
        listener,
        router,
        runner,
        limits,
        server::Shutdown {
            signal: bounded_shutdown_signal(exit_bound(&config)),
            grace: config.shutdown_grace(),
            drained,
        },
    )
    .await?;
    tracing::info!("stopped");
    crate::leftovers::release(&std::env::temp_dir());
    Ok(())
}

/// Serves the peer channel on its own port until `drained`: a draining replica still answers
/// its peers (the outputs it kept), until its running commands are done.
async fn serve_peer_port(
    addr: SocketAddr,
    router: axum::Router,
    runner: &Runner,
    limits: &crate::server::connections::ConnectionLimits,
    drained: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr} (server.peer_listen)"))?;
    let local = listener.local_addr()?;
    tracing::info!(addr = %local, "peer channel served on its own port (replicas only)");
    let limits = crate::server::connections::ConnectionLimits {
        // Peers prove the peer secret, checked by the peer routes.
        auth_on: true,
        ..limits.clone()
    };
    let metrics = runner.metrics().clone();
    tokio::spawn(async move {
        if let Err(e) = crate::server::connections::run(
            listener,
            router,
            limits,
            metrics,
            drained.cancelled_owned(),
        )
        .await
        {
            tracing::warn!("the peer port stopped: {e}");
        }
    });
    Ok(())
}

/// After the signal, the longest the gateway takes to exit: the drain, closing connections,
/// and removing its directories (trees of many inodes can take minutes). Past it, the
/// process exits and what is left is removed by its reaper and by the next gateway
/// (crate::leftovers).
fn exit_bound(config: &Config) -> Duration {
    config.shutdown_grace() + crate::server::connections::CLOSE_GRACE + CLEANUP_BOUND
}

/// The time given to removing the gateway's directories at shutdown.
const CLEANUP_BOUND: Duration = Duration::from_secs(5);

/// The shutdown signal, which also starts the clock of [`exit_bound`].
async fn bounded_shutdown_signal(bound: Duration) {
    shutdown_signal().await;
    std::thread::spawn(move || {
        std::thread::sleep(bound);
        tracing::warn!(
            "shutdown took longer than {} s: exiting; the reaper and the next gateway remove what is left",
            bound.as_secs()
        );
        std::process::exit(0);
    });
}

/// The local backend runs every command as the gateway's user: several identities would
/// reach each other's trees and cached contents, so they need the operator's word.
fn check_tenancy(config: &Config, auth: &crate::auth::Auth) -> anyhow::Result<()> {
    if config.server.backend != BackendKind::Local || config.local.allow_multiple_identities {
        return Ok(());
    }
    let n = auth.identities();
    if n > 1 {
        anyhow::bail!(
            "the local backend runs every identity's commands as this gateway's user, so {n} identities could read each other's workspace trees and cached contents: \
             use one identity, the kube backend, or set local.allow_multiple_identities: true if they trust each other (docs/policy.md)"
        );
    }
    auth.limit_identities(1);
    Ok(())
}

/// Refuses to serve a non-loopback address without auth unless the operator said so.
fn check_exposure(config: &Config, auth: bool) -> anyhow::Result<()> {
    let addr = config.server.listen.ip();
    if auth || addr.is_loopback() {
        return Ok(());
    }
    if !config.server.insecure_no_auth {
        anyhow::bail!(
            "refusing to listen on {addr} without auth: anyone who reaches it could run commands. \
             Configure tokens (`auth:`, MCP_RUN_AUTH_TOKENS), listen on a loopback address, or pass \
             --insecure-no-auth (`server.insecure_no_auth: true`) if something else guards the port"
        );
    }
    tracing::warn!(
        %addr,
        "listening on a non-loopback address WITHOUT auth (--insecure-no-auth): anyone who can reach this port can run commands"
    );
    Ok(())
}

/// The runner every front end uses, with the configured policy and limits.
pub(crate) fn build_runner(
    config: &Config,
    executor: Arc<dyn Executor>,
    metrics: crate::metrics::Metrics,
) -> anyhow::Result<Runner> {
    let redactor =
        crate::redact::Redactor::from_config(&config.redaction, |k| std::env::var(k).ok())
            .map_err(|e| anyhow::anyhow!("invalid configuration: {e}"))?;
    if let Some(r) = &redactor {
        crate::redact::redact_logs(r.clone());
    }
    let workspaces = if config.workspaces.enabled && executor.supports_workspaces() {
        let store = crate::workspace::WorkspaceStore::open(config.workspaces.clone())
            .with_context(|| {
                format!(
                    "cannot open the workspace cache in {}",
                    config.workspaces.cache_dir().display()
                )
            })?;
        Some(Arc::new(store))
    } else {
        None
    };
    Ok(Runner::new(executor, config.limits.clone())
        .with_workspaces(workspaces)
        .with_metrics(metrics)
        .with_sessions(config.sessions.clone())
        .with_policy(crate::policy::Policy::new(
            config.policy.clone(),
            config.limits.clone(),
        )?)
        .with_redactor(redactor))
}

/// What `serve` and `stdio` both start from.
struct Prepared {
    runner: Arc<Runner>,
    templates: Arc<crate::templates::TemplateStore>,
    capabilities: Arc<Capabilities>,
}

/// Builds the backend, the runner, the template store (`discover`: also the repository's
/// `.mcp-run/config.yaml`, for `stdio`) and the capabilities document.
async fn prepare(
    config: &Config,
    discover: bool,
    peers: Option<Arc<crate::peers::Peers>>,
    replicas: Option<tokio::sync::watch::Receiver<Vec<String>>>,
) -> anyhow::Result<Prepared> {
    // One registry per gateway, handed to whoever records (served on /metrics).
    let metrics = crate::metrics::Metrics::new();
    let executor = build_executor(config, &metrics, replicas).await?;
    let runner = Arc::new(build_runner(config, executor, metrics)?.with_peers(peers));
    let templates = template_store(config, discover)?;
    let mut capabilities = capabilities(config, &runner).await;
    capabilities.templates = templates.names(&working_dir());
    Ok(Prepared {
        runner,
        templates,
        capabilities: Arc::new(capabilities),
    })
}

/// The capabilities document of this gateway.
pub(crate) async fn capabilities(config: &Config, runner: &Runner) -> Capabilities {
    let backend = runner.executor().capabilities().await;
    let mut caps = Capabilities::new(backend, &config.limits, config.mcp.max_output_bytes);
    if config.policy != crate::policy::PolicyConfig::default() {
        caps.policy = serde_json::to_value(runner.policy().summary()).ok();
        caps.limitations.push(
            "an execution policy restricts executables, arguments, environment, working directories and timeouts (see `policy`)".into(),
        );
    }
    if let Some(n) = config.limits.max_concurrent_executions {
        caps.limitations.push(format!(
            "at most {n} commands run at once on this gateway; more are refused (retry later)"
        ));
    }
    if let Some(r) = &config.limits.rate_limit {
        caps.limitations.push(format!(
            "each client may start {} commands a minute (bursts of {})",
            r.per_minute, r.burst
        ));
    }
    if let Some(s) = runner.sessions() {
        let c = s.config();
        caps.limitations.push(format!(
            "a call may name a `session` to keep its runner (and build outputs) across calls: it ends after {} s idle or {} s in all; at most {} open sessions per caller (docs/sessions.md)",
            c.idle_ttl_secs, c.max_lifetime_secs, c.max_per_identity
        ));
    } else if !runner.executor().forwards_sessions() {
        caps.limitations
            .push("no sessions: every call runs in a fresh runner".into());
    }
    if !config.redaction.is_empty() {
        caps.limitations
            .push("configured secrets in the output are replaced by [REDACTED]".into());
    }
    caps
}

/// The MCP tool's output templates: the built-ins plus the configuration file's
/// `templates:` (an invalid one stops the start, naming the file and the template); with
/// `discover` (stdio), plus the nearest `.mcp-run/config.yaml` of the working directory.
pub(crate) fn template_store(
    config: &Config,
    discover: bool,
) -> anyhow::Result<Arc<crate::templates::TemplateStore>> {
    let path = config
        .source
        .clone()
        .unwrap_or_else(|| "configuration".into());
    let base = crate::templates::Catalog::with_templates(&path, config.templates.clone())?;
    Ok(Arc::new(crate::templates::TemplateStore::with_base(
        crate::templates::store::DEFAULT_TTL,
        base,
        discover,
    )))
}

/// The process's working directory, where `.mcp-run/config.yaml` is looked for.
fn working_dir() -> std::path::PathBuf {
    std::env::current_dir().unwrap_or_else(|_| "/".into())
}

fn run_stdio(args: StdioArgs) -> anyhow::Result<()> {
    let mut config = args.backend.load()?;
    if let Some(dir) = args.workspace {
        anyhow::ensure!(
            config.server.backend == BackendKind::Remote,
            "--workspace needs --backend remote (the local backend already runs in this machine's files)"
        );
        config.remote.workspace = Some(dir);
    }
    if let Some(name) = &args.session {
        crate::contract::check_session_name(name)
            .map_err(|e| anyhow::anyhow!("--session: {}", e.message))?;
    }
    block_on(stdio_with(config, args.session))
}

/// Serves MCP on stdin/stdout until the client closes stdin (or SIGTERM/SIGINT), with a
/// session for the calls that name none.
pub(crate) async fn stdio_with(config: Config, session: Option<String>) -> anyhow::Result<()> {
    use rmcp::ServiceExt as _;
    let Prepared {
        runner,
        templates,
        capabilities,
    } = prepare(&config, true, None, None).await?;
    let service = McpService::new(runner.clone(), capabilities, &config.mcp)
        .with_tools(Arc::new(config.tools.clone()))
        .with_templates(templates, working_dir())
        .with_default_session(session);
    let running = service
        .serve(rmcp::transport::stdio())
        .await
        .context("MCP initialization over stdio failed")?;
    tokio::select! {
        r = running.waiting() => { r.context("MCP over stdio")?; }
        _ = shutdown_signal() => {}
    }
    runner.shutdown(config.shutdown_grace()).await;
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
