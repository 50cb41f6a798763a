//! Issue 15, through the real binary: executions whose limits hold whatever the client does
//! (stalled readers) and that nothing outlives (timeouts, gateway death), and allow lists
//! that the request's environment cannot walk around.

use crate::support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::wire::{self, exchange, post_raw};
use support::{Gateway, config_file, pid_alive, wait_until};

/// The NDJSON events of a whole `/raw` answer.
fn events(a: &wire::Answer) -> Vec<Value> {
    assert_eq!(a.status, 200, "{}", a.text());
    a.body
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).expect("event"))
        .collect()
}

fn stdout_of(evs: &[Value]) -> String {
    let mut out = Vec::new();
    for e in evs {
        if let Ok(mcp_run::contract::Event::Stdout { data }) = serde_json::from_value(e.clone()) {
            out.extend_from_slice(&data);
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn run(gw: &Gateway, body: Value) -> Vec<Value> {
    events(&exchange(gw, &post_raw(&wire::addr(gw), &body.to_string())))
}

/// Starts a run and reads its answer only up to the `started` event (the pid), then stops
/// reading: a client that stalls, with its socket open.
fn start_and_stall(gw: &Gateway, body: Value) -> (TcpStream, i32) {
    let mut s = wire::connect(gw);
    s.write_all(&post_raw(&wire::addr(gw), &body.to_string()))
        .unwrap();
    let mut seen = Vec::new();
    let re = regex::Regex::new(r#""pid":(\d+)"#).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut buf = [0u8; 256];
    loop {
        assert!(Instant::now() < deadline, "no started event");
        let n = s.read(&mut buf).expect("read");
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
        if let Some(c) = re.captures(&String::from_utf8_lossy(&seen)) {
            return (s, c[1].parse().unwrap());
        }
    }
}

fn gateway_with(yaml: &str) -> (Gateway, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(&dir, yaml);
    (Gateway::start(&["--config", cfg.to_str().unwrap()]), dir)
}

/// A fake program named `name` in a new directory, printing `EVIL`.
fn fake_program(dir: &std::path::Path, name: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let p = bin.join(name);
    std::fs::write(&p, "#!/bin/sh\necho EVIL\n").unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    bin.to_str().unwrap().to_string()
}

#[test]
fn the_request_environment_cannot_walk_around_an_allow_list() {
    let (gw, dir) = gateway_with("policy:\n  executables:\n    allow: [echo, ls, cat]\n");
    let evil_path = fake_program(dir.path(), "echo");
    for env in [
        json!({"PATH": evil_path}),
        json!({"LD_PRELOAD": "/tmp/evil.so"}),
        json!({"BASH_ENV": "/tmp/x"}),
        json!({"NODE_OPTIONS": "--require /tmp/x"}),
    ] {
        let body = json!({"executable": "echo", "args": ["hi"], "env": env});
        let a = exchange(&gw, &post_raw(&wire::addr(&gw), &body.to_string()));
        assert_eq!(
            (a.status, a.code()),
            (403, "policy_violation".into()),
            "{env}: {}",
            a.text()
        );
        assert!(a.text().contains("injection_vars"), "{}", a.text());
    }
    // A harmless variable still goes through.
    let evs = run(
        &gw,
        json!({"executable": "echo", "args": ["hi"], "env": {"LANG": "C"}}),
    );
    assert_eq!(stdout_of(&evs), "hi\n");
}

#[test]
fn bare_names_are_looked_up_in_the_gateways_path() {
    let gw = Gateway::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let evil_path = fake_program(dir.path(), "echo");
    // Without a policy PATH may be set, and the command sees it, but `echo` is the
    // gateway's echo.
    let evs = run(
        &gw,
        json!({"executable": "echo", "args": ["hi"], "env": {"PATH": evil_path}}),
    );
    assert_eq!(stdout_of(&evs), "hi\n", "{evs:?}");
}

/// A client that reads the `started` event and then nothing: the timeout still kills the
/// command, the concurrency slot comes back, and SIGTERM still stops the gateway.
#[test]
fn a_stalled_reader_defeats_neither_timeout_nor_slot_nor_shutdown() {
    let (mut gw, _dir) = gateway_with(
        "limits:\n  max_concurrent_executions: 1\nserver:\n  shutdown_grace_secs: 1\n",
    );
    let (stalled, pid) = start_and_stall(&gw, json!({"executable": "yes", "timeout_secs": 2}));
    assert!(pid_alive(pid));
    assert!(
        wait_until(Duration::from_secs(15), || !pid_alive(pid)),
        "`yes` outlived its 2 s timeout behind a stalled client"
    );
    // The slot is free again: a new command runs (not 429).
    let mut last = String::new();
    let freed = wait_until(Duration::from_secs(10), || {
        let a = exchange(&gw, &post_raw(&wire::addr(&gw), r#"{"executable":"true"}"#));
        last = a.text();
        a.status == 200
    });
    assert!(freed, "the slot stayed taken: {last}");

    let t = Instant::now();
    let status = gw.terminate();
    assert!(
        status.is_some(),
        "the gateway did not exit while a client stalled"
    );
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    drop(stalled);
}

/// `setsid` leaves the process group; the command's end still kills it.
#[test]
fn escaped_descendants_die_with_the_run() {
    let gw = Gateway::start(&[]);
    let evs = run(
        &gw,
        json!({"executable": "sh", "args": ["-c", "setsid sleep 300 & echo $!; sleep 300"], "timeout_secs": 1}),
    );
    let pid: i32 = stdout_of(&evs).trim().parse().expect("pid");
    assert!(
        evs.iter()
            .any(|e| e["type"] == "exit" && e["timed_out"] == true),
        "{evs:?}"
    );
    assert!(
        wait_until(Duration::from_secs(10), || !pid_alive(pid)),
        "setsid'd descendant {pid} survived the timeout"
    );
    // And after a normal exit.
    let evs = run(
        &gw,
        json!({"executable": "sh", "args": ["-c", "setsid sleep 300 & echo $!"]}),
    );
    let pid: i32 = stdout_of(&evs).trim().parse().expect("pid");
    assert!(
        wait_until(Duration::from_secs(10), || !pid_alive(pid)),
        "setsid'd descendant {pid} survived the exit"
    );
}

/// SIGKILL of the gateway: no cleanup code runs, the commands die anyway.
#[test]
fn commands_die_with_a_killed_gateway() {
    let gw = Gateway::start(&[]);
    let mut pids = Vec::new();
    let mut streams = Vec::new();
    for _ in 0..3 {
        let (s, pid) = start_and_stall(&gw, json!({"executable": "sleep", "args": ["300"]}));
        pids.push(pid);
        streams.push(s);
    }
    // A grandchild, in the group and out of it: the reaper process gets those.
    for script in [
        "sleep 300 & echo $!; wait",
        "setsid sleep 300 & echo $!; wait",
    ] {
        let mut s = wire::connect(&gw);
        s.write_all(&post_raw(
            &wire::addr(&gw),
            &json!({"executable": "sh", "args": ["-c", script]}).to_string(),
        ))
        .unwrap();
        let mut seen = String::new();
        let mut buf = [0u8; 512];
        let pid = loop {
            let n = s.read(&mut buf).expect("read");
            assert!(n > 0, "{seen}");
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
            let out = seen
                .lines()
                .filter(|l| l.starts_with(r#"{"type":"stdout""#))
                .find_map(|l| match serde_json::from_str(l) {
                    Ok(mcp_run::contract::Event::Stdout { data }) => {
                        String::from_utf8_lossy(&data).trim().parse::<i32>().ok()
                    }
                    _ => None,
                });
            if let Some(pid) = out {
                break pid;
            }
        };
        pids.push(pid);
        streams.push(s);
    }
    let gpid = gw.pid().unwrap() as i32;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(gpid), nix::sys::signal::SIGKILL).unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || pids
            .iter()
            .all(|p| !pid_alive(*p))),
        "commands outlived the gateway: {:?}",
        pids.iter().filter(|p| pid_alive(**p)).collect::<Vec<_>>()
    );
}

/// Issue 24.8: on the local backend, commands run as the gateway's user. The gateway is
/// non-dumpable, so a command cannot read its environment (the tokens) or memory through
/// /proc (checked as an unprivileged user: root reads any process); and several identities
/// need the operator's word, since their commands could read each other's trees.
#[test]
fn commands_cannot_read_the_gateways_secrets_and_identities_are_not_mixed() {
    const TOKEN: &str = "ci:tok-0123456789abcdef-secret";
    // As `nobody`, in a temporary directory that user can write.
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let probe = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "true"])
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        eprintln!("SKIPPED: setpriv cannot switch to uid 65534 here (not root?)");
    } else {
        let gw = Gateway::start_wrapped(
            &[
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
            ],
            None,
            &[],
            &[
                ("MCP_RUN_AUTH_TOKENS", TOKEN),
                ("TMPDIR", tmp.path().to_str().unwrap()),
            ],
        );
        let token = TOKEN.split_once(':').unwrap().1;
        let body = json!({"executable": "sh", "args": ["-c",
            "id -u; cat /proc/$PPID/environ; head -c 64 /proc/$PPID/cmdline >/dev/null; echo; echo done"]})
        .to_string();
        let a = exchange(
            &gw,
            &wire::request(
                "POST",
                "/raw",
                &wire::addr(&gw),
                &[
                    "Content-Type: application/json",
                    &format!("Authorization: Bearer {token}"),
                ],
                body.as_bytes(),
            ),
        );
        let out = stdout_of(&events(&a));
        assert!(out.starts_with("65534\n"), "{out}");
        assert!(out.contains("done"), "{out}");
        assert!(
            !out.contains(token),
            "the command read the gateway's tokens: {out}"
        );
    }

    // Two identities on the local backend: refused at start, with the way out named.
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(support::gateway_bin())
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env(
            "MCP_RUN_AUTH_TOKENS",
            "a:aaaaaaaaaaaaaaaaaaaa,b:bbbbbbbbbbbbbbbbbbbb",
        )
        .env_remove("MCP_RUN_AUTH_TOKENS_FILE")
        .env("TMPDIR", dir.path())
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("local.allow_multiple_identities"),
        "{stderr}"
    );
    let cfg = config_file(&dir, "local:\n  allow_multiple_identities: true\n");
    let _gw = Gateway::start_with_env(
        &["--config", cfg.to_str().unwrap()],
        &[(
            "MCP_RUN_AUTH_TOKENS",
            "a:aaaaaaaaaaaaaaaaaaaa,b:bbbbbbbbbbbbbbbbbbbb",
        )],
    );
}

/// Pids of processes whose command line contains `needle`.
fn processes_with(needle: &str) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains(needle) && !cmd.contains("processes_with") {
            out.push(pid);
        }
    }
    out
}

