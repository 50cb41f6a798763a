//! `run-remote [OPTIONS] -- <executable> [args...]`: runs a command on a gateway and
//! behaves like the command: its output on our stdout and stderr, its exit code ours.
//! `run-remote templates` lists the output templates (see [`super::run_remote_templates`]);
//! `run-remote completions SHELL` prints a completion script. How an invocation ends is an
//! [`Outcome`], reported in one place ([`outcome::report`]).
//!
//! Size: about 650 lines of code: the flags, the request they build, and the two ways the
//! answer is shown (streamed, or one structured result); stdin, progress lines, templates and
//! workspaces live in `run_remote_io`, `run_remote_templates` and `run_remote_workspace`.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::fd::AsFd;

use clap::Parser;
use tokio_util::sync::CancellationToken;

use super::outcome::{self, Failure, Outcome};
use super::run_remote_io as io;
use super::run_remote_templates::{self as tpl, TemplateSink};
use super::run_remote_workspace as ws;
use crate::contract::{ErrorBody, ErrorCode, Event, RunRequest};
use crate::exec::Execution;
use crate::exec::remote::RemoteExecutor;
use crate::result::StructuredResult;

/// The one-line synopsis, also the hint after a usage error.
pub(crate) const SYNOPSIS: &str = "run-remote [OPTIONS] -- COMMAND [ARGS...]";

/// The usage block of `--help`: the run, then the subcommands (parsed in [`parse`]).
const USAGE: &str = "run-remote [OPTIONS] -- COMMAND [ARGS...]
       run-remote templates [NAME]      (list the output templates, or show one)
       run-remote completions SHELL     (a completion script: bash, zsh or fish)";

const AFTER_HELP: &str = "\
Examples:
  export RUN_REMOTE_SERVER=http://127.0.0.1:8080/raw
  run-remote -- uname -a                     # everything after -- is the command, as argv
  run-remote -- sh -c 'make && make test'    # a shell only when you ask for one
  run-remote --keep-env RUST_LOG --timeout 600 -- cargo test
  run-remote --output-format json -- ls /    # one JSON result when the command ends
  run-remote --workspace -- cargo test       # this git tree's files on the runner (incremental)
  run-remote --workspace --sync-back 'out/**' -- make   # and the files it made under out/ back
  run-remote --session build --workspace -- cargo test   # a warm runner across calls
  run-remote sessions list                   # your open sessions; `sessions end NAME` ends one
  run-remote templates                       # the output templates available here
  run-remote completions bash > ~/.local/share/bash-completion/completions/run-remote

Environment:
  RUN_REMOTE_SERVER  the gateway's /raw URL, e.g. http://127.0.0.1:8080/raw (required unless --server)
  RUN_REMOTE_TOKEN   bearer token sent to the gateway, if it requires one
  RUN_REMOTE_SESSION the session to run in (as --session)

