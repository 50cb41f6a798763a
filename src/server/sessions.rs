//! `GET /sessions` (the caller's open sessions) and `DELETE /sessions/{name}` (end one):
//! docs/sessions.md. Only the caller that opened a session sees or ends it.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::AppState;
use crate::auth::Caller;
use crate::contract::{ErrorBody, ErrorCode, SessionList};

fn off() -> Response {
    ErrorBody::new(
        ErrorCode::NotFound,
        "this gateway keeps no sessions (sessions.enabled is false, or its backend forwards them to another gateway)",
    )
    .into_response()
}

pub(super) async fn list(
    State(state): State<AppState>,
    caller: Option<axum::Extension<Caller>>,
) -> Response {
    let caller = caller.map(|c| c.0).unwrap_or_default();
    match state.runner.sessions() {
        Some(s) => match s.list(state.runner.executor().as_ref(), &caller).await {
            Ok(sessions) => Json(SessionList { sessions }).into_response(),
            Err(e) => e.into_response(),
        },
        None => off(),
    }
}

pub(super) async fn end(
    State(state): State<AppState>,
    caller: Option<axum::Extension<Caller>>,
    Path(name): Path<String>,
) -> Response {
    let caller = caller.map(|c| c.0).unwrap_or_default();
    let Some(sessions) = state.runner.sessions() else {
        return off();
    };
    if let Err(e) = crate::contract::check_session_name(&name) {
        return e.into_response();
    }
    match sessions
        .end(state.runner.executor().as_ref(), &caller, &name)
        .await
    {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}
