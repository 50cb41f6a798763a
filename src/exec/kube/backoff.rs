//! One backoff for every retried Kubernetes API call (the start path, the pod guard's
//! deletions, the warm pool, the permission checks), with backon:
//!
//! - what may heal is retried (429, 500, 502, 503, 504, a lost connection, no answer in
//!   time), with exponential backoff and jitter as client-go's, and never sooner than the
//!   server's `Retry-After` (the header, which API Priority and Fairness sends with a
//!   plain-text body, or the Status' `details.retryAfterSeconds`);
//! - retries end by time, never by count: each call belongs to a phase with a budget (the
//!   request's start timeout, a deletion's 30 s), and a wait that would reach the end of the
//!   budget is not begun: the call fails at once, saying why;
//! - an API server that cannot be reached at all (connection refused, a name that does not
//!   resolve, a TLS handshake that fails) is not a busy one: it fails within
//!   [`UNREACHABLE_GRACE`], with the cause, as kubectl does.
//!
//! kube-rs's own retry layer (429/503/504, up to 15 times) is off (`setup.rs`), so that the
//! two never compound. [`RetryAfterLayer`] carries the `Retry-After` header into the Status
//! that kube-rs hands back, for every call the client makes.

use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use backon::{BackoffBuilder as _, ExponentialBuilder, Retryable as _};
use futures_util::StreamExt as _;
use http_body_util::BodyExt as _;
use hyper::{Response, StatusCode};
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::watcher;
use tokio::time::Instant;

/// How long an unreachable API server (connection refused, DNS, TLS) is retried: long
/// enough for a load balancer to move to a restarted replica, short enough to say at once
/// that the address or the credentials are wrong.
pub(super) const UNREACHABLE_GRACE: Duration = Duration::from_secs(3);

/// An exec request and its WebSocket upgrade may take this long.
pub(super) const EXEC_UPGRADE_TIMEOUT: Duration = Duration::from_secs(30);

/// The largest error body read to add a `Retry-After` to it.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// The backoff of every retry: 200 ms doubling to 5 s, with jitter, unbounded in count (the
/// budget ends it).
pub(super) fn exponential() -> ExponentialBuilder {
    ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(200))
        .with_max_delay(Duration::from_secs(5))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
}

/// What a failed call means for retrying it.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Trouble {
    /// Busy or briefly away (429, 5xx, a lost connection): retried, after `retry_after`
    /// when the server said.
    Busy { retry_after: Option<Duration> },
    /// Not reachable at all: connection refused, DNS, TLS.
    Unreachable,
    /// The answer stands (403, 404, 409, 422, ...).
    Final,
}

/// Classifies a kube-rs error.
pub(super) fn classify(e: &kube::Error) -> Trouble {
    match e {
        kube::Error::Api(s) => match s.code {
            429 | 500 | 502 | 503 | 504 => Trouble::Busy {
                retry_after: s
                    .details
                    .as_ref()
                    .map(|d| d.retry_after_seconds)
                    .filter(|s| *s > 0)
                    .map(|s| Duration::from_secs(u64::from(s))),
            },
            _ => Trouble::Final,
        },
        kube::Error::BuildRequest(_)
        | kube::Error::SerdeError(_)
        | kube::Error::FromUtf8(_)
        | kube::Error::UpgradeConnection(_) => Trouble::Final,
        other if is_unreachable(other) => Trouble::Unreachable,
        // Connections reset or closed mid-request, timeouts, an upgrade that failed.
        _ => Trouble::Busy { retry_after: None },
    }
}

/// Whether the error is a failure to connect (TCP, DNS, TLS handshake) rather than a
/// connection lost on the way.
fn is_unreachable(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(h) = err.downcast_ref::<hyper_util::client::legacy::Error>() {
            return h.is_connect();
        }
        cur = err.source();
    }
    false
}

/// An error and its causes on one line ("client error (Connect): tcp connect error:
/// Connection refused (os error 111)"), without repeating what a wrapper already says.
pub(super) fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(err) = cur {
        let s = err.to_string();
        if !out.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        cur = err.source();
    }
    out
}

/// What one call under a budget may take.
#[derive(Debug, Clone, Copy)]
pub(super) struct Budget {
    /// When the phase the call belongs to ends.
    pub end: Instant,
    /// One attempt may take this long (less when the budget ends sooner).
    pub attempt: Duration,
    /// Whether a 500 may heal (an etcd leader change while creating) or is an answer (the
    /// kubelet's refusal of an exec).
    pub retry_internal: bool,
}