Exit status: the remote command's exit code; 128+N if signal N killed it; 124 if the gateway's
timeout killed it; 141 if our stdout was closed. 125 when run-remote itself failed (bad usage or
configuration, gateway unreachable, request rejected, the run failed on the gateway, an output
error): the command did not run or its end is unknown, and one line on stderr says why. A run
the gateway refused before it started for a reason that may heal (a replica that just died or
is draining, no connection, a proxy's 502/503/504) is sent up to 4 times (never with -i).

Templates: --template NAME prints the output filtered when the command ends (failures with
their locations, diagnostics, summary lines), and names the file that keeps the full output.
--template auto picks the template for the tool the command runs (cargo test, pytest, npx
eslint, go vet, make, mvn, ...) or, when the command says nothing (npm test, a script), by the
output, and the note names its pick. `run-remote templates` lists them.";

/// Run a command on an mcp-run gateway, streaming its output and mirroring its exit code.
///
/// Everything after `--` is the command and its arguments, sent as argv (never through a
/// shell). The current directory is sent as the command's working directory. No environment
/// variable is sent unless named with --keep-env.
#[derive(Debug, Parser)]
#[command(
    name = "run-remote",
    version,
    override_usage = USAGE,
    after_help = AFTER_HELP
)]
pub(crate) struct Args {
    /// Send our stdin to the command, byte for byte, its end as the command's end of input.
    /// Without it the command's stdin is empty.
    #[arg(short = 'i', long = "stdin", visible_alias = "interactive")]
    pub stdin: bool,
    /// Show on stderr the phases while the gateway prepares the command (shown anyway when
    /// stderr is a terminal) and where the command runs once it started.
    #[arg(short = 'v', long)]
    pub verbose: bool,
    /// Send this variable of the local environment with the command (repeatable). Fails
    /// before sending when any of them is unset.
    #[arg(long = "keep-env", value_name = "NAME")]
    pub keep_env: Vec<String>,
    /// Kill the command after this many seconds (the gateway bounds it).
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout: Option<u64>,
    /// The gateway's /raw URL; overrides RUN_REMOTE_SERVER.
    #[arg(long, value_name = "URL")]
    pub server: Option<String>,
    /// Filter the output with this template when the command ends (see `run-remote
    /// templates`; `auto` picks one by the command or the output, `raw` is none); the full
    /// output is saved to a file that the filtered output names.
    #[arg(long, value_name = "NAME")]
    pub template: Option<String>,
    /// Run the command in this directory (on the runner) instead of the current one.
    #[arg(long, value_name = "DIR", conflicts_with = "no_cwd")]
    pub cwd: Option<String>,
    /// Send no directory: the command runs where the runner starts commands (a pod's
    /// working directory).
    #[arg(long)]
    pub no_cwd: bool,
    /// Send DIR's files to the runner first: what git would consider part of the tree
    /// (.gitignore'd files and .git excluded). DIR defaults to the git work tree around the
    /// current directory, else the current directory; the command runs in the same
    /// directory relative to DIR. Only contents the gateway lacks are uploaded.
    /// `--workspace DIR` and `--workspace=DIR` both name DIR; a bare `--workspace` before
    /// `--` or another option means the default.
    #[arg(long, value_name = "DIR", num_args = 0..=1,
          default_missing_value = "", conflicts_with_all = ["cwd", "no_cwd"])]
    pub workspace: Option<String>,
    /// With --workspace: after the run, copy the files matching these globs (relative to
    /// DIR; `*` within a directory, `**` across) that the command created or changed back
    /// into DIR.
    #[arg(long = "sync-back", value_name = "GLOB", num_args = 1.., requires = "workspace")]
    pub sync_back: Vec<String>,
    /// The gateway's runner profile (a pod template on the Kubernetes backend).
    #[arg(long, value_name = "NAME")]
    pub profile: Option<String>,
    /// Names the project whose caches the run uses, for the profile's caches with
    /// `scope: workspace` (docs/caches.md) [default: the workspace].
    #[arg(long, value_name = "NAME", env = "RUN_REMOTE_CACHE_SCOPE")]
    pub cache_scope: Option<String>,
    /// Run in the runner of this session (opened by the first call with the name), so that
    /// what earlier calls wrote stays: build outputs, caches. Use one name per build loop;
    /// `run-remote sessions end NAME` ends it. Overrides RUN_REMOTE_SESSION.
    #[arg(long, value_name = "NAME")]
    pub session: Option<String>,
    /// With a session: when another call of it runs, `wait` for it (default) or `fail` at
    /// once (exit 125, session_busy).
    #[arg(long, value_name = "WHAT", value_parser = ["wait", "fail"])]
    pub session_busy: Option<String>,
    /// `stream`: the command's output as it arrives (default). `json` or `markdown`: the
    /// structured result (context, output, exit) after the command ends. The exit code is
    /// mirrored in every format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Stream)]
    pub output_format: OutputFormat,
    /// With `json` or `markdown`: the most output kept per stream (head and tail).
    #[arg(long, value_name = "BYTES", default_value_t = crate::result::DEFAULT_MAX_OUTPUT_BYTES)]
    pub max_output_bytes: usize,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum OutputFormat {
    Stream,
    Json,
    Markdown,
}

/// Runs the client and returns its exit status. Every path ends here, in [`outcome::report`]:
/// the one place that prints a failure and picks the status.
pub fn main() -> i32 {
    super::tune_allocator();
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let outcome = match parse(&argv) {
        Ok(Invocation::Run(args)) => run_blocking(*args),
        Ok(Invocation::Templates(rest)) => tpl::list(&rest),
        Ok(Invocation::Completions(rest)) => completions(&rest),
        Ok(Invocation::Sessions(rest)) => super::run_remote_sessions::main(&rest),
        Err(outcome) => outcome,
    };
    outcome::report(&outcome, &mut std::io::stderr())
}

/// What the command line asks for.
#[derive(Debug)]
pub(crate) enum Invocation {
    Run(Box<Args>),
    /// `run-remote templates ...`
    Templates(Vec<String>),
    /// `run-remote completions SHELL`
    Completions(Vec<String>),
    /// `run-remote sessions list|end NAME`
    Sessions(Vec<String>),
}

/// Parses the command line. `templates` and `completions` as the first argument are
/// subcommands; a command always follows `--`, so they cannot shadow a run. Help and version
/// are printed here (they are the output asked for).
pub(crate) fn parse(argv: &[std::ffi::OsString]) -> Result<Invocation, Outcome> {
    let first = argv.get(1).and_then(|a| a.to_str());
    let rest = || -> Vec<String> {
        argv.iter()
            .skip(2)
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    };
    match first {
        Some("templates") => return Ok(Invocation::Templates(rest())),
        Some("completions") => return Ok(Invocation::Completions(rest())),
        Some("sessions") => return Ok(Invocation::Sessions(rest())),
        _ => {}
    }
    match Args::try_parse_from(argv) {
        Ok(a) => Ok(Invocation::Run(Box::new(a))),
        Err(e) if !e.use_stderr() => Err(match e.print() {
            Ok(()) => Outcome::Done,
            Err(io) => outcome::write_failed(&io, "the help"),
        }),
        Err(e) => Err(Failure::usage(usage_message(&e)).into()),
    }
}

