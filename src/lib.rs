//! mcp-run: run commands in ephemeral Kubernetes pods (or local processes) and stream their
//! output back byte-exact, over a plain HTTP endpoint (`/raw`) and MCP.
//!
//! The shape (docs/architecture.md has the layer diagram): [`contract`] is the wire format
//! shared by server and clients; [`exec`] is the execution interface and its backends;
//! [`runner`] is the one entry point every front end uses; [`server`] and [`mcp`] are the
//! fronts; [`cli`] holds the logic of the binaries.
//!
//! Life of a `/raw` request: [`server::connections`] accepts → [`server::guard`] (Host, Origin, length) →
//! [`auth`] (token, [`caller::Caller`]) → `server::raw` parses a [`contract::RunRequest`] →
//! [`runner::Runner::start_with`] ([`policy`], [`rate_limit`], concurrency slot) →
//! [`exec::Executor::start`] on the backend → the [`exec::Execution`] wrapped with [`redact`],
//! [`audit`], the timeout and [`metrics`] → events written as NDJSON lines.
//!
//! Life of an MCP call: `/mcp` ([`server::mcp_http`] session caps) or `mcp-run stdio` →
//! [`mcp::McpService`] → `mcp::execute` (the same `Runner::start_with`, phases as progress,
//! one streaming [`templates`] filter, the full output kept in `mcp::store`) → `mcp::reply`
//! renders a [`result::StructuredResult`] within the character budget.

//!
//! The public surface is small on purpose: the wire [`contract`], the binaries' entry points,
//! and the handful of types integration tests and benches drive in-process (re-exported below).
//! Everything else is private to the crate, so the compiler reports what nothing uses.

pub mod contract;

mod audit;
mod auth;
mod caller;
mod capabilities;
mod cli;
mod config;
mod exec;
mod exit;
mod leftovers;
mod limits;
mod mcp;
mod metrics;
mod peers;
mod policy;
mod rate_limit;
mod redact;
mod result;
mod runner;
mod server;
mod session;
mod templates;
mod workspace;

// The binaries' entry points (src/bin/*.rs stay thin).
pub use cli::run_remote::main as run_remote_main;
pub use cli::serve::main as serve_main;

// What integration tests and benches drive in-process.
pub use cli::serve::{App, app};
pub use config::{BackendKind, Config};
pub use exec::kube::KubeExecutor;
pub use exec::kube::config::{KubernetesConfig, Profile};
pub use exec::kube::pod::label_value;
pub use exec::remote::RemoteExecutor;
pub use exec::{ExecSpec, Executor, Progress, StartOptions};
pub use metrics::Metrics;
pub use templates::filter::{Filtered, StreamFilter};
pub use templates::{Catalog, Template};
pub use workspace::hash_bytes;
