//! Routing, bearer-token authentication, the request log and the small endpoints (version,
//! health, discovery, SelfSubjectAccessReview).

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use serde_json::{Value, json};

use super::Shared;
use super::status::{ApiError, json_response};
use super::{delete, endpointslices, exec, pods, protobuf, pvcs, watch};

const SSAR_PATH: &str = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews";

pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/version", get(version))
        .route("/livez", get(ok_text))
        .route("/readyz", get(ok_text))
        .route("/healthz", get(ok_text))
        .route("/api", get(api_versions))
        .route("/apis", get(api_groups))
        .route("/api/v1", get(core_resources))
        .route(
            "/apis/authorization.k8s.io/v1",
            get(authorization_resources),
        )
        .route(SSAR_PATH, post(ssar))
        .route("/api/v1/pods", get(watch::list_all))
        .route(
            "/api/v1/namespaces/{ns}/pods",
            get(watch::list)
                .post(pods::create)
                .delete(delete::delete_collection),
        )
        .route(
            "/api/v1/namespaces/{ns}/pods/{name}",
            get(pods::get)
                .delete(delete::delete)
                .patch(pods::patch)
                .put(pods::replace),
        )
        .route("/api/v1/namespaces/{ns}/pods/{name}/exec", any(exec::exec))
        .route(
            "/api/v1/namespaces/{ns}/persistentvolumeclaims",
            get(pvcs::list).post(pvcs::create),
        )
        .route(
            "/api/v1/namespaces/{ns}/persistentvolumeclaims/{name}",
            get(pvcs::get).delete(pvcs::delete).patch(pvcs::patch),
        )
        .route("/apis/discovery.k8s.io/v1", get(discovery_resources))
        .route(
            "/apis/discovery.k8s.io/v1/endpointslices",
            get(endpointslices::list_all),
        )
        .route(
            "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
            get(endpointslices::list).post(endpointslices::create),
        )
        .route(
            "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices/{name}",
            get(endpointslices::get).delete(endpointslices::delete),
        )
        .fallback(unknown)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(shared.clone(), gate))
        .with_state(shared)
}

/// Logs the request, then requires the bearer token (401 Status otherwise).
async fn gate(State(shared): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let line = match req.uri().query() {
        Some(q) => format!("{} {}?{}", req.method(), req.uri().path(), q),
        None => format!("{} {}", req.method(), req.uri().path()),
    };
    shared.lock().requests.push(line);
    let expected = format!("Bearer {}", shared.opts.token);
    let authorized = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == expected);
    if !authorized {
        return ApiError::unauthorized().into_response();
    }
    // The double speaks JSON only, like an API server for a type without protobuf support.
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    // ... except for the SelfSubjectAccessReview that kubectl sends as protobuf (protobuf.rs).
    if content_type.starts_with("application/vnd.kubernetes.protobuf")
        && req.uri().path() != SSAR_PATH
    {
        return ApiError::unsupported_media_type(content_type).into_response();
    }
    if let Some(verb) = verb(&req)
        && let Some(rejected) = too_many(&shared, verb)
    {
        return rejected;
    }
    next.run(req).await
}

/// The API verb of a request, as RBAC and API Priority and Fairness name it (`None` for
/// discovery and health paths, which APF exempts here).
fn verb(req: &Request) -> Option<&'static str> {
    let path = req.uri().path();
    let query = parse_query(req.uri().query());
    if path == SSAR_PATH {
        return Some("ssar");
    }
    if !path.starts_with("/api/v1/") || !path.contains("pods") {
        return None;
    }
    if path.ends_with("/exec") {
        return Some("exec");
    }
    let named = path.trim_end_matches('/').rsplit('/').nth(1) == Some("pods");
    Some(match *req.method() {
        axum::http::Method::POST => "create",
        axum::http::Method::DELETE => "delete",
        axum::http::Method::PATCH | axum::http::Method::PUT => "patch",
        _ if flag(&query, "watch") => "watch",
        _ if named => "get",
        _ => "list",
    })
}

/// A 429 as API Priority and Fairness sends it (plain text and `Retry-After`), when the
/// test asked for one for this verb.
fn too_many(shared: &Shared, verb: &str) -> Option<Response> {
    let mut st = shared.lock();
    let left = st.faults.too_many.get_mut(verb).filter(|n| **n > 0)?;
    *left -= 1;
    let after = st.faults.too_many_retry_after.max(1);
    st.faults
        .too_many_sent
        .push((verb.to_string(), std::time::Instant::now()));
    Some(
        (
            StatusCode::TOO_MANY_REQUESTS,
            [
                (
                    header::CONTENT_TYPE,
                    "text/plain; charset=utf-8".to_string(),
                ),
                (header::RETRY_AFTER, after.to_string()),
            ],
            "Too many requests, please try again later.\n",
        )
            .into_response(),
    )
}

async fn unknown() -> ApiError {
    ApiError::unknown_path()
}

async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}

async fn ok_text() -> &'static str {
    "ok"
}

async fn version() -> Response {
    json_response(
        StatusCode::OK,
        &json!({
            "major": "1",
            "minor": "33",
            "emulationMajor": "1",
            "emulationMinor": "33",
            "minCompatibilityMajor": "1",
            "minCompatibilityMinor": "32",
            "gitVersion": "v1.33.1",
            "gitCommit": "8adc0f041b8e7ad1d30e29cc59c6ae7a15e19828",
            "gitTreeState": "clean",
            "buildDate": "2025-05-15T08:19:08Z",
            "goVersion": "go1.24.2",
            "compiler": "gc",
            "platform": "linux/amd64"
        }),
    )
}