/// clap's error in one line, with the synopsis (a forgotten `--` is the usual mistake).
fn usage_message(e: &clap::Error) -> String {
    // clap's first line, with what a line ending in `:` introduces ("the following required
    // arguments were not provided:" and the list below it).
    let text = e.to_string();
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next().unwrap_or_default();
    let mut line = first.strip_prefix("error: ").unwrap_or(first).to_owned();
    if line.ends_with(':')
        && let Some(next) = lines.next()
    {
        line.push(' ');
        line.push_str(next);
    }
    format!("{line}; usage: {SYNOPSIS} (see run-remote --help)")
}

fn run_blocking(args: Args) -> Outcome {
    match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt.block_on(run(args)),
        Err(e) => Failure::output(format!("cannot start the runtime: {e}")).into(),
    }
}

/// `run-remote completions bash|zsh|fish|elvish|powershell`: the completion script on stdout.
fn completions(args: &[String]) -> Outcome {
    use clap::CommandFactory as _;
    let [shell] = args else {
        return Failure::usage(format!(
            "completions takes one shell name; usage: run-remote completions {}",
            super::SHELLS
        ))
        .into();
    };
    let Some(shell) = super::shell(shell) else {
        return Failure::usage(format!("unknown shell {shell:?}; one of {}", super::SHELLS)).into();
    };
    // The subcommands are parsed by hand (see `parse`); they are declared here for the script.
    let cmd = Args::command()
        .subcommand_negates_reqs(true)
        .subcommand(
            clap::Command::new("templates").about("List the output templates available here"),
        )
        .subcommand(
            clap::Command::new("sessions")
                .about("List (`list`) or end (`end NAME`) your sessions on the gateway"),
        )
        .subcommand(
            clap::Command::new("completions")
                .about("Print a shell completion script")
                .arg(
                    clap::Arg::new("shell").value_parser(clap::value_parser!(clap_complete::Shell)),
                ),
        );
    super::write_completions(shell, cmd)
}

/// Builds the request from the command line and the environment, checking everything that
/// can be checked before anything is sent.
pub(crate) fn build_request(
    args: &Args,
    env: impl Fn(&str) -> Option<String>,
    cwd: std::io::Result<std::path::PathBuf>,
) -> Result<(String, RunRequest), Failure> {
    let (server, source) = match (&args.server, env("RUN_REMOTE_SERVER")) {
        (Some(s), _) => (s.clone(), "--server"),
        (None, Some(s)) => (s, "RUN_REMOTE_SERVER"),
        (None, None) => {
            return Err(Failure::config(
                "RUN_REMOTE_SERVER is not set: set it (or --server) to the gateway's /raw URL, e.g. http://127.0.0.1:8080/raw",
            ));
        }
    };
    crate::exec::remote::parse_server_url(&server)
        .map_err(|e| Failure::config(format!("{source}: {e}")))?;
    let (executable, rest) = args
        .command
        .split_first()
        .ok_or_else(|| Failure::usage("no command given after `--`"))?;
    let mut env_out = BTreeMap::new();
    let mut missing = Vec::new();
    for name in &args.keep_env {
        if !crate::contract::is_valid_env_name(name) {
            return Err(Failure::usage(format!(
                "--keep-env {name:?} is not a valid variable name"
            )));
        }
        match env(name) {
            Some(v) => {
                env_out.insert(name.clone(), v);
            }
            None => missing.push(name.as_str()),
        }
    }
    if !missing.is_empty() {
        return Err(Failure::config(format!(
            "--keep-env names variables that are not set: {}",
            missing.join(", ")
        )));
    }
    let cwd = if args.no_cwd || args.workspace.is_some() {
        // With a workspace, the directory inside it is set once the workspace is resolved.
        None
    } else if let Some(dir) = &args.cwd {
        Some(dir.clone())
    } else {
        let cwd =
            cwd.map_err(|e| Failure::config(format!("cannot read the current directory: {e}")))?;
        Some(
            cwd.to_str()
                .ok_or_else(|| {
                    Failure::config(format!(
                        "the current directory {cwd:?} is not valid UTF-8 (use --cwd or --no-cwd)"
                    ))
                })?
                .to_owned(),
        )
    };
    let request = RunRequest {
        executable: executable.clone(),
        args: rest.to_vec(),
        cwd,
        env: env_out,
        timeout_secs: args.timeout,
        profile: args.profile.clone(),
        sync_back: args.sync_back.clone(),
        cache_scope: args.cache_scope.clone(),
        session: args
            .session
            .clone()
            .or_else(|| env("RUN_REMOTE_SESSION").filter(|s| !s.is_empty())),
        session_busy: match args.session_busy.as_deref() {
            Some("fail") => Some(crate::contract::SessionBusy::Fail),
            Some(_) => Some(crate::contract::SessionBusy::Wait),
            None => None,
        },
        ..RunRequest::default()
    };
    if let Some(name) = &request.session {
        crate::contract::check_session_name(name).map_err(|e| Failure::usage(e.message))?;
    } else if request.session_busy.is_some() {
        return Err(Failure::usage(
            "--session-busy needs --session (or RUN_REMOTE_SESSION)",
        ));
    }
    Ok((server, request))
}

