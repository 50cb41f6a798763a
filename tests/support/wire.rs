//! HTTP/1.1 at the byte level, for tests that need what a well-behaved client library will
//! not do: a foreign `Host`, invalid header bytes, a client that stops reading or
//! half-closes, a connection that never finishes its headers.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use super::Gateway;

/// The `host:port` of a gateway.
pub fn addr(gw: &Gateway) -> String {
    gw.base.trim_start_matches("http://").to_string()
}

/// A connection to the gateway; reads give up after 30 s so that no test can hang.
pub fn connect(gw: &Gateway) -> TcpStream {
    let s = TcpStream::connect(addr(gw)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// A parsed answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub head: String,
    pub body: Vec<u8>,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {:?} (status {})",
                String::from_utf8_lossy(&self.body),
                self.status
            )
        })
    }

    /// The `error.code` of a JSON error body.
    pub fn code(&self) -> String {
        self.json()["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A request for `path` with `headers` (each `Name: value`) and a body; `Connection: close`
/// is added so that the answer ends at EOF.
pub fn request(method: &str, path: &str, host: &str, headers: &[&str], body: &[u8]) -> Vec<u8> {
    let mut text = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for h in headers {
        text.push_str(h);
        text.push_str("\r\n");
    }
    text.push_str("\r\n");
    let mut bytes = text.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

/// A JSON `POST /raw` with the given `Host`.
pub fn post_raw(host: &str, body: &str) -> Vec<u8> {
    request(
        "POST",
        "/raw",
        host,
        &["Content-Type: application/json"],
        body.as_bytes(),
    )
}

/// Sends `bytes` on a new connection and reads the whole answer (to EOF).
pub fn exchange(gw: &Gateway, bytes: &[u8]) -> Answer {
    let mut s = connect(gw);
    s.write_all(bytes).expect("write");
    read_answer(&mut s)
}

/// Reads an answer to EOF and splits head and (de-chunked) body.
pub fn read_answer(s: &mut TcpStream) -> Answer {
    let mut all = Vec::new();
    let _ = s.read_to_end(&mut all);
    parse(&all)
}

/// Splits a raw answer into status, head and body (de-chunked when chunked).
pub fn parse(all: &[u8]) -> Answer {
    let split = all
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no end of head in {:?}", String::from_utf8_lossy(all)));
    let head = String::from_utf8_lossy(&all[..split]).into_owned();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut body = all[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    Answer { status, head, body }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = data.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(
            String::from_utf8_lossy(&data[..eol])
                .split(';')
                .next()
                .unwrap_or("")
                .trim(),
            16,
        )
        .unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = eol + 2;
        let end = (start + size).min(data.len());
        out.extend_from_slice(&data[start..end]);
        data = &data[(end + 2).min(data.len())..];
    }
    out
}

/// Whether the peer closed the connection within `limit` (reads and discards what comes).
pub fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut buf = [0u8; 65536];
    while Instant::now() < deadline {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return true,
        }
    }
    false
}

/// Half-closes: the gateway sees EOF on the request side.
pub fn half_close(s: &TcpStream) {
    s.shutdown(Shutdown::Write).expect("shutdown");
}

/// Reads one answer from a keep-alive connection: the head, then `Content-Length` bytes.
pub fn read_response(s: &mut TcpStream) -> Answer {
    let mut all = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = all.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&all[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if all.len() >= end + 4 + len {
                return parse(&all[..end + 4 + len]);
            }
        }
        let n = s.read(&mut buf).expect("read");
        assert!(n > 0, "closed after {:?}", String::from_utf8_lossy(&all));
        all.extend_from_slice(&buf[..n]);
    }
}
