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

    let idle: Vec<_> = (0..10).map(|_| wire::connect(&gw)).collect();
    // Give the gateway time to accept them all: a connection over the cap is answered at once.
    let mut over = None;
    let deadline = Instant::now() + Duration::from_secs(10);
    while over.is_none() && Instant::now() < deadline {
        let mut s = wire::connect(&gw);
        s.set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        let mut first = [0u8; 1];
        if std::io::Read::read(&mut s, &mut first).is_ok_and(|n| n == 1) {
            let mut rest = Vec::new();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let _ = std::io::Read::read_to_end(&mut s, &mut rest);
            let mut all = first.to_vec();
            all.extend(rest);
            over = Some(wire::parse(&all));
        }
    }
    let over = over.expect("an 11th unauthenticated connection was neither answered nor closed");
    assert_eq!(
        (over.status, over.code()),
        (503, "too_many_requests".into()),
        "{}",
        over.text()
    );
    // The authenticated connection still works.
    assert_eq!(capabilities(&mut good).status, 200);
    drop(idle);
}