/// Everything checked and resolved before the request is sent.
struct Prepared {
    server: String,
    request: RunRequest,
    template: Option<crate::templates::Template>,
    remote: RemoteExecutor,
}

/// Runs the command; data piped in without -i is not sent, and says so once, as early as it
/// can be seen (a pipe's writer may not have written yet at the start, so it is checked
/// again at the end).
async fn run(args: Args) -> Outcome {
    let forwarding = args.stdin;
    let hinted = !forwarding && io::stdin_has_data();
    if hinted {
        eprintln!("{}", io::STDIN_HINT);
    }
    let outcome = run_command(args).await;
    if !forwarding && !hinted && io::stdin_has_data() {
        eprintln!("{}", io::STDIN_HINT);
    }
    outcome
}

fn prepare(args: &Args) -> Result<Prepared, Failure> {
    let (server, request) =
        build_request(args, |k| std::env::var(k).ok(), std::env::current_dir())?;
    // `raw` asks for no template; `auto` picks by the command line (or by the output).
    let template = args
        .template
        .as_deref()
        .filter(|n| *n != crate::templates::RAW)
        .map(resolve_template)
        .transpose()?
        .map(|t| t.for_command(&request.executable, &request.args));
    // Trimmed: a token from a file or a Secret's key (`secretKeyRef`) ends with a newline,
    // which no header may carry; the gateway's tokens never hold whitespace.
    let token = std::env::var("RUN_REMOTE_TOKEN")
        .ok()
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty());
    let remote = RemoteExecutor::new(&server, token).map_err(|e| Failure::config(e.to_string()))?;
    Ok(Prepared {
        server,
        request,
        template,
        remote,
    })
}

async fn run_command(args: Args) -> Outcome {
    let mut prepared = match prepare(&args) {
        Ok(p) => p,
        Err(f) => return not_started(f, &args, None),
    };
    let workspace = match &args.workspace {
        None => None,
        Some(dir) => match start_workspace(&prepared.remote, dir, &mut prepared.request).await {
            Ok(w) => Some(w),
            Err(f) => return not_started(f, &args, Some(&prepared.request)),
        },
    };
    // In stream format the template's output goes through a sink that keeps the full output
    // in a file; in json and markdown it is applied to the result.
    let sink = match &prepared.template {
        Some(t) if args.output_format == OutputFormat::Stream => {
            match TemplateSink::create(t.clone(), &std::env::temp_dir()) {
                Ok(s) => Some(s),
                Err(f) => return not_started(f, &args, Some(&prepared.request)),
            }
        }
        _ => None,
    };
    let (progress, printer) = if io::show_progress(args.verbose) {
        let (progress, phases) = crate::exec::Progress::channel();
        (progress, Some(io::print_phases(phases)))
    } else {
        (crate::exec::Progress::default(), None)
    };
    let changes = ws::Changes::default();
    let mut started = start(&prepared, &args, progress).await;
    // The gateway's cache may have evicted contents between the upload and the run (or
    // another replica answered): sync once more and retry (not with stdin, which the first
    // attempt took).
    if let (Err(e), Some(w), false) = (&started, &workspace, args.stdin)
        && e.code == ErrorCode::WorkspaceIncomplete
    {
        if let Err(f) = ws::sync(&w.client, &w.resolved.root, false).await {
            return not_started(f, &args, Some(&prepared.request));
        }
        started = prepared
            .remote
            .run_with(&prepared.request, crate::exec::StartOptions::default())
            .await;
    }
    if let Some(printer) = printer {
        // Every phase is printed before what follows.
        let _ = printer.await;
    }
    if let (Ok(e), true) = (&started, args.verbose) {
        eprintln!("{}", io::started_line(e.context()));
    }
    let execution = match started {
        Ok(e) => e.filtered(ws::CaptureChanges(changes.clone())),
        Err(e) => {
            let f = rejection(&e, &prepared.server);
            return not_started(f, &args, Some(&prepared.request));
        }
    };
    let back = workspace
        .as_ref()
        .filter(|_| !args.sync_back.is_empty())
        .map(|w| (w, &changes));
    match args.output_format {
        OutputFormat::Stream => stream(execution, sink, back).await,
        format => {
            structured(
                execution,
                &prepared,
                &args,
                format,
                workspace.as_ref(),
                &changes,
            )
            .await
        }
    }
}

