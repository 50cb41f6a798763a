//! Why a session call was refused or its session is gone: each variant says its wire code
//! once. The sessions keep the wire error of a session that ended (its tombstone, its end
//! reason) to answer the calls that come later, so the variants are turned into `ErrorBody`
//! where they are made.

use crate::contract::{ErrorBody, ErrorCode};

#[derive(Debug, thiserror::Error)]
pub(crate) enum SessionError {
    #[error("the gateway is shutting down")]
    ShuttingDown,
    /// `why`: which bound it reached.
    #[error("{0}; the next call with this name opens a new session")]
    Expired(String),
    /// Ended at a bound by another replica (`why`, as that replica wrote it).
    #[error("{0}")]
    ExpiredElsewhere(String),
    #[error(
        "session {name:?} runs profile {has:?}; this call names profile {asked:?} (end the session or use another name)"
    )]
    OtherProfile {
        name: String,
        has: String,
        asked: String,
    },
    #[error(
        "another call of session {0:?} is running (the request asked not to wait: session_busy is fail)"
    )]
    BusyFail(String),
    #[error(
        "another call of session {name:?} was still running after this call waited {secs} s (its timeout)"
    )]
    BusyTimeout { name: String, secs: u64 },
    #[error(
        "session {name:?} was lost: {reason}; the next call with this name opens a new session"
    )]
    Lost { name: String, reason: String },
    /// Ended by its owner through another replica.
    #[error("ended by its owner")]
    EndedElsewhere,
    #[error("session {0:?} was ended by its owner")]
    Ended(String),
    #[error("you have no open session {0:?}")]
    NoSuch(String),
    #[error(
        "you have {0} open sessions, the most this gateway allows per caller (sessions.max_per_identity); end one (run-remote sessions end NAME) or reuse a name"
    )]
    TooManyOfYours(usize),
    #[error("{0} sessions are open on this gateway, its maximum (sessions.max_total); retry later")]
    TooMany(usize),
    #[error("a new session is locked")]
    Locked,
}

impl From<SessionError> for ErrorBody {
    fn from(e: SessionError) -> Self {
        let code = match e {
            SessionError::ShuttingDown => ErrorCode::ShuttingDown,
            SessionError::Expired(_) | SessionError::ExpiredElsewhere(_) => {
                ErrorCode::SessionExpired
            }
            SessionError::OtherProfile { .. } => ErrorCode::InvalidRequest,
            SessionError::BusyFail(_) | SessionError::BusyTimeout { .. } => ErrorCode::SessionBusy,
            SessionError::Lost { .. } => ErrorCode::SessionLost,
            SessionError::EndedElsewhere | SessionError::Ended(_) | SessionError::NoSuch(_) => {
                ErrorCode::UnknownSession
            }
            SessionError::TooManyOfYours(_) | SessionError::TooMany(_) => {
                ErrorCode::TooManySessions
            }
            SessionError::Locked => ErrorCode::Internal,
        };
        ErrorBody::new(code, e.to_string())
    }
}
