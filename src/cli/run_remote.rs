//! `run-remote [OPTIONS] -- <executable> [args...]`: runs a command on a gateway and
//! behaves like the command: its output on our stdout and stderr, its exit code ours.
//! `run-remote templates` lists the output templates (see [`super::run_remote_templates`]).

use std::collections::BTreeMap;
use std::io::Write;
use std::os::fd::AsFd;

use clap::Parser;
use tokio_util::sync::CancellationToken;

use super::exit_codes as code;
use super::run_remote_templates::{self as tpl, TemplateSink};
use crate::contract::{ErrorCode, Event, ExitInfo, RunRequest};
use crate::exec::remote::RemoteExecutor;

const AFTER_HELP: &str = "\
Environment:
  RUN_REMOTE_SERVER  the gateway's /raw URL, e.g. http://127.0.0.1:8080/raw (required unless --server)
  RUN_REMOTE_TOKEN   bearer token sent to the gateway, if it requires one

Exit status: the remote command's exit code; 128+N if signal N killed it; 124 if the gateway's
timeout killed it. run-remote's own failures: 64 usage, 65 rejected by the gateway, 69 gateway
unreachable, 70 failure on the gateway after the start, 74 output error, 76 protocol error,
78 configuration error (also: an unknown template, an invalid .mcp-run/config.yaml).

Templates: --template NAME prints the output filtered when the command ends (errors and
summary), and names the file that keeps the full output. `run-remote templates` lists them.";

/// Run a command on an mcp-run gateway, streaming its output and mirroring its exit code.
///
/// The current directory is sent as the command's working directory. No environment
/// variable is sent unless named with --keep-env.
#[derive(Debug, Parser)]
#[command(name = "run-remote", version, about, after_help = AFTER_HELP)]
pub struct Args {
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
    /// templates`); the full output is saved to a file that the filtered output names.
    #[arg(long, value_name = "NAME")]
    pub template: Option<String>,
    /// Run the command in this directory (on the runner) instead of the current one.
    #[arg(long, value_name = "DIR", conflicts_with = "no_cwd")]
    pub cwd: Option<String>,
    /// Send no directory: the command runs where the runner starts commands (a pod's
    /// working directory).
    #[arg(long)]
    pub no_cwd: bool,
    /// The gateway's runner profile (a pod template on the Kubernetes backend).
    #[arg(long, value_name = "NAME")]
    pub profile: Option<String>,
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
pub enum OutputFormat {
    Stream,
    Json,
    Markdown,
}

/// Runs the client and returns its exit code.
pub fn main() -> i32 {
    // `templates` as the first argument is the listing; a command always follows `--`, so
    // this cannot shadow a run.
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.first().map(String::as_str) == Some("templates") {
        return tpl::list_main(&argv[1..]);
    }
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { code::USAGE } else { 0 };
        }
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("run-remote: cannot start the runtime: {e}");
            return code::IO_ERROR;
        }
    };
    rt.block_on(run(args))
}

/// A failure of run-remote itself: the message and the exit code.
#[derive(Debug)]
pub struct Failure {
    pub code: i32,
    pub message: String,
}

fn fail(code: i32, message: impl Into<String>) -> Failure {
    Failure {
        code,
        message: message.into(),
    }
}

