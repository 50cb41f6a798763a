//! mcp-run: run commands in ephemeral Kubernetes pods (or local processes) and stream their
//! output back byte-exact, over a plain HTTP endpoint (`/raw`) and MCP.
//!
//! The shape: [`contract`] is the wire format shared by server and clients; [`exec`] is the
//! execution interface and its backends; [`runner`] is the one entry point every front end
//! uses; [`server`] is the HTTP gateway; [`cli`] holds the logic of the binaries.

pub mod audit;
pub mod auth;
pub mod capabilities;
pub mod cli;
pub mod config;
pub mod connections;
pub mod contract;
pub mod exec;
pub mod exit;
pub mod guard;
pub mod limits;
pub mod mcp;
pub mod mcp_http;
pub mod metrics;
pub mod policy;
pub mod rate_limit;
pub mod redact;
pub mod result;
pub mod runner;
pub mod server;
pub mod templates;
pub mod workspace;
