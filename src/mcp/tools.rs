//! Operator-declared CLI tools (config `tools:`), as in the reference's CLI-to-MCP bridge:
//! each entry becomes its own MCP tool whose input `{"flags": {...}, "args": [...]}` is turned
//! into argv by fixed rules, run through the same [`crate::runner::Runner`] (so policy,
//! limits, audit and redaction apply), and answered with `{stdout, stderr, exitCode}`.
//!
//! Conversion (`docs/tools.md`): `true` → `--flag`, `false` omitted; string or number →
//! `--flag value`; an array repeats the flag for each element; null or empty omitted. An
//! undeclared flag, a wrong type, a missing required flag, or a positional argument that
//! looks like a flag is rejected before anything runs.
//!
//! Size: about 430 lines of code; the rest are unit tests of the flag conversion rules.

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::contract::RunRequest;

/// One `tools:` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolConfig {
    /// The MCP tool name: letters, digits, `_` and `-`, at most 64.
    pub name: String,
    /// What the tool does, for the agent.
    pub description: String,
    /// The program (a name looked up in `PATH` where it runs, or an absolute path).
    pub executable: String,
    /// Fixed leading words after the executable (`[get, pods]`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    /// Declared flags, by name (without `--`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub flags: BTreeMap<String, FlagSpec>,
    /// Positional arguments; absent: the tool takes none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<ArgsSpec>,
    /// The runner profile to run in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// Working directory of the command.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Timeout; absent: the policy's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
    /// Output template (docs/templates.md) applied to stdout and stderr of every call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
}

/// A declared flag.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlagSpec {
    #[serde(rename = "type")]
    pub kind: FlagType,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    #[serde(default)]
    pub required: bool,
}

/// The JSON type a flag takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FlagType {
    #[serde(alias = "boolean")]
    Bool,
    String,
    Number,
    /// Strings or numbers; the flag is repeated for each.
    Array,
}

impl FlagType {
    fn name(self) -> &'static str {
        match self {
            FlagType::Bool => "a boolean",
            FlagType::String => "a string",
            FlagType::Number => "a number",
            FlagType::Array => "an array of strings or numbers",
        }
    }
}

/// Positional arguments of a tool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArgsSpec {
    /// What the positional arguments are, for the agent.
    pub description: String,
    /// The most positional arguments accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<usize>,
    /// Put `--` before the positional arguments, so that the program never reads them as
    /// flags (for programs that understand `--`). Without it, positional arguments that
    /// begin with `-` are rejected: they would be undeclared flags.
    #[serde(default)]
    pub separator: bool,
}

/// A configuration error: the field and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{field}` {message}")]
pub(crate) struct ToolConfigError {
    pub field: String,
    pub message: String,
}

fn cerr(field: String, message: impl Into<String>) -> ToolConfigError {
    ToolConfigError {
        field,
        message: message.into(),
    }
}

/// Names the built-in tool uses; a declared tool may not take them.
pub(crate) const RESERVED: &[&str] = &["run_network_tool"];

/// Checks every tool; errors name the field as `tools[i].…`.
pub(crate) fn validate(tools: &[ToolConfig]) -> Result<(), ToolConfigError> {
    let mut names = HashSet::new();
    for (i, t) in tools.iter().enumerate() {
        let base = format!("tools[{i}]");
        let name_ok = !t.name.is_empty()
            && t.name.len() <= 64
            && t.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !name_ok {
            return Err(cerr(
                format!("{base}.name"),
                format!("{:?} must be 1-64 letters, digits, `_` or `-`", t.name),
            ));
        }
        if RESERVED.contains(&t.name.as_str()) || !names.insert(t.name.as_str()) {
            return Err(cerr(
                format!("{base}.name"),
                format!("{:?} is already taken", t.name),
            ));
        }
        if t.description.trim().is_empty() {
            return Err(cerr(format!("{base}.description"), "must not be empty"));
        }
        if t.executable.is_empty() || t.executable.contains('\0') {
            return Err(cerr(format!("{base}.executable"), "must not be empty"));
        }
        for (j, w) in t.command.iter().enumerate() {
            if w.contains('\0') {
                return Err(cerr(format!("{base}.command[{j}]"), "contains a NUL byte"));
            }
        }
        for name in t.flags.keys() {
            let ok = name
                .bytes()
                .next()
                .is_some_and(|b| b.is_ascii_alphanumeric())
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if !ok {
                return Err(cerr(
                    format!("{base}.flags.{name}"),
                    "a flag name must start with a letter or digit and hold only letters, digits, `-` and `_`",
                ));
            }
        }
        if let Some(cwd) = &t.cwd
            && !cwd.starts_with('/')
        {
            return Err(cerr(format!("{base}.cwd"), "must be an absolute path"));
        }
        if t.timeout_secs == Some(0) {
            return Err(cerr(format!("{base}.timeout_secs"), "must be at least 1"));
        }
    }
    Ok(())
}