impl Budget {
    pub(super) fn left(&self) -> Duration {
        self.end.saturating_duration_since(Instant::now())
    }
}

/// Why a call under a budget failed.
#[derive(Debug)]
pub(super) enum Failure {
    /// An answer that retrying cannot change.
    Api(kube::Error),
    /// It kept failing in ways that may heal until the budget (or the next wait) ran out.
    OutOfTime { attempts: u32, last: String },
    /// The API server cannot be reached (connection refused, DNS, TLS).
    Unreachable(String),
}

/// The outcome of one attempt.
#[derive(Debug)]
enum Attempt {
    Failed(kube::Error),
    NoAnswer(Duration),
}

impl Attempt {
    fn trouble(&self, budget: &Budget) -> Trouble {
        match self {
            Attempt::Failed(kube::Error::Api(s)) if s.code == 500 && !budget.retry_internal => {
                Trouble::Final
            }
            Attempt::Failed(e) => classify(e),
            Attempt::NoAnswer(_) => Trouble::Busy { retry_after: None },
        }
    }

    fn why(&self) -> String {
        match self {
            Attempt::Failed(kube::Error::Api(s)) => {
                let after = match classify(&kube::Error::Api(s.clone())) {
                    Trouble::Busy {
                        retry_after: Some(d),
                    } => format!("; Retry-After {}s", d.as_secs()),
                    _ => String::new(),
                };
                format!("{} ({}, HTTP {}{after})", s.message, s.reason, s.code)
            }
            Attempt::Failed(e) => describe(e),
            Attempt::NoAnswer(d) => format!("no answer within {:.1}s", d.as_secs_f64()),
        }
    }
}

/// Runs `op` until it succeeds, its error is final, or `budget` ends: 429/5xx and lost
/// connections are retried with [`exponential`] backoff, never sooner than Retry-After,
/// and no wait is begun that would end beyond the budget; an unreachable server is retried
/// for at most [`UNREACHABLE_GRACE`]. `what` names the call in the log.
pub(super) async fn call<T, F, Fut>(what: &str, budget: Budget, mut op: F) -> Result<T, Failure>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, kube::Error>>,
{
    let attempts = AtomicU32::new(0);
    let unreachable_since: Mutex<Option<Instant>> = Mutex::new(None);
    let attempt = || {
        attempts.fetch_add(1, Ordering::Relaxed);
        let limit = budget.attempt.min(budget.left());
        let fut = op();
        async move {
            match tokio::time::timeout(limit, fut).await {
                Ok(r) => r.map_err(Attempt::Failed),
                Err(_) => Err(Attempt::NoAnswer(limit)),
            }
        }
    };
    let result = attempt
        .retry(exponential())
        .sleep(tokio::time::sleep)
        .when(|e: &Attempt| match e.trouble(&budget) {
            Trouble::Busy { .. } => {
                *unreachable_since.lock().unwrap_or_else(|e| e.into_inner()) = None;
                true
            }
            Trouble::Unreachable => {
                let mut since = unreachable_since.lock().unwrap_or_else(|e| e.into_inner());
                since.get_or_insert_with(Instant::now).elapsed() < UNREACHABLE_GRACE
            }
            Trouble::Final => false,
        })
        .adjust(|e: &Attempt, backoff: Option<Duration>| {
            let wait = match e.trouble(&budget) {
                Trouble::Busy {
                    retry_after: Some(after),
                } => after,
                _ => backoff?,
            };
            // A wait that ends at or beyond the budget is not begun: no attempt could follow.
            (Instant::now() + wait < budget.end).then_some(wait)
        })
        .notify(|e: &Attempt, wait: Duration| {
            tracing::warn!(
                attempt = attempts.load(Ordering::Relaxed),
                wait_ms = wait.as_millis() as u64,
                "{what} failed, retrying: {}",
                e.why()
            );
        })
        .await;
    result.map_err(|e| match e.trouble(&budget) {
        Trouble::Final => match e {
            Attempt::Failed(k) => Failure::Api(k),
            Attempt::NoAnswer(_) => unreachable!("no answer is never final"),
        },
        Trouble::Unreachable => Failure::Unreachable(e.why()),
        Trouble::Busy { .. } => Failure::OutOfTime {
            attempts: attempts.load(Ordering::Relaxed),
            last: e.why(),
        },
    })
}

/// Why a watch of one pod ended without the awaited state.
#[derive(Debug)]
pub(super) enum WatchEnd {
    /// The deadline came first.
    Deadline,
    /// The watch was refused (401, 403): retrying cannot help.
    Refused(kube::Error),
    /// The API server cannot be reached (connection refused, DNS, TLS).
    Unreachable(String),
}

