//! apimachinery `metav1.Status` errors, serialised with the field order and omissions of the
//! Go structs (`kind`, `apiVersion`, `metadata`, `status`, `message`, `reason`, `details`, `code`).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::Value;

/// An API error: an HTTP status code with the `Status` body the API server sends for it.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    pub details: Option<Details>,
}

impl ApiError {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }

    pub fn with_details(mut self, details: Details) -> Self {
        self.details = Some(details);
        self
    }

    /// `pods "x" not found` and the like (`errors.NewNotFound`).
    pub fn not_found(resource: &str, name: &str) -> Self {
        Self::new(404, "NotFound", format!("{resource} \"{name}\" not found"))
            .with_details(Details::named(name, resource))
    }

    /// `errors.NewAlreadyExists`.
    pub fn already_exists(resource: &str, name: &str) -> Self {
        Self::new(
            409,
            "AlreadyExists",
            format!("{resource} \"{name}\" already exists"),
        )
        .with_details(Details::named(name, resource))
    }

    /// `errors.NewConflict` with the optimistic-concurrency message of the registry.
    pub fn conflict_modified(resource: &str, name: &str) -> Self {
        Self::conflict(
            resource,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    /// `errors.NewConflict`.
    pub fn conflict(resource: &str, name: &str, why: &str) -> Self {
        Self::new(
            409,
            "Conflict",
            format!("Operation cannot be fulfilled on {resource} \"{name}\": {why}"),
        )
        .with_details(Details::named(name, resource))
    }

    /// `errors.NewForbidden` (admission refusals): `pods "x" is forbidden: WHY`.
    pub fn forbidden(resource: &str, name: &str, why: &str) -> Self {
        Self::new(
            403,
            "Forbidden",
            format!("{resource} \"{name}\" is forbidden: {why}"),
        )
        .with_details(Details::named(name, resource))
    }

    /// `errors.NewTooManyRequests`, with the Retry-After the server sets for it.
    pub fn too_many_requests(retry_after_secs: u64) -> Self {
        let mut e = Self::new(
            429,
            "TooManyRequests",
            "the server has received too many requests and has asked us to try again later",
        );
        e.details = Some(Details {
            retry_after_seconds: Some(retry_after_secs as i64),
            ..Details::default()
        });
        e
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    /// `errors.NewInvalid`: one cause per field error; the message lists them in brackets when
    /// there are several, as `ToAggregate().Error()` does.
    pub fn invalid(kind: &str, name: &str, causes: &[(&'static str, String, String)]) -> Self {
        let texts: Vec<String> = causes
            .iter()
            .map(|(_, field, detail)| format!("{field}: {detail}"))
            .collect();
        let joined = if texts.len() == 1 {
            texts[0].clone()
        } else {
            format!("[{}]", texts.join(", "))
        };
        let mut details = Details::named(name, kind);
        details.causes = causes
            .iter()
            .map(|(reason, field, detail)| Cause::new(Some(reason), detail, Some(field)))
            .collect();
        Self::new(
            422,
            "Invalid",
            format!("{kind} \"{name}\" is invalid: {joined}"),
        )
        .with_details(details)
    }

    pub fn unauthorized() -> Self {
        Self::new(401, "Unauthorized", "Unauthorized")
    }

    /// What the API server answers for a path it does not serve.
    pub fn unknown_path() -> Self {
        Self::new(
            404,
            "NotFound",
            "the server could not find the requested resource",
        )
        .with_details(Details::default())
    }

    pub fn method_not_allowed() -> Self {
        Self::new(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )
        .with_details(Details::default())
    }

    pub fn unsupported_media_type(content_type: &str) -> Self {
        Self::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml; got {content_type:?}"
            ),
        )
    }

    /// `errors.NewInternalError`: the cause carries the bare error text.
    pub fn internal(err: &str) -> Self {
        Self::new(
            500,
            "InternalError",
            format!("Internal error occurred: {err}"),
        )
        .with_details(Details {
            causes: vec![Cause::new(None, err, None)],
            ..Details::default()
        })
    }

    /// The full Status object as JSON text, in the field order of the Go struct; sent in an
    /// HTTP error body or a watch ERROR event.
    pub fn to_status(&self) -> String {
        let status = Status {
            kind: Some("Status"),
            api_version: Some("v1"),
            metadata: Empty {},
            status: "Failure",
            message: Some(&self.message),
            reason: Some(self.reason),
            details: self.details.as_ref(),
            code: Some(self.code),
        };
        serde_json::to_string(&status).unwrap_or_default()
    }
}

#[derive(Serialize)]
pub struct Empty {}

/// `metav1.Status` with its Go field order; `None` fields are omitted as `omitempty` does.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Status<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_version: Option<&'a str>,
    pub metadata: Empty,
    pub status: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details: Option<&'a Details>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub code: Option<u16>,
}

/// `metav1.StatusDetails`.
#[derive(Serialize, Debug, Clone, Default)]
pub struct Details {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub causes: Vec<Cause>,
    #[serde(rename = "retryAfterSeconds", skip_serializing_if = "Option::is_none")]
    pub retry_after_seconds: Option<i64>,
}

/// `metav1.StatusCause`: the Go field `Type` is serialised as `reason`.
#[derive(Serialize, Debug, Clone)]
pub struct Cause {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

impl Details {
    pub fn named(name: &str, kind: &str) -> Self {
        Details {
            name: Some(name.to_string()),
            kind: Some(kind.to_string()),
            ..Details::default()
        }
    }
}

impl Cause {
    pub fn new(reason: Option<&str>, message: &str, field: Option<&str>) -> Self {
        Cause {
            reason: reason.map(str::to_string),
            message: Some(message.to_string()),
            field: field.map(str::to_string),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let retry = self.details.as_ref().and_then(|d| d.retry_after_seconds);
        let mut resp = json_text_response(code, self.to_status());
        if let Some(secs) = retry
            && let Ok(v) = axum::http::HeaderValue::from_str(&secs.to_string())
        {
            resp.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, v);
        }
        resp
    }
}

/// A JSON response with the content type the API server uses.
pub fn json_response(code: StatusCode, body: &Value) -> Response {
    json_text_response(code, body.to_string())
}

pub fn json_text_response(code: StatusCode, body: String) -> Response {
    (
        code,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_found_status_has_the_go_shape() {
        let s = ApiError::not_found("pods", "x").to_status();
        assert_eq!(
            s,
            r#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"pods \"x\" not found","reason":"NotFound","details":{"name":"x","kind":"pods"},"code":404}"#
        );
    }
}
