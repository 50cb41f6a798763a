//! Issue 15.4, through the real binary: connections that send nothing, half a request or
//! a huge declared body, and floods of idle connections, cannot hold the gateway.

use crate::support;

use std::io::Write;
use std::time::{Duration, Instant};

use support::wire::{self, closed_within, read_response, request};
use support::{Gateway, config_file};

const TOKEN: &str = "ci:0123456789abcdef0123";

fn gateway_with(yaml: &str, env: &[(&str, &str)]) -> (Gateway, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(&dir, yaml);
    (
        Gateway::start_with_env(&["--config", cfg.to_str().unwrap()], env),
        dir,
    )
}

#[test]
fn unfinished_headers_bodies_and_idle_keepalives_are_closed() {
    let (gw, _dir) = gateway_with(
        "server:\n  header_timeout_secs: 1\n  body_timeout_secs: 1\n",
        &[],
    );

    // Half a request head, then nothing.
    let mut s = wire::connect(&gw);
    s.write_all(b"POST /raw HTTP/1.1\r\nHost: localhost\r\n")
        .unwrap();
    assert!(
        closed_within(&mut s, Duration::from_secs(8)),
        "a half-sent head kept its connection"
    );

    // A keep-alive connection that goes idle after one request.
    let mut s = wire::connect(&gw);
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap();
    assert_eq!(read_response(&mut s).status, 200);
    assert!(
        closed_within(&mut s, Duration::from_secs(8)),
        "an idle keep-alive connection stayed"
    );

    // A body that stops arriving: answered (JSON) or closed, not held.
    let mut s = wire::connect(&gw);
    s.write_all(
        b"POST /raw HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"executable\"",
    )
    .unwrap();
    let t = Instant::now();
    assert!(
        closed_within(&mut s, Duration::from_secs(8)),
        "a stalled body kept its connection"
    );
    assert!(t.elapsed() < Duration::from_secs(8));
}

#[test]
fn a_huge_declared_body_is_refused_before_it_is_sent() {
    let gw = Gateway::start(&[]);
    for path in ["/raw", "/mcp"] {
        let mut s = wire::connect(&gw);
        s.write_all(
            format!(
                "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 1073741824\r\n\r\n"
            )
            .as_bytes(),
        )
        .unwrap();
        let a = read_response(&mut s);
        assert_eq!(
            (a.status, a.code()),
            (413, "payload_too_large".into()),
            "{path}"
        );
    }
}

#[test]
fn idle_unauthenticated_connections_are_capped() {
    let (gw, _dir) = gateway_with(
        "server:\n  max_connections: 40\n  max_unauthenticated_connections: 10\n",
        &[("MCP_RUN_AUTH_TOKENS", TOKEN)],
    );
    let token = TOKEN.split_once(':').unwrap().1;
    let auth = format!("Authorization: Bearer {token}");
    let capabilities = |s: &mut std::net::TcpStream| {
        let mut req = request("GET", "/capabilities", "localhost", &[&auth], b"");
        // Keep the connection: drop the `Connection: close` the helper adds.
        let text = String::from_utf8(req.clone())
            .unwrap()
            .replace("Connection: close\r\n", "");
        req = text.into_bytes();
        s.write_all(&req).unwrap();
        read_response(s)
    };
    // An authenticated keep-alive connection, made before the flood.
    let mut good = wire::connect(&gw);
    assert_eq!(capabilities(&mut good).status, 200);

    let mut idle: Vec<_> = (0..10).map(|_| wire::connect(&gw)).collect();
    // Issue 24.6: an 11th connection is not refused; the oldest idle one makes room.
    let mut eleventh = wire::connect(&gw);
    assert_eq!(capabilities(&mut eleventh).status, 200);
    assert!(
        closed_within(&mut idle[0], Duration::from_secs(5)),
        "the oldest idle connection stayed"
    );
    // The authenticated connection still works.
    assert_eq!(capabilities(&mut good).status, 200);
    drop(idle);
}

/// Issue 24.6: connections that send nothing are closed after the header timeout, and a
/// flood of them never keeps an authenticated client out.
#[test]
fn silent_connections_are_closed_and_never_lock_clients_out() {
    let (gw, _dir) = gateway_with(
        "server:\n  header_timeout_secs: 1\n  max_connections: 200\n  max_unauthenticated_connections: 20\n",
        &[("MCP_RUN_AUTH_TOKENS", TOKEN)],
    );
    let token = TOKEN.split_once(':').unwrap().1;
    let auth = format!("Authorization: Bearer {token}");
    let mut silent: Vec<_> = (0..100).map(|_| wire::connect(&gw)).collect();
    for _ in 0..3 {
        let mut s = wire::connect(&gw);
        s.write_all(&request("GET", "/capabilities", "localhost", &[&auth], b""))
            .unwrap();
        let a = read_response(&mut s);
        assert_eq!(a.status, 200, "{}", a.text());
    }
    let t = Instant::now();
    for s in &mut silent {
        assert!(
            closed_within(s, Duration::from_secs(6)),
            "a silent connection stayed {:?}",
            t.elapsed()
        );
    }
}