/// How many times a run that did not start is sent at most (`RETRY_BACKOFF`'s waits between).
const TRIES: usize = 4;
/// The longest wait before a retry, whatever the gateway's `Retry-After` says.
const MAX_RETRY_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Whether a run the gateway did not start may start if sent again: a replica that is
/// draining (`shutting_down`), and, when marked with a `Retry-After`, a caller's home replica
/// that just died (`backend_unavailable`), a connection that could not be made, a proxy's
/// 502/503/504 page (`RemoteExecutor` marks the last two). A `backend_unavailable` without
/// one (an unreachable API server, missing RBAC) comes after the gateway's own retries:
/// sending it again would only multiply the wait before the cause is reported.
fn retryable(e: &ErrorBody) -> bool {
    match e.code {
        ErrorCode::ShuttingDown => true,
        ErrorCode::BackendUnavailable
        | ErrorCode::GatewayUnreachable
        | ErrorCode::ProtocolError => e.retry_after_secs.is_some(),
        _ => false,
    }
}

/// Sends the run, again after a bounded backoff while it was refused for a reason that may
/// heal ([`retryable`]) before it started: nothing ran and nothing was printed. Never with
/// `--stdin` (the first try took what it read). The last try's error is the one reported.
async fn start(
    prepared: &Prepared,
    args: &Args,
    progress: crate::exec::Progress,
) -> Result<Execution, ErrorBody> {
    use backon::BackoffBuilder as _;
    let mut waits = backon::ExponentialBuilder::new()
        .with_min_delay(std::time::Duration::from_millis(500))
        .with_max_delay(std::time::Duration::from_secs(2))
        .with_factor(2.0)
        .with_jitter()
        .with_max_times(TRIES - 1)
        .build();
    let mut stdin = args.stdin.then(io::forward_stdin);
    let mut tries = 1;
    loop {
        let opts = crate::exec::StartOptions {
            cancel: CancellationToken::new(),
            progress: progress.clone(),
            stdin: stdin.take(),
        };
        let mut e = match prepared.remote.run_with(&prepared.request, opts).await {
            Ok(execution) => return Ok(execution),
            Err(e) => e,
        };
        let wait = waits.next().filter(|_| !args.stdin && retryable(&e));
        let Some(wait) = wait else {
            if tries > 1 {
                e.message = format!("{} (after {tries} tries)", e.message);
            }
            return Err(e);
        };
        let asked = std::time::Duration::from_secs(e.retry_after_secs.unwrap_or(0));
        let wait = wait.max(asked).min(MAX_RETRY_WAIT);
        if args.verbose {
            eprintln!(
                "run-remote: {}: {}; trying again in {:.1} s (try {} of {TRIES})",
                e.code,
                e.message,
                wait.as_secs_f64(),
                tries + 1
            );
        }
        tokio::time::sleep(wait).await;
        tries += 1;
    }
}

/// The gateway's refusal, with a hint when the URL is not its `/raw` endpoint.
fn rejection(e: &ErrorBody, server: &str) -> Failure {
    let mut f = Failure::gateway(e);
    if matches!(e.code, ErrorCode::NotFound | ErrorCode::MethodNotAllowed) {
        f.message.push_str(&format!(
            " at {server}: the URL must be the gateway's /raw endpoint, e.g. http://127.0.0.1:8080/raw"
        ));
    }
    f
}

/// A failure before the command ran; in json and markdown it is also the result printed.
fn not_started(f: Failure, args: &Args, request: Option<&RunRequest>) -> Outcome {
    if args.output_format == OutputFormat::Stream {
        return f.into();
    }
    let from_args;
    let request = match request {
        Some(r) => r,
        None => {
            let mut argv = args.command.iter().cloned();
            from_args = RunRequest {
                executable: argv.next().unwrap_or_default(),
                args: argv.collect(),
                ..Default::default()
            };
            &from_args
        }
    };
    let r = StructuredResult::did_not_run("run-remote", request, f.reason.as_str(), &f.message);
    match print_result(&r, args.output_format) {
        Ok(()) => f.into(),
        Err(e) => outcome::write_failed(&e, "the result"),
    }
}

