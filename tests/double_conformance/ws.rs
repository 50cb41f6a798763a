//! A raw WebSocket exec client for the double: subprotocol negotiation, channel bytes.

use super::*;

// Raw WebSocket exec: subprotocol negotiation, channel bytes, status frames.

pub(super) type Ws =
    tokio_tungstenite::WebSocketStream<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;
pub(super) use tokio_tungstenite::tungstenite::{self, Message, client::IntoClientRequest};

/// Connects to `pods/{pod}/exec?{query}` offering `protocols`; returns the socket and the
/// protocol the server selected.
pub(super) async fn ws_exec(
    d: &KubeDouble,
    pod: &str,
    query: &str,
    protocols: Option<&str>,
) -> Result<(Ws, Option<String>), tungstenite::Error> {
    let url = format!(
        "wss://{}/api/v1/namespaces/default/pods/{pod}/exec?{query}",
        d.url().trim_start_matches("https://")
    );
    let mut req = url.into_client_request()?;
    let h = req.headers_mut();
    h.insert(
        "authorization",
        format!("Bearer {}", d.options().token).parse().unwrap(),
    );
    if let Some(p) = protocols {
        h.insert("sec-websocket-protocol", p.parse().unwrap());
    }
    let tls = kube_double::tls::connect(d.addr()).await?;
    let (ws, resp) = tokio_tungstenite::client_async(req, tls).await?;
    let proto = resp
        .headers()
        .get("sec-websocket-protocol")
        .map(|v| v.to_str().unwrap().to_string());
    Ok((ws, proto))
}

/// Every data frame as (channel, bytes) until the server closes, and the close code.
pub(super) async fn frames(ws: &mut Ws) -> (Vec<(u8, Vec<u8>)>, Option<u16>) {
    let mut out = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(m) = ws.next().await {
            match m.expect("frame") {
                Message::Binary(b) => out.push((b[0], b[1..].to_vec())),
                Message::Text(t) => {
                    let ch = t.as_bytes()[0] - b'0';
                    let data = base64_simd::STANDARD
                        .decode_to_vec(&t.as_bytes()[1..])
                        .expect("base64");
                    out.push((ch, data));
                }
                Message::Close(c) => return c.map(|c| u16::from(c.code)),
                _ => {}
            }
        }
        None
    })
    .await
    .expect("stream ended in time");
    (out, r)
}

pub(super) fn q(cmd: &[&str], extra: &str) -> String {
    let mut s: Vec<String> = cmd
        .iter()
        .map(|c| {
            let enc: String = c
                .bytes()
                .map(|b| {
                    if b.is_ascii_alphanumeric() || b"-_./".contains(&b) {
                        (b as char).to_string()
                    } else {
                        format!("%{b:02X}")
                    }
                })
                .collect();
            format!("command={enc}")
        })
        .collect();
    s.push(extra.to_string());
    s.join("&")
}

pub(super) fn joined(frames: &[(u8, Vec<u8>)], ch: u8) -> Vec<u8> {
    frames
        .iter()
        .filter(|(c, _)| *c == ch)
        .flat_map(|(_, d)| d.clone())
        .collect()
}

pub(super) async fn running_pod(
    d: &KubeDouble,
    name: &str,
    tweak: impl FnOnce(&mut Pod),
) -> Api<Pod> {
    let api: Api<Pod> = Api::default_namespaced(client(d).await);
    let mut p = pod(name, "busybox");
    tweak(&mut p);
    api.create(&PostParams::default(), &p)
        .await
        .expect("create");
    running(&api, name).await;
    api
}

pub(super) const OUT_ERR: &str = "stdout=true&stderr=true";
