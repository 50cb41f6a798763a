//! The execution policy (config `policy:`): which executables, arguments, environment
//! variables, working directories and timeouts a request may use. Checked in
//! [`crate::runner::Runner::spec`], so that every front end (`/raw`, MCP, CLI tools) gets the
//! same rules; a violation is rejected before anything starts, with the rule that matched in
//! the message. `docs/policy.md` documents the matching rules.
//!
//! Size: about 650 lines of code plus unit tests. Each rule (executables, arguments,
//! environment, cwd, timeouts, per-profile overrides) is a config type, its validation and its
//! check side by side; split apart, a rule's three parts would sit in three files.

use std::collections::BTreeMap;

use globset::{Candidate, GlobBuilder, GlobSet, GlobSetBuilder};
use serde::{Deserialize, Serialize};

use crate::contract::{ErrorBody, ErrorCode};
use crate::limits::Limits;

/// The `policy:` section of the configuration file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    pub executables: ExecutableRules,
    pub args: ArgRules,
    pub env: EnvRules,
    pub cwd: CwdRules,
    pub timeout: TimeoutRules,
    /// Overrides per runner profile (`default` for requests without one). Each section given
    /// here replaces the same section of the base rules as a whole.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub profiles: BTreeMap<String, PolicyOverride>,
}

/// A profile's overrides: every section is optional and replaces the base section.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyOverride {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub executables: Option<ExecutableRules>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub args: Option<ArgRules>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub env: Option<EnvRules>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<CwdRules>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout: Option<TimeoutRules>,
}

/// Executables: entries are bare names (`cargo`) or absolute paths (`/usr/bin/cargo`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ExecutableRules {
    /// When not empty, only these may run. A name allows that bare name only (looked up in
    /// `PATH` where the command runs); a path allows exactly that path (after `.`/`..`
    /// normalisation).
    pub allow: Vec<String>,
    /// Never run these. Compared by file name, whatever the form of the entry or of the
    /// request: `rm` and `/bin/rm` both deny `rm`, `/usr/bin/rm` and `./rm`.
    pub deny: Vec<String>,
}

/// Argument limits.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ArgRules {
    /// The most arguments a request may pass (the executable not counted).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_count: Option<usize>,
    /// The longest single argument, in bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_length: Option<usize>,
}

/// Request environment variables. Patterns are names with `*` wildcards (`CARGO_*`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct EnvRules {
    /// When not empty, a request may only set variables matching one of these.
    pub allow: Vec<String>,
    /// A request may never set variables matching one of these (checked first).
    pub deny: Vec<String>,
    /// Variables that change which code a program runs (loader, shell, interpreter hooks,
    /// `PATH`): refused whenever `executables.allow` restricts executables, since any of them
    /// walks around an allow list. Absent: [`INJECTION_VARS`]; `[]` turns the check off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub injection_vars: Option<Vec<String>>,
}

/// The default of `policy.env.injection_vars` (docs/policy.md explains each group).
pub(crate) const INJECTION_VARS: &[&str] = &[
    // Program lookup and the dynamic loader.
    "PATH",
    "LD_*",
    "DYLD_*",
    "GCONV_PATH",
    "HOSTALIASES",
    "LOCALDOMAIN",
    "RES_OPTIONS",
    "MALLOC_*",
    "GLIBC_TUNABLES",
    // Shells.
    "BASH_ENV",
    "ENV",
    "BASH_FUNC_*",
    "SHELLOPTS",
    "BASHOPTS",
    "PS4",
    "PROMPT_COMMAND",
    "IFS",
    "CDPATH",
    "ZDOTDIR",
    // Interpreters and runtimes.
    "PYTHONSTARTUP",
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONUSERBASE",
    "PERL5LIB",
    "PERL5OPT",
    "PERLLIB",
    "RUBYOPT",
    "RUBYLIB",
    "NODE_OPTIONS",
    "NODE_PATH",
    "JAVA_TOOL_OPTIONS",
    "_JAVA_OPTIONS",
    "JDK_JAVA_OPTIONS",
    "CLASSPATH",
    // Helper programs that tools start by name.
    "GIT_*",
    "SSH_ASKPASS",
    "PAGER",
    "MANPAGER",
    "EDITOR",
    "VISUAL",
    "BROWSER",
    "LESSOPEN",
    "LESSCLOSE",
];