/// Streams the output to our stdout and stderr as it arrives (or into the template's sink)
/// and mirrors the exit.
async fn stream(
    mut execution: Execution,
    mut sink: Option<TemplateSink>,
    sync_back: Option<(&WorkspaceRun, &ws::Changes)>,
) -> Outcome {
    // Unbuffered handles on our stdout and stderr: std's stdout is line-buffered, which
    // would copy and split binary output.
    let (mut stdout, mut stderr) = match (
        raw_handle(std::io::stdout().as_fd()),
        raw_handle(std::io::stderr().as_fd()),
    ) {
        (Ok(o), Ok(e)) => (o, e),
        (Err(e), _) | (_, Err(e)) => {
            return Failure::output(format!("cannot use stdout/stderr: {e}")).into();
        }
    };
    let end = loop {
        let Some(event) = execution.next().await else {
            break Err(Failure::gateway(&ErrorBody::new(
                ErrorCode::ProtocolError,
                "the stream ended before the command's exit was reported",
            )));
        };
        let written = match (&event, sink.as_mut()) {
            (Event::Stdout { data }, None) => stdout.write_all(data),
            (Event::Stderr { data }, None) => stderr.write_all(data),
            (Event::Stdout { data }, Some(s)) => s.stdout(data).map_err(raw_file_error),
            (Event::Stderr { data }, Some(s)) => s.stderr(data).map_err(raw_file_error),
            (Event::Exit(info), _) => {
                // Results come back before the status is mirrored.
                if let Some((w, changes)) = sync_back
                    && let Err(f) =
                        ws::sync_back(&w.client, &w.resolved.root, &w.globs, changes, false).await
                {
                    break Err(f);
                }
                break Ok(*info);
            }
            (Event::Error { code, message }, _) => {
                break Err(Failure::gateway(&ErrorBody::new(*code, message.clone())));
            }
            _ => Ok(()),
        };
        if let Err(e) = written {
            // Dropping the execution closes the connection; the gateway kills the command.
            return outcome::write_failed(&e, "the output");
        }
    };
    if let Some(s) = sink {
        let code = end.as_ref().ok().and_then(|info| info.code);
        if let Err(e) = s.finish(code, &mut stdout, &mut stderr) {
            return outcome::write_failed(&e, "the output");
        }
    }
    match end {
        Ok(info) => Outcome::Exited(info),
        Err(f) => f.into(),
    }
}

/// Collects the run and prints it as one result, then mirrors the exit.
async fn structured(
    execution: Execution,
    prepared: &Prepared,
    args: &Args,
    format: OutputFormat,
    workspace: Option<&WorkspaceRun>,
    changes: &ws::Changes,
) -> Outcome {
    // The template reads the whole output as it arrives, not the capped capture.
    let mut filters = prepared.template.as_ref().map(crate::result::Filters::new);
    let collected = crate::result::collect(execution, args.max_output_bytes.max(1024), |s, d| {
        if let Some(f) = filters.as_mut() {
            f.push(s, d);
        }
    })
    .await;
    let mut r = StructuredResult::from_run("run-remote", &prepared.request, &collected);
    if let Some(f) = filters {
        f.apply(&mut r, None);
    }
    let mut synced_back = None;
    if let Some(w) = workspace
        && !args.sync_back.is_empty()
        && collected.exit.is_some()
    {
        match ws::sync_back(&w.client, &w.resolved.root, &w.globs, changes, true).await {
            Ok(files) => synced_back = Some(files),
            Err(f) => return f.into(),
        }
    }
    let printed = match (workspace, format) {
        (Some(w), OutputFormat::Json) => print_json_with_workspace(&r, w, synced_back),
        _ => print_result(&r, format),
    };
    if let Err(e) = printed {
        return outcome::write_failed(&e, "the result");
    }
    match (collected.exit, &collected.error) {
        (Some(info), _) => Outcome::Exited(info),
        (None, Some(e)) => Failure::gateway(e).into(),
        (None, None) => Failure::gateway(&ErrorBody::new(
            ErrorCode::ProtocolError,
            "the stream ended before the command's exit was reported",
        ))
        .into(),
    }
}

/// A `--workspace` run: where the tree is, and what its sync did.
struct WorkspaceRun {
    client: crate::workspace::client::WorkspaceClient,
    resolved: ws::Resolved,
    synced: crate::workspace::client::Synced,
    /// The `--sync-back` globs: only results matching them are written.
    globs: Vec<String>,
}

/// Resolves and syncs the workspace, and points the request at it.
async fn start_workspace(
    remote: &RemoteExecutor,
    dir: &str,
    request: &mut RunRequest,
) -> Result<WorkspaceRun, Failure> {
    let resolved = ws::resolve(dir, std::env::current_dir())?;
    let client = remote.workspace_client();
    let synced = ws::sync(&client, &resolved.root, false).await?;
    request.workspace = Some(synced.workspace.clone());
    request.cwd = (!resolved.cwd.is_empty()).then(|| resolved.cwd.clone());
    Ok(WorkspaceRun {
        client,
        resolved,
        synced,
        globs: request.sync_back.clone(),
    })
}