/// Kills what is left of processes whose command line contains `needle` (a test's escapee).
fn kill_all_with(needle: &str) {
    for pid in processes_with(needle) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
    }
}

/// Issue 24.7: a command that leaves its process group and clears its environment
/// (`setsid env -i`) does not outlive its run nor its timeout, nor a session's call: the
/// gateway is a child subreaper, so the escapee becomes its child when the command's
/// processes are gone, and dies with the last command that could have started it. Where the
/// machine gives the gateway cgroup v2, its command's cgroup catches it first; so the
/// scenario runs twice, the second time with a gateway that cannot make cgroups (as an
/// unprivileged user), which is what every machine without cgroup v2 has.
#[test]
fn escapes_from_the_process_group_and_the_tag_are_killed() {
    let gw = Gateway::start(&[]);
    escapees_die(&gw, 987650);
    let probe = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "true"])
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        assert!(
            gw.log_text().contains("no cgroup per command"),
            "SKIPPED the run without cgroups: setpriv cannot switch to uid 65534 here, and this gateway used cgroups"
        );
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let plain = Gateway::start_wrapped(
        &[
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
        ],
        None,
        &[],
        &[("TMPDIR", tmp.path().to_str().unwrap())],
    );
    if plain.log_text().contains("cannot start the reaper process") {
        // uid 65534 cannot reach the gateway's binary (a checkout below a 0700 directory,
        // such as `mktemp -d`): without its reaper the gateway is not a subreaper either.
        eprintln!(
            "SKIPPED the run without cgroups: uid 65534 cannot start the gateway's reaper here"
        );
        return;
    }
    escapees_die(&plain, 987660);
    let log = plain.log_text();
    assert!(
        log.contains("no cgroup per command") && log.contains("killed a process that had escaped"),
        "{log}"
    );
}