/// Working directories.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CwdRules {
    /// When not empty, a request's `cwd` (after `.`/`..` normalisation) must be one of these
    /// directories or below one. A request without `cwd` runs in the backend's default
    /// directory, which the operator controls, and is allowed.
    pub allow: Vec<String>,
}

/// Timeouts; absent values fall back to `limits.default_timeout_secs` / `max_timeout_secs`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TimeoutRules {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_secs: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_secs: Option<u64>,
}

/// A configuration error in `policy:`: the field (a full dotted path) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{field}` {message}")]
pub struct PolicyConfigError {
    pub field: String,
    pub message: String,
}

fn config_error(field: impl Into<String>, message: impl Into<String>) -> PolicyConfigError {
    PolicyConfigError {
        field: field.into(),
        message: message.into(),
    }
}

/// The resolved rules of one profile, with the dotted config path each section came from,
/// so that a violation names the rule that matched, and the environment patterns compiled.
#[derive(Debug, Clone)]
struct Effective {
    executables: (String, ExecutableRules),
    args: (String, ArgRules),
    env: (String, EnvRules),
    cwd: (String, CwdRules),
    timeout: (String, TimeoutRules),
    env_allow: Patterns,
    env_deny: Patterns,
    /// `env.injection_vars`, or [`INJECTION_VARS`] when not set.
    injection_vars: Patterns,
}

/// What a request may do once the policy allowed it: the normalised values to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Allowed {
    /// The executable, with a path normalised (`/usr/bin/../bin/rm` → `/usr/bin/rm`).
    pub executable: String,
    /// The normalised working directory.
    pub cwd: Option<String>,
    pub timeout_secs: u64,
}

/// The request fields the policy looks at.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Subject<'a> {
    pub executable: &'a str,
    pub args: &'a [String],
    pub cwd: Option<&'a str>,
    pub env_names: &'a [&'a str],
    pub timeout_secs: Option<u64>,
    pub profile: Option<&'a str>,
}

/// The checked policy, ready to evaluate requests.
#[derive(Debug, Clone)]
pub(crate) struct Policy {
    config: PolicyConfig,
    limits: Limits,
    /// The rules of a profile without overrides.
    base: Effective,
    /// The rules of each profile with overrides.
    profiles: BTreeMap<String, Effective>,
}

/// The profile name a request without `profile` uses.
pub(crate) const DEFAULT_PROFILE: &str = "default";

impl PolicyConfig {
    /// Checks every rule; errors name the field as `policy.…`.
    pub fn validate(&self, limits: &Limits) -> Result<(), PolicyConfigError> {
        self.executables.validate("policy.executables")?;
        self.args.validate("policy.args")?;
        self.env.validate("policy.env")?;
        self.cwd.validate("policy.cwd")?;
        self.timeout.validate("policy.timeout", limits)?;
        for (name, o) in &self.profiles {
            let base = format!("policy.profiles.{name}");
            if name.is_empty() {
                return Err(config_error("policy.profiles", "has an empty profile name"));
            }
            if let Some(e) = &o.executables {
                e.validate(&format!("{base}.executables"))?;
            }
            if let Some(a) = &o.args {
                a.validate(&format!("{base}.args"))?;
            }
            if let Some(e) = &o.env {
                e.validate(&format!("{base}.env"))?;
            }
            if let Some(c) = &o.cwd {
                c.validate(&format!("{base}.cwd"))?;
            }
            let timeout = o.timeout.as_ref().unwrap_or(&self.timeout);
            let field = if o.timeout.is_some() {
                format!("{base}.timeout")
            } else {
                "policy.timeout".to_owned()
            };
            timeout.validate(&field, limits)?;
        }
        Ok(())
    }
}

