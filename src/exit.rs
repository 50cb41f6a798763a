//! The exit-status policy, in one place (docs/protocol.md, "Exit status"): how the end of a
//! run becomes one exit status. `run-remote` exits with it and the MCP tool reports it as
//! `exitCode`.
//!
//! A command that ran is mirrored as a shell reports it; everything else that can go wrong
//! in the client is one code, 125, as `docker run`, `timeout(1)` and `env(1)` do, so that a
//! script can tell "the command did not run" from the command's own codes. Which failure it
//! was is in the message (and in `--output-format json`), not in the number.

use crate::contract::ExitInfo;

/// The gateway's timeout killed the command (as `timeout(1)`).
pub(crate) const TIMED_OUT: i32 = 124;
/// The client failed: the command did not run, or how it ended is unknown (as `docker run`).
pub(crate) const CLIENT_ERROR: i32 = 125;
/// Our stdout was closed by its reader: 128 + SIGPIPE, as a shell reports a process that
/// SIGPIPE killed.
pub(crate) const BROKEN_PIPE: i32 = 141;
/// No exit status was reported at all (as a shell reports a status it cannot know).
pub(crate) const UNKNOWN: i32 = 255;

/// The status that mirrors how a command ended: its code, 128 + N when signal N killed it,
/// [`TIMED_OUT`] when the gateway's timeout did, [`UNKNOWN`] without an exit event.
pub(crate) fn status(exit: Option<&ExitInfo>) -> i32 {
    match exit {
        Some(e) if e.timed_out => TIMED_OUT,
        Some(e) => e.shell_status(),
        None => UNKNOWN,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mirrors_codes_signals_and_timeouts() {
        let exit = |code, signal, timed_out| ExitInfo {
            code,
            signal,
            timed_out,
            ..Default::default()
        };
        assert_eq!(status(Some(&exit(Some(3), None, false))), 3);
        assert_eq!(status(Some(&exit(None, Some(15), false))), 143);
        assert_eq!(status(Some(&exit(None, Some(9), true))), TIMED_OUT);
        assert_eq!(status(None), UNKNOWN);
    }
}
