//! The accept loop: what `axum::serve` does, plus the limits a gateway needs whatever its
//! clients do.
//! - At most `max_connections` connections; of those, at most `max_unauthenticated` that have
//!   not yet made an authenticated request (any request when auth is off). A connection over
//!   `max_connections` gets a `503` JSON answer and is closed at once, so idle or malicious
//!   clients cannot use up the gateway's file descriptors. Over `max_unauthenticated`, the
//!   oldest connection that has not authenticated is closed to make room (as sshd's
//!   `MaxStartups` drops early): a flood of idle connections delays a new client by nothing,
//!   and authenticated connections keep the rest of `max_connections`.
//! - `header_timeout`: the time a client has to send its first byte, then a request's headers,
//!   which is also how long a keep-alive connection may stay idle between requests (hyper
//!   starts the timer when it waits for the next request head).
//! - (The request body timeout is [`crate::server::guard`]'s: it depends on the request.)
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
pub(crate) const MAX_CONNECTION_BUFFER: usize = 96 * 1024;

/// After the drain, how long connections get to finish before they are dropped.
pub(crate) const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// The connection limits (`server.*` in the configuration).
#[derive(Debug, Clone)]
pub(crate) struct ConnectionLimits {
    pub max_connections: usize,
    pub max_unauthenticated: usize,
    pub header_timeout: Duration,
    /// Whether bearer tokens are required: a connection then counts as unauthenticated until
    /// one of its requests passed auth (otherwise until its first request).
    pub auth_on: bool,
}

/// A connection's hold on the unauthenticated cap, released by its first authenticated
/// request. In the extensions of every request of that connection.
#[derive(Clone, Default)]
pub(crate) struct Unauthenticated(Arc<Mutex<Option<OwnedSemaphorePermit>>>);

impl Unauthenticated {
    /// This connection proved who it is: it no longer counts against the cap.
    pub(crate) fn release(&self) {
        self.take();
    }

    fn take(&self) -> Option<OwnedSemaphorePermit> {
        self.0.lock().ok().and_then(|mut p| p.take())
    }

    /// Whether it still counts against the cap.
    fn holds(&self) -> bool {
        self.0.lock().is_ok_and(|p| p.is_some())
    }
}

/// Middleware inside auth: a request that got this far is authenticated (or auth is off),
/// except on the open paths (probes), which prove nothing.
pub(crate) async fn mark_authenticated(req: Request, next: Next) -> Response {
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
pub(crate) struct PeerClosed(std::os::fd::RawFd);

impl PeerClosed {
    /// A token cancelled at the client's EOF, watched until `until` fires. `None` when the
    /// socket cannot be duplicated (out of descriptors): the stream then learns of a gone
    /// client only when a write fails.
    pub(crate) fn watch(&self, until: CancellationToken) -> Option<CancellationToken> {
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

/// The connections that have not authenticated yet, oldest first, each with the token
/// that closes it.
#[derive(Clone, Default)]
struct Pending(Arc<Mutex<std::collections::VecDeque<(Unauthenticated, CancellationToken)>>>);

impl Pending {
    /// Registers a new connection; the token closes it when it is evicted.
    fn add(&self, conn: &Unauthenticated) -> CancellationToken {
        let token = CancellationToken::new();
        if let Ok(mut q) = self.0.lock() {
            // Those that authenticated or ended since are forgotten.
            q.retain(|(c, _)| c.holds());
            q.push_back((conn.clone(), token.clone()));
        }
        token
    }

    /// Closes the oldest connection still unauthenticated and hands its place over.
    fn evict_oldest(&self) -> Option<OwnedSemaphorePermit> {
        let mut q = self.0.lock().ok()?;
        while let Some((conn, token)) = q.pop_front() {
            if let Some(permit) = conn.take() {
                token.cancel();
                return Some(permit);
            }
        }
        None
    }
}

/// Marks requests of a gateway without auth: every request counts as authenticated.
#[derive(Clone, Copy)]
pub(crate) struct AuthOff;

/// Serves `router` on `listener` until `drained` resolves (the caller's shutdown: the
/// signal, then the drain of running commands); then connections are closed.
pub(crate) async fn run(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    metrics: crate::metrics::Metrics,
    drained: impl std::future::Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let all = Arc::new(Semaphore::new(limits.max_connections));
    let unauth = Arc::new(Semaphore::new(limits.max_unauthenticated));
    let closing = CancellationToken::new();
    let tracker = TaskTracker::new();
    tokio::pin!(drained);
    let trimmer = tokio::spawn(return_freed_memory());
    let pending = Pending::default();
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
        let Ok(permit) = all.clone().try_acquire_owned() else {
            refuse(stream, &metrics);
            continue;
        };
        // Over the unauthenticated cap, the oldest connection that has not authenticated
        // yet gives up its place: a flood of idle connections cannot keep a client out.
        let unauth_permit = match unauth.clone().try_acquire_owned() {
            Ok(p) => Some(p),
            Err(_) => pending.evict_oldest(),
        };
        let Some(unauth_permit) = unauth_permit else {
            refuse(stream, &metrics);
            continue;
        };
        let conn_state = Unauthenticated(Arc::new(Mutex::new(Some(unauth_permit))));
        let evicted = pending.add(&conn_state);
        let router = router.clone();
        let closing = closing.clone();
        let header_timeout = limits.header_timeout;
        let auth_on = limits.auth_on;
        tracker.spawn(async move {
            let _permit = permit;
            let state = conn_state.clone();
            tokio::select! {
                () = serve_connection(
                    stream,
                    addr,
                    router,
                    conn_state,
                    auth_on,
                    header_timeout,
                    closing,
                ) => {}
                () = evicted.cancelled() => {
                    tracing::debug!(%addr, "closed an unauthenticated connection to make room");
                }
            }
            // Its place on the unauthenticated cap, if it still has one, is free again.
            state.release();
        });
    }
    drop(listener);
    trimmer.abort();
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

/// glibc keeps what a burst of connections, sessions or streams freed in its arenas, so the
/// gateway's memory would stay at its peak (500 expired MCP sessions kept 34 MiB); giving
/// free pages back to the system now and then lets it fall again.
async fn return_freed_memory() {
    let mut every = tokio::time::interval(Duration::from_secs(30));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: malloc_trim only walks the allocator's own free lists.
        unsafe {
            nix::libc::malloc_trim(0);
        }
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
    // hyper's header timeout starts with the first byte (the protocol is detected from it):
    // a connection that sends nothing is closed here, after the same time.
    let mut first = [0u8; 1];
    tokio::select! {
        sent = tokio::time::timeout(header_timeout, stream.peek(&mut first)) => match sent {
            Ok(Ok(n)) if n > 0 => {}
            _ => {
                tracing::debug!(%addr, "closed a connection that sent nothing");
                return;
            }
        },
        () = closing.cancelled() => return,
    }
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