/// A one-shot run, a timed-out run and a session's call each leave an escapee (`sleep
/// N`, `N+1`, `N+2`): none outlives its command.
fn escapees_die(gw: &Gateway, n: u32) {
    let escape = |n: u32| {
        format!(
            "setsid env -i sh -c 'sleep {n}' </dev/null >/dev/null 2>&1 & sleep 0.2; echo started"
        )
    };
    let gone = |n: u32| {
        let needle = format!("sleep {n}");
        let gone = wait_until(Duration::from_secs(10), || {
            processes_with(&needle).is_empty()
        });
        kill_all_with(&needle);
        gone
    };
    // Ends at once, leaving the escapee behind.
    let evs = run(gw, json!({"executable": "sh", "args": ["-c", escape(n)]}));
    assert_eq!(stdout_of(&evs), "started\n");
    assert!(gone(n), "the escapee outlived its run: {}", gw.log_text());

    // Cut by its timeout.
    let evs = run(
        gw,
        json!({"executable": "sh", "timeout_secs": 1, "args": ["-c",
            format!("setsid env -i sh -c 'sleep {}' </dev/null >/dev/null 2>&1 & sleep 100", n + 1)]}),
    );
    assert!(
        evs.iter()
            .any(|e| e["type"] == "exit" && e["timed_out"] == true),
        "{evs:?}"
    );
    assert!(gone(n + 1), "the escapee outlived its timeout");

    // A session's call: as its process group, nothing it started runs between calls
    // (docs/sessions.md); the session itself stays.
    let evs = run(
        gw,
        json!({"executable": "sh", "session": "dev", "args": ["-c", escape(n + 2)]}),
    );
    assert_eq!(stdout_of(&evs), "started\n", "{evs:?}");
    assert!(gone(n + 2), "the escapee outlived its session call");
    let evs = run(
        gw,
        json!({"executable": "sh", "session": "dev", "args": ["-c", "echo still"]}),
    );
    assert_eq!(stdout_of(&evs), "still\n", "{evs:?}");
}