async fn api_versions() -> Response {
    json_response(
        StatusCode::OK,
        &json!({
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1:6443"}]
        }),
    )
}

async fn api_groups() -> Response {
    let group = |name: &str| {
        json!({
            "name": name,
            "versions": [{"groupVersion": format!("{name}/v1"), "version": "v1"}],
            "preferredVersion": {"groupVersion": format!("{name}/v1"), "version": "v1"}
        })
    };
    json_response(
        StatusCode::OK,
        &json!({
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [group("authorization.k8s.io"), group("discovery.k8s.io")]
        }),
    )
}

async fn core_resources() -> Response {
    json_response(
        StatusCode::OK,
        &json!({
            "kind": "APIResourceList",
            "groupVersion": "v1",
            "resources": [
                {"name": "pods", "singularName": "pod", "namespaced": true, "kind": "Pod",
                 "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"],
                 "shortNames": ["po"], "categories": ["all"]},
                {"name": "pods/exec", "singularName": "", "namespaced": true, "kind": "PodExecOptions",
                 "verbs": ["create", "get"]},
                {"name": "persistentvolumeclaims", "singularName": "persistentvolumeclaim", "namespaced": true,
                 "kind": "PersistentVolumeClaim", "verbs": ["create", "delete", "get", "list", "patch", "watch"],
                 "shortNames": ["pvc"], "categories": ["all"]}
            ]
        }),
    )
}

async fn discovery_resources() -> Response {
    json_response(
        StatusCode::OK,
        &json!({
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": "discovery.k8s.io/v1",
            "resources": [
                {"name": "endpointslices", "singularName": "endpointslice", "namespaced": true,
                 "kind": "EndpointSlice", "verbs": ["create", "delete", "get", "list", "watch"]}
            ]
        }),
    )
}

async fn authorization_resources() -> Response {
    json_response(
        StatusCode::OK,
        &json!({
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": "authorization.k8s.io/v1",
            "resources": [
                {"name": "selfsubjectaccessreviews", "singularName": "selfsubjectaccessreview",
                 "namespaced": false, "kind": "SelfSubjectAccessReview", "verbs": ["create"]}
            ]
        }),
    )
}

/// SelfSubjectAccessReview: echoes the spec with `status.allowed`, as the authorizer answers.
/// JSON or (kubectl) protobuf.
async fn ssar(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    let protobuf = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.starts_with("application/vnd.kubernetes.protobuf"));
    let review = if protobuf {
        protobuf::self_subject_access_review(&body)
    } else {
        serde_json::from_slice::<Value>(&body).map_err(|e| e.to_string())
    };
    let review = match review {
        Ok(v) => v,
        Err(e) => {
            return ApiError::bad_request(format!("the object provided is unrecognized: {e}"))
                .into_response();
        }
    };
    let Some(attrs) = review.pointer("/spec/resourceAttributes") else {
        // Non-resource attributes (URLs) are always allowed here.
        if review.pointer("/spec/nonResourceAttributes").is_some() {
            return ssar_answer(&review, true);
        }
        return ApiError::invalid(
            "SelfSubjectAccessReview",
            "",
            &[(
                "FieldValueRequired",
                "spec.resourceAttributes".into(),
                "Required value: exactly one of nonResourceAttributes or resourceAttributes must be specified".into(),
            )],
        )
        .into_response();
    };
    let field = |k: &str| {
        attrs
            .get(k)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    let key = (
        field("namespace"),
        field("resource"),
        field("subresource"),
        field("verb"),
    );
    let allowed = !shared.lock().denied.contains(&key);
    ssar_answer(&review, allowed)
}

fn ssar_answer(review: &Value, allowed: bool) -> Response {
    // RBAC denies with no reason ("no opinion" from every authorizer): kubectl prints "no".
    let status = json!({"allowed": allowed});
    json_response(
        StatusCode::CREATED,
        &json!({
            "kind": "SelfSubjectAccessReview",
            "apiVersion": "authorization.k8s.io/v1",
            "metadata": {"creationTimestamp": null},
            "spec": review.get("spec").cloned().unwrap_or(json!({})),
            "status": status
        }),
    )
}

/// Parses a query string into ordered pairs (repeated keys kept, `+` is a space).
pub fn parse_query(raw: Option<&str>) -> Vec<(String, String)> {
    let Some(raw) = raw else { return Vec::new() };
    raw.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let hex = |c: u8| (c as char).to_digit(16);
                match (hex(b[i + 1]), hex(b[i + 2])) {
                    (Some(h), Some(l)) => {
                        out.push((h * 16 + l) as u8);
                        i += 2;
                    }
                    _ => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The first value of a query parameter.
pub fn first<'a>(q: &'a [(String, String)], key: &str) -> Option<&'a str> {
    q.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

/// A boolean query parameter as the API server's conversion reads it.
pub fn flag(q: &[(String, String)], key: &str) -> bool {
    matches!(first(q, key), Some("true" | "1" | "True" | "TRUE"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_decoding_keeps_repeats() {
        let q = parse_query(Some("command=sh&command=-c&command=echo%20a+b&x=%zz"));
        let cmds: Vec<&str> = q
            .iter()
            .filter(|(k, _)| k == "command")
            .map(|(_, v)| v.as_str())
            .collect();
        assert_eq!(cmds, ["sh", "-c", "echo a b"]);
        assert_eq!(first(&q, "x"), Some("%zz"));
    }
}