/// The JSON result with a `workspace` object: the sync's figures and the files copied back.
fn print_json_with_workspace(
    r: &StructuredResult,
    w: &WorkspaceRun,
    synced_back: Option<Vec<crate::contract::ChangedFile>>,
) -> std::io::Result<()> {
    let mut value = serde_json::to_value(r).unwrap_or_default();
    let mut info = serde_json::to_value(&w.synced).unwrap_or_default();
    info["root"] = w.resolved.root.display().to_string().into();
    if let Some(files) = synced_back {
        info["synced_back"] = serde_json::to_value(files).unwrap_or_default();
    }
    value["workspace"] = info;
    let text = serde_json::to_string_pretty(&value).unwrap_or_default() + "\n";
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()
}

/// Resolves `--template` in the current directory.
fn resolve_template(name: &str) -> Result<crate::templates::Template, Failure> {
    let dir = std::env::current_dir()
        .map_err(|e| Failure::config(format!("cannot read the current directory: {e}")))?;
    tpl::resolve(name, &dir)
}

/// A failed write to the raw output file: not a closed pipe, whatever the OS says.
fn raw_file_error(e: std::io::Error) -> std::io::Error {
    std::io::Error::other(format!("the full-output file: {e}"))
}

/// Prints a structured result on stdout.
fn print_result(r: &StructuredResult, format: OutputFormat) -> std::io::Result<()> {
    let text = match format {
        OutputFormat::Json => r.to_json() + "\n",
        _ => r.to_markdown(),
    };
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()
}

