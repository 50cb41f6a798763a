//! Checks in front of every endpoint, before auth and before any body is read:
//! - `Host` (and `Origin` when a browser sends one) must name a host the gateway serves
//!   (`server.allowed_hosts`), so that a web page using DNS rebinding cannot reach a gateway
//!   on a workstation (403 `forbidden_host`);
//! - a declared `Content-Length` over `server.max_body_bytes` is refused at once (413),
//!   without waiting for the body.
//!
//! The probes and `/metrics` are exempt from the host check: the kubelet and Prometheus
//! address a pod by its IP, and those paths run nothing.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::contract::{ErrorBody, ErrorCode};

/// Paths answered whatever the `Host` header says.
const HOST_EXEMPT: &[&str] = &["/healthz", "/readyz", "/metrics"];

/// What the middleware checks.
#[derive(Debug, Clone)]
pub(crate) struct Guard {
    /// Lower-case host names without port; `None`: any host (`"*"` in the list).
    allowed: Option<Vec<String>>,
    max_body_bytes: usize,
    /// The longest pause while a request body arrives (not for `/raw` stdin streams).
    body_timeout: Option<std::time::Duration>,
    /// Where refusals are counted.
    metrics: Option<crate::metrics::Metrics>,
}

impl Guard {
    /// `allowed_hosts` as configured: names or addresses, `*` for any.
    pub(crate) fn new(allowed_hosts: &[String], max_body_bytes: usize) -> Self {
        let allowed = (!allowed_hosts.iter().any(|h| h == "*")).then(|| {
            allowed_hosts
                .iter()
                .map(|h| normalize_host(h.trim_start_matches('[').trim_end_matches(']')))
                .collect()
        });
        Self {
            allowed,
            max_body_bytes,
            body_timeout: None,
            metrics: None,
        }
    }

    /// Fails a request body that pauses longer than `timeout`.
    pub(crate) fn with_body_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.body_timeout = Some(timeout);
        self
    }

    /// Counts refusals in `metrics`.
    pub(crate) fn with_metrics(mut self, metrics: crate::metrics::Metrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    fn host_allowed(&self, host: &str) -> bool {
        match &self.allowed {
            None => true,
            Some(list) => list.iter().any(|h| *h == normalize_host(host)),
        }
    }

    /// Checks `Host` (or the request target's authority, HTTP/2) and `Origin`.
    pub(crate) fn check_host(
        &self,
        uri: &axum::http::Uri,
        headers: &HeaderMap,
    ) -> Result<(), ErrorBody> {
        if self.allowed.is_none() {
            return Ok(());
        }
        let authority = match headers.get(header::HOST) {
            Some(v) => v.to_str().ok().map(str::to_owned),
            None => uri.authority().map(|a| a.as_str().to_owned()),
        };
        let Some(authority) = authority else {
            return Err(forbidden("the request has no valid Host header"));
        };
        let host = host_of_authority(&authority);
        if !self.host_allowed(host) {
            return Err(forbidden(
                "the Host header names a host this gateway does not serve (server.allowed_hosts)",
            ));
        }
        if let Some(origin) = headers.get(header::ORIGIN) {
            let ok = origin
                .to_str()
                .ok()
                .and_then(|o| o.split_once("://"))
                .map(|(_, rest)| host_of_authority(rest.split('/').next().unwrap_or(rest)))
                .is_some_and(|h| self.host_allowed(h));
            if !ok {
                return Err(forbidden(
                    "the Origin header names a site this gateway does not serve (server.allowed_hosts)",
                ));
            }
        }
        Ok(())
    }

    /// Refuses a declared body larger than the limit before any of it is read. A body that
    /// carries stdin is exempt: its request line and its stdin have limits of their own,
    /// checked by `/raw` (`server.max_body_bytes`, `limits.max_stdin_bytes`).
    pub(crate) fn check_length(&self, headers: &HeaderMap) -> Result<(), ErrorBody> {
        if is_stdin(headers) {
            return Ok(());
        }
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        match declared {
            Some(n) if n > self.max_body_bytes as u64 => Err(ErrorBody::new(
                ErrorCode::PayloadTooLarge,
                format!(
                    "the request body is {n} bytes, over the server's limit of {} (server.max_body_bytes)",
                    self.max_body_bytes
                ),
            )),
            _ => Ok(()),
        }
    }
}

