//! The gateway's Prometheus metrics, served on `GET /metrics` in the Prometheus text
//! exposition format (version 0.0.4).
//!
//! One process-wide registry, always present, so that any part of the gateway can record
//! without a handle being threaded through: the runner counts executions and rejections,
//! [`crate::exec::Execution`] counts streamed bytes, the Kubernetes backend calls
//! [`observe_pod_start`]. A handful of mutex-guarded maps is enough at the gateway's request
//! rates and keeps the output exactly the 0.0.4 format without a dependency.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{LazyLock, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::contract::{ErrorCode, Event};

/// The `Content-Type` of [`render`]'s output.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

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
pub enum Outcome {
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
    pub fn as_str(self) -> &'static str {
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
    pub fn of(event: &Event) -> Option<Self> {
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

#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    /// Non-cumulative counts per bucket; the last one is `+Inf`.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, value: f64) {
        let i = self
            .bounds
            .iter()
            .position(|b| value <= *b)
            .unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += value;
        self.count += 1;
    }

    fn write(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (i, n) in self.counts.iter().enumerate() {
            cumulative += n;
            let le = match self.bounds.get(i) {
                Some(b) => format_float(*b),
                None => "+Inf".into(),
            };
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {cumulative}"
            );
        }
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {}", format_float(self.sum));
        let _ = writeln!(out, "{name}_count{braces} {}", self.count);
    }
}

/// Floats as Prometheus writes them: integers without a fraction, others in the shortest
/// form that round-trips.
fn format_float(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else if v.is_nan() {
        "NaN".into()
    } else {
        format!("{v}")
    }
}