/// A `File` on a duplicate of a standard stream's descriptor: writes go straight to it.
fn raw_handle(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<std::fs::File> {
    fd.try_clone_to_owned().map(std::fs::File::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::outcome::Reason;

    fn args(v: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("run-remote").chain(v.iter().copied()))
    }

    #[test]
    fn workspace_takes_its_directory_with_or_without_equals() {
        let dir = |v: &[&str]| args(v).unwrap().workspace;
        assert_eq!(
            dir(&["--workspace", ".", "--", "true"]).as_deref(),
            Some(".")
        );
        assert_eq!(
            dir(&["--workspace=sub", "--", "true"]).as_deref(),
            Some("sub")
        );
        assert_eq!(dir(&["--workspace", "--", "make"]).as_deref(), Some(""));
        let a = args(&["--workspace", "--sync-back", "out/*", "--", "make"]).unwrap();
        assert_eq!(a.workspace.as_deref(), Some(""));
        assert_eq!(a.sync_back, ["out/*"]);
    }

    #[test]
    fn double_dash_is_required() {
        assert!(args(&["ls"]).is_err());
        assert!(args(&[]).is_err());
        let a = args(&["--keep-env", "A", "--", "ls", "--keep-env", "-l"]).unwrap();
        assert_eq!(a.command, ["ls", "--keep-env", "-l"]);
        assert_eq!(a.keep_env, ["A"]);
    }

    #[test]
    fn missing_env_lists_every_name() {
        let a = args(&[
            "--keep-env",
            "A",
            "--keep-env",
            "B",
            "--keep-env",
            "C",
            "--",
            "true",
        ])
        .unwrap();
        let env = |k: &str| match k {
            "RUN_REMOTE_SERVER" => Some("http://127.0.0.1:1/raw".to_owned()),
            "B" => Some("b".to_owned()),
            _ => None,
        };
        let f = build_request(&a, env, Ok("/tmp".into())).unwrap_err();
        assert_eq!(f.reason, Reason::Config);
        assert!(f.message.contains("A, C"), "{}", f.message);
    }

    #[test]
    fn server_must_be_set_and_a_url_named_by_where_it_came_from() {
        let a = args(&["--", "true"]).unwrap();
        assert_eq!(
            build_request(&a, |_| None, Ok("/".into()))
                .unwrap_err()
                .reason,
            Reason::Config
        );
        let bad = |_: &str| Some("localhost:8080".to_owned());
        let f = build_request(&a, bad, Ok("/".into())).unwrap_err();
        assert_eq!(f.reason, Reason::Config);
        assert!(
            f.message.starts_with("RUN_REMOTE_SERVER: "),
            "{}",
            f.message
        );
        let a = args(&["--server", "localhost:8080", "--", "true"]).unwrap();
        let good = |_: &str| Some("http://127.0.0.1:1/raw".to_owned());
        let f = build_request(&a, good, Ok("/".into())).unwrap_err();
        assert!(f.message.starts_with("--server: "), "{}", f.message);
    }

    #[test]
    fn usage_errors_are_one_line_with_the_synopsis() {
        let argv = |v: &[&str]| -> Vec<std::ffi::OsString> {
            std::iter::once("run-remote")
                .chain(v.iter().copied())
                .map(Into::into)
                .collect()
        };
        let Err(Outcome::Failed(f)) = parse(&argv(&["echo", "hi"])) else {
            panic!("a command without -- is a usage error")
        };
        assert_eq!(f.reason, Reason::Usage);
        assert!(
            f.message.contains("'echo'")
                && f.message.contains(SYNOPSIS)
                && !f.message.contains('\n'),
            "{}",
            f.message
        );
        assert!(matches!(
            parse(&argv(&["templates"])),
            Ok(Invocation::Templates(v)) if v.is_empty()
        ));
        assert!(matches!(
            parse(&argv(&["completions", "zsh"])),
            Ok(Invocation::Completions(v)) if v == ["zsh"]
        ));
        assert!(matches!(
            parse(&argv(&["--", "templates"])),
            Ok(Invocation::Run(a)) if a.command == ["templates"]
        ));
    }

    #[test]
    fn a_url_that_is_not_raw_gets_a_hint() {
        let e = ErrorBody::new(ErrorCode::NotFound, "no such endpoint");
        let f = rejection(&e, "http://127.0.0.1:8080/");
        assert!(f.message.contains("/raw endpoint"), "{}", f.message);
        let e = ErrorBody::new(ErrorCode::PolicyViolation, "no");
        assert_eq!(rejection(&e, "http://h/raw").message, "no");
    }

    #[test]
    fn cwd_and_profile_flags() {
        let env = |k: &str| (k == "RUN_REMOTE_SERVER").then(|| "http://h:1/raw".to_string());
        let a = args(&["--cwd", "/workspace", "--profile", "build", "--", "ls"]).unwrap();
        let (_, r) = build_request(&a, env, Ok("/home/me".into())).unwrap();
        assert_eq!(
            (r.cwd.as_deref(), r.profile.as_deref()),
            (Some("/workspace"), Some("build"))
        );
        let a = args(&["--no-cwd", "--", "ls"]).unwrap();
        let (_, r) = build_request(&a, env, Err(std::io::Error::other("gone"))).unwrap();
        assert_eq!(r.cwd, None, "no directory read or sent");
        assert!(args(&["--no-cwd", "--cwd", "/x", "--", "ls"]).is_err());
    }

    #[test]
    fn only_refusals_that_may_heal_are_retried() {
        let e = |code| ErrorBody::new(code, "x");
        // A home replica that did not answer is marked with a Retry-After (sent as a header);
        // an unreachable API server or missing RBAC is not: the gateway already retried.
        assert!(retryable(&e(ErrorCode::BackendUnavailable).retry_after(1)));
        assert!(!retryable(&e(ErrorCode::BackendUnavailable)));
        assert!(retryable(&e(ErrorCode::ShuttingDown)));
        // A connection that could not be made, or a proxy's page: marked by RemoteExecutor.
        assert!(retryable(&e(ErrorCode::GatewayUnreachable).retry_after(1)));
        assert!(retryable(&e(ErrorCode::ProtocolError).retry_after(1)));
        // A request that may have been sent, a broken stream, or a refusal of the request.
        assert!(!retryable(&e(ErrorCode::GatewayUnreachable)));
        assert!(!retryable(&e(ErrorCode::ProtocolError)));
        for code in [
            ErrorCode::TooManyRequests,
            ErrorCode::PolicyViolation,
            ErrorCode::InvalidRequest,
            ErrorCode::StartFailed,
            ErrorCode::Unauthorized,
        ] {
            assert!(!retryable(&e(code).retry_after(1)), "{code}");
        }
    }

    #[test]
    fn request_carries_cwd_and_only_kept_env() {
        let a = args(&["--keep-env", "B", "--timeout", "5", "--", "echo", "a b"]).unwrap();
        let env = |k: &str| match k {
            "RUN_REMOTE_SERVER" => Some("http://127.0.0.1:1/raw".to_owned()),
            "B" => Some("b".to_owned()),
            "SECRET" => Some("s".to_owned()),
            _ => None,
        };
        let (_, r) = build_request(&a, env, Ok("/work".into())).unwrap();
        assert_eq!(r.cwd.as_deref(), Some("/work"));
        assert_eq!(r.env.len(), 1);
        assert_eq!(r.args, ["a b"]);
        assert_eq!(r.timeout_secs, Some(5));
    }
}

#[cfg(test)]
mod retry_header_tests {
    use crate::contract::{ErrorBody, ErrorCode};
    use axum::response::IntoResponse as _;

    /// What run-remote's retry reads: the gateway sends `Retry-After` with an error whose
    /// maker set one, and not with a plain `backend_unavailable`.
    #[test]
    fn a_marked_backend_unavailable_carries_retry_after() {
        let plain = ErrorBody::new(ErrorCode::BackendUnavailable, "API server not reachable");
        assert!(
            plain
                .clone()
                .into_response()
                .headers()
                .get("retry-after")
                .is_none()
        );
        let resp = plain.retry_after(1).into_response();
        assert_eq!(resp.headers()["retry-after"], "1");
    }
}