/// Issue 23 (bound): a local session's directory counts against
/// `workspaces.max_local_inodes` while it lives, as runs' trees do: a session whose
/// directory alone is over the bound gets 413 on its next call, one that others crowd out
/// gets 429 until they give their share back (here: another session ends). The count is
/// taken after each call, in the background, so the test retries until it has happened.
#[test]
fn session_directories_count_against_the_local_inode_bound() {
    let tmp = tempfile::tempdir().unwrap();
    let (gw, _dir) = gateway_with(&format!(
        "workspaces:\n  max_local_inodes: 500\n  local_dir: {}\n",
        tmp.path().join("runs").display()
    ));
    let call = |session: &str, script: &str| {
        let body = json!({"executable": "sh", "session": session, "args": ["-c", script]});
        exchange(&gw, &post_raw(&wire::addr(&gw), &body.to_string()))
    };
    let files =
        |n: u32| format!("mkdir -p d && for i in $(seq {n}); do : > d/f$$.$i; done; echo ok");
    // Two sessions write 300 entries each: the second's next call finds the budget used.
    assert_eq!(stdout_of(&events(&call("a", &files(300)))), "ok\n");
    assert_eq!(stdout_of(&events(&call("b", &files(300)))), "ok\n");
    let mut last = String::new();
    let crowded = wait_until(Duration::from_secs(20), || {
        let a = call("b", "true");
        last = a.text();
        a.status == 429
    });
    assert!(crowded, "session b was never refused: {last}");
    assert!(
        last.contains("workspaces.max_local_inodes") && last.contains("session"),
        "{last}"
    );
    // Session a ends (its directory is removed in the background): b has room again.
    let ended = exchange(
        &gw,
        &wire::request("DELETE", "/sessions/a", &wire::addr(&gw), &[], b""),
    );
    assert_eq!(ended.status, 204, "{}", ended.text());
    let room = wait_until(Duration::from_secs(20), || {
        let a = call("b", "echo again");
        last = a.text();
        a.status == 200
    });
    assert!(room, "session b stayed refused after a ended: {last}");
    assert!(last.contains(r#""type":"exit""#), "{last}");
    // One session over the bound alone: 413, which ending it is the way out of.
    assert_eq!(stdout_of(&events(&call("b", &files(300)))), "ok\n");
    let too_big = wait_until(Duration::from_secs(20), || {
        let a = call("b", "true");
        last = a.text();
        a.status == 413
    });
    assert!(too_big, "session b was never refused: {last}");
    assert!(last.contains("end the session"), "{last}");
    // A one-shot run still runs (sessions hold inodes, not slots).
    let evs = run(&gw, json!({"executable": "echo", "args": ["one-shot"]}));
    assert_eq!(stdout_of(&evs), "one-shot\n");
}

/// The gateway's children (pids), from each of its threads' `children` list.
fn children_of(pid: u32) -> Vec<i32> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(text) = std::fs::read_to_string(t.path().join("children")) {
            out.extend(
                text.split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok()),
            );
        }
    }
    out
}

