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

pub mod audit;
pub mod auth;
pub mod caller;
pub mod capabilities;
pub mod cli;
pub mod config;
pub mod contract;
pub mod exec;
pub mod exit;
pub mod leftovers;
pub mod limits;
pub mod mcp;
pub mod metrics;
pub mod peers;
pub mod policy;
pub mod rate_limit;
pub mod redact;
pub mod result;
pub mod runner;
pub mod server;
pub mod session;
pub mod templates;
pub mod workspace;
