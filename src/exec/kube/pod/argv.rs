//! What is exec'd in the runner pod: the command itself, or a constant wrapper script that
//! first reads the request's `cwd` and `env` from a header on the exec's stdin.
//!
//! Why stdin: the exec request's URL carries the argv (`command=` parameters), and the API
//! server's audit log records that URL; the argv of the processes in the container is
//! visible to anything that can list them. `cwd` and `env` (which may hold secrets passed
//! with `--keep-env`) travel in neither: only the command and its arguments do.
//!
//! The header, written before the user's own stdin bytes (docs/kubernetes.md):
//!
//! ```text
//! mcp-run/1
//! c<cwd>            (when a working directory is asked for)
//! e<NAME=VALUE>     (one line per variable)
//! n                 (when the command gets no stdin: the wrapper reads /dev/null instead)
//! .
//! ```
//!
//! Values are encoded so that every line is one line: bytes outside printable ASCII, and
//! `\`, become `\0ooo` octal escapes, which the POSIX `printf %b` decodes. `read -r` reads
//! the header line by line without consuming the stdin that follows (shells read a pipe one
//! byte at a time for `read`).

use std::collections::BTreeMap;

/// The first line of the header: names the format, so that a wrapper and a gateway of
/// different versions fail clearly rather than misread each other.
pub(crate) const HEADER_MAGIC: &str = "mcp-run/1";

/// The script that applies `cwd` and `env` in the container without any shell parsing of
/// the request: it is a constant, the argv is its positional parameters (`sh -c SCRIPT
/// mcp-run EXE ARGS...`), and the rest comes from the header on stdin. Failures are reported
/// exactly as the local backend reports them (exit 125, 126, 127).
pub(crate) const WRAPPER: &str = r#"IFS= read -r __mr_l || { echo 'mcp-run: no exec header on stdin' >&2; exit 125; }
[ "$__mr_l" = mcp-run/1 ] || { echo 'mcp-run: unknown exec header' >&2; exit 125; }
__mr_d=; __mr_s=1
while IFS= read -r __mr_l; do
  case $__mr_l in
    .) break ;;
    c*) __mr_d=$(printf '%bx' "${__mr_l#c}"); __mr_d=${__mr_d%x} ;;
    e*) __mr_v=$(printf '%bx' "${__mr_l#e}"); export "${__mr_v%x}" || exit 125 ;;
    n) __mr_s=0 ;;
  esac
done
[ "$__mr_s" = 1 ] || exec </dev/null
if [ -n "$__mr_d" ] && ! cd -- "$__mr_d" 2>/dev/null; then
  if [ ! -e "$__mr_d" ]; then __mr_r='no such file or directory'
  elif [ ! -d "$__mr_d" ]; then __mr_r='not a directory'
  else __mr_r='permission denied'; fi
  printf 'mcp-run: cannot change directory to "%s": %s\n' "$__mr_d" "$__mr_r" >&2; exit 125