impl ExecutableRules {
    fn validate(&self, base: &str) -> Result<(), PolicyConfigError> {
        for (list, entries) in [("allow", &self.allow), ("deny", &self.deny)] {
            for (i, e) in entries.iter().enumerate() {
                let field = format!("{base}.{list}[{i}]");
                if e.is_empty() || e.contains('\0') {
                    return Err(config_error(field, "must be a non-empty name or path"));
                }
                if e.contains('/') {
                    if !e.starts_with('/') {
                        return Err(config_error(
                            field,
                            format!("{e:?} must be a bare name or an absolute path"),
                        ));
                    }
                    if e.ends_with('/') {
                        return Err(config_error(
                            field,
                            format!("{e:?} names a directory, not a program"),
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

impl ArgRules {
    fn validate(&self, base: &str) -> Result<(), PolicyConfigError> {
        if self.max_length == Some(0) {
            return Err(config_error(
                format!("{base}.max_length"),
                "must be at least 1",
            ));
        }
        Ok(())
    }
}

impl EnvRules {
    fn validate(&self, base: &str) -> Result<(), PolicyConfigError> {
        let injection = self.injection_vars.as_deref().unwrap_or_default();
        for (list, entries) in [
            ("allow", &self.allow[..]),
            ("deny", &self.deny[..]),
            ("injection_vars", injection),
        ] {
            for (i, p) in entries.iter().enumerate() {
                let ok = !p.is_empty()
                    && p.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'*');
                if !ok {
                    return Err(config_error(
                        format!("{base}.{list}[{i}]"),
                        format!(
                            "{p:?} is not a variable name pattern (letters, digits, `_` and `*` wildcards)"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

impl CwdRules {
    fn validate(&self, base: &str) -> Result<(), PolicyConfigError> {
        for (i, p) in self.allow.iter().enumerate() {
            if !p.starts_with('/') || p.contains('\0') {
                return Err(config_error(
                    format!("{base}.allow[{i}]"),
                    format!("{p:?} must be an absolute path"),
                ));
            }
        }
        Ok(())
    }
}

impl TimeoutRules {
    fn resolve(&self, limits: &Limits) -> (u64, u64) {
        let max = self.max_secs.unwrap_or(limits.max_timeout_secs);
        let default = self
            .default_secs
            .unwrap_or(limits.default_timeout_secs.min(max));
        (default, max)
    }

    fn validate(&self, base: &str, limits: &Limits) -> Result<(), PolicyConfigError> {
        if self.max_secs == Some(0) {
            return Err(config_error(
                format!("{base}.max_secs"),
                "must be at least 1",
            ));
        }
        let (default, max) = self.resolve(limits);
        if default == 0 || default > max {
            return Err(config_error(
                format!("{base}.default_secs"),
                format!("must be between 1 and the maximum timeout ({max})"),
            ));
        }
        Ok(())
    }
}

/// Normalises an absolute path lexically: `.` and empty components dropped, `..` removes the
/// previous component (never above `/`). Symbolic links are not resolved: the command may
/// run on another machine (a pod), where the gateway cannot look.
pub(crate) fn normalize_path(path: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    let mut out = String::with_capacity(path.len());
    for p in &parts {
        out.push('/');
        out.push_str(p);
    }
    if out.is_empty() {
        out.push('/');
    }
    out
}

/// Whether `dir` is `prefix` or below it, component-wise (`/work` does not cover
/// `/workspace`). Both are normalised.
fn under(dir: &str, prefix: &str) -> bool {
    prefix == "/"
        || dir == prefix
        || (dir.starts_with(prefix) && dir.as_bytes().get(prefix.len()) == Some(&b'/'))
}

/// A list of variable name patterns compiled once, when the policy is loaded: `*` matches
/// any run of characters (also none); everything else matches itself, case-sensitively.
#[derive(Debug, Clone)]
struct Patterns {
    set: GlobSet,
    entries: Vec<String>,
}

impl Patterns {
    fn new(field: &str, entries: &[impl AsRef<str>]) -> Result<Self, PolicyConfigError> {
        let mut set = GlobSetBuilder::new();
        for (i, entry) in entries.iter().enumerate() {
            // A run of `*` is one `*`: globset reads a `**` at an end as a path wildcard.
            let mut pattern = String::with_capacity(entry.as_ref().len());
            for c in entry.as_ref().chars() {
                if !(c == '*' && pattern.ends_with('*')) {
                    pattern.push(c);
                }
            }
            let glob = GlobBuilder::new(&pattern)
                .literal_separator(false)
                .backslash_escape(false)
                .build()
                .map_err(|e| config_error(format!("{field}[{i}]"), e.kind().to_string()))?;
            set.add(glob);
        }
        Ok(Self {
            set: set
                .build()
                .map_err(|e| config_error(field, e.to_string()))?,
            entries: entries.iter().map(|e| e.as_ref().to_owned()).collect(),
        })
    }

    /// The first entry (by position) that matches `name`.
    fn first(&self, name: &Candidate<'_>) -> Option<&str> {
        let hits = self.set.matches_candidate(name);
        hits.first().map(|&i| self.entries[i].as_str())
    }
}

fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// Why the policy refused a request; the message names the rule that matched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PolicyError {
    /// A rule refused it: `403 policy_violation`.
    #[error("{0}")]
    Violation(String),
    /// `timeout_secs` over the maximum: `400 invalid_request`.
    #[error("`timeout_secs` is {secs}, over the server maximum of {max} ({set_by})")]
    TimeoutOverMax { secs: u64, max: u64, set_by: String },
}

impl From<PolicyError> for ErrorBody {
    fn from(e: PolicyError) -> Self {
        let code = match e {
            PolicyError::Violation(_) => ErrorCode::PolicyViolation,
            PolicyError::TimeoutOverMax { .. } => ErrorCode::InvalidRequest,
        };
        ErrorBody::new(code, e.to_string())
    }
}

fn violation(message: String) -> PolicyError {
    PolicyError::Violation(message)
}

impl Policy {
    /// A policy from a configuration that [`PolicyConfig::validate`] accepted, its patterns
    /// compiled.
    pub(crate) fn new(config: PolicyConfig, limits: Limits) -> Result<Self, PolicyConfigError> {
        let base = Self::resolve(&config, None)?;
        let profiles = config
            .profiles
            .keys()
            .map(|name| Ok((name.clone(), Self::resolve(&config, Some(name))?)))
            .collect::<Result<_, PolicyConfigError>>()?;
        Ok(Self {
            config,
            limits,
            base,
            profiles,
        })
    }

    /// The policy of a configuration without `policy:`: every request goes through.
    pub(crate) fn unrestricted(limits: Limits) -> Self {
        // Only the built-in injection_vars list is compiled, and its entries are plain names.
        Self::new(PolicyConfig::default(), limits).expect("the built-in patterns compile")
    }

    fn effective(&self, profile: &str) -> &Effective {
        self.profiles.get(profile).unwrap_or(&self.base)
    }

    /// The rules of `profile` (`None`: without overrides).
    fn resolve(base: &PolicyConfig, profile: Option<&str>) -> Result<Effective, PolicyConfigError> {
        let o = profile.and_then(|p| base.profiles.get(p));
        let profile = profile.unwrap_or_default();
        let pick = |name: &str, over: bool| {
            if over {
                format!("policy.profiles.{profile}.{name}")
            } else {
                format!("policy.{name}")
            }
        };
        macro_rules! section {
            ($f:ident) => {{
                let over = o.and_then(|o| o.$f.as_ref());
                (
                    pick(stringify!($f), over.is_some()),
                    over.unwrap_or(&base.$f).clone(),
                )
            }};
        }
        let env = section!(env);
        let (field, rules) = &env;
        let injection_vars = match &rules.injection_vars {
            Some(list) => Patterns::new(&format!("{field}.injection_vars"), list)?,
            None => Patterns::new(&format!("{field}.injection_vars"), INJECTION_VARS)?,
        };
        Ok(Effective {
            executables: section!(executables),
            args: section!(args),
            env_allow: Patterns::new(&format!("{field}.allow"), &rules.allow)?,
            env_deny: Patterns::new(&format!("{field}.deny"), &rules.deny)?,
            injection_vars,
            env,
            cwd: section!(cwd),
            timeout: section!(timeout),
        })
    }

    /// Checks a request. `Err` is a `policy_violation` (403) naming the rule, or an
    /// `invalid_request` for a timeout over the maximum.
    pub(crate) fn check(&self, s: &Subject<'_>) -> Result<Allowed, PolicyError> {
        let profile = s.profile.unwrap_or(DEFAULT_PROFILE);
        let eff = self.effective(profile);
        let cwd = s.cwd.map(normalize_path);
        let executable = self.check_executable(eff, s.executable, cwd.as_deref())?;

        let (field, args) = &eff.args;
        if let Some(max) = args.max_count
            && s.args.len() > max
        {
            return Err(violation(format!(
                "{} arguments, over the limit of {max} set by {field}.max_count",
                s.args.len()
            )));
        }
        if let Some(max) = args.max_length
            && let Some((i, a)) = s.args.iter().enumerate().find(|(_, a)| a.len() > max)
        {
            return Err(violation(format!(
                "args[{i}] is {} bytes long, over the limit of {max} set by {field}.max_length",
                a.len()
            )));
        }

        let (field, env) = &eff.env;
        for name in s.env_names {
            let candidate = Candidate::new(name);
            if let Some(p) = eff.env_deny.first(&candidate) {
                return Err(violation(format!(
                    "environment variable {name} is denied by {field}.deny entry {p:?}"
                )));
            }
            if !env.allow.is_empty() && eff.env_allow.first(&candidate).is_none() {
                return Err(violation(format!(
                    "environment variable {name} is not in {field}.allow"
                )));
            }
        }
        let (exe_field, exes) = &eff.executables;
        if !exes.allow.is_empty() {
            for name in s.env_names {
                if let Some(p) = eff.injection_vars.first(&Candidate::new(name)) {
                    return Err(violation(format!(
                        "environment variable {name} can change which program runs, so it is refused while {exe_field}.allow restricts executables ({field}.injection_vars entry {p:?})"
                    )));
                }
            }
        }

        let (field, rules) = &eff.cwd;
        if let Some(dir) = &cwd
            && !rules.allow.is_empty()
            && !rules.allow.iter().any(|p| under(dir, &normalize_path(p)))
        {
            return Err(violation(format!(
                "working directory {dir:?} is not under any directory of {field}.allow"
            )));
        }

        let (field, timeout) = &eff.timeout;
        let (default, max) = timeout.resolve(&self.limits);
        let secs = s.timeout_secs.unwrap_or(default);
        if secs > max {
            let source = if timeout.max_secs.is_some() {
                format!("{field}.max_secs")
            } else {
                "limits.max_timeout_secs".to_owned()
            };
            return Err(PolicyError::TimeoutOverMax {
                secs,
                max,
                set_by: source,
            });
        }
        Ok(Allowed {
            executable,
            cwd,
            timeout_secs: secs,
        })
    }

    fn check_executable(
        &self,
        eff: &Effective,
        executable: &str,
        cwd: Option<&str>,
    ) -> Result<String, PolicyError> {
        let (field, rules) = &eff.executables;
        let is_path = executable.contains('/');
        // A relative path (`./build.sh`) is resolved against the request's cwd for the path
        // rules; without a cwd the gateway cannot know what it names.
        let resolved = if executable.starts_with('/') {
            Some(normalize_path(executable))
        } else if is_path {
            cwd.map(|d| normalize_path(&format!("{d}/{executable}")))
        } else {
            None
        };
        let name = file_name(resolved.as_deref().unwrap_or(executable));
        if let Some(entry) = rules.deny.iter().find(|e| file_name(e) == name) {
            return Err(violation(format!(
                "executable {executable:?} is denied by {field}.deny entry {entry:?}"
            )));
        }
        if !rules.allow.is_empty() {
            let allowed = rules.allow.iter().any(|entry| {
                if entry.contains('/') {
                    resolved.as_deref() == Some(normalize_path(entry).as_str())
                } else {
                    !is_path && entry == executable
                }
            });
            if !allowed {
                let hint = if is_path && resolved.is_none() {
                    " (a relative path needs `cwd` to be checked)"
                } else {
                    ""
                };
                return Err(violation(format!(
                    "executable {executable:?} is not in {field}.allow{hint}"
                )));
            }
        }
        // Run what was checked: an absolute path without `..` tricks.
        Ok(if executable.starts_with('/') {
            resolved.unwrap_or_else(|| executable.to_owned())
        } else {
            executable.to_owned()
        })
    }

    /// The rules as the capabilities document reports them.
    pub(crate) fn summary(&self) -> PolicySummary {
        let mut profiles = BTreeMap::new();
        for name in self.config.profiles.keys() {
            profiles.insert(name.clone(), self.rules_summary(name));
        }
        PolicySummary {
            default: self.rules_summary(DEFAULT_PROFILE),
            profiles,
        }
    }

    fn rules_summary(&self, profile: &str) -> RulesSummary {
        let eff = self.effective(profile);
        let (default_timeout_secs, max_timeout_secs) = eff.timeout.1.resolve(&self.limits);
        RulesSummary {
            executables: eff.executables.1.clone(),
            args: eff.args.1.clone(),
            env: eff.env.1.clone(),
            cwd: eff.cwd.1.clone(),
            default_timeout_secs,
            max_timeout_secs,
        }
    }
}

/// The policy in the capabilities document: the effective rules for requests without a
/// profile, and for each profile that has overrides.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub(crate) struct PolicySummary {
    pub default: RulesSummary,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub profiles: BTreeMap<String, RulesSummary>,
}

/// One profile's effective rules (empty lists mean "no restriction").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub(crate) struct RulesSummary {
    pub executables: ExecutableRules,
    pub args: ArgRules,
    pub env: EnvRules,
    pub cwd: CwdRules,
    pub default_timeout_secs: u64,
    pub max_timeout_secs: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(yaml: &str) -> Policy {
        let c: PolicyConfig = yaml_serde::from_str(yaml).unwrap();
        c.validate(&Limits::default()).unwrap();
        Policy::new(c, Limits::default()).unwrap()
    }

    fn subject(exe: &str) -> Subject<'_> {
        Subject {
            executable: exe,
            args: &[],
            cwd: None,
            env_names: &[],
            timeout_secs: None,
            profile: None,
        }
    }

    fn denied(p: &Policy, s: Subject<'_>) -> String {
        let e = ErrorBody::from(p.check(&s).unwrap_err());
        assert_eq!(e.code, ErrorCode::PolicyViolation, "{}", e.message);
        e.message
    }

    #[test]
    fn normalisation() {
        for (a, b) in [
            ("/", "/"),
            ("/a/b/../c", "/a/c"),
            ("/a/./b//c/", "/a/b/c"),
            ("/../../etc", "/etc"),
            ("/work/../etc/passwd", "/etc/passwd"),
        ] {
            assert_eq!(normalize_path(a), b, "{a}");
        }
        assert!(under("/work/x", "/work"));
        assert!(under("/work", "/work"));
        assert!(!under("/workspace", "/work"));
        assert!(under("/anything", "/"));
    }

    #[test]
    fn globs() {
        for (p, n, m) in [
            ("CARGO_*", "CARGO_HOME", true),
            ("CARGO_*", "CARGO_", true),
            ("CARGO_*", "XCARGO_A", false),
            ("*_TOKEN", "GH_TOKEN", true),
            ("*_TOKEN", "GH_TOKENS", false),
            ("A*B*C", "AxxBxxC", true),
            ("A*B*C", "AxxBxx", false),
            ("PATH", "PATH", true),
            ("PATH", "PATHS", false),
            ("*", "X", true),
            ("cargo_*", "CARGO_HOME", false),
            ("A**B", "AxB", true),
            ("**", "ANY", true),
            ("**_X", "A_X", true),
            ("*", "a/b", true),
        ] {
            let set = Patterns::new("policy.env.allow", &[p]).unwrap();
            assert_eq!(set.first(&Candidate::new(n)).is_some(), m, "{p} {n}");
        }
        // The first matching entry by position is the one a message names.
        let set = Patterns::new("policy.env.deny", &["B_*", "*_X", "A_*"]).unwrap();
        assert_eq!(set.first(&Candidate::new("A_X")), Some("*_X"));
        assert_eq!(set.first(&Candidate::new("C")), None);
    }

    #[test]
    fn deny_matches_by_file_name() {
        let p = policy("executables: {deny: [rm, /usr/bin/shred]}");
        for exe in [
            "rm",
            "/bin/rm",
            "/usr/bin/../bin/rm",
            "./rm",
            "shred",
            "/opt/shred",
        ] {
            let mut s = subject(exe);
            s.cwd = Some("/tmp");
            let m = denied(&p, s);
            assert!(m.contains("policy.executables.deny"), "{m}");
        }
        assert!(p.check(&subject("ls")).is_ok());
        assert!(p.check(&subject("/bin/rmdir")).is_ok());
    }

    #[test]
    fn allow_names_and_paths() {
        let p = policy("executables: {allow: [cargo, /usr/bin/make]}");
        assert!(p.check(&subject("cargo")).is_ok());
        assert_eq!(
            p.check(&subject("/usr/bin/../bin/make"))
                .unwrap()
                .executable,
            "/usr/bin/make"
        );
        // A name allows the bare name only: not a program of that name anywhere.
        assert!(denied(&p, subject("/tmp/cargo")).contains("policy.executables.allow"));
        assert!(denied(&p, subject("make")).contains("policy.executables.allow"));
        let m = denied(&p, subject("./make"));
        assert!(m.contains("needs `cwd`"), "{m}");
        let mut s = subject("./make");
        s.cwd = Some("/usr/bin");
        assert!(p.check(&s).is_ok());
        assert!(denied(&p, subject("sh")).contains("not in policy.executables.allow"));
    }

    #[test]
    fn args_limits() {
        let p = policy("args: {max_count: 2, max_length: 4}");
        let ok = ["a".to_owned(), "abcd".to_owned()];
        let mut s = subject("x");
        s.args = &ok;
        assert!(p.check(&s).is_ok());
        let many = ["a".to_owned(), "b".to_owned(), "c".to_owned()];
        s.args = &many;
        assert!(denied(&p, s).contains("policy.args.max_count"));
        let long = ["a".to_owned(), "abcde".to_owned()];
        s.args = &long;
        let m = denied(&p, s);
        assert!(
            m.contains("args[1]") && m.contains("policy.args.max_length"),
            "{m}"
        );
    }

    #[test]
    fn env_rules() {
        let p = policy("env: {allow: ['CARGO_*', RUST_LOG, 'GIT_*'], deny: [GIT_SSH_COMMAND]}");
        let mut s = subject("x");
        s.env_names = &["CARGO_HOME", "RUST_LOG"];
        assert!(p.check(&s).is_ok());
        s.env_names = &["RUST_LOG", "LD_PRELOAD"];
        let m = denied(&p, s);
        assert!(
            m.contains("LD_PRELOAD") && m.contains("policy.env.allow"),
            "{m}"
        );
        s.env_names = &["GIT_SSH_COMMAND"];
        let m = denied(&p, s);
        assert!(
            m.contains("policy.env.deny entry \"GIT_SSH_COMMAND\""),
            "{m}"
        );
    }

    #[test]
    fn injection_vars_are_refused_under_an_allow_list() {
        let p = policy("executables: {allow: [ls, echo]}");
        let mut s = subject("ls");
        for name in [
            "LD_PRELOAD",
            "PATH",
            "BASH_ENV",
            "NODE_OPTIONS",
            "GIT_SSH_COMMAND",
        ] {
            let names = [name];
            let mut t = s;
            t.env_names = &names;
            let m = denied(&p, t);
            assert!(m.contains(name) && m.contains("injection_vars"), "{m}");
        }
        s.env_names = &["LANG"];
        assert!(p.check(&s).is_ok());
        // Without an allow list nothing is restricted, so neither are these.
        let open = policy("executables: {deny: [rm]}");
        s.env_names = &["LD_PRELOAD"];
        assert!(open.check(&s).is_ok());
        // The list is the operator's to change.
        let custom = policy("executables: {allow: [ls]}\nenv: {injection_vars: [FOO_*]}");
        assert!(custom.check(&s).is_ok());
        s.env_names = &["FOO_BAR"];
        assert!(denied(&custom, s).contains("FOO_*"));
    }

    #[test]
    fn cwd_prefixes_normalise_dotdot() {
        let p = policy("cwd: {allow: [/work, /tmp/]}");
        let mut s = subject("x");
        for ok in ["/work", "/work/a/b", "/tmp/x", "/work/a/../b"] {
            s.cwd = Some(ok);
            assert!(p.check(&s).is_ok(), "{ok}");
        }
        assert_eq!(
            {
                s.cwd = Some("/work/./a/../b");
                p.check(&s).unwrap().cwd
            },
            Some("/work/b".to_owned())
        );
        for bad in ["/workspace", "/work/../etc", "/", "/etc"] {
            s.cwd = Some(bad);
            assert!(denied(&p, s).contains("policy.cwd.allow"), "{bad}");
        }
        s.cwd = None;
        assert!(p.check(&s).is_ok());
    }

    #[test]
    fn timeouts_and_profiles() {
        let p = policy(
            "timeout: {default_secs: 30, max_secs: 60}\n\
             executables: {allow: [ls]}\n\
             profiles:\n  build:\n    timeout: {max_secs: 7200}\n    executables: {allow: [cargo]}\n",
        );
        assert_eq!(p.check(&subject("ls")).unwrap().timeout_secs, 30);
        let mut s = subject("ls");
        s.timeout_secs = Some(61);
        let e = ErrorBody::from(p.check(&s).unwrap_err());
        assert_eq!(e.code, ErrorCode::InvalidRequest);
        assert!(
            e.message.contains("policy.timeout.max_secs"),
            "{}",
            e.message
        );
        let mut s = subject("cargo");
        s.profile = Some("build");
        s.timeout_secs = Some(7000);
        assert!(p.check(&s).is_ok());
        s.timeout_secs = None;
        // The profile's timeout section replaces the base one: the default comes from limits.
        assert_eq!(p.check(&s).unwrap().timeout_secs, 600);
        s.executable = "ls";
        assert!(denied(&p, s).contains("policy.profiles.build.executables.allow"));
        let sum = p.summary();
        assert_eq!(sum.default.max_timeout_secs, 60);
        assert_eq!(sum.profiles["build"].max_timeout_secs, 7200);
        assert_eq!(sum.profiles["build"].executables.allow, ["cargo"]);
    }

    #[test]
    fn validation_names_the_field() {
        for (yaml, field) in [
            (
                "executables: {allow: [bin/ls]}",
                "policy.executables.allow[0]",
            ),
            ("executables: {deny: ['']}", "policy.executables.deny[0]"),
            ("args: {max_length: 0}", "policy.args.max_length"),
            ("env: {deny: ['A-B']}", "policy.env.deny[0]"),
            ("cwd: {allow: [work]}", "policy.cwd.allow[0]"),
            (
                "timeout: {default_secs: 10, max_secs: 5}",
                "policy.timeout.default_secs",
            ),
            ("timeout: {max_secs: 0}", "policy.timeout.max_secs"),
            (
                "profiles: {b: {cwd: {allow: [x]}}}",
                "policy.profiles.b.cwd.allow[0]",
            ),
        ] {
            let c: PolicyConfig = yaml_serde::from_str(yaml).unwrap();
            let e = c.validate(&Limits::default()).unwrap_err();
            assert_eq!(e.field, field, "{yaml}: {e}");
        }
    }
}
