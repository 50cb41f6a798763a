//! Agent-sized MCP results and the kept full output, through the real gateway and rmcp's
//! client: the character budget (head and tail, the cut marked with the URI that reads it),
//! resources/read of whole outputs, pages, ranges and searches, expiry, and templates over a
//! failure in the middle of a 10 MB log.

use crate::support;

use rmcp::ServiceExt as _;
use rmcp::model::{
    CallToolRequestParams, CallToolResult, ReadResourceRequestParams, ResourceContents,
};
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use serde_json::{Value, json};
use support::Gateway;

type Client = RunningService<RoleClient, ()>;

async fn client(gw: &Gateway) -> Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let transport = StreamableHttpClientTransport::from_uri(gw.url("/mcp"));
    ().serve(transport).await.expect("MCP initialize over HTTP")
}

async fn call(c: &Client, args: Value) -> CallToolResult {
    c.call_tool(
        CallToolRequestParams::new("run_network_tool")
            .with_arguments(args.as_object().cloned().unwrap_or_default()),
    )
    .await
    .expect("tools/call")
}

async fn read(c: &Client, uri: &str) -> Result<String, String> {
    match c
        .read_resource(ReadResourceRequestParams::new(uri.to_owned()))
        .await
    {
        Ok(r) => match &r.contents[0] {
            ResourceContents::TextResourceContents { text, .. } => Ok(text.clone()),
            other => panic!("{other:?}"),
        },
        Err(e) => Err(e.to_string()),
    }
}

/// A result's size as it travels: the JSON of the whole result.
fn wire_len(r: &CallToolResult) -> usize {
    serde_json::to_string(r).unwrap().len()
}

fn out(r: &CallToolResult) -> &Value {
    &r.structured_content.as_ref().expect("structuredContent")["outputs"][0]
}

