//! How a `run-remote` invocation ends, and the one place that turns that into a line on
//! stderr and an exit status (as ripgrep's `main` does). The numbers are [`crate::exit`]'s.

use std::io::Write;

use crate::contract::{ErrorBody, ErrorCode, ExitInfo};

/// How an invocation ended.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// Something other than a run succeeded (a listing).
    Done,
    /// The remote command ended: its status is mirrored.
    Exited(ExitInfo),
    /// Our stdout or stderr was closed by its reader; the remote command is killed.
    BrokenPipe,
    /// run-remote itself failed.
    Failed(Failure),
}

/// A failure of run-remote itself: why, and the sentence a person reads.
#[derive(Debug)]
pub(crate) struct Failure {
    pub reason: Reason,
    pub message: String,
}

/// Why run-remote failed. Every reason exits [`crate::exit::CLIENT_ERROR`]; the reason is
/// in the message and in `--output-format json`'s `error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reason {
    /// A bad command line.
    Usage,
    /// A bad `--server`, unset `--keep-env` variables, an unknown template, ...
    Config,
    /// Writing our output (or the template's full-output file) failed.
    Output,
    /// `--workspace`: the directory cannot be sent (unreadable file, a symlink pointing
    /// outside it, a name that is not UTF-8).
    Workspace,
    /// `--sync-back`: a result could not be downloaded or written into the directory.
    SyncBack,
    /// The gateway refused the request, could not be reached, failed after the start, or
    /// broke the protocol: the contract's code.
    Gateway(ErrorCode),
}

impl Reason {
    /// The name in `--output-format json` (`code: message`) and after the message.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Reason::Usage => "usage_error",
            Reason::Config => "configuration_error",
            Reason::Output => "output_error",
            Reason::Workspace => "workspace_error",
            Reason::SyncBack => "sync_back_error",
            Reason::Gateway(c) => c.as_str(),
        }
    }
}

impl Failure {
    pub(crate) fn new(reason: Reason, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
        }
    }

    pub(crate) fn usage(message: impl Into<String>) -> Self {
        Self::new(Reason::Usage, message)
    }

    pub(crate) fn config(message: impl Into<String>) -> Self {
        Self::new(Reason::Config, message)
    }

    pub(crate) fn output(message: impl Into<String>) -> Self {
        Self::new(Reason::Output, message)
    }

    /// The gateway's (or the transport's) error.
    pub(crate) fn gateway(e: &ErrorBody) -> Self {
        Self::new(Reason::Gateway(e.code), e.message.clone())
    }
}

impl From<Failure> for Outcome {
    fn from(f: Failure) -> Self {
        Outcome::Failed(f)
    }
}

impl Outcome {
    /// The exit status.
    pub(crate) fn code(&self) -> i32 {
        match self {
            Outcome::Done => 0,
            Outcome::Exited(info) => crate::exit::status(Some(info)),
            Outcome::BrokenPipe => crate::exit::BROKEN_PIPE,
            Outcome::Failed(_) => crate::exit::CLIENT_ERROR,
        }
    }

    /// What a person reads about it on stderr: one line, or nothing when the command's own
    /// output and status say it all.
    pub(crate) fn message(&self) -> Option<String> {
        match self {
            Outcome::Failed(f) => Some(match f.reason {
                Reason::Gateway(c) => format!("run-remote: {} ({c})", f.message),
                _ => format!("run-remote: {}", f.message),
            }),
            Outcome::Exited(info) if info.timed_out => {
                Some("run-remote: the command timed out and was killed".into())
            }
            _ => None,
        }
    }
}

/// Prints the outcome's line on `stderr` (a closed stderr is ignored: the status still
/// says it) and returns the exit status.
pub(crate) fn report(outcome: &Outcome, stderr: &mut impl Write) -> i32 {
    if let Some(line) = outcome.message() {
        let _ = writeln!(stderr, "{line}");
    }
    outcome.code()
}

/// A write to our stdout or stderr failed: a closed pipe is [`Outcome::BrokenPipe`], anything
/// else an output failure.
pub(crate) fn write_failed(e: &std::io::Error, what: &str) -> Outcome {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        Outcome::BrokenPipe
    } else {
        Failure::output(format!("cannot write {what}: {e}")).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_client_failure_is_one_line_and_125() {
        let failures = [
            Failure::usage("no command"),
            Failure::config("RUN_REMOTE_SERVER is not set"),
            Failure::output("cannot write"),
            Failure::gateway(&ErrorBody::new(
                ErrorCode::GatewayUnreachable,
                "cannot reach",
            )),
            Failure::gateway(&ErrorBody::new(ErrorCode::ShuttingDown, "stopping")),
        ];
        for f in failures {
            let mut err = Vec::new();
            let code = report(&Outcome::Failed(f), &mut err);
            assert_eq!(code, crate::exit::CLIENT_ERROR);
            let err = String::from_utf8(err).unwrap();
            assert!(
                err.starts_with("run-remote: ") && err.lines().count() == 1,
                "{err}"
            );
        }
    }

    #[test]
    fn a_command_that_ran_is_mirrored_quietly() {
        let mut err = Vec::new();
        let exit = ExitInfo {
            code: Some(69),
            ..Default::default()
        };
        assert_eq!(report(&Outcome::Exited(exit), &mut err), 69);
        assert!(err.is_empty());
        let timed_out = ExitInfo {
            signal: Some(9),
            timed_out: true,
            ..Default::default()
        };
        assert_eq!(report(&Outcome::Exited(timed_out), &mut err), 124);
        assert!(String::from_utf8(err).unwrap().contains("timed out"));
        assert_eq!(report(&Outcome::BrokenPipe, &mut Vec::new()), 141);
        let closed = std::io::Error::from(std::io::ErrorKind::BrokenPipe);
        assert!(matches!(write_failed(&closed, "x"), Outcome::BrokenPipe));
    }

    #[test]
    fn reasons_are_named() {
        assert_eq!(Failure::config("x").reason.as_str(), "configuration_error");
        let f = Failure::gateway(&ErrorBody::new(ErrorCode::PolicyViolation, "no"));
        assert_eq!(f.reason.as_str(), "policy_violation");
    }
}