/// Watches one pod (kube-runtime's `watch_object`: a watch, no polling; resumed from the
/// last resourceVersion after a transport error, relisted after 410 Gone) until `seen`
/// returns `Some` for a state of it (`None`: the pod does not exist) or `end` comes.
/// Errors are waited out with [`exponential`] backoff, never sooner than Retry-After.
pub(super) async fn watch_pod<T>(
    pods: &Api<Pod>,
    name: &str,
    end: Instant,
    mut seen: impl FnMut(Option<Pod>) -> Option<T>,
) -> Result<T, WatchEnd> {
    let mut events = std::pin::pin!(watcher::watch_object(pods.clone(), name));
    let mut backoff = exponential().build();
    let mut unreachable_since: Option<Instant> = None;
    loop {
        let next = tokio::time::timeout_at(end, events.next())
            .await
            .map_err(|_| WatchEnd::Deadline)?;
        let e = match next {
            Some(Ok(pod)) => {
                backoff = exponential().build();
                unreachable_since = None;
                if let Some(done) = seen(pod) {
                    return Ok(done);
                }
                continue;
            }
            Some(Err(e)) => e,
            None => return Err(WatchEnd::Deadline),
        };
        let api = match &e {
            watcher::Error::InitialListFailed(k)
            | watcher::Error::WatchStartFailed(k)
            | watcher::Error::WatchFailed(k) => Some(k),
            _ => None,
        };
        let mut retry_after = None;
        match api {
            Some(k @ kube::Error::Api(s)) if matches!(s.code, 401 | 403) => {
                return Err(WatchEnd::Refused(clone_api(k)));
            }
            Some(k) => match classify(k) {
                Trouble::Unreachable => {
                    let since = *unreachable_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= UNREACHABLE_GRACE {
                        return Err(WatchEnd::Unreachable(describe(k)));
                    }
                }
                Trouble::Busy { retry_after: r } => retry_after = r,
                // 410 Gone and the like: the watcher relists on its next poll.
                Trouble::Final => {}
            },
            None => {}
        }
        let wait = retry_after
            .or_else(|| backoff.next())
            .unwrap_or(Duration::from_secs(5));
        tracing::debug!(
            pod = name,
            wait_ms = wait.as_millis() as u64,
            "watching the pod: {}; resuming",
            describe(&e)
        );
        if Instant::now() + wait >= end {
            tokio::time::sleep_until(end).await;
            return Err(WatchEnd::Deadline);
        }
        tokio::time::sleep(wait).await;
    }
}

fn clone_api(e: &kube::Error) -> kube::Error {
    match e {
        kube::Error::Api(s) => kube::Error::Api(s.clone()),
        other => kube::Error::Service(other.to_string().into()),
    }
}

/// The body of the client's error answers once [`retry_after_layer`] has read them.
pub(super) type RewrittenBody =
    http_body_util::Either<Box<kube::client::DynBody>, http_body_util::Full<bytes::Bytes>>;

type Rewrite = fn(
    Response<Box<kube::client::DynBody>>,
) -> futures_util::future::BoxFuture<
    'static,
    Result<Response<RewrittenBody>, tower::BoxError>,
>;

/// A client layer that carries a `Retry-After` header into the `Status` kube-rs returns:
/// API Priority and Fairness answers 429 with the header and a plain-text body
/// (`Too many requests, please try again later.`), which kube-rs turns into a Status
/// without `details.retryAfterSeconds`. Bodies of error answers with the header are read
/// (at most 64 KiB) and rewritten as a Status that carries it.
pub(super) fn retry_after_layer() -> tower::util::AndThenLayer<Rewrite> {
    tower::util::AndThenLayer::new(rewrite as Rewrite)
}

fn rewrite(
    res: Response<Box<kube::client::DynBody>>,
) -> futures_util::future::BoxFuture<'static, Result<Response<RewrittenBody>, tower::BoxError>> {
    use http_body_util::Either;
    let retry_after = res
        .headers()
        .get(hyper::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u32>().ok())
        .filter(|s| *s > 0);
    let status = res.status();
    let (Some(secs), true) = (
        retry_after,
        status.is_client_error() || status.is_server_error(),
    ) else {
        return Box::pin(async move { Ok(res.map(Either::Left)) });
    };
    Box::pin(async move {
        let (parts, mut body) = res.into_parts();
        let mut bytes = Vec::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame?.into_data() {
                bytes.extend_from_slice(&data);
                if bytes.len() > MAX_ERROR_BODY {
                    break;
                }
            }
        }
        let text = with_retry_after(&bytes, status, secs);
        Ok(Response::from_parts(
            parts,
            Either::Right(http_body_util::Full::new(bytes::Bytes::from(text))),
        ))
    })
}

