//! The gateway's Prometheus metrics, served on `GET /metrics` in the OpenMetrics text format
//! (which Prometheus scrapes natively), built on `prometheus-client`.
//!
//! One [`Metrics`] per gateway, made at start-up and handed to whoever records: the runner
//! counts executions and rejections, [`crate::exec::Execution`] counts streamed bytes
//! through its [`ExecutionObserver`], the Kubernetes backend records pod starts and warm
//! pool claims. Cloning is cheap: every metric is shared behind an `Arc`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::contract::{ErrorCode, Event};

/// The `Content-Type` of [`Metrics::render`]'s output.
pub(crate) const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Execution durations: from a few milliseconds to the default maximum timeout.
const DURATION_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];

/// Pod start times: a warm node starts a pod in well under a second, a cold image pull takes
/// tens of seconds.
const POD_START_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
];

/// How an execution ended, the `result` label of `mcp_run_executions_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Outcome {
    /// Exit code 0.
    Success,
    /// A non-zero exit code.
    Failure,
    /// Killed by a signal (not by the gateway's timeout).
    Signal,
    /// Killed by the gateway at its timeout.
    Timeout,
    /// An `error` event: the backend failed after the stream began.
    Error,
    /// The consumer went away (client disconnect) before the command ended.
    Cancelled,
}