/// Builds the request from the command line and the environment, checking everything that
/// can be checked before anything is sent.
pub fn build_request(
    args: &Args,
    env: impl Fn(&str) -> Option<String>,
    cwd: std::io::Result<std::path::PathBuf>,
) -> Result<(String, RunRequest), Failure> {
    let server = args.server.clone().or_else(|| env("RUN_REMOTE_SERVER")).ok_or_else(|| {
        fail(
            code::CONFIG,
            "RUN_REMOTE_SERVER is not set: set it to the gateway's /raw URL, e.g. http://127.0.0.1:8080/raw",
        )
    })?;
    crate::exec::remote::parse_server_url(&server)
        .map_err(|e| fail(code::CONFIG, format!("RUN_REMOTE_SERVER: {e}")))?;
    let (executable, rest) = args
        .command
        .split_first()
        .ok_or_else(|| fail(code::USAGE, "no command given after `--`"))?;
    let mut env_out = BTreeMap::new();
    let mut missing = Vec::new();
    for name in &args.keep_env {
        if !crate::contract::is_valid_env_name(name) {
            return Err(fail(
                code::USAGE,
                format!("--keep-env {name:?} is not a valid variable name"),
            ));
        }
        match env(name) {
            Some(v) => {
                env_out.insert(name.clone(), v);
            }
            None => missing.push(name.as_str()),
        }
    }
    if !missing.is_empty() {
        return Err(fail(
            code::CONFIG,
            format!(
                "--keep-env names variables that are not set: {}",
                missing.join(", ")
            ),
        ));
    }
    let cwd = if args.no_cwd {
        None
    } else if let Some(dir) = &args.cwd {
        Some(dir.clone())
    } else {
        let cwd = cwd.map_err(|e| {
            fail(
                code::CONFIG,
                format!("cannot read the current directory: {e}"),
            )
        })?;
        Some(
            cwd.to_str()
                .ok_or_else(|| {
                    fail(
                        code::CONFIG,
                        format!("the current directory {cwd:?} is not valid UTF-8"),
                    )
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
    };
    Ok((server, request))
}

/// The exit code that mirrors how the remote command ended.
pub fn mirror_exit(info: &ExitInfo) -> i32 {
    if info.timed_out {
        code::TIMED_OUT
    } else {
        info.shell_status()
    }
}

/// The exit code for a rejection before the stream began.
pub fn rejection_code(c: ErrorCode) -> i32 {
    match c {
        ErrorCode::GatewayUnreachable => code::UNAVAILABLE,
        ErrorCode::ProtocolError => code::PROTOCOL,
        _ => code::REJECTED,
    }
}

async fn run(args: Args) -> i32 {
    let (server, request) =
        match build_request(&args, |k| std::env::var(k).ok(), std::env::current_dir()) {
            Ok(r) => r,
            Err(f) => {
                eprintln!("run-remote: {}", f.message);
                return f.code;
            }
        };
    // The template is resolved before anything is sent; in stream format its output goes
    // through a sink that keeps the full output in a file.
    let structured = args.output_format != OutputFormat::Stream;
    let template = match args.template.as_deref().map(resolve_template) {
        None => None,
        Some(Ok(t)) => Some(t),
        Some(Err(f)) => {
            eprintln!("run-remote: {}", f.message);
            return f.code;
        }
    };
    let mut sink = match template.clone().filter(|_| !structured) {
        None => None,
        Some(t) => match TemplateSink::create(t, &std::env::temp_dir()) {
            Ok(s) => Some(s),
            Err(f) => {
                eprintln!("run-remote: {}", f.message);
                return f.code;
            }
        },
    };
    let token = std::env::var("RUN_REMOTE_TOKEN")
        .ok()
        .filter(|t| !t.is_empty());
    let remote = match RemoteExecutor::new(&server, token) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("run-remote: {e}");
            return code::CONFIG;
        }
    };
    let mut execution = match remote.run(&request, CancellationToken::new()).await {
        Ok(e) => e,
        Err(e) => {
            if args.output_format != OutputFormat::Stream {
                let r = crate::result::StructuredResult::not_started("run-remote", &request, &e);
                print_result(&r, args.output_format);
            }
            eprintln!("run-remote: {} ({})", e.message, e.code);
            return rejection_code(e.code);
        }
    };
    if args.output_format != OutputFormat::Stream {
        // The template reads the whole output as it arrives, not the capped capture.
        let mut filters = template.as_ref().map(crate::result::Filters::new);
        let collected =
            crate::result::collect(execution, args.max_output_bytes.max(1024), |s, d| {
                if let Some(f) = filters.as_mut() {
                    f.push(s, d);
                }
            })
            .await;
        let mut r = crate::result::StructuredResult::from_run("run-remote", &request, &collected);
        if let Some(f) = filters {
            f.apply(&mut r, None);
        }
        if !print_result(&r, args.output_format) {
            return code::IO_ERROR;
        }
        return match (&collected.exit, &collected.error) {
            (Some(info), _) => mirror_exit(info),
            (None, Some(e)) if e.code == ErrorCode::ProtocolError => code::PROTOCOL,
            (None, Some(_)) => code::REMOTE_ERROR,
            (None, None) => code::PROTOCOL,
        };
    }
    // Unbuffered handles on our stdout and stderr: std's stdout is line-buffered, which
    // would copy and split binary output.
    let (mut stdout, mut stderr) = match (
        raw_handle(std::io::stdout().as_fd()),
        raw_handle(std::io::stderr().as_fd()),
    ) {
        (Ok(o), Ok(e)) => (o, e),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("run-remote: cannot use stdout/stderr: {e}");
            return code::IO_ERROR;
        }
    };
    while let Some(event) = execution.next().await {
        let written = match (&event, sink.as_mut()) {
            (Event::Stdout { data }, None) => stdout.write_all(data),
            (Event::Stderr { data }, None) => stderr.write_all(data),
            (Event::Stdout { data }, Some(s)) => s.stdout(data).map_err(raw_file_error),
            (Event::Stderr { data }, Some(s)) => s.stderr(data).map_err(raw_file_error),
            (Event::Exit(info), _) => {
                if let Some(s) = sink.take()
                    && let Some(c) = finish(s, info.code, &mut stdout, &mut stderr)
                {
                    return c;
                }
                if info.timed_out {
                    eprintln!("run-remote: the command timed out and was killed");
                }
                return mirror_exit(info);
            }
            (Event::Error { code: c, message }, _) => {
                if let Some(s) = sink.take()
                    && let Some(c) = finish(s, None, &mut stdout, &mut stderr)
                {
                    return c;
                }
                eprintln!("run-remote: {message} ({c})");
                return if *c == ErrorCode::ProtocolError {
                    code::PROTOCOL
                } else {
                    code::REMOTE_ERROR
                };
            }
            _ => Ok(()),
        };
        if let Err(e) = written {
            // Dropping the execution closes the connection; the gateway kills the command.
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                return code::BROKEN_PIPE;
            }
            let _ = writeln!(stderr, "run-remote: cannot write the output: {e}");
            return code::IO_ERROR;
        }
    }
    if let Some(s) = sink.take()
        && let Some(c) = finish(s, None, &mut stdout, &mut stderr)
    {
        return c;
    }
    code::PROTOCOL
}