/// The Status of an error answer, with `details.retryAfterSeconds` set when it is not.
fn with_retry_after(body: &[u8], code: StatusCode, secs: u32) -> Vec<u8> {
    use kube::core::Status;
    let mut status = match serde_json::from_slice::<Status>(body) {
        Ok(s) => s,
        Err(_) => {
            let text = String::from_utf8_lossy(body).trim().to_string();
            let reason = match code {
                StatusCode::TOO_MANY_REQUESTS => "TooManyRequests",
                StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailable",
                StatusCode::GATEWAY_TIMEOUT => "Timeout",
                _ => "InternalError",
            };
            Status::failure(&text, reason).with_code(code.as_u16())
        }
    };
    let details = status
        .details
        .get_or_insert_with(|| kube::core::response::StatusDetails {
            name: String::new(),
            group: String::new(),
            kind: String::new(),
            uid: String::new(),
            causes: Vec::new(),
            retry_after_seconds: 0,
        });
    if details.retry_after_seconds == 0 {
        details.retry_after_seconds = secs;
    }
    serde_json::to_vec(&status).unwrap_or_else(|_| body.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_text_429_gets_its_retry_after() {
        let body = with_retry_after(
            b"Too many requests, please try again later.\n",
            StatusCode::TOO_MANY_REQUESTS,
            3,
        );
        let s: kube::core::Status = serde_json::from_slice(&body).unwrap();
        assert_eq!(s.code, 429);
        assert_eq!(s.message, "Too many requests, please try again later.");
        assert_eq!(
            classify(&kube::Error::Api(Box::new(s))),
            Trouble::Busy {
                retry_after: Some(Duration::from_secs(3))
            }
        );
        // A Status that says it itself keeps its own value.
        let own = br#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"m","reason":"TooManyRequests","details":{"retryAfterSeconds":7},"code":429}"#;
        let s: kube::core::Status =
            serde_json::from_slice(&with_retry_after(own, StatusCode::TOO_MANY_REQUESTS, 1))
                .unwrap();
        assert_eq!(s.details.unwrap().retry_after_seconds, 7);
    }

    #[tokio::test(start_paused = true)]
    async fn retries_honour_retry_after_and_end_with_the_budget() {
        let budget = Budget {
            end: Instant::now() + Duration::from_secs(10),
            attempt: Duration::from_secs(5),
            retry_internal: true,
        };
        let too_many = || {
            kube::Error::Api(Box::new(
                kube::core::Status::failure("slow down", "TooManyRequests")
                    .with_code(429)
                    .with_details(kube::core::response::StatusDetails {
                        name: String::new(),
                        group: String::new(),
                        kind: String::new(),
                        uid: String::new(),
                        causes: Vec::new(),
                        retry_after_seconds: 2,
                    }),
            ))
        };
        let start = Instant::now();
        let mut times = Vec::new();
        let r: Result<(), Failure> = call("test", budget, || {
            times.push(start.elapsed());
            let e = too_many();
            async move { Err(e) }
        })
        .await;
        // At 0, 2, 4, 6, 8 s: the wait after the fifth would reach the budget's end.
        assert_eq!(
            times,
            (0..5)
                .map(|i| Duration::from_secs(2 * i))
                .collect::<Vec<_>>()
        );
        match r {
            Err(Failure::OutOfTime { attempts, last }) => {
                assert_eq!(attempts, 5);
                assert!(last.contains("Retry-After 2s"), "{last}");
            }
            other => panic!("{other:?}"),
        }
        // A final answer is not retried.
        let mut n = 0;
        let r: Result<(), Failure> = call("test", budget, || {
            n += 1;
            async {
                Err(kube::Error::Api(Box::new(
                    kube::core::Status::failure("no", "Forbidden").with_code(403),
                )))
            }
        })
        .await;
        assert!(matches!(r, Err(Failure::Api(_))));
        assert_eq!(n, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_without_an_answer_is_retried_until_the_budget_ends() {
        let budget = Budget {
            end: Instant::now() + Duration::from_secs(3),
            attempt: Duration::from_secs(1),
            retry_internal: true,
        };
        let start = Instant::now();
        let r: Result<(), Failure> = call("test", budget, std::future::pending).await;
        assert!(matches!(r, Err(Failure::OutOfTime { .. })), "{r:?}");
        assert!(start.elapsed() <= Duration::from_secs(3));
    }
}
