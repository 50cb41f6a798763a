//! `GET /metrics` of the real gateway binary: the text format parses, and running commands
//! moves the counters the way the requests say.

use crate::support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use regex::Regex;
use support::{Gateway, http, raw, raw_bytes};

/// One parsed exposition: sample (name with sorted labels) -> value, and family -> type.
#[derive(Debug, Default)]
struct Exposition {
    samples: BTreeMap<String, f64>,
    types: BTreeMap<String, String>,
}

impl Exposition {
    fn get(&self, key: &str) -> f64 {
        self.samples.get(key).copied().unwrap_or(0.0)
    }
}

/// Parses the OpenMetrics text format strictly: every line a HELP, a TYPE or a sample, then
/// `# EOF`; names and labels well-formed; each sample after its family's TYPE (a counter
/// family `x` has the sample `x_total`); no sample twice; histogram buckets cumulative and
/// ending in `+Inf` equal to `_count`.
fn parse(text: &str) -> Exposition {
    let name = r"[a-zA-Z_:][a-zA-Z0-9_:]*";
    let help = Regex::new(&format!(r"^# HELP ({name}) (.*)$")).unwrap();
    let typ = Regex::new(&format!(
        r"^# TYPE ({name}) (counter|gauge|histogram|summary|untyped)$"
    ))
    .unwrap();
    let sample = Regex::new(&format!(r"^({name})(\{{(.*)\}})? ([^ ]+)( -?[0-9]+)?$")).unwrap();
    let label = Regex::new(r#"^([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"$"#).unwrap();
    let mut out = Exposition::default();
    let text = text
        .strip_suffix("# EOF\n")
        .expect("the exposition must end with `# EOF` and a newline");
    for line in text.lines() {
        if let Some(c) = help.captures(line) {
            assert!(!c[2].is_empty(), "empty HELP: {line}");
            continue;
        }
        if let Some(c) = typ.captures(line) {
            assert!(
                out.types.insert(c[1].to_owned(), c[2].to_owned()).is_none(),
                "TYPE twice: {line}"
            );
            continue;
        }
        let c = sample
            .captures(line)
            .unwrap_or_else(|| panic!("not a valid exposition line: {line:?}"));
        let metric = &c[1];
        let family = [
            ("_bucket", "histogram"),
            ("_sum", "histogram"),
            ("_count", "histogram"),
            ("_total", "counter"),
        ]
        .iter()
        .find_map(|(s, kind)| {
            metric
                .strip_suffix(s)
                .filter(|f| out.types.get(*f).map(String::as_str) == Some(*kind))
        })
        .unwrap_or(metric);
        assert!(
            out.types.contains_key(family),
            "sample before its TYPE: {line}"
        );
        let mut labels = Vec::new();
        if let Some(inner) = c.get(3) {
            // Label values here never contain commas; split and check each pair.
            for pair in inner.as_str().split(',') {
                let l = label
                    .captures(pair)
                    .unwrap_or_else(|| panic!("bad label {pair:?} in {line:?}"));
                labels.push(format!("{}=\"{}\"", &l[1], &l[2]));
            }
        }
        labels.sort();
        let value: f64 = match &c[4] {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            "NaN" => f64::NAN,
            v => v
                .parse()
                .unwrap_or_else(|_| panic!("bad value in {line:?}")),
        };
        let key = if labels.is_empty() {
            metric.to_owned()
        } else {
            format!("{metric}{{{}}}", labels.join(","))
        };
        assert!(
            out.samples.insert(key, value).is_none(),
            "sample twice: {line}"
        );
    }
    check_histograms(&out);
    out
}

fn check_histograms(e: &Exposition) {
    let le = Regex::new(r#"le="([^"]+)""#).unwrap();
    for (family, kind) in &e.types {
        if kind != "histogram" {
            continue;
        }
        // Group buckets by their other labels.
        let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        for (key, value) in &e.samples {
            if let Some(rest) = key.strip_prefix(&format!("{family}_bucket")) {
                let bound = le.captures(rest).expect("bucket without le")[1].to_owned();
                let bound = if bound == "+Inf" {
                    f64::INFINITY
                } else {
                    bound.parse().unwrap()
                };
                let others = le.replace(rest, "").replace("{,", "{").replace(",}", "}");
                series.entry(others).or_default().push((bound, *value));
            }
        }
        for (others, mut buckets) in series {
            buckets.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
            assert!(
                buckets.windows(2).all(|w| w[0].1 <= w[1].1),
                "{family}{others}: buckets not cumulative: {buckets:?}"
            );
            let (last_bound, last) = *buckets.last().unwrap();
            assert_eq!(
                last_bound,
                f64::INFINITY,
                "{family}{others}: no +Inf bucket"
            );
            let count_key = if others == "{}" || others.is_empty() {
                format!("{family}_count")
            } else {
                format!("{family}_count{others}")
            };
            assert_eq!(
                e.samples.get(&count_key),
                Some(&last),
                "{family}{others}: +Inf bucket differs from {count_key}"
            );
        }
    }
}

async fn scrape(gw: &Gateway) -> Exposition {
    let resp = http().get(gw.url("/metrics")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let ct = resp.headers()["content-type"].to_str().unwrap().to_owned();
    assert!(
        ct.starts_with("application/openmetrics-text; version=1.0.0"),
        "{ct}"
    );
    parse(&resp.text().await.unwrap())
}

#[tokio::test]
async fn counters_move_with_the_requests() {
    let gw = Gateway::start(&["--backend", "local"]);
    let before = scrape(&gw).await;
    let ok = raw(
        &gw,
        serde_json::json!({"executable": "printf", "args": ["hello"]}),
    )
    .await;
    assert_eq!((ok.code(), ok.stdout_str().as_str()), (Some(0), "hello"));
    let fail = raw(
        &gw,
        serde_json::json!({"executable": "sh", "args": ["-c", "printf ab >&2; exit 3"]}),
    )
    .await;
    assert_eq!(fail.code(), Some(3));
    let bad = raw_bytes(&gw, b"{not json".to_vec(), "application/json").await;
    assert_eq!(bad.status, 400);
    let too_long = raw(
        &gw,
        serde_json::json!({"executable": "true", "timeout_secs": 999_999}),
    )
    .await;
    assert_eq!(too_long.status, 400);

    let after = scrape(&gw).await;
    // A labelled family is listed once it has a sample (prometheus-client leaves out empty ones).
    assert_eq!(after.types["mcp_run_executions"], "counter");
    assert_eq!(
        after.types["mcp_run_execution_duration_seconds"],
        "histogram"
    );
    assert_eq!(
        after.types["mcp_run_pod_start_duration_seconds"],
        "histogram"
    );
    assert_eq!(after.types["mcp_run_executions_in_flight"], "gauge");
    assert_eq!(after.types["mcp_run_streamed_bytes"], "counter");
    assert_eq!(after.types["mcp_run_rejections"], "counter");

    for (key, moved) in [
        (
            r#"mcp_run_executions_total{backend="local",result="success"}"#,
            1.0,
        ),
        (
            r#"mcp_run_executions_total{backend="local",result="failure"}"#,
            1.0,
        ),
        (
            r#"mcp_run_streamed_bytes_total{backend="local",stream="stdout"}"#,
            5.0,
        ),
        (
            r#"mcp_run_streamed_bytes_total{backend="local",stream="stderr"}"#,
            2.0,
        ),
        // The body that is not JSON and the timeout over the maximum.
        (r#"mcp_run_rejections_total{reason="invalid_request"}"#, 2.0),
        (
            r#"mcp_run_execution_duration_seconds_count{backend="local"}"#,
            2.0,
        ),
    ] {
        assert_eq!(after.get(key) - before.get(key), moved, "{key}");
    }
    assert_eq!(
        after.get(r#"mcp_run_executions_in_flight{backend="local"}"#),
        0.0
    );
    assert_eq!(after.get("mcp_run_pod_start_duration_seconds_count"), 0.0);
}

#[tokio::test]
async fn a_client_that_goes_away_is_counted_as_cancelled() {
    let gw = Gateway::start(&["--backend", "local"]);
    let before = scrape(&gw).await;
    let mut resp = http()
        .post(gw.raw_url())
        .header("content-type", "application/json")
        .body(r#"{"executable": "sleep", "args": ["30"]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    // The `started` event: the command runs.
    resp.chunk().await.unwrap().unwrap();
    let running = scrape(&gw).await;
    assert_eq!(
        running.get(r#"mcp_run_executions_in_flight{backend="local"}"#),
        1.0
    );
    drop(resp);
    let key = r#"mcp_run_executions_total{backend="local",result="cancelled"}"#;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = scrape(&gw).await;
        if now.get(key) - before.get(key) == 1.0 {
            assert_eq!(
                now.get(r#"mcp_run_executions_in_flight{backend="local"}"#),
                0.0
            );
            break;
        }
        assert!(Instant::now() < deadline, "the disconnect was not counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn the_parser_rejects_malformed_expositions() {
    for bad in [
        "# TYPE x counter\nx_total{a=b} 1\n# EOF\n",
        "x 1\n# EOF\n",
        "# TYPE x counter\nx_total one\n# EOF\n",
        "# TYPE x counter\nx_total 1\nx_total 2\n# EOF\n",
        "# TYPE x counter\nx_total 1\n",
        "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_count 1\nh_sum 0\n# EOF\n",
    ] {
        assert!(
            std::panic::catch_unwind(|| parse(bad)).is_err(),
            "accepted {bad:?}"
        );
    }
}
