//! Label selectors (`=`, `==`, `!=`, `in`, `notin`, `key`, `!key`) and the pod field selectors
//! the API server supports, applied to a pod as JSON.

use serde_json::Value;

use super::status::ApiError;

#[derive(Debug, Clone, PartialEq)]
enum Req {
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// A parsed `labelSelector` plus `fieldSelector`; the empty selector matches everything.
#[derive(Debug, Clone, Default)]
pub struct Selector {
    labels: Vec<Req>,
    fields: Vec<(String, bool, String)>,
}

/// Pod fields the API server accepts in a field selector (pod `GetAttrs` / conversion funcs).
const POD_FIELDS: &[&str] = &[
    "metadata.name",
    "metadata.namespace",
    "spec.nodeName",
    "spec.restartPolicy",
    "spec.schedulerName",
    "spec.serviceAccountName",
    "spec.hostNetwork",
    "status.phase",
    "status.podIP",
    "status.nominatedNodeName",
];

impl Selector {
    pub fn parse(label: Option<&str>, field: Option<&str>) -> Result<Selector, ApiError> {
        let mut sel = Selector::default();
        if let Some(l) = label {
            for part in split_top_level(l) {
                let part = part.trim();
                if part.is_empty() {
                    continue;
                }
                sel.labels.push(parse_label_req(part)?);
            }
        }
        if let Some(f) = field {
            for part in f.split(',') {
                let part = part.trim();
                if part.is_empty() {
                    continue;
                }
                let (key, eq, value) = if let Some((k, v)) = part.split_once("!=") {
                    (k, false, v)
                } else if let Some((k, v)) = part.split_once("==") {
                    (k, true, v)
                } else if let Some((k, v)) = part.split_once('=') {
                    (k, true, v)
                } else {
                    return Err(ApiError::bad_request(format!(
                        "invalid field selector: invalid selector: '{f}'; can't understand '{part}'"
                    )));
                };
                let key = key.trim();
                if !POD_FIELDS.contains(&key) {
                    return Err(ApiError::bad_request(format!(
                        "field label not supported: {key}"
                    )));
                }
                sel.fields
                    .push((key.to_string(), eq, value.trim().to_string()));
            }
        }
        Ok(sel)
    }

    pub fn matches(&self, pod: &Value) -> bool {
        let labels = pod.pointer("/metadata/labels");
        let label = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        let labels_ok = self.labels.iter().all(|r| match r {
            Req::Eq(k, v) => label(k) == Some(v.as_str()),
            Req::Ne(k, v) => label(k) != Some(v.as_str()),
            Req::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            Req::NotIn(k, vs) => label(k).is_none_or(|l| vs.iter().all(|v| v != l)),
            Req::Exists(k) => label(k).is_some(),
            Req::NotExists(k) => label(k).is_none(),
        });
        labels_ok
            && self.fields.iter().all(|(k, eq, v)| {
                let actual = field_value(pod, k);
                (actual == *v) == *eq
            })
    }
}

/// A field's value as the API server's field set renders it ("" when unset).
fn field_value(pod: &Value, key: &str) -> String {
    let ptr = format!("/{}", key.replace('.', "/"));
    match pod.pointer(&ptr) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Bool(b)) => b.to_string(),
        _ if key == "spec.hostNetwork" => "false".into(),
        _ => String::new(),
    }
}

/// Splits on commas that are not inside a `( ... )` value set.
fn split_top_level(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn parse_label_req(part: &str) -> Result<Req, ApiError> {
    let bad = || {
        ApiError::bad_request(format!(
            "unable to parse requirement: found '{part}', expected: identifier or operator"
        ))
    };
    let valid_key = |k: &str| {
        !k.is_empty()
            && k.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
    };
    if let Some(k) = part.strip_prefix('!') {
        let k = k.trim();
        return if valid_key(k) {
            Ok(Req::NotExists(k.into()))
        } else {
            Err(bad())
        };
    }
    for (op, notin) in [(" notin ", true), (" in ", false)] {
        if let Some((k, rest)) = part.split_once(op) {
            let rest = rest.trim();
            let inner = rest
                .strip_prefix('(')
                .and_then(|r| r.strip_suffix(')'))
                .ok_or_else(bad)?;
            let values: Vec<String> = inner
                .split(',')
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
                .collect();
            let k = k.trim();
            if !valid_key(k) || values.is_empty() {
                return Err(bad());
            }
            return Ok(if notin {
                Req::NotIn(k.into(), values)
            } else {
                Req::In(k.into(), values)
            });
        }
    }
    let (k, v, ne) = if let Some((k, v)) = part.split_once("!=") {
        (k, v, true)
    } else if let Some((k, v)) = part.split_once("==") {
        (k, v, false)
    } else if let Some((k, v)) = part.split_once('=') {
        (k, v, false)
    } else {
        let k = part.trim();
        return if valid_key(k) {
            Ok(Req::Exists(k.into()))
        } else {
            Err(bad())
        };
    };
    let (k, v) = (k.trim(), v.trim());
    if !valid_key(k) {
        return Err(bad());
    }
    Ok(if ne {
        Req::Ne(k.into(), v.into())
    } else {
        Req::Eq(k.into(), v.into())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(labels: Value) -> Value {
        json!({"metadata": {"name": "p", "namespace": "default", "labels": labels},
               "spec": {"nodeName": "n1"}, "status": {"phase": "Running"}})
    }

    fn sel(l: &str) -> Selector {
        Selector::parse(Some(l), None).unwrap()
    }

    #[test]
    fn label_operators() {
        let p = pod(json!({"app": "a", "tier": "web"}));
        assert!(sel("app=a").matches(&p));
        assert!(sel("app==a,tier=web").matches(&p));
        assert!(!sel("app!=a").matches(&p));
        assert!(sel("app in (a, b),tier notin (db)").matches(&p));
        assert!(!sel("tier notin (web)").matches(&p));
        assert!(sel("app,!missing").matches(&p));
        assert!(!sel("missing").matches(&p));
        assert!(sel("missing!=x").matches(&p));
        assert!(Selector::parse(Some("a in b"), None).is_err());
    }

    #[test]
    fn field_selectors() {
        let p = pod(json!({}));
        let f = |s: &str| Selector::parse(None, Some(s)).unwrap();
        assert!(f("metadata.name=p,spec.nodeName=n1").matches(&p));
        assert!(f("status.phase!=Pending").matches(&p));
        assert!(!f("metadata.namespace==other").matches(&p));
        assert!(Selector::parse(None, Some("spec.image=x")).is_err());
    }
}
