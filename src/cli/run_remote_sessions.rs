//! `run-remote sessions list [--json]` and `run-remote sessions end NAME`: the caller's
//! sessions on the gateway of `RUN_REMOTE_SERVER` (docs/sessions.md).

use std::io::Write;

use super::outcome::{self, Failure, Outcome};
use crate::exec::remote::RemoteExecutor;

const USAGE: &str = "usage: run-remote sessions list [--json] | run-remote sessions end NAME";

/// Runs `run-remote sessions ARGS...`.
pub(crate) fn main(args: &[String]) -> Outcome {
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    let job = match words.as_slice() {
        ["list"] => Job::List { json: false },
        ["list", "--json"] => Job::List { json: true },
        ["end", name] => Job::End(name.to_string()),
        ["-h" | "--help"] | [] => {
            println!("{USAGE}");
            return Outcome::Done;
        }
        _ => return Failure::usage(format!("unknown sessions command; {USAGE}")).into(),
    };
    let remote = match client() {
        Ok(r) => r,
        Err(f) => return f.into(),
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return Failure::output(format!("cannot start the runtime: {e}")).into(),
    };
    rt.block_on(run(remote, job))
}

enum Job {
    List { json: bool },
    End(String),
}

fn client() -> Result<RemoteExecutor, Failure> {
    let server = std::env::var("RUN_REMOTE_SERVER").map_err(|_| {
        Failure::config(
            "RUN_REMOTE_SERVER is not set: set it to the gateway's /raw URL, e.g. http://127.0.0.1:8080/raw",
        )
    })?;
    let token = std::env::var("RUN_REMOTE_TOKEN")
        .ok()
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty());
    RemoteExecutor::new(&server, token)
        .map_err(|e| Failure::config(format!("RUN_REMOTE_SERVER: {e}")))
}

async fn run(remote: RemoteExecutor, job: Job) -> Outcome {
    match job {
        Job::End(name) => match remote.end_session(&name).await {
            Ok(()) => Outcome::Done,
            Err(e) => Failure::gateway(&e).into(),
        },
        Job::List { json } => {
            let list = match remote.sessions().await {
                Ok(l) => l,
                Err(e) => return Failure::gateway(&e).into(),
            };
            let mut out = std::io::stdout().lock();
            let written = if json {
                serde_json::to_string_pretty(&list)
                    .map_err(std::io::Error::other)
                    .and_then(|s| writeln!(out, "{s}"))
            } else {
                table(&list, &mut out)
            };
            match written {
                Ok(()) => Outcome::Done,
                Err(e) => outcome::write_failed(&e, "the session list"),
            }
        }
    }
}

/// One line per session: name, profile, calls, age, idle, expiry, busy, where.
fn table(list: &crate::contract::SessionList, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<24} {:<12} {:>6} {:>8} {:>8} {:>10} {:<5} WHERE",
        "NAME", "PROFILE", "CALLS", "AGE", "IDLE", "EXPIRES IN", "BUSY"
    )?;
    for s in &list.sessions {
        let c = &s.context;
        let place = match (&c.pod, &c.host) {
            (Some(pod), _) => format!("{}/{}", c.namespace.as_deref().unwrap_or(""), pod),
            (None, Some(h)) => format!("{} {}", c.backend, h),
            _ => c.backend.clone(),
        };
        writeln!(
            out,
            "{:<24} {:<12} {:>6} {:>7}s {:>7}s {:>9}s {:<5} {}",
            s.name,
            s.profile,
            s.calls,
            s.age_secs,
            s.idle_secs,
            s.expires_in_secs,
            if s.busy { "yes" } else { "no" },
            place
        )?;
    }
    Ok(())
}