fn forbidden(message: &str) -> ErrorBody {
    ErrorBody::new(ErrorCode::ForbiddenHost, message)
}

/// `name`, `name:port`, `[v6]:port` or `v6` → the host part.
fn host_of_authority(authority: &str) -> &str {
    let authority = authority.rsplit('@').next().unwrap_or(authority);
    if let Some(rest) = authority.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match authority.rsplit_once(':') {
        // More than one colon without brackets: a bare IPv6 address.
        Some((host, _)) if !host.contains(':') => host,
        _ => authority,
    }
}

fn normalize_host(h: &str) -> String {
    h.trim_end_matches('.').to_ascii_lowercase()
}

/// The middleware (outermost layer): host check, then the declared length.
pub(crate) async fn middleware(
    State(guard): State<Arc<Guard>>,
    req: Request,
    next: Next,
) -> Response {
    // Replicas call each other by address, with the peer secret (no browser sends it).
    let exempt = HOST_EXEMPT.contains(&req.uri().path())
        || req.uri().path().starts_with(crate::peers::PATH_PREFIX);
    // A `/raw` stdin body is a stream as long as the command's input: its size and pauses are
    // the command's (limits.max_stdin_bytes, the run's timeout), not a request's.
    let stdin = is_stdin(req.headers());
    let checked = if exempt {
        Ok(())
    } else {
        guard.check_host(req.uri(), req.headers())
    }
    .and_then(|()| {
        // Workspace uploads have bounds of their own (the manifest's declared sizes,
        // workspaces.max_manifest_bytes), checked as they stream whether the body is sent
        // with a Content-Length or chunked.
        if req.uri().path().starts_with("/workspaces/") || req.uri().path() == "/workspaces" {
            Ok(())
        } else {
            guard.check_length(req.headers())
        }
    });
    if let Err(e) = checked {
        tracing::info!(path = %req.uri().path(), code = %e.code, "refused: {}", e.message);
        if let Some(m) = &guard.metrics {
            m.rejected(e.code);
        }
        return e.into_response();
    }
    let req = match guard.body_timeout {
        Some(t) if !stdin => {
            req.map(|b| axum::body::Body::new(tower_http::timeout::TimeoutBody::new(t, b)))
        }
        _ => req,
    };
    next.run(req).await
}

fn is_stdin(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|m| {
            m.trim()
                .eq_ignore_ascii_case(crate::contract::STDIN_CONTENT_TYPE)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LOOPBACK_HOSTS;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn hosts_and_origins() {
        let g = Guard::new(
            &LOOPBACK_HOSTS
                .iter()
                .map(|s| s.to_string())
                .chain(["[mcp-run.ns.svc]".into()])
                .collect::<Vec<_>>(),
            1024,
        );
        let uri = axum::http::Uri::from_static("/raw");
        for ok in [
            "localhost:8080",
            "LOCALHOST.",
            "127.0.0.1",
            "[::1]:80",
            "mcp-run.ns.svc:8080",
        ] {
            assert!(
                g.check_host(&uri, &headers(&[("host", ok)])).is_ok(),
                "{ok}"
            );
        }
        for bad in [
            "rebind.attacker.example",
            "127.0.0.2:80",
            "localhost.evil",
            "",
        ] {
            assert!(
                g.check_host(&uri, &headers(&[("host", bad)])).is_err(),
                "{bad}"
            );
        }
        assert!(g.check_host(&uri, &HeaderMap::new()).is_err());
        let origin =
            |o: &str| g.check_host(&uri, &headers(&[("host", "localhost"), ("origin", o)]));
        assert!(origin("http://localhost:3000").is_ok());
        assert!(origin("http://evil.example").is_err());
        assert!(origin("null").is_err());
        let any = Guard::new(&["*".into()], 1024);
        assert!(
            any.check_host(&uri, &headers(&[("host", "x.example")]))
                .is_ok()
        );
    }

    #[test]
    fn declared_length() {
        let g = Guard::new(&[], 1024);
        assert!(
            g.check_length(&headers(&[("content-length", "1024")]))
                .is_ok()
        );
        let e = g
            .check_length(&headers(&[("content-length", "1073741824")]))
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::PayloadTooLarge);
    }
}
