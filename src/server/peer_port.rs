//! The peer channel on its own port (`server.peer_listen`): only `/peer/v1/` (the peer routes
//! and the users' requests other replicas forward to a caller's home) is served there, and
//! the gateway's own port refuses it. Replicas then reach each other on a port that a
//! NetworkPolicy can admit from the gateway's pods only, while users (and anything else that
//! reaches the user port, such as a runner pod allowed to call the gateway) never get to try
//! the peer secret.

use axum::Router;
use axum::extract::DefaultBodyLimit;

use super::AppState;
use crate::contract::{ErrorBody, ErrorCode};

/// The router of the peer port: `routes` (the `/peer/v1/` ones) behind the edge checks.
pub(crate) fn app(routes: Router<AppState>, state: AppState, max_body_bytes: usize) -> Router {
    Router::new()
        .merge(routes)
        .fallback(|| async {
            ErrorBody::new(
                ErrorCode::NotFound,
                "no such endpoint: the peer port serves the replicas' /peer/v1/ paths only",
            )
        })
        .layer(DefaultBodyLimit::max(max_body_bytes))
        // Forwarded `/raw` requests read their head within the same bound.
        .layer(axum::Extension(super::HeadLimit(max_body_bytes)))
        // Peer paths skip the user bearer gate (the routes check the peer secret); the gate
        // still records the caller's address.
        .layer(axum::middleware::from_fn_with_state(
            crate::auth::Gate {
                auth: state.auth.clone(),
                metrics: state.runner.metrics().clone(),
            },
            crate::auth::middleware,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.guard.clone(),
            crate::server::guard::middleware,
        ))
        .with_state(state)
}

/// What the gateway's own port answers on `/peer/` paths when the peer channel has its own.
pub(crate) fn refused_here() -> Router<AppState> {
    let refuse = || async {
        ErrorBody::new(
            ErrorCode::NotFound,
            "no such endpoint: the peer channel is served on the peer port (server.peer_listen), not on this one",
        )
    };
    Router::new()
        .route("/peer", axum::routing::any(refuse))
        .route("/peer/{*rest}", axum::routing::any(refuse))
}