impl Outcome {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Success => "success",
            Outcome::Failure => "failure",
            Outcome::Signal => "signal",
            Outcome::Timeout => "timeout",
            Outcome::Error => "error",
            Outcome::Cancelled => "cancelled",
        }
    }

    /// The outcome a terminal event means; `None` for other events.
    pub(crate) fn of(event: &Event) -> Option<Self> {
        match event {
            Event::Exit(info) if info.timed_out => Some(Outcome::Timeout),
            Event::Exit(info) => Some(match (info.code, info.signal) {
                (Some(0), _) => Outcome::Success,
                (None, Some(_)) => Outcome::Signal,
                _ => Outcome::Failure,
            }),
            Event::Error { .. } => Some(Outcome::Error),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BackendLabels {
    backend: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    backend: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StreamLabels {
    backend: &'static str,
    stream: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClaimLabels {
    profile: String,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProfileLabels {
    profile: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SessionLabels {
    event: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CacheLabels {
    cache: String,
    event: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VersionLabels {
    version: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn duration_histogram() -> Histogram {
    Histogram::new(DURATION_BUCKETS.iter().copied())
}

fn pod_start_histogram() -> Histogram {
    Histogram::new(POD_START_BUCKETS.iter().copied())
}

/// Every metric of the gateway, and the registry that renders them.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    executions: Family<ResultLabels, Counter>,
    durations: HistogramFamily<BackendLabels>,
    in_flight: Family<BackendLabels, Gauge>,
    bytes: Family<StreamLabels, Counter>,
    rejections: Family<ReasonLabels, Counter>,
    pod_start: Histogram,
    /// Warm pool claims by profile and whether a pod was there (hit) or not (miss).
    pool_claims: Family<ClaimLabels, Counter>,
    /// Warm pool refills: from creating a pool pod to it running, by profile.
    pool_refill: HistogramFamily<ProfileLabels>,
    /// Sessions open now, what happened to sessions, and calls run in sessions.
    sessions_open: Gauge,
    session_events: Family<SessionLabels, Counter>,
    cache_events: Family<CacheLabels, Counter>,
    session_calls: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let build_info = Family::<VersionLabels, Gauge>::default();
        build_info
            .get_or_create(&VersionLabels {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        registry.register(
            "mcp_run_build_info",
            "The running mcp-run version",
            build_info,
        );
        let m = Self {
            registry: Arc::new(Registry::default()),
            executions: Family::default(),
            durations: Family::new_with_constructor(duration_histogram as fn() -> Histogram),
            in_flight: Family::default(),
            bytes: Family::default(),
            rejections: Family::default(),
            pod_start: pod_start_histogram(),
            pool_claims: Family::default(),
            pool_refill: Family::new_with_constructor(pod_start_histogram as fn() -> Histogram),
            sessions_open: Gauge::default(),
            session_events: Family::default(),
            cache_events: Family::default(),
            session_calls: Counter::default(),
        };
        registry.register(
            "mcp_run_executions",
            "Executions that ended, by backend and result (success, failure, signal, timeout, error, cancelled)",
            m.executions.clone(),
        );
        registry.register(
            "mcp_run_execution_duration_seconds",
            "Wall time of executions from start to their end, by backend",
            m.durations.clone(),
        );
        registry.register(
            "mcp_run_executions_in_flight",
            "Executions running now, by backend",
            m.in_flight.clone(),
        );
        registry.register(
            "mcp_run_streamed_bytes",
            "Output bytes streamed to clients, by backend and stream (stdout, stderr)",
            m.bytes.clone(),
        );
        registry.register(
            "mcp_run_rejections",
            "Requests refused before their stream began, by error code",
            m.rejections.clone(),
        );
        registry.register(
            "mcp_run_pod_start_duration_seconds",
            "Time from creating a runner pod to it running (Kubernetes backend)",
            m.pod_start.clone(),
        );
        registry.register(
            "mcp_run_warm_pool_claims",
            "Warm pool claims by profile and result (hit: a warm pod was claimed; miss: a pod was created)",
            m.pool_claims.clone(),
        );
        registry.register(
            "mcp_run_warm_pool_refill_duration_seconds",
            "Time from creating a warm pool pod to it running, by profile",
            m.pool_refill.clone(),
        );
        registry.register(
            "mcp_run_sessions_open",
            "Sessions open now on this gateway",
            m.sessions_open.clone(),
        );
        registry.register(
            "mcp_run_sessions",
            "Sessions by what happened to them on this gateway (created, adopted, ended, expired, lost, gone, left: live at its shutdown and left to the other replicas)",
            m.session_events.clone(),
        );
        registry.register(
            "mcp_run_cache_events",
            "Cache volumes by what happened: created, mounted (an existing one reused), waited (held by another run), skipped (run without it), deleted (idle)",
            m.cache_events.clone(),
        );
        registry.register(
            "mcp_run_session_calls",
            "Calls run in sessions (the first one, which opened the session, included)",
            m.session_calls.clone(),
        );
        Self {
            registry: Arc::new(registry),
            ..m
        }
    }

    /// Counts an execution as running; its [`ExecutionObserver`] records how it ends.
    pub fn execution_started(&self, backend: &'static str) -> ExecutionObserver {
        self.in_flight
            .get_or_create(&BackendLabels { backend })
            .inc();
        ExecutionObserver {
            metrics: self.clone(),
            backend,
            started: Instant::now(),
            done: false,
        }
    }

    fn execution_ended(&self, backend: &'static str, outcome: Outcome, duration: Duration) {
        self.in_flight
            .get_or_create(&BackendLabels { backend })
            .dec();
        self.executions
            .get_or_create(&ResultLabels {
                backend,
                result: outcome.as_str(),
            })
            .inc();
        self.durations
            .get_or_create(&BackendLabels { backend })
            .observe(duration.as_secs_f64());
    }

    fn streamed(&self, backend: &'static str, stream: &'static str, n: usize) {
        self.bytes
            .get_or_create(&StreamLabels { backend, stream })
            .inc_by(n as u64);
    }

    /// Counts a request refused before its stream began.
    pub fn rejected(&self, code: ErrorCode) {
        self.rejections
            .get_or_create(&ReasonLabels {
                reason: code.as_str(),
            })
            .inc();
    }

    /// Records how long a runner pod took from creation to Running.
    pub fn observe_pod_start(&self, d: Duration) {
        self.pod_start.observe(d.as_secs_f64());
    }

    /// Counts a warm pool claim: `hit` when a warm pod was claimed.
    pub fn warm_pool_claim(&self, profile: &str, hit: bool) {
        self.pool_claims
            .get_or_create(&ClaimLabels {
                profile: profile.to_owned(),
                result: if hit { "hit" } else { "miss" },
            })
            .inc();
    }

    /// Records how long a warm pool pod took from creation to Running.
    pub fn warm_pool_refill(&self, profile: &str, d: Duration) {
        self.pool_refill
            .get_or_create(&ProfileLabels {
                profile: profile.to_owned(),
            })
            .observe(d.as_secs_f64());
    }

    /// Counts a session event: `created` (open goes up), `ended`, `expired`, `lost` (open
    /// goes down).
    pub fn session(&self, event: &'static str) {
        self.session_events
            .get_or_create(&SessionLabels { event })
            .inc();
        // Adopted: opened by another replica, open on this one now too.
        if event == "created" || event == "adopted" {
            self.sessions_open.inc();
        } else {
            self.sessions_open.dec();
        }
    }

    /// Counts a cache event (see the metric's help) of the profile's cache `cache`.
    pub fn cache(&self, cache: &str, event: &'static str) {
        self.cache_events
            .get_or_create(&CacheLabels {
                cache: cache.to_owned(),
                event,
            })
            .inc();
    }

    /// Counts a call run in a session.
    pub fn session_call(&self) {
        self.session_calls.inc();
    }

    /// Every metric in the OpenMetrics text format.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Follows one execution: counts its streamed bytes, and when it ends (terminal event, or
/// dropped before one), its result and duration.
#[derive(Debug)]
pub struct ExecutionObserver {
    metrics: Metrics,
    backend: &'static str,
    started: Instant,
    done: bool,
}

impl ExecutionObserver {
    /// Records what `event` says about the execution.
    pub fn observe(&mut self, event: &Event) {
        match event {
            Event::Stdout { data } => self.metrics.streamed(self.backend, "stdout", data.len()),
            Event::Stderr { data } => self.metrics.streamed(self.backend, "stderr", data.len()),
            _ => {
                if let Some(outcome) = Outcome::of(event) {
                    self.end(outcome);
                }
            }
        }
    }

    fn end(&mut self, outcome: Outcome) {
        if !self.done {
            self.done = true;
            self.metrics
                .execution_ended(self.backend, outcome, self.started.elapsed());
        }
    }
}

impl Drop for ExecutionObserver {
    fn drop(&mut self) {
        self.end(Outcome::Cancelled);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::ExitInfo;

    fn leaked() -> Metrics {
        Metrics::new()
    }

    fn exit(code: Option<i32>, signal: Option<i32>, timed_out: bool) -> Event {
        Event::Exit(ExitInfo {
            code,
            signal,
            duration_ms: 1,
            timed_out,
        })
    }

    #[test]
    fn outcomes() {
        assert_eq!(
            Outcome::of(&exit(Some(0), None, false)),
            Some(Outcome::Success)
        );
        assert_eq!(
            Outcome::of(&exit(Some(3), None, false)),
            Some(Outcome::Failure)
        );
        assert_eq!(
            Outcome::of(&exit(None, Some(9), false)),
            Some(Outcome::Signal)
        );
        assert_eq!(
            Outcome::of(&exit(None, Some(9), true)),
            Some(Outcome::Timeout)
        );
        let err = Event::Error {
            code: ErrorCode::PodFailed,
            message: "x".into(),
        };
        assert_eq!(Outcome::of(&err), Some(Outcome::Error));
        assert_eq!(Outcome::of(&Event::Keepalive), None);
    }

    #[test]
    fn an_execution_is_counted_once_with_its_bytes() {
        let r = leaked();
        let mut o = r.execution_started("local");
        assert!(
            r.render()
                .contains("mcp_run_executions_in_flight{backend=\"local\"} 1\n")
        );
        o.observe(&Event::Stdout {
            data: "hello".into(),
        });
        o.observe(&Event::Stderr { data: "ab".into() });
        o.observe(&exit(Some(0), None, false));
        drop(o);
        let text = r.render();
        for line in [
            "mcp_run_executions_total{backend=\"local\",result=\"success\"} 1\n",
            "mcp_run_executions_in_flight{backend=\"local\"} 0\n",
            "mcp_run_streamed_bytes_total{backend=\"local\",stream=\"stdout\"} 5\n",
            "mcp_run_streamed_bytes_total{backend=\"local\",stream=\"stderr\"} 2\n",
            "mcp_run_execution_duration_seconds_count{backend=\"local\"} 1\n",
            "mcp_run_execution_duration_seconds_bucket{le=\"+Inf\",backend=\"local\"} 1\n",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        assert!(!text.contains("result=\"cancelled\""), "{text}");
    }

    #[test]
    fn dropped_before_the_end_is_cancelled() {
        let r = leaked();
        drop(r.execution_started("kubernetes"));
        assert!(
            r.render().contains(
                "mcp_run_executions_total{backend=\"kubernetes\",result=\"cancelled\"} 1\n"
            )
        );
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let r = leaked();
        r.observe_pod_start(Duration::from_millis(300));
        r.observe_pod_start(Duration::from_millis(1500));
        r.observe_pod_start(Duration::from_secs(500));
        let text = r.render();
        for line in [
            "mcp_run_pod_start_duration_seconds_bucket{le=\"0.25\"} 0\n",
            "mcp_run_pod_start_duration_seconds_bucket{le=\"0.5\"} 1\n",
            "mcp_run_pod_start_duration_seconds_bucket{le=\"2.0\"} 2\n",
            "mcp_run_pod_start_duration_seconds_bucket{le=\"120.0\"} 2\n",
            "mcp_run_pod_start_duration_seconds_bucket{le=\"+Inf\"} 3\n",
            "mcp_run_pod_start_duration_seconds_sum 501.8\n",
            "mcp_run_pod_start_duration_seconds_count 3\n",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
    }

    #[test]
    fn rejections_by_reason() {
        let r = leaked();
        r.rejected(ErrorCode::TooManyRequests);
        r.rejected(ErrorCode::TooManyRequests);
        r.rejected(ErrorCode::InvalidRequest);
        let text = r.render();
        assert!(text.contains("mcp_run_rejections_total{reason=\"too_many_requests\"} 2\n"));
        assert!(text.contains("mcp_run_rejections_total{reason=\"invalid_request\"} 1\n"));
    }
}
