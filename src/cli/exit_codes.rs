//! `run-remote`'s exit codes. A command that ran is mirrored: its exit code, 128 + N when
//! signal N killed it, 124 when the gateway's timeout killed it (as timeout(1) does).
//! run-remote's own failures use the sysexits(3) codes below, documented in
//! docs/protocol.md.

/// The gateway killed the command at its timeout (as `timeout(1)`).
pub const TIMED_OUT: i32 = 124;
/// Bad command line: unknown flag, missing `--`, no command.
pub const USAGE: i32 = 64;
/// The gateway rejected the request (an HTTP error before the stream began).
pub const REJECTED: i32 = 65;
/// The gateway cannot be reached.
pub const UNAVAILABLE: i32 = 69;
/// The run failed on the gateway after it began (an `error` event).
pub const REMOTE_ERROR: i32 = 70;
/// `--workspace`: the directory cannot be sent (unreadable file, a symlink that leaves it,
/// a name that is not UTF-8).
pub const WORKSPACE: i32 = 66;
/// `--sync-back`: a result could not be downloaded or written into the directory.
pub const SYNC_BACK: i32 = 73;
/// Writing the output failed for a reason other than a closed pipe.
pub const IO_ERROR: i32 = 74;
/// The gateway's answer broke the protocol, or the stream was cut.
pub const PROTOCOL: i32 = 76;
/// Configuration error: `RUN_REMOTE_SERVER` missing or not a URL, `--keep-env` variables
/// unset, an invalid template configuration.
pub const CONFIG: i32 = 78;
/// Our stdout or stderr was closed by the reader (as a process killed by SIGPIPE).
pub const BROKEN_PIPE: i32 = 141;