/// Why a tool input was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InputError(pub String);

fn ierr(m: impl Into<String>) -> InputError {
    InputError(m.into())
}

/// A scalar as a command-line word: strings as they are, numbers as JSON writes them.
fn word(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

impl ToolConfig {
    /// The argv after the executable for a tool input `{"flags": {...}, "args": [...]}`.
    pub fn argv(&self, input: &Map<String, Value>) -> Result<Vec<String>, InputError> {
        if let Some(k) = input.keys().find(|k| *k != "flags" && *k != "args") {
            return Err(ierr(format!(
                "unknown input field {k:?}: the input is {{\"flags\": {{...}}, \"args\": [...]}}"
            )));
        }
        let empty = Map::new();
        let flags = match input.get("flags") {
            None | Some(Value::Null) => &empty,
            Some(Value::Object(m)) => m,
            Some(_) => return Err(ierr("`flags` must be an object")),
        };
        let mut out = self.command.clone();
        if let Some(name) = flags.keys().find(|k| !self.flags.contains_key(*k)) {
            let known: Vec<&str> = self.flags.keys().map(String::as_str).collect();
            return Err(ierr(format!(
                "undeclared flag {name:?}; this tool takes: {}",
                if known.is_empty() {
                    "no flags".to_owned()
                } else {
                    known.join(", ")
                }
            )));
        }
        // Declared order (sorted by name): the same input always gives the same argv.
        for (name, spec) in &self.flags {
            let value = flags.get(name).unwrap_or(&Value::Null);
            let wrong = || {
                ierr(format!(
                    "flag {name:?} must be {}, got {}",
                    spec.kind.name(),
                    kind_of(value)
                ))
            };
            let before = out.len();
            match (spec.kind, value) {
                (_, Value::Null) => {}
                (FlagType::Bool, Value::Bool(b)) => {
                    if *b {
                        out.push(format!("--{name}"));
                    }
                }
                (FlagType::String, Value::String(s)) => {
                    if !s.is_empty() {
                        out.push(format!("--{name}"));
                        out.push(s.clone());
                    }
                }
                (FlagType::Number, Value::Number(n)) => {
                    out.push(format!("--{name}"));
                    out.push(n.to_string());
                }
                (FlagType::Array, Value::Array(items)) => {
                    for item in items {
                        if item.is_null() {
                            continue;
                        }
                        let w = word(item).ok_or_else(|| {
                            ierr(format!(
                                "flag {name:?}: array elements must be strings or numbers, got {}",
                                kind_of(item)
                            ))
                        })?;
                        if w.is_empty() {
                            continue;
                        }
                        out.push(format!("--{name}"));
                        out.push(w);
                    }
                }
                _ => return Err(wrong()),
            }
            // `false`, null and empty values are omitted; a required flag must give something.
            if spec.required && out.len() == before && !matches!(value, Value::Bool(false)) {
                return Err(ierr(format!("flag {name:?} is required")));
            }
        }
        let args = match input.get("args") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a.clone(),
            Some(_) => return Err(ierr("`args` must be an array of strings")),
        };
        if args.is_empty() {
            return Ok(out);
        }
        let Some(spec) = &self.args else {
            return Err(ierr("this tool takes no positional arguments"));
        };
        if let Some(max) = spec.max
            && args.len() > max
        {
            return Err(ierr(format!(
                "{} positional arguments, this tool takes at most {max}",
                args.len()
            )));
        }
        if spec.separator {
            out.push("--".into());
        }
        for (i, a) in args.iter().enumerate() {
            let Value::String(w) = a else {
                return Err(ierr(format!(
                    "args[{i}] must be a string, got {}",
                    kind_of(a)
                )));
            };
            if !spec.separator && w.starts_with('-') {
                return Err(ierr(format!(
                    "args[{i}] {w:?} looks like a flag: pass flags in `flags` (only declared ones are accepted)"
                )));
            }
            out.push(w.clone());
        }
        Ok(out)
    }

    /// The run request for a tool input.
    pub fn request(&self, input: &Map<String, Value>) -> Result<RunRequest, InputError> {
        Ok(RunRequest {
            executable: self.executable.clone(),
            args: self.argv(input)?,
            cwd: self.cwd.clone(),
            env: BTreeMap::new(),
            timeout_secs: self.timeout_secs,
            profile: self.profile.clone(),
            ..RunRequest::default()
        })
    }

    /// The MCP input schema: `flags` with one property per declared flag, `args` when the
    /// tool takes positional arguments.
    pub fn input_schema(&self) -> Map<String, Value> {
        let mut props = Map::new();
        let mut required = Vec::new();
        for (name, spec) in &self.flags {
            let mut s = match spec.kind {
                FlagType::Bool => json!({"type": "boolean"}),
                FlagType::String => json!({"type": "string"}),
                FlagType::Number => json!({"type": "number"}),
                FlagType::Array => {
                    json!({"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "number"}]}})
                }
            };
            if !spec.description.is_empty() {
                s["description"] = Value::String(spec.description.clone());
            }
            if spec.required {
                required.push(Value::String(name.clone()));
            }
            props.insert(name.clone(), s);
        }
        let mut flags = json!({
            "type": "object",
            "additionalProperties": false,
            "properties": props,
            "description": "Flags: true → --flag, false omitted; string/number → --flag value; arrays repeat the flag.",
        });
        if !required.is_empty() {
            flags["required"] = Value::Array(required.clone());
        }
        let mut properties = Map::new();
        properties.insert("flags".into(), flags);
        if let Some(a) = &self.args {
            let mut s =
                json!({"type": "array", "items": {"type": "string"}, "description": a.description});
            if let Some(max) = a.max {
                s["maxItems"] = json!(max);
            }
            properties.insert("args".into(), s);
        }
        let mut schema = json!({
            "type": "object",
            "additionalProperties": false,
            "properties": properties,
        });
        if !required.is_empty() {
            schema["required"] = json!(["flags"]);
        }
        match schema {
            Value::Object(m) => m,
            _ => Map::new(),
        }
    }

    /// The command line the tool runs, for its description (`kubectl get pods [flags] [args]`).
    pub fn usage(&self) -> String {
        let mut s = std::iter::once(&self.executable)
            .chain(&self.command)
            .map(|w| crate::contract::shell_quote(w))
            .collect::<Vec<_>>()
            .join(" ");
        if !self.flags.is_empty() {
            s.push_str(" [flags]");
        }
        if self.args.is_some() {
            s.push_str(" [args...]");
        }
        s
    }
}

/// What a declared tool answers (its structured content).
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
pub(crate) struct ToolOutput {
    pub stdout: String,
    pub stderr: String,
    /// The exit code; 128+N when signal N killed the command; 124 when its timeout did.
    #[serde(rename = "exitCode")]
    pub exit_code: i32,
    /// When the result leaves output out: where the full output is (resources/read).
    #[serde(rename = "fullOutput", skip_serializing_if = "Option::is_none")]
    pub full_output: Option<crate::result::FullOutput>,
}

/// The output schema of every declared tool: [`ToolOutput`]'s.
pub(crate) fn output_schema() -> Map<String, Value> {
    super::schema::derived::<ToolOutput>()
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kubectl() -> ToolConfig {
        yaml_serde::from_str(
            r#"
name: kubectl_get_pods
description: List pods
executable: kubectl
command: [get, pods]
flags:
  namespace: {type: string, description: The namespace}
  output: {type: string}
  verbose: {type: bool}
  limit: {type: number}
  label: {type: array}
args: {description: Pod names, max: 3}
"#,
        )
        .unwrap()
    }

    fn argv(t: &ToolConfig, input: Value) -> Result<Vec<String>, InputError> {
        t.argv(input.as_object().unwrap())
    }

    #[test]
    fn the_reference_example() {
        let t = kubectl();
        let a = argv(
            &t,
            json!({"flags": {"namespace": "production", "output": "json", "verbose": true}, "args": ["web-server"]}),
        )
        .unwrap();
        // Flags in name order, then the positional arguments.
        assert_eq!(
            a,
            [
                "get",
                "pods",
                "--namespace",
                "production",
                "--output",
                "json",
                "--verbose",
                "web-server"
            ]
        );
    }

    #[test]
    fn conversion_table() {
        let t = kubectl();
        let cases: &[(Value, &[&str])] = &[
            (json!({}), &["get", "pods"]),
            (
                json!({"flags": {"verbose": true}}),
                &["get", "pods", "--verbose"],
            ),
            (json!({"flags": {"verbose": false}}), &["get", "pods"]),
            (json!({"flags": {"verbose": null}}), &["get", "pods"]),
            (
                json!({"flags": {"output": "wide"}}),
                &["get", "pods", "--output", "wide"],
            ),
            (json!({"flags": {"output": ""}}), &["get", "pods"]),
            (
                json!({"flags": {"limit": 5}}),
                &["get", "pods", "--limit", "5"],
            ),
            (
                json!({"flags": {"limit": 2.5}}),
                &["get", "pods", "--limit", "2.5"],
            ),
            (
                json!({"flags": {"limit": -1}}),
                &["get", "pods", "--limit", "-1"],
            ),
            (
                json!({"flags": {"label": ["a", "b"]}}),
                &["get", "pods", "--label", "a", "--label", "b"],
            ),
            (
                json!({"flags": {"label": [1, null, ""]}}),
                &["get", "pods", "--label", "1"],
            ),
            (json!({"flags": {"label": []}}), &["get", "pods"]),
            (
                json!({"flags": {"output": "a b; rm -rf /"}}),
                &["get", "pods", "--output", "a b; rm -rf /"],
            ),
            (json!({"args": ["x", "y"]}), &["get", "pods", "x", "y"]),
            (json!({"args": null, "flags": null}), &["get", "pods"]),
        ];
        for (input, want) in cases {
            assert_eq!(argv(&t, input.clone()).unwrap(), *want, "{input}");
        }
    }

    #[test]
    fn rejections() {
        let t = kubectl();
        for (input, msg) in [
            (json!({"flags": {"all": true}}), "undeclared flag \"all\""),
            (
                json!({"flags": {"verbose": "yes"}}),
                "\"verbose\" must be a boolean, got a string",
            ),
            (
                json!({"flags": {"output": 3}}),
                "\"output\" must be a string, got a number",
            ),
            (
                json!({"flags": {"limit": "5"}}),
                "\"limit\" must be a number",
            ),
            (
                json!({"flags": {"label": "a"}}),
                "\"label\" must be an array",
            ),
            (
                json!({"flags": {"label": [true]}}),
                "array elements must be strings or numbers",
            ),
            (json!({"flags": []}), "`flags` must be an object"),
            (json!({"args": "x"}), "`args` must be an array"),
            (json!({"args": [1]}), "args[0] must be a string"),
            (json!({"args": ["--all-namespaces"]}), "looks like a flag"),
            (json!({"args": ["a", "b", "c", "d"]}), "at most 3"),
            (json!({"other": 1}), "unknown input field \"other\""),
        ] {
            let e = argv(&t, input.clone()).unwrap_err().0;
            assert!(e.contains(msg), "{input}: {e}");
        }
        let mut no_args = kubectl();
        no_args.args = None;
        assert!(
            argv(&no_args, json!({"args": ["x"]}))
                .unwrap_err()
                .0
                .contains("no positional")
        );
        assert!(argv(&no_args, json!({"args": []})).is_ok());
    }

    #[test]
    fn required_flags_and_separator() {
        let t: ToolConfig = yaml_serde::from_str(
            "name: grep\ndescription: Search\nexecutable: grep\nflags:\n  regexp: {type: string, required: true}\nargs: {description: files, separator: true}\n",
        )
        .unwrap();
        assert!(
            argv(&t, json!({}))
                .unwrap_err()
                .0
                .contains("\"regexp\" is required")
        );
        assert!(argv(&t, json!({"flags": {"regexp": ""}})).is_err());
        assert_eq!(
            argv(
                &t,
                json!({"flags": {"regexp": "x"}, "args": ["-weird-file"]})
            )
            .unwrap(),
            ["--regexp", "x", "--", "-weird-file"]
        );
        let schema = Value::Object(t.input_schema());
        assert_eq!(schema["required"], json!(["flags"]));
        assert_eq!(schema["properties"]["flags"]["required"], json!(["regexp"]));
        assert_eq!(schema["properties"]["flags"]["additionalProperties"], false);
    }

    #[test]
    fn validation_names_the_field() {
        let ok = kubectl();
        type Change = Box<dyn Fn(&mut ToolConfig)>;
        let cases: Vec<(Change, &str)> = vec![
            (Box::new(|t| t.name = "has space".into()), "tools[1].name"),
            (
                Box::new(|t| t.name = "run_network_tool".into()),
                "tools[1].name",
            ),
            (
                Box::new(|t| t.name = "kubectl_get_pods".into()),
                "tools[1].name",
            ),
            (
                Box::new(|t| t.description = " ".into()),
                "tools[1].description",
            ),
            (
                Box::new(|t| t.executable = "".into()),
                "tools[1].executable",
            ),
            (
                Box::new(|t| {
                    t.flags.insert(
                        "--x".into(),
                        FlagSpec {
                            kind: FlagType::Bool,
                            description: String::new(),
                            required: false,
                        },
                    );
                }),
                "tools[1].flags.--x",
            ),
            (Box::new(|t| t.cwd = Some("rel".into())), "tools[1].cwd"),
            (
                Box::new(|t| t.timeout_secs = Some(0)),
                "tools[1].timeout_secs",
            ),
        ];
        for (change, field) in cases {
            let mut second = kubectl();
            second.name = "second".into();
            change(&mut second);
            let e = validate(&[ok.clone(), second]).unwrap_err();
            assert_eq!(e.field, field, "{e}");
        }
        assert!(validate(&[ok]).is_ok());
        let bad_type = yaml_serde::from_str::<ToolConfig>(
            "name: a\ndescription: b\nexecutable: c\nflags: {x: {type: list}}\n",
        );
        assert!(bad_type.is_err());
    }
}
