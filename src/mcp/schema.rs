//! Tool schemas derived from the contract types (`RunRequest`, `StructuredResult`), then
//! narrowed with what only the server knows (its profiles, its maximum timeout, its
//! templates) and made acceptable to strict validators: no `format: uint64` and the like,
//! which JSON Schema does not define and TypeScript clients warn about on every tools/list.

use serde_json::{Map, Value, json};

use crate::contract::RunRequest;
use crate::result::StructuredResult;

/// What the server adds to the derived input schema of `run_network_tool`.
pub(crate) struct InputExtras {
    pub profiles: Vec<String>,
    pub default_timeout_secs: u64,
    pub max_timeout_secs: u64,
    pub templates: Vec<String>,
    pub template_listing: String,
    pub default_result_chars: usize,
    pub max_result_chars: usize,
    pub max_stdin_bytes: usize,
}

/// A derived schema as a JSON object, cleaned for strict validators.
pub(crate) fn derived<T: schemars::JsonSchema>() -> Map<String, Value> {
    let mut v = serde_json::to_value(schemars::schema_for!(T)).unwrap_or_default();
    strict(&mut v);
    match v {
        Value::Object(mut m) => {
            m.remove("$schema");
            m
        }
        _ => Map::new(),
    }
}

/// Makes a derived schema portable: removes `format` keywords that JSON Schema does not
/// define (schemars writes `uint64`, `int32`, `double`, ... for Rust numbers; the ranges stay
/// as `minimum`/`maximum`), and writes a nullable `type: [T, "null"]` as `anyOf` of single
/// types, which single-type dialects (and `inspector --strict`) accept.
pub(crate) fn strict(v: &mut Value) {
    const STANDARD: &[&str] = &[
        "date-time",
        "date",
        "time",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "uuid",
        "regex",
    ];
    match v {
        Value::Object(m) => {
            if let Some(Value::String(f)) = m.get("format")
                && !STANDARD.contains(&f.as_str())
            {
                m.remove("format");
            }
            if let Some(Value::Array(types)) = m.get("type").cloned() {
                // Everything but `type` applies to the non-null branches.
                m.remove("type");
                let rest = std::mem::take(m);
                let branches: Vec<Value> = types
                    .into_iter()
                    .map(|t| {
                        let mut b = Map::new();
                        if t != "null" {
                            b.extend(
                                rest.iter()
                                    .filter(|(k, _)| !is_annotation(k))
                                    .map(|(k, v)| (k.clone(), v.clone())),
                            );
                        }
                        b.insert("type".into(), t);
                        Value::Object(b)
                    })
                    .collect();
                m.extend(rest.into_iter().filter(|(k, _)| is_annotation(k)));
                m.insert("anyOf".into(), Value::Array(branches));
            }
            m.values_mut().for_each(strict);
        }
        Value::Array(a) => a.iter_mut().for_each(strict),
        _ => {}
    }
}

/// Keywords that describe a schema rather than constrain it.
fn is_annotation(k: &str) -> bool {
    matches!(k, "description" | "title" | "default" | "examples")
}

/// An optional input is omitted, not null: `type: [T, "null"]` becomes `type: T`.
fn not_null(v: &mut Value) {
    if let Some(Value::Array(types)) = v.get("type") {
        let t: Vec<Value> = types.iter().filter(|t| *t != "null").cloned().collect();
        if t.len() == 1 {
            v["type"] = t[0].clone();
        }
    }
}

