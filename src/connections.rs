//! The accept loop: what `axum::serve` does, plus the limits a gateway needs whatever its
//! clients do.
//! - At most `max_connections` connections; of those, at most `max_unauthenticated` that have
//!   not yet made an authenticated request (any request when auth is off). A connection over
//!   either cap gets a `503` JSON answer and is closed at once, so idle or malicious clients
//!   cannot use up the gateway's file descriptors.
//! - `header_timeout`: the time a client has to send a request's headers, which is also how
//!   long a keep-alive connection may stay idle between requests (hyper starts the timer when
//!   it waits for the next request head).
//! - `body_timeout`: the longest silence while a request body arrives.
//! - Shutdown: the listener stays open while running commands drain, so that new requests
//!   get `503 shutting_down` rather than a refused connection; then connections are asked to
//!   close, and after [`CLOSE_GRACE`] whatever is left (a client that stopped reading) is
//!   dropped, so that the gateway exits.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{ConnectInfo, Request};
use axum::middleware::Next;
use axum::response::Response;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// hyper's read and write buffer per connection; also bounds a request's headers.
pub const MAX_CONNECTION_BUFFER: usize = 96 * 1024;

/// After the drain, how long connections get to finish before they are dropped.
pub const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// The connection limits (`server.*` in the configuration).
#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    pub max_unauthenticated: usize,
    pub header_timeout: Duration,
    pub body_timeout: Duration,
}

/// A connection's hold on the unauthenticated cap, released by its first authenticated
/// request. In the extensions of every request of that connection.
#[derive(Clone, Default)]
pub struct Unauthenticated(Arc<Mutex<Option<OwnedSemaphorePermit>>>);

impl Unauthenticated {
    /// This connection proved who it is: it no longer counts against the cap.
    pub fn release(&self) {
        if let Ok(mut p) = self.0.lock() {
            p.take();
        }
    }
}

/// Middleware inside auth: a request that got this far is authenticated (or auth is off),
/// except on the open paths (probes), which prove nothing.
pub async fn mark_authenticated(req: Request, next: Next) -> Response {
    let proven = req
        .extensions()
        .get::<crate::auth::Caller>()
        .is_some_and(|c| c.identity.is_some());
    let auth_off = req.extensions().get::<AuthOff>().is_some();
    if (proven || auth_off)
        && let Some(u) = req.extensions().get::<Unauthenticated>()
    {
        u.release();
    }
    next.run(req).await
}

/// Tells a streaming handler when the client's side of the connection reached EOF (a
/// half-close, or a client that is gone). hyper, which lets a client half-close, no longer
/// reads while it answers, so a watcher peeks at a duplicate of the socket instead: only for
/// the connections that stream a run, so an idle connection costs no extra descriptor.
#[derive(Clone, Copy)]
pub struct PeerClosed(std::os::fd::RawFd);

impl PeerClosed {
    /// A token cancelled at the client's EOF, watched until `until` fires. `None` when the
    /// socket cannot be duplicated (out of descriptors): the stream then learns of a gone
    /// client only when a write fails.
    pub fn watch(&self, until: CancellationToken) -> Option<CancellationToken> {
        use std::os::fd::BorrowedFd;
        // SAFETY: the fd is the connection's socket, which hyper owns for as long as any of
        // the connection's requests is being handled, and this runs inside a handler.
        let dup = unsafe { BorrowedFd::borrow_raw(self.0) }
            .try_clone_to_owned()
            .ok()?;
        let std = std::net::TcpStream::from(dup);
        std.set_nonblocking(true).ok()?;
        let dup = TcpStream::from_std(std).ok()?;
        let closed = CancellationToken::new();
        let fired = closed.clone();
        tokio::spawn(async move {
            let mut byte = [0u8; 1];
            loop {
                tokio::select! {
                    () = until.cancelled() => return,
                    peeked = dup.peek(&mut byte) => match peeked {
                        Ok(0) | Err(_) => {
                            fired.cancel();
                            return;
                        }
                        // A pipelined request waits in the buffer: look again later.
                        Ok(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                    },
                }
            }
        });
        Some(closed)
    }
}

/// Marks requests of a gateway without auth: every request counts as authenticated.
#[derive(Clone, Copy)]
pub struct AuthOff;

/// Serves `router` on `listener` until `drained` resolves (the caller's shutdown: the
/// signal, then the drain of running commands); then connections are closed.
pub async fn run(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    auth_on: bool,
    metrics: crate::metrics::Metrics,
    drained: impl std::future::Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let all = Arc::new(Semaphore::new(limits.max_connections));
    let unauth = Arc::new(Semaphore::new(limits.max_unauthenticated));
    let closing = CancellationToken::new();
    let tracker = TaskTracker::new();
    let body_timeout = limits.body_timeout;
    let router = router.layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
        body_timeout,
    ));
    tokio::pin!(drained);
    loop {
        let (stream, addr) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // EMFILE and friends: wait a little rather than spin.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut drained => break,
        };
        let permits = all
            .clone()
            .try_acquire_owned()
            .ok()
            .zip(unauth.clone().try_acquire_owned().ok());
        let Some((permit, unauth_permit)) = permits else {
            refuse(stream, &metrics);
            continue;
        };
        let conn_state = Unauthenticated(Arc::new(Mutex::new(Some(unauth_permit))));
        let router = router.clone();
        let closing = closing.clone();
        let header_timeout = limits.header_timeout;
        tracker.spawn(async move {
            let _permit = permit;
            serve_connection(
                stream,
                addr,
                router,
                conn_state,
                auth_on,
                header_timeout,
                closing,
            )
            .await;
        });
    }
    drop(listener);
    tracker.close();
    closing.cancel();
    if tokio::time::timeout(CLOSE_GRACE, tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            connections = tracker.len(),
            "closing connections that did not finish (clients that stopped reading)"
        );
    }
    Ok(())
}