fi
unset __mr_l __mr_d __mr_s __mr_v __mr_r
case $1 in
  */*) if [ ! -e "$1" ]; then printf 'mcp-run: %s: command not found\n' "$1" >&2; exit 127
       elif [ -d "$1" ]; then printf 'mcp-run: %s: is a directory\n' "$1" >&2; exit 126
       elif [ ! -x "$1" ]; then printf 'mcp-run: %s: permission denied\n' "$1" >&2; exit 126; fi ;;
  *) if ! command -v -- "$1" >/dev/null 2>&1; then
       printf 'mcp-run: %s: command not found\n' "$1" >&2; exit 127; fi ;;
esac
exec "$@"
"#;

/// How a command is exec'd: the argv, and the header its stdin starts with (if any).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ExecCommand {
    pub argv: Vec<String>,
    /// The wrapper's header, sent on stdin before the user's input.
    pub header: Option<Vec<u8>>,
}

impl ExecCommand {
    /// Whether the exec needs a stdin stream at all.
    pub(crate) fn wants_stdin(&self, user_stdin: bool) -> bool {
        self.header.is_some() || user_stdin
    }
}

/// The command exec'd in the runner container: the command itself when it needs neither a
/// working directory nor variables (then the image needs no shell), else the wrapper with
/// its header. `user_stdin`: whether the caller sends input after the header.
pub(crate) fn exec_command(
    shell: &str,
    executable: &str,
    args: &[String],
    cwd: Option<&str>,
    env: &BTreeMap<String, String>,
    user_stdin: bool,
) -> ExecCommand {
    if cwd.is_none() && env.is_empty() {
        let mut argv = Vec::with_capacity(args.len() + 1);
        argv.push(executable.to_string());
        argv.extend(args.iter().cloned());
        return ExecCommand { argv, header: None };
    }
    let mut argv = vec![
        shell.to_string(),
        "-c".into(),
        WRAPPER.into(),
        "mcp-run".into(),
        executable.to_string(),
    ];
    argv.extend(args.iter().cloned());
    ExecCommand {
        argv,
        header: Some(header(cwd, env, user_stdin)),
    }
}

/// The first argument of a kept runner's call (its `$0`): `mcp-run-call=ID`, by which the
/// kill of that call finds the call's wrapper among the pod's processes (see [`KILL_CALL`]).
pub(crate) fn call_tag(id: &str) -> String {
    format!("mcp-run-call={id}")
}

/// The command of one call in a kept runner (a session's pod): always the wrapper, with the
/// call's tag as `$0`, and the wrapper stays the command's parent (it runs the command
/// instead of `exec`ing it, then exits with its status: a command killed by signal N ends
/// with 128+N, as the runtime reports it). So [`KILL_CALL`] can find the call's processes
/// and kill them without touching the pod or the session's other state.
pub(crate) fn kept_exec_command(
    shell: &str,
    call: &str,
    executable: &str,
    args: &[String],
    cwd: Option<&str>,
    env: &BTreeMap<String, String>,
    user_stdin: bool,
) -> ExecCommand {
    let script = WRAPPER
        .strip_suffix("exec \"$@\"\n")
        .expect("the wrapper ends with exec");
    let mut argv = vec![
        shell.to_string(),
        "-c".into(),
        // The last command a builtin: shells that exec a `-c` string's last simple command
        // (bash 5.1+) must not replace the wrapper.
        format!("{script}\"$@\"\n__mr_x=$?\nexit $__mr_x\n"),
        call_tag(call),
        executable.to_string(),
    ];
    argv.extend(args.iter().cloned());
    ExecCommand {
        argv,
        header: Some(header(cwd, env, user_stdin)),
    }
}

/// Kills one call of a kept runner and everything it started (`sh -c KILL_CALL mcp-run-kill
/// ID`): finds the wrapper whose argv carries `mcp-run-call=ID`, then, generation by
/// generation, stops the processes (so they cannot fork meanwhile), collects their children
/// (by the parent pid in `/proc/PID/stat`) and kills them. Needs only a POSIX shell, `cat`
/// and `/proc`: no pid file, so it works with a read-only root filesystem. The pod, and
/// whatever else runs in it, stays.
pub(crate) const KILL_CALL: &str = r#"id=$1; me=$$; pids=
for d in /proc/[0-9]*; do
  p=${d#/proc/}; [ "$p" = "$me" ] && continue
  { c=$(cat "$d/cmdline"); } 2>/dev/null || continue
  case $c in *"mcp-run-call=$id"*) pids="$pids $p" ;; esac
done
while [ -n "$pids" ]; do
  kill -STOP $pids 2>/dev/null
  next=
  for d in /proc/[0-9]*; do
    { read -r l < "$d/stat"; } 2>/dev/null || continue
    l=${l##*) }; set -- $l
    for q in $pids; do [ "$2" = "$q" ] && next="$next ${d#/proc/}"; done
  done
  kill -KILL $pids 2>/dev/null
  pids=$next
done
exit 0
"#;

/// The header the wrapper reads (see the module docs).
pub(crate) fn header(
    cwd: Option<&str>,
    env: &BTreeMap<String, String>,
    user_stdin: bool,
) -> Vec<u8> {
    let mut h = Vec::with_capacity(64);
    h.extend_from_slice(HEADER_MAGIC.as_bytes());
    h.push(b'\n');
    if let Some(d) = cwd {
        h.push(b'c');
        encode(d.as_bytes(), &mut h);
        h.push(b'\n');
    }
    for (k, v) in env {
        h.push(b'e');
        encode(k.as_bytes(), &mut h);
        h.push(b'=');
        encode(v.as_bytes(), &mut h);
        h.push(b'\n');
    }
    if !user_stdin {
        h.extend_from_slice(b"n\n");
    }
    h.extend_from_slice(b".\n");
    h
}

/// Printable ASCII other than `\` as is; every other byte as a `\0ooo` escape of `printf %b`.
fn encode(value: &[u8], out: &mut Vec<u8>) {
    for &b in value {
        if (0x20..0x7f).contains(&b) && b != b'\\' {
            out.push(b);
        } else {
            out.extend_from_slice(format!("\\0{b:03o}").as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    #[test]
    fn argv_is_direct_without_cwd_and_env_and_never_carries_them() {
        let args = vec!["a b".to_string(), "$(id)".into()];
        let direct = exec_command("/bin/sh", "printf", &args, None, &BTreeMap::new(), false);
        assert_eq!(direct.argv, ["printf", "a b", "$(id)"]);
        assert_eq!(direct.header, None);
        assert!(!direct.wants_stdin(false));
        assert!(direct.wants_stdin(true));
        let env = BTreeMap::from([("TOKEN".to_string(), "s3cret\nx".to_string())]);
        let c = exec_command("/bin/sh", "printf", &args, Some("/tmp"), &env, false);
        assert_eq!(&c.argv[..2], ["/bin/sh", "-c"]);
        assert_eq!(&c.argv[3..], ["mcp-run", "printf", "a b", "$(id)"]);
        assert!(c.argv.iter().all(|a| !a.contains("s3cret") && a != "/tmp"));
        assert_eq!(
            String::from_utf8(c.header.unwrap()).unwrap(),
            "mcp-run/1\nc/tmp\neTOKEN=s3cret\\0012x\nn\n.\n"
        );
    }

    /// Runs the wrapper with the host's /bin/sh, the header and `input` on its stdin.
    fn run(
        cwd: Option<&str>,
        env: &[(&str, &str)],
        argv: &[&str],
        input: Option<&[u8]>,
    ) -> (Option<i32>, String, String) {
        let env: BTreeMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let args: Vec<String> = argv[1..].iter().map(|s| s.to_string()).collect();
        let c = exec_command(
            "/bin/sh",
            argv[0],
            &args,
            Some(cwd.unwrap_or("")),
            &env,
            input.is_some(),
        );
        let mut child = std::process::Command::new(&c.argv[0])
            .args(&c.argv[1..])
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let mut all = c.header.unwrap();
        all.extend_from_slice(input.unwrap_or(b"never read"));
        // Ignore EPIPE: a wrapper that fails early does not read everything.
        let _ = stdin.write_all(&all);
        // Without user stdin the pipe stays open, as on a v4 exec stream: the wrapper must
        // not wait for its end.
        if input.is_some() {
            drop(stdin);
        } else {
            std::mem::forget(stdin);
        }
        let out = child.wait_with_output().unwrap();
        (
            out.status.code(),
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8(out.stderr).unwrap(),
        )
    }

    /// argv arrives unchanged, values survive any bytes, and failures look like the local
    /// backend's.
    #[test]
    fn wrapper_behaves_like_the_local_backend() {
        let tricky = ["a b", "it's", "$(id)", "`id`", "a;b", "x\ny", "*", "", "-n"];
        let mut argv = vec!["printf", "%s|"];
        argv.extend(tricky);
        let (code, out, _) = run(Some("/"), &[], &argv, None);
        assert_eq!(code, Some(0));
        assert_eq!(
            out,
            tricky.iter().map(|a| format!("{a}|")).collect::<String>()
        );
        let (_, out, _) = run(
            Some("/etc"),
            &[("V", "$(id) `x` \"q\"\\c\\n\nz\n\n"), ("W", "é\t-")],
            &["sh", "-c", "pwd; printf %s \"$V|$W\""],
            None,
        );
        assert_eq!(out, "/etc\n$(id) `x` \"q\"\\c\\n\nz\n\n|é\t-");
        assert_eq!(
            run(Some("/no/such"), &[], &["true"], None),
            (
                Some(125),
                String::new(),
                "mcp-run: cannot change directory to \"/no/such\": no such file or directory\n"
                    .into()
            )
        );
        assert_eq!(
            run(None, &[("A", "1")], &["no-such-program-mcp-run"], None),
            (
                Some(127),
                String::new(),
                "mcp-run: no-such-program-mcp-run: command not found\n".into()
            )
        );
        assert_eq!(
            run(None, &[("A", "1")], &["/no/such/prog"], None).0,
            Some(127)
        );
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("data.txt");
        std::fs::write(&plain, "not a program").unwrap();
        let plain = plain.to_str().unwrap();
        assert_eq!(
            run(None, &[("A", "1")], &[plain], None),
            (
                Some(126),
                String::new(),
                format!("mcp-run: {plain}: permission denied\n")
            )
        );
        assert_eq!(run(None, &[("A", "1")], &["/etc"], None).0, Some(126));
        assert_eq!(
            run(None, &[("A", "1")], &["sh", "-c", "exit 7"], None).0,
            Some(7)
        );
    }

    #[test]
    fn the_users_stdin_follows_the_header_byte_exact() {
        let input: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
        let (code, out, err) = run(
            Some("/"),
            &[("A", "1")],
            &["od", "-An", "-v", "-tx1"],
            Some(&input),
        );
        assert_eq!(code, Some(0), "{err}");
        let bytes: Vec<u8> = out
            .split_whitespace()
            .map(|h| u8::from_str_radix(h, 16).unwrap())
            .collect();
        assert_eq!(bytes, input);
        // Without stdin the command reads /dev/null, not the rest of the stream.
        let (code, out, _) = run(Some("/"), &[], &["cat"], None);
        assert_eq!((code, out.as_str()), (Some(0), ""));
    }
}
