//! TLS as a real API server serves it: the double's own CA (tests/kube_double/tls/, test
//! material only) signs a certificate for 127.0.0.1; the kubeconfig carries the CA. ALPN
//! offers h2 and http/1.1, so HTTP/2 clients (kubectl) use it and WebSocket upgrades use
//! HTTP/1.1, as with kube-apiserver.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

pub const CA_PEM: &str = include_str!("tls/ca.pem");
const CERT_PEM: &str = include_str!("tls/server.pem");
const KEY_PEM: &str = include_str!("tls/server-key.pem");

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The server side: our certificate, h2 and http/1.1.
pub fn server_config() -> Arc<rustls::ServerConfig> {
    let certs =
        vec![CertificateDer::from_pem_slice(CERT_PEM.as_bytes()).expect("kube double: cert")];
    let key = PrivateKeyDer::from_pem_slice(KEY_PEM.as_bytes()).expect("kube double: key");
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("kube double: TLS versions")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("kube double: TLS config");
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Arc::new(cfg)
}

/// A client that trusts the double's CA (for tests' raw HTTP and WebSocket clients).
pub fn client_config(alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(CA_PEM.as_bytes()).expect("kube double: CA"))
        .expect("kube double: CA");
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("kube double: TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(cfg)
}

/// An HTTP/1.1 reqwest client that trusts the double's CA, for tests that speak raw HTTP.
pub fn reqwest_client() -> reqwest::Client {
    reqwest::Client::builder()
        .tls_backend_preconfigured(client_config(&[b"http/1.1"]).as_ref().clone())
        .build()
        .expect("kube double: reqwest client")
}

/// Connects to the double over TLS (HTTP/1.1), for WebSocket clients.
pub async fn connect(
    addr: SocketAddr,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    let connector = tokio_rustls::TlsConnector::from(client_config(&[b"http/1.1"]));
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1")
        .map_err(std::io::Error::other)?
        .to_owned();
    connector.connect(name, tcp).await
}

/// Accepts TCP connections and completes their TLS handshakes concurrently (a client that
/// stalls in its handshake holds up no one), for `axum::serve`.
pub struct TlsListener {
    rx: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    addr: SocketAddr,
}

impl TlsListener {
    pub fn new(listener: TcpListener) -> Self {
        let addr = listener.local_addr().expect("kube double: local addr");
        let acceptor = TlsAcceptor::from(server_config());
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            loop {
                let Ok((tcp, peer)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let acceptor = acceptor.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    let hs =
                        tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp)).await;
                    if let Ok(Ok(tls)) = hs {
                        let _ = tx.send((tls, peer)).await;
                    }
                });
            }
        });
        Self { rx, addr }
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accept task never ends while the listener lives.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.addr)
    }
}