/// The connection as hyper sees it, with one change: hyper answers a request it cannot parse
/// (control bytes in a header, a malformed request line, headers too large) itself, with an
/// empty body. Such an answer, recognised by its empty 4xx head (the gateway's own errors
/// always have a JSON body), is rewritten into the gateway's JSON error body.
struct JsonParseErrors {
    inner: TcpStream,
    /// A rewritten answer being written: the bytes, how many are out, and the length of the
    /// original write to report once done.
    pending: Option<(Vec<u8>, usize, usize)>,
}

impl JsonParseErrors {
    fn new(inner: TcpStream) -> Self {
        Self {
            inner,
            pending: None,
        }
    }

    /// The JSON version of an empty error answer from hyper, if `buf` is one.
    fn rewrite(buf: &[u8]) -> Option<Vec<u8>> {
        let (status, message) = if buf.starts_with(b"HTTP/1.1 400 ") {
            (
                "400",
                "the request is not valid HTTP (a malformed request line, or invalid bytes in a header)",
            )
        } else if buf.starts_with(b"HTTP/1.1 431 ") {
            ("431", "the request headers are too large")
        } else if buf.starts_with(b"HTTP/1.1 414 ") {
            ("414", "the request target is too long")
        } else {
            return None;
        };
        let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
        let head = std::str::from_utf8(&buf[..end]).ok()?;
        if end + 4 != buf.len() || !head.to_ascii_lowercase().contains("\r\ncontent-length: 0") {
            return None;
        }
        let body =
            format!(r#"{{"error":{{"code":"invalid_request","message":"{message} ({status})"}}}}"#);
        let head = head
            .lines()
            .filter(|l| !l.to_ascii_lowercase().starts_with("content-length:"))
            .collect::<Vec<_>>()
            .join("\r\n");
        Some(
            format!(
                "{head}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
            .into_bytes(),
        )
    }
}

impl tokio::io::AsyncRead for JsonParseErrors {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for JsonParseErrors {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        use std::task::Poll;
        if self.pending.is_none()
            && let Some(out) = Self::rewrite(buf)
        {
            self.pending = Some((out, 0, buf.len()));
        }
        let this = &mut *self;
        let Some((out, done, reported)) = this.pending.as_mut() else {
            return std::pin::Pin::new(&mut this.inner).poll_write(cx, buf);
        };
        while *done < out.len() {
            match std::pin::Pin::new(&mut this.inner).poll_write(cx, &out[*done..]) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
                }
                Poll::Ready(Ok(n)) => *done += n,
                other => return other,
            }
        }
        let reported = *reported;
        this.pending = None;
        Poll::Ready(Ok(reported))
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        // An empty error answer is one slice; anything else goes straight through, so that
        // streaming keeps its vectored writes.
        let mut nonempty = bufs.iter().filter(|b| !b.is_empty());
        if let (Some(only), None) = (nonempty.next(), nonempty.next())
            && (self.pending.is_some() || Self::rewrite(only).is_some())
        {
            return self.poll_write(cx, only);
        }
        std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Answers a connection over a cap without waiting for it, and closes it.
fn refuse(stream: TcpStream, metrics: &crate::metrics::Metrics) {
    metrics.rejected(crate::contract::ErrorCode::TooManyRequests);
    let body =
        r#"{"error":{"code":"too_many_requests","message":"too many connections; retry later"}}"#;
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.try_write(answer.as_bytes());
}

async fn serve_connection(
    stream: TcpStream,
    addr: SocketAddr,
    router: Router,
    unauth: Unauthenticated,
    auth_on: bool,
    header_timeout: Duration,
    closing: CancellationToken,
) {
    let _ = stream.set_nodelay(true);
    let closed = PeerClosed(std::os::fd::AsRawFd::as_raw_fd(&stream));
    let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        let ext = req.extensions_mut();
        ext.insert(ConnectInfo(addr));
        ext.insert(closed);
        ext.insert(unauth.clone());
        if !auth_on {
            ext.insert(AuthOff);
        }
        tower::ServiceExt::oneshot(router.clone(), req.map(Body::new))
    });
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        // What hyper queues for a client that does not read (on top of the execution's own
        // buffer): one encoded output chunk, not hyper's default of ~400 KiB.
        .max_buf_size(MAX_CONNECTION_BUFFER)
        // A client may shut down its sending side once the request is sent; that EOF is not
        // the end of the connection, and its command keeps running.
        .half_close(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .enable_connect_protocol();
    let conn =
        builder.serve_connection_with_upgrades(TokioIo::new(JsonParseErrors::new(stream)), service);
    tokio::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(%addr, "connection ended: {e}");
            }
            return;
        }
        () = closing.cancelled() => conn.as_mut().graceful_shutdown(),
    }
    // Idle connections close now; one still streaming gets until the forced close.
    let _ = tokio::time::timeout(CLOSE_GRACE, conn).await;
}
