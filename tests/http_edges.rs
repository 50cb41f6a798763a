//! The HTTP edges of the gateway, in process: the router `serve` binds is driven with
//! `tower::ServiceExt::oneshot`, as axum's testing example does, so that every refusal's
//! status and JSON body is checked without a socket. The black-box suites (tests/local.rs,
//! tests/auth.rs, ...) still start the real binary.

use axum::body::{Body, to_bytes};
use axum::http::{Request, StatusCode, header};
use mcp_run::Config;
use mcp_run::{App, app};
use tower::ServiceExt as _;

const TOKEN: &str = "edge-token-0123456789abcdef";

async fn router(yaml: &str) -> (axum::Router, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let yaml = yaml.replace("{dir}", dir.path().to_str().unwrap());
    let config = Config::parse(&yaml, None).unwrap();
    let App { router, .. } = app(&config).await.unwrap();
    (router, dir)
}

/// Sends one request; returns the status and the JSON body.
async fn send(router: &axum::Router, req: Request<Body>) -> (StatusCode, serde_json::Value) {
    let resp = router.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let ct = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let body = to_bytes(resp.into_body(), 1 << 20).await.unwrap();
    assert!(
        ct.starts_with("application/json"),
        "{status}: content-type {ct:?}, body {:?}",
        String::from_utf8_lossy(&body)
    );
    (status, serde_json::from_slice(&body).unwrap())
}

fn post_raw(content_type: &str, body: impl Into<Body>) -> Request<Body> {
    Request::post("/raw")
        .header(header::HOST, "localhost")
        .header(header::CONTENT_TYPE, content_type)
        .body(body.into())
        .unwrap()
}

fn code(body: &serde_json::Value) -> &str {
    body["error"]["code"].as_str().unwrap_or_default()
}

#[tokio::test]
async fn malformed_json_is_400() {
    let (r, _d) = router("").await;
    let (status, body) = send(&r, post_raw("application/json", "{not json")).await;
    assert_eq!(
        (status, code(&body)),
        (StatusCode::BAD_REQUEST, "invalid_request")
    );
    let (status, body) = send(
        &r,
        post_raw("application/json", r#"{"executable":"true","bogus":1}"#),
    )
    .await;
    assert_eq!(
        (status, code(&body)),
        (StatusCode::BAD_REQUEST, "invalid_request")
    );
}

#[tokio::test]
async fn other_media_types_are_415() {
    let (r, _d) = router("").await;
    let (status, body) = send(&r, post_raw("text/plain", r#"{"executable":"true"}"#)).await;
    assert_eq!(
        (status, code(&body)),
        (StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type")
    );
}

#[tokio::test]
async fn bodies_over_the_limit_are_413() {
    let (r, _d) = router("server:\n  max_body_bytes: 1024\n").await;
    let big = format!(r#"{{"executable":"echo","args":["{}"]}}"#, "x".repeat(4096));
    let (status, body) = send(&r, post_raw("application/json", big)).await;
    assert_eq!(
        (status, code(&body)),
        (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large")
    );
}

#[tokio::test]
async fn unknown_paths_are_404_and_wrong_methods_405() {
    let (r, _d) = router("").await;
    let get = |path: &str| {
        Request::get(path)
            .header(header::HOST, "localhost")
            .body(Body::empty())
            .unwrap()
    };
    let (status, body) = send(&r, get("/nope")).await;
    assert_eq!((status, code(&body)), (StatusCode::NOT_FOUND, "not_found"));
    let (status, body) = send(&r, get("/raw")).await;
    assert_eq!(
        (status, code(&body)),
        (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed")
    );
    // `curl -T` is a PUT: the answer says which method the endpoint takes.
    let put = Request::put("/raw")
        .header(header::HOST, "localhost")
        .body(Body::empty())
        .unwrap();
    let (status, body) = send(&r, put).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .ends_with("it takes POST"),
        "{body}"
    );
}

#[tokio::test]
async fn auth_refusals_are_401_and_probes_stay_open() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, format!("edge:{TOKEN}\n")).unwrap();
    let (r, _d) = router(&format!(
        "auth:\n  tokens_file: {}\n  required: true\n",
        tokens.display()
    ))
    .await;
    let body = r#"{"executable":"true"}"#;
    let (status, json) = send(&r, post_raw("application/json", body)).await;
    assert_eq!(
        (status, code(&json)),
        (StatusCode::UNAUTHORIZED, "unauthorized")
    );
    let mut wrong = post_raw("application/json", body);
    wrong.headers_mut().insert(
        header::AUTHORIZATION,
        "Bearer not-the-token".parse().unwrap(),
    );
    let (status, json) = send(&r, wrong).await;
    assert_eq!(
        (status, code(&json)),
        (StatusCode::UNAUTHORIZED, "unauthorized")
    );
    // The refusal never echoes what was presented.
    assert!(!json.to_string().contains("not-the-token"), "{json}");
    let health = Request::get("/healthz")
        .header(header::HOST, "localhost")
        .body(Body::empty())
        .unwrap();
    let resp = r.clone().oneshot(health).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
}