/// The text before `[mcp-run: page ends here; next page: URI]`, and the URI.
fn split_page(text: &str) -> (&str, Option<String>) {
    match text.rsplit_once("\n[mcp-run: page ends here; next page: ") {
        Some((body, rest)) => (body, Some(rest.trim_end().trim_end_matches(']').to_owned())),
        None => (text, None),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn large_output_fits_the_budget_and_the_rest_is_one_read_away() {
    let gw = Gateway::start(&[]);
    let c = client(&gw).await;
    // 5 MiB on stdout between two markers.
    let r = call(
        &c,
        json!({"executable": "sh", "args": ["-c", "echo FIRST; head -c 5242880 /dev/zero | tr '\\0' x; echo; echo LAST"]}),
    )
    .await;
    let o = out(&r);
    let stdout = o["stdout"].as_str().unwrap();
    assert_eq!(o["truncated"], true);
    assert!(stdout.starts_with("FIRST\n") && stdout.ends_with("LAST\n"));
    assert!(stdout.chars().count() <= 30_000, "{}", stdout.len());
    // The structured content and the markdown each carry the bounded text once.
    assert!(wire_len(&r) < 70_000, "{}", wire_len(&r));
    // The cut is marked in place with the range left out and the URI that reads it.
    let marker = stdout
        .lines()
        .find(|l| l.starts_with("[... mcp-run: bytes "))
        .expect("marker");
    let uri = marker
        .split("read them: ")
        .nth(1)
        .unwrap()
        .trim_end_matches(" ...]");
    assert!(uri.contains("/stdout?bytes="), "{marker}");
    let page = read(&c, uri).await.unwrap();
    let (body, next) = split_page(&page);
    assert!(
        body.len() > 10_000 && body.bytes().all(|b| b == b'x'),
        "{}",
        &page[..200]
    );
    assert!(next.unwrap().contains("?bytes="));
    let full = &o["full_output"];
    assert_eq!(full["stdout_bytes"], 5_242_892);
    assert!(full["how"].as_str().unwrap().contains("grep"));
    let text: String = r
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect();
    assert!(
        text.contains("**Full output:**"),
        "{}",
        &text[text.len() - 500..]
    );

    // A smaller budget per call, and one out of bounds.
    let small = call(
        &c,
        json!({"executable": "sh", "args": ["-c", "seq 1 100000"], "result_chars": 2000}),
    )
    .await;
    let s = out(&small)["stdout"].as_str().unwrap();
    assert!(
        s.len() <= 2000 && s.starts_with("1\n2\n") && s.ends_with("100000\n"),
        "{s}"
    );
    let bad = call(&c, json!({"executable": "true", "result_chars": 10})).await;
    assert_eq!(bad.is_error, Some(true));
    assert!(bad.structured_content.is_none());
    c.cancel().await.unwrap();
}

/// NUL bytes cost six characters each once JSON-escaped: the budget counts them so.
#[tokio::test(flavor = "multi_thread")]
async fn control_bytes_count_at_their_escaped_cost() {
    let gw = Gateway::start(&[]);
    let c = client(&gw).await;
    let r = call(
        &c,
        json!({"executable": "sh", "args": ["-c", "head -c 100000 /dev/zero"]}),
    )
    .await;
    let s = out(&r)["stdout"].as_str().unwrap();
    let escaped = serde_json::to_string(s).unwrap().len();
    assert!(escaped <= 30_000 + 2, "{escaped}");
    assert!(s.contains("[... mcp-run: bytes "), "marker");
    assert!(wire_len(&r) < 70_000, "{}", wire_len(&r));
    c.cancel().await.unwrap();
}

/// `resources/read` walks a whole output page by page, reads line ranges and searches.
#[tokio::test(flavor = "multi_thread")]
async fn resources_pages_lines_and_grep() {
    let gw = Gateway::start(&[]);
    let c = client(&gw).await;
    let r = call(
        &c,
        json!({"executable": "sh", "args": ["-c", "seq 1 60000; echo done >&2"]}),
    )
    .await;
    let o = out(&r);
    let uri = o["full_output"]["stdout_uri"].as_str().unwrap().to_owned();
    let want: String = (1..=60000).map(|i| format!("{i}\n")).collect();

    let mut got = String::new();
    let mut next = Some(uri.clone());
    let mut pages = 0;
    while let Some(u) = next {
        let page = read(&c, &u).await.unwrap();
        assert!(page.chars().count() <= 30_000, "page of {}", page.len());
        let (body, n) = split_page(&page);
        got.push_str(body);
        next = n;
        pages += 1;
        assert!(pages < 100, "no end");
    }
    assert_eq!(got, want, "the pages put together are the output");
    assert!(pages > 5, "{pages}");

    let lines = read(&c, &format!("{uri}?lines=100-102")).await.unwrap();
    assert_eq!(lines, "100\n101\n102\n");
    let grep = read(&c, &format!("{uri}?grep=%5E5999%5B0-9%5D%24"))
        .await
        .unwrap();
    assert_eq!(
        grep,
        (59990..=59999)
            .map(|i| format!("{i}:{i}\n"))
            .collect::<String>()
    );
    let none = read(&c, &format!("{uri}?grep=nothing")).await.unwrap();
    assert!(none.contains("no line matches"), "{none}");
    let err_uri = o["full_output"]["stderr_uri"].as_str().unwrap();
    assert_eq!(read(&c, err_uri).await.unwrap(), "done\n");

    // Bad parameters and unknown runs are refused with the reason.
    let e = read(&c, &format!("{uri}?lines=0-1")).await.unwrap_err();
    assert!(e.contains("lines must be"), "{e}");
    let e = read(&c, "mcp-run://runs/0123abcd/stdout")
        .await
        .unwrap_err();
    assert!(e.contains("no run 0123abcd"), "{e}");

    // The resource template and the listing.
    let templates = c
        .list_resource_templates(None)
        .await
        .unwrap()
        .resource_templates;
    assert_eq!(
        templates[0].uri_template,
        "mcp-run://runs/{id}/{stream}{?lines,bytes,grep}"
    );
    let listed = c.list_resources(None).await.unwrap().resources;
    assert!(listed.iter().any(|r| r.uri == uri), "{listed:?}");
    c.cancel().await.unwrap();
}

/// A `bytes=` range is exact: bytes that are not UTF-8 come back as a blob, not replaced.
#[tokio::test(flavor = "multi_thread")]
async fn byte_ranges_that_are_not_text_come_back_exact() {
    let gw = Gateway::start(&[]);
    let c = client(&gw).await;
    let r = call(
        &c,
        json!({"executable": "sh", "args": ["-c", "printf 'A\\377\\376\\000B'; printf 'caf\\303\\251' >&2"]}),
    )
    .await;
    // Nothing was left out, so the result names no URI: the run is the caller's latest.
    let base = match out(&r)["full_output"]["stdout_uri"].as_str() {
        Some(u) => u.to_owned(),
        None => format!("mcp-run://runs/{}/stdout", run_id(&c).await),
    };
    let got = c
        .read_resource(ReadResourceRequestParams::new(format!("{base}?bytes=0-5")))
        .await
        .unwrap();
    match &got.contents[0] {
        ResourceContents::BlobResourceContents {
            blob, mime_type, ..
        } => {
            assert_eq!(
                base64_simd::STANDARD.decode_to_vec(blob).unwrap(),
                b"A\xff\xfe\x00B"
            );
            assert_eq!(mime_type.as_deref(), Some("application/octet-stream"));
        }
        other => panic!("a blob, not {other:?}"),
    }
    // Text stays text, and a range that cuts a character ends before it.
    let err = base.replace("/stdout", "/stderr");
    assert_eq!(read(&c, &format!("{err}?bytes=0-5")).await.unwrap(), "café");
    let cut = read(&c, &format!("{err}?bytes=0-4")).await.unwrap();
    assert!(cut.starts_with("caf"), "{cut}");
    c.cancel().await.unwrap();
}

/// The id of the caller's most recent run, from `resources/list`.
async fn run_id(c: &Client) -> String {
    let listed = c.list_resources(None).await.unwrap().resources;
    let uri = &listed
        .iter()
        .find(|r| r.uri.starts_with("mcp-run://runs/"))
        .expect("a run is listed")
        .uri;
    uri.trim_start_matches("mcp-run://runs/")
        .split('/')
        .next()
        .unwrap()
        .to_owned()
}

/// A stream past the per-stream bound says what was kept; a run past the age bound says it
/// expired.
#[tokio::test(flavor = "multi_thread")]
async fn expired_outputs_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = support::config_file(
        &dir,
        "mcp:\n  max_output_bytes: 4096\n  output_store:\n    max_age_secs: 1\n",
    );
    let gw = Gateway::start(&["--config", cfg.to_str().unwrap()]);
    let c = client(&gw).await;
    let r = call(
        &c,
        json!({"executable": "sh", "args": ["-c", "seq 1 100000"]}),
    )
    .await;
    let uri = out(&r)["full_output"]["stdout_uri"]
        .as_str()
        .unwrap()
        .to_owned();
    // Past the per-stream bound, the read says what was kept.
    let text = read(&c, &uri).await.unwrap();
    assert!(text.starts_with("1\n2\n"), "{text}");
    assert!(
        text.contains("only the first 4096 of 588895 bytes of this stream were kept"),
        "{}",
        &text[text.len() - 300..]
    );
    // The age bound is whole seconds: a read fails once a second has passed since the run
    // ended (reads until then succeed; they do not renew the run).
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    let e = loop {
        match read(&c, &uri).await {
            Err(e) => break e,
            Ok(_) => assert!(tokio::time::Instant::now() < deadline, "never expired"),
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert!(e.contains("has expired"), "{e}");
    c.cancel().await.unwrap();
}

/// The template reads the whole output as it streams: a compile error in the middle of a
/// 10 MB log survives, with its code frame, and the result stays small.
#[tokio::test(flavor = "multi_thread")]
async fn templates_find_a_failure_in_the_middle_of_10_mb() {
    let gw = Gateway::start(&[]);
    let c = client(&gw).await;
    let script = "yes '   Compiling crate v1.0.0 (/src/crate)' | head -n 200000; \
         printf 'error[E0308]: mismatched types\\n --> src/main.rs:4:18\\n  |\\n4 |     let x: u32 = v.len();\\n  |            ---   ^^^^^^^ expected `u32`, found `usize`\\n\\n'; \
         yes '   Compiling crate v1.0.0 (/src/crate)' | head -n 200000; \
         echo 'error: could not compile `crate` due to 1 previous error'; exit 101";
    let r = call(
        &c,
        json!({"executable": "sh", "args": ["-c", script], "template": "cargo-build"}),
    )
    .await;
    let o = out(&r);
    let s = o["stdout"].as_str().unwrap();
    assert!(
        s.contains("error[E0308]: mismatched types\n --> src/main.rs:4:18\n"),
        "{s}"
    );
    assert!(s.contains("expected `u32`, found `usize`"), "{s}");
    assert!(s.contains("could not compile"), "{s}");
    assert!(s.starts_with("[template cargo-build: "), "{s}");
    assert!(s.len() < 4000, "{}", s.len());
    assert!(o["full_output"]["stdout_bytes"].as_u64().unwrap() > 10_000_000);
    c.cancel().await.unwrap();
}

/// `stdin` reaches the command (the local backend feeds it); over the limit it is refused.
#[tokio::test(flavor = "multi_thread")]
async fn stdin_reaches_the_command() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = support::config_file(&dir, "mcp:\n  max_stdin_bytes: 100000\n");
    let gw = Gateway::start(&["--config", cfg.to_str().unwrap()]);
    let c = client(&gw).await;
    let r = call(&c, json!({"executable": "cat", "stdin": "hello\nworld\n"})).await;
    assert_eq!(out(&r)["stdout"], "hello\nworld\n");
    let big = "x".repeat(99_999) + "\n";
    let r = call(
        &c,
        json!({"executable": "wc", "args": ["-c"], "stdin": big}),
    )
    .await;
    assert_eq!(out(&r)["stdout"].as_str().unwrap().trim(), "100000");
    let r = call(
        &c,
        json!({"executable": "cat", "stdin": "y".repeat(100_001)}),
    )
    .await;
    assert_eq!(r.is_error, Some(true));
    assert!(r.structured_content.is_none());
    // Without stdin, a command that reads it gets end of input at once.
    let r = call(&c, json!({"executable": "cat"})).await;
    assert_eq!(out(&r)["stdout"], "");
    assert_eq!(out(&r)["exit_code"], 0);
    c.cancel().await.unwrap();
}
