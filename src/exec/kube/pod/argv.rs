//! What is exec'd in the runner pod: the command itself, or a constant wrapper script that
//! applies `cwd` and `env` first.

/// The script that applies `cwd` and `env` in the container without any shell parsing of
/// the request: it is a constant, and the directory, the `NAME=VALUE` pairs and the argv
/// are its positional parameters (`sh -c SCRIPT mcp-run DIR N NAME=VALUE... EXE ARGS...`).
/// Failures are reported exactly as the local backend reports them (exit 125, 126, 127).
pub const WRAPPER: &str = r#"d=$1; n=$2; shift 2
if [ -n "$d" ] && ! cd -- "$d" 2>/dev/null; then
  if [ ! -e "$d" ]; then r='no such file or directory'
  elif [ ! -d "$d" ]; then r='not a directory'
  else r='permission denied'; fi
  printf 'mcp-run: cannot change directory to "%s": %s\n' "$d" "$r" >&2; exit 125
fi
while [ "$n" -gt 0 ]; do export "$1" || exit 125; shift; n=$((n-1)); done
case $1 in
  */*) if [ ! -e "$1" ]; then printf 'mcp-run: %s: command not found\n' "$1" >&2; exit 127
       elif [ -d "$1" ]; then printf 'mcp-run: %s: is a directory\n' "$1" >&2; exit 126
       elif [ ! -x "$1" ]; then printf 'mcp-run: %s: permission denied\n' "$1" >&2; exit 126; fi ;;
  *) if ! command -v -- "$1" >/dev/null 2>&1; then
       printf 'mcp-run: %s: command not found\n' "$1" >&2; exit 127; fi ;;
esac
exec "$@"
"#;

/// The argv exec'd in the runner container: the command itself when it needs neither a
/// working directory nor variables (then the image needs no shell), else the wrapper.
pub fn exec_argv(
    shell: &str,
    executable: &str,
    args: &[String],
    cwd: Option<&str>,
    env: &std::collections::BTreeMap<String, String>,
) -> Vec<String> {
    if cwd.is_none() && env.is_empty() {
        let mut argv = Vec::with_capacity(args.len() + 1);
        argv.push(executable.to_string());
        argv.extend(args.iter().cloned());
        return argv;
    }
    let mut argv = vec![
        shell.to_string(),
        "-c".into(),
        WRAPPER.into(),
        "mcp-run".into(),
        cwd.unwrap_or("").to_string(),
        env.len().to_string(),
    ];
    argv.extend(env.iter().map(|(k, v)| format!("{k}={v}")));
    argv.push(executable.to_string());
    argv.extend(args.iter().cloned());
    argv
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn argv_is_direct_without_cwd_and_env() {
        let args = vec!["a b".to_string(), "$(id)".into()];
        assert_eq!(
            exec_argv("/bin/sh", "printf", &args, None, &BTreeMap::new()),
            ["printf", "a b", "$(id)"]
        );
        let env = BTreeMap::from([("A".to_string(), "1 2".to_string())]);
        let argv = exec_argv("/bin/sh", "printf", &args, Some("/tmp"), &env);
        assert_eq!(&argv[..2], ["/bin/sh", "-c"]);
        assert_eq!(
            &argv[3..],
            ["mcp-run", "/tmp", "1", "A=1 2", "printf", "a b", "$(id)"]
        );
    }

    /// The wrapper run by the host's /bin/sh: argv arrives unchanged, and failures look like
    /// the local backend's.
    #[test]
    fn wrapper_behaves_like_the_local_backend() {
        let run = |cwd: Option<&str>, env: &[(&str, &str)], argv: &[&str]| {
            let env: BTreeMap<String, String> = env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let args: Vec<String> = argv[1..].iter().map(|s| s.to_string()).collect();
            let full = exec_argv("/bin/sh", argv[0], &args, Some(cwd.unwrap_or("")), &env);
            let out = std::process::Command::new(&full[0])
                .args(&full[1..])
                .env_clear()
                .env("PATH", "/usr/bin:/bin")
                .output()
                .unwrap();
            (
                out.status.code(),
                String::from_utf8(out.stdout).unwrap(),
                String::from_utf8(out.stderr).unwrap(),
            )
        };
        let tricky = ["a b", "it's", "$(id)", "`id`", "a;b", "x\ny", "*", "", "-n"];
        let mut argv = vec!["printf", "%s|"];
        argv.extend(tricky);
        let (code, out, _) = run(Some("/"), &[], &argv);
        assert_eq!(code, Some(0));
        assert_eq!(
            out,
            tricky.iter().map(|a| format!("{a}|")).collect::<String>()
        );
        let (_, out, _) = run(
            Some("/etc"),
            &[("V", "$(id) `x` \"q\"\nz")],
            &["sh", "-c", "pwd; printf %s \"$V\""],
        );
        assert_eq!(out, "/etc\n$(id) `x` \"q\"\nz");
        assert_eq!(
            run(Some("/no/such"), &[], &["true"]),
            (
                Some(125),
                String::new(),
                "mcp-run: cannot change directory to \"/no/such\": no such file or directory\n"
                    .into()
            )
        );
        assert_eq!(
            run(None, &[], &["no-such-program-mcp-run"]),
            (
                Some(127),
                String::new(),
                "mcp-run: no-such-program-mcp-run: command not found\n".into()
            )
        );
        assert_eq!(run(None, &[], &["/no/such/prog"]).0, Some(127));
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("data.txt");
        std::fs::write(&plain, "not a program").unwrap();
        let plain = plain.to_str().unwrap();
        assert_eq!(
            run(None, &[], &[plain]),
            (
                Some(126),
                String::new(),
                format!("mcp-run: {plain}: permission denied\n")
            )
        );
        assert_eq!(run(None, &[], &["/etc"]).0, Some(126));
        assert_eq!(run(None, &[], &["sh", "-c", "exit 7"]).0, Some(7));
    }
}