/// Issue 24.10: at SIGTERM, removing the gateway's directories is bounded: trees that take
/// longer than the bound to remove (many large trees; here a session's 600 files, each
/// removal slowed to 50 ms by strace's syscall delay injection, so about 30 s) do not keep
/// the gateway from exiting `shutdown_grace_secs` + 10 s after the signal; what is left is
/// for the reaper and the next gateway.
#[test]
fn shutdown_is_bounded_when_removing_trees_is_slow() {
    let probe = std::process::Command::new("strace")
        .args([
            "-f",
            "--seccomp-bpf",
            "-e",
            "trace=unlinkat",
            "-e",
            "inject=unlinkat:delay_enter=1000",
            "-o",
            "/dev/null",
            "true",
        ])
        .status();
    match probe {
        // Installed but refused (no ptrace in this container): a limit of the machine.
        Ok(s) if !s.success() => {
            eprintln!("SKIPPED: strace cannot trace here (ptrace refused)");
            return;
        }
        Ok(_) => {}
        Err(_) => {
            assert!(
                std::env::var_os("CI").is_none_or(|v| v != "true"),
                "strace is not installed (.ci/install.d/strace.sh installs it)"
            );
            eprintln!("SKIPPED: strace is not installed");
            return;
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config_file(&tmp, "server:\n  shutdown_grace_secs: 1\n");
    let gw = Gateway::start_wrapped(
        &[
            "strace",
            "-f",
            "--seccomp-bpf",
            "-o",
            "/dev/null",
            "-e",
            "trace=unlinkat",
            "-e",
            "inject=unlinkat:delay_enter=50000",
        ],
        None,
        &["--config", cfg.to_str().unwrap()],
        &[("TMPDIR", tmp.path().to_str().unwrap())],
    );
    // strace is the child; the gateway is strace's child.
    let strace = gw.pid().unwrap();
    let gateway = children_of(strace);
    assert_eq!(gateway.len(), 1, "{gateway:?}");
    let gateway = gateway[0];
    let body = json!({"executable": "sh", "session": "big", "args": ["-c",
        "mkdir d && for i in $(seq 600); do : > d/f$i; done; echo ok"]});
    let a = exchange(&gw, &post_raw(&wire::addr(&gw), &body.to_string()));
    assert_eq!(stdout_of(&events(&a)), "ok\n");
    let t = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(gateway),
        nix::sys::signal::SIGTERM,
    )
    .unwrap();
    // Bound: 1 s grace + 5 s closing connections + 5 s clean-up; the removal alone would
    // take about 30 s.
    let exited = wait_until(Duration::from_secs(40), || !pid_alive(gateway));
    let took = t.elapsed();
    assert!(exited, "the gateway did not exit");
    assert!(
        took < Duration::from_secs(20),
        "the gateway took {took:?} to exit: its clean-up was not bounded"
    );
    assert!(
        gw.log_text().contains("shutdown took longer than"),
        "{}",
        gw.log_text()
    );
}