/// Every metric of the gateway. Tests make their own; the gateway uses [`registry`].
#[derive(Debug)]
pub struct Registry {
    executions: Mutex<BTreeMap<(&'static str, Outcome), u64>>,
    durations: Mutex<BTreeMap<&'static str, Histogram>>,
    in_flight: Mutex<BTreeMap<&'static str, i64>>,
    bytes: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    rejections: Mutex<BTreeMap<&'static str, u64>>,
    pod_start: Mutex<Histogram>,
    /// Warm pool claims by profile and whether a pod was there (hit) or not (miss).
    pool_claims: Mutex<BTreeMap<(String, bool), u64>>,
    /// Warm pool refills: from creating a pool pod to it running, by profile.
    pool_refill: Mutex<BTreeMap<String, Histogram>>,
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

/// A poisoned metrics lock only means another thread panicked mid-update of a number:
/// the data is still usable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Registry {
    pub fn new() -> Self {
        Self {
            executions: Mutex::default(),
            durations: Mutex::default(),
            in_flight: Mutex::default(),
            bytes: Mutex::default(),
            rejections: Mutex::default(),
            pod_start: Mutex::new(Histogram::new(POD_START_BUCKETS)),
            pool_claims: Mutex::default(),
            pool_refill: Mutex::default(),
        }
    }

    /// Counts an execution as running; its [`ExecutionObserver`] records how it ends.
    pub fn execution_started(&'static self, backend: &'static str) -> ExecutionObserver {
        *lock(&self.in_flight).entry(backend).or_default() += 1;
        ExecutionObserver {
            registry: self,
            backend,
            started: Instant::now(),
            done: false,
        }
    }

    fn execution_ended(&self, backend: &'static str, outcome: Outcome, duration: Duration) {
        *lock(&self.in_flight).entry(backend).or_default() -= 1;
        *lock(&self.executions)
            .entry((backend, outcome))
            .or_default() += 1;
        lock(&self.durations)
            .entry(backend)
            .or_insert_with(|| Histogram::new(DURATION_BUCKETS))
            .observe(duration.as_secs_f64());
    }

    fn streamed(&self, backend: &'static str, stream: &'static str, n: usize) {
        *lock(&self.bytes).entry((backend, stream)).or_default() += n as u64;
    }

    /// Counts a request refused before its stream began.
    pub fn rejected(&self, code: ErrorCode) {
        *lock(&self.rejections).entry(code.as_str()).or_default() += 1;
    }

    /// Records how long a runner pod took from creation to Running.
    pub fn observe_pod_start(&self, d: Duration) {
        lock(&self.pod_start).observe(d.as_secs_f64());
    }

    /// Counts a warm pool claim: `hit` when a warm pod was claimed.
    pub fn warm_pool_claim(&self, profile: &str, hit: bool) {
        *lock(&self.pool_claims)
            .entry((profile.to_string(), hit))
            .or_default() += 1;
    }

    /// Records how long a warm pool pod took from creation to Running.
    pub fn warm_pool_refill(&self, profile: &str, d: Duration) {
        lock(&self.pool_refill)
            .entry(profile.to_string())
            .or_insert_with(|| Histogram::new(POD_START_BUCKETS))
            .observe(d.as_secs_f64());
    }

    /// The whole registry in the Prometheus text format.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        let _ = writeln!(
            out,
            "# HELP mcp_run_build_info The running mcp-run version.\n\
             # TYPE mcp_run_build_info gauge\n\
             mcp_run_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        );

        header(
            &mut out,
            "mcp_run_executions_total",
            "counter",
            "Executions that ended, by backend and result (success, failure, signal, timeout, error, cancelled).",
        );
        for ((backend, outcome), n) in lock(&self.executions).iter() {
            let _ = writeln!(
                out,
                "mcp_run_executions_total{{backend=\"{backend}\",result=\"{}\"}} {n}",
                outcome.as_str()
            );
        }

        header(
            &mut out,
            "mcp_run_execution_duration_seconds",
            "histogram",
            "Wall time of executions from start to their end, by backend.",
        );
        for (backend, h) in lock(&self.durations).iter() {
            h.write(
                &mut out,
                "mcp_run_execution_duration_seconds",
                &format!("backend=\"{backend}\""),
            );
        }

        header(
            &mut out,
            "mcp_run_executions_in_flight",
            "gauge",
            "Executions running now, by backend.",
        );
        for (backend, n) in lock(&self.in_flight).iter() {
            let _ = writeln!(
                out,
                "mcp_run_executions_in_flight{{backend=\"{backend}\"}} {n}"
            );
        }

        header(
            &mut out,
            "mcp_run_streamed_bytes_total",
            "counter",
            "Output bytes streamed to clients, by backend and stream (stdout, stderr).",
        );
        for ((backend, stream), n) in lock(&self.bytes).iter() {
            let _ = writeln!(
                out,
                "mcp_run_streamed_bytes_total{{backend=\"{backend}\",stream=\"{stream}\"}} {n}"
            );
        }

        header(
            &mut out,
            "mcp_run_rejections_total",
            "counter",
            "Requests refused before their stream began, by error code.",
        );
        for (reason, n) in lock(&self.rejections).iter() {
            let _ = writeln!(out, "mcp_run_rejections_total{{reason=\"{reason}\"}} {n}");
        }

        header(
            &mut out,
            "mcp_run_pod_start_duration_seconds",
            "histogram",
            "Time from creating a runner pod to it running (Kubernetes backend).",
        );
        lock(&self.pod_start).write(&mut out, "mcp_run_pod_start_duration_seconds", "");

        header(
            &mut out,
            "mcp_run_warm_pool_claims_total",
            "counter",
            "Warm pool claims by profile and result (hit: a warm pod was claimed; miss: a pod was created).",
        );
        for ((profile, hit), n) in lock(&self.pool_claims).iter() {
            let result = if *hit { "hit" } else { "miss" };
            let _ = writeln!(
                out,
                "mcp_run_warm_pool_claims_total{{profile=\"{}\",result=\"{result}\"}} {n}",
                escape_label(profile)
            );
        }

        header(
            &mut out,
            "mcp_run_warm_pool_refill_duration_seconds",
            "histogram",
            "Time from creating a warm pool pod to it running, by profile.",
        );
        for (profile, h) in lock(&self.pool_refill).iter() {
            h.write(
                &mut out,
                "mcp_run_warm_pool_refill_duration_seconds",
                &format!("profile=\"{}\"", escape_label(profile)),
            );
        }
        out
    }
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// Follows one execution: counts its streamed bytes, and when it ends (terminal event, or
/// dropped before one), its result and duration.
#[derive(Debug)]
pub struct ExecutionObserver {
    registry: &'static Registry,
    backend: &'static str,
    started: Instant,
    done: bool,
}

impl ExecutionObserver {
    /// Records what `event` says about the execution.
    pub fn observe(&mut self, event: &Event) {
        match event {
            Event::Stdout { data } => self.registry.streamed(self.backend, "stdout", data.len()),
            Event::Stderr { data } => self.registry.streamed(self.backend, "stderr", data.len()),
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
            self.registry
                .execution_ended(self.backend, outcome, self.started.elapsed());
        }
    }
}

impl Drop for ExecutionObserver {
    fn drop(&mut self) {
        self.end(Outcome::Cancelled);
    }
}

static REGISTRY: LazyLock<Registry> = LazyLock::new(Registry::new);

/// The gateway's registry.
pub fn registry() -> &'static Registry {
    &REGISTRY
}

/// Records how long a runner pod took to start (called by the Kubernetes backend).
pub fn observe_pod_start(d: Duration) {
    registry().observe_pod_start(d);
}

/// See [`Registry::warm_pool_claim`].
pub fn warm_pool_claim(profile: &str, hit: bool) {
    registry().warm_pool_claim(profile, hit);
}

/// See [`Registry::warm_pool_refill`].
pub fn warm_pool_refill(profile: &str, d: Duration) {
    registry().warm_pool_refill(profile, d);
}

/// A label value as the text format wants it: backslash, quote and newline escaped.
fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Counts a request refused before its stream began.
pub fn rejected(code: ErrorCode) {
    registry().rejected(code);
}

/// Starts following an execution on `backend`.
pub fn execution_started(backend: &'static str) -> ExecutionObserver {
    registry().execution_started(backend)
}

/// The gateway's metrics in the Prometheus text format.
pub fn render() -> String {
    registry().render()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::ExitInfo;

    fn leaked() -> &'static Registry {
        Box::leak(Box::new(Registry::new()))
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
            "mcp_run_execution_duration_seconds_bucket{backend=\"local\",le=\"+Inf\"} 1\n",
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
            "mcp_run_pod_start_duration_seconds_bucket{le=\"2\"} 2\n",
            "mcp_run_pod_start_duration_seconds_bucket{le=\"120\"} 2\n",
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