/// The input schema of `run_network_tool`: [`RunRequest`]'s, with the profiles as an enum,
/// the timeout bounded, and MCP's own arguments (`template`, `stdin`, `result_chars`).
pub(crate) fn run_input(x: &InputExtras) -> Map<String, Value> {
    // Inlined (no `$defs`/`$ref` for `steps` and `session_busy`): some clients do not
    // resolve references in tool schemas.
    let schema = schemars::generate::SchemaSettings::draft2020_12()
        .with(|s| s.inline_subschemas = true)
        .into_generator()
        .into_root_schema_for::<RunRequest>();
    let mut raw = serde_json::to_value(schema).unwrap_or_default();
    if let Some(props) = raw.get_mut("properties").and_then(Value::as_object_mut) {
        props.values_mut().for_each(not_null);
    }
    strict(&mut raw);
    let mut schema = match raw {
        Value::Object(mut m) => {
            m.remove("$schema");
            m
        }
        _ => Map::new(),
    };
    let props = schema
        .entry("properties")
        .or_insert_with(|| json!({}))
        .as_object_mut();
    let Some(props) = props else {
        return schema;
    };
    let mut set = |name: &str, patch: Value| {
        let p = props.entry(name).or_insert_with(|| json!({}));
        if let (Some(p), Value::Object(patch)) = (p.as_object_mut(), patch) {
            p.extend(patch);
        }
    };
    set(
        "executable",
        json!({"minLength": 1, "description": "The program to run, looked up in the runner's PATH (or an absolute path). Not a shell command line: pass arguments in `args`, and use executable `sh` with args [\"-c\", \"...\"] when you need a shell. Required unless `steps` is given."}),
    );
    set(
        "timeout_secs",
        json!({"minimum": 1, "maximum": x.max_timeout_secs,
               "description": format!("Kill the command after this many seconds (default {}).", x.default_timeout_secs)}),
    );
    set(
        "profile",
        json!({"enum": x.profiles, "description": "The runner profile (image, resources) to run in; default `default`."}),
    );
    set(
        "workspace",
        json!({"description": "Leave out unless you were given a workspace id. A workspace is a copy of a caller's file tree, registered on this gateway over HTTP (`POST /workspaces`, which `run-remote --workspace` does; docs/workspaces.md) by the same identity; the command then runs in it and `cwd` is relative to its root. An MCP call cannot upload files itself."}),
    );
    set(
        "sync_back",
        json!({"description": "With `workspace`: globs (relative to its root; `*` within a path component, `**` across) of the files to report back when the command created or changed them."}),
    );
    set(
        "steps",
        json!({"maxItems": crate::contract::MAX_STEPS, "description": "Several commands to run in order in one runner (one pod), in place of `executable` and `args`; each step's cwd, env and timeout_secs default to the call's. The run stops at the first failing step unless `continue_on_error`; the result has one `outputs` entry per step that ran."}),
    );
    props.insert(
        "template".into(),
        json!({
            "type": "string", "enum": x.templates,
            "description": format!(
                "Filter stdout and stderr down to what matters (default `auto`: the template for the tool the command runs, picked by the command line or else by the output, named in the note; `raw` for the output as it came). Failures with their locations and expected/actual, diagnostics and summary lines are always kept; a passing run shrinks to its summary; an output that filtering would not shrink comes unchanged; the full output stays readable as a resource. {}",
                x.template_listing
            )
        }),
    );
    props.insert(
        "stdin".into(),
        json!({"type": "string", "maxLength": x.max_stdin_bytes,
               "description": format!("Text given to the command on its standard input (at most {} bytes, UTF-8); without it stdin is empty.", x.max_stdin_bytes)}),
    );
    props.insert(
        "result_chars".into(),
        json!({"type": "integer", "minimum": 1000, "maximum": x.max_result_chars,
               "description": format!("How many characters of output this result may carry (default {}); the rest stays readable as a resource.", x.default_result_chars)}),
    );
    schema
}

/// The output schema of `run_network_tool`: [`StructuredResult`]'s.
pub(crate) fn run_output() -> Map<String, Value> {
    derived::<StructuredResult>()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extras() -> InputExtras {
        InputExtras {
            profiles: vec!["default".into(), "gpu".into()],
            default_timeout_secs: 60,
            max_timeout_secs: 600,
            templates: vec!["cargo-test".into()],
            template_listing: "`cargo-test`: cargo".into(),
            default_result_chars: 30_000,
            max_result_chars: 100_000,
            max_stdin_bytes: 1024,
        }
    }

    fn formats(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                if let Some(Value::String(f)) = m.get("format") {
                    out.push(f.clone());
                }
                if let Some(Value::Array(t)) = m.get("type") {
                    out.push(format!("type {t:?}"));
                }
                m.values().for_each(|v| formats(v, out));
            }
            Value::Array(a) => a.iter().for_each(|v| formats(v, out)),
            _ => {}
        }
    }

    #[test]
    fn input_follows_the_contract_and_adds_the_server_s_bounds() {
        let s = Value::Object(run_input(&extras()));
        assert_eq!(s["type"], "object");
        assert_eq!(s["additionalProperties"], false);
        // `executable` or `steps`: the server says which is missing.
        assert!(s.get("required").is_none(), "{s}");
        let p = &s["properties"];
        // Every RunRequest field is there, from the contract.
        for f in [
            "executable",
            "args",
            "cwd",
            "env",
            "timeout_secs",
            "profile",
        ] {
            assert!(p.get(f).is_some(), "{f}: {s}");
        }
        assert_eq!(p["profile"]["enum"], json!(["default", "gpu"]));
        assert_eq!(p["timeout_secs"]["maximum"], 600);
        assert_eq!(p["timeout_secs"]["minimum"], 1);
        assert_eq!(p["template"]["enum"], json!(["cargo-test"]));
        assert_eq!(p["result_chars"]["maximum"], 100_000);
        assert!(s.get("$schema").is_none());
        assert!(!s.to_string().contains("$ref"), "{s}");
        assert_eq!(p["steps"]["items"]["required"], json!(["executable"]));
        jsonschema::meta::validate(&s).unwrap();
    }

    #[test]
    fn no_nonstandard_formats_or_type_arrays() {
        for s in [
            Value::Object(run_input(&extras())),
            Value::Object(run_output()),
        ] {
            let mut f = Vec::new();
            formats(&s, &mut f);
            assert!(f.is_empty(), "{f:?}");
        }
        let mut v = json!({"type": ["integer", "null"], "minimum": 0, "description": "d"});
        strict(&mut v);
        assert_eq!(
            v,
            json!({"description": "d", "anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]})
        );
    }
}