/// Resolves `--template` in the current directory.
fn resolve_template(name: &str) -> Result<crate::templates::Template, Failure> {
    let dir = std::env::current_dir().map_err(|e| {
        fail(
            code::CONFIG,
            format!("cannot read the current directory: {e}"),
        )
    })?;
    tpl::resolve(name, &dir)
}

/// A failed write to the raw output file: not a closed pipe, whatever the OS says.
fn raw_file_error(e: std::io::Error) -> std::io::Error {
    std::io::Error::other(format!("the full-output file: {e}"))
}

/// Prints the filtered output; `Some(code)` when that failed.
fn finish(
    sink: TemplateSink,
    exit_code: Option<i32>,
    stdout: &mut std::fs::File,
    stderr: &mut std::fs::File,
) -> Option<i32> {
    match sink.finish(exit_code, stdout, stderr) {
        Ok(()) => None,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Some(code::BROKEN_PIPE),
        Err(e) => {
            let _ = writeln!(stderr, "run-remote: cannot write the output: {e}");
            Some(code::IO_ERROR)
        }
    }
}

/// Prints a structured result on stdout; false when stdout is gone.
fn print_result(r: &crate::result::StructuredResult, format: OutputFormat) -> bool {
    let text = match format {
        OutputFormat::Json => r.to_json() + "\n",
        _ => r.to_markdown(),
    };
    std::io::stdout()
        .write_all(text.as_bytes())
        .and_then(|()| std::io::stdout().flush())
        .is_ok()
}

/// A `File` on a duplicate of a standard stream's descriptor: writes go straight to it.
fn raw_handle(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<std::fs::File> {
    fd.try_clone_to_owned().map(std::fs::File::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("run-remote").chain(v.iter().copied()))
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
        assert_eq!(f.code, code::CONFIG);
        assert!(f.message.contains("A, C"), "{}", f.message);
    }

    #[test]
    fn server_must_be_set_and_a_url() {
        let a = args(&["--", "true"]).unwrap();
        assert_eq!(
            build_request(&a, |_| None, Ok("/".into()))
                .unwrap_err()
                .code,
            code::CONFIG
        );
        let bad = |_: &str| Some("localhost:8080".to_owned());
        assert_eq!(
            build_request(&a, bad, Ok("/".into())).unwrap_err().code,
            code::CONFIG
        );
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

    #[test]
    fn exit_mirroring() {
        assert_eq!(
            mirror_exit(&ExitInfo {
                code: Some(3),
                ..Default::default()
            }),
            3
        );
        assert_eq!(
            mirror_exit(&ExitInfo {
                code: None,
                signal: Some(15),
                ..Default::default()
            }),
            143
        );
        assert_eq!(
            mirror_exit(&ExitInfo {
                code: None,
                signal: Some(9),
                timed_out: true,
                ..Default::default()
            }),
            code::TIMED_OUT
        );
    }
}
