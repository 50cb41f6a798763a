//! Output templates: filter the noisy output of builds and test runs down to the errors and
//! the summary (docs/templates.md).
//!
//! A [`Template`] keeps the lines that match its `include_regex` plus the last
//! `tail_paragraphs` paragraphs; on a non-zero exit, error-shaped lines and their locations
//! survive whatever it says ([`filter::apply`]). The built-ins live in `builtin.yaml`;
//! `.mcp-run/config.yaml`, found by walking up from the working directory, adds to them and
//! overrides them by name ([`Catalog::load`]). Long-running processes use a
//! [`TemplateStore`], which caches per directory with a TTL and keeps the last good
//! configuration when the file turns invalid.

pub(crate) mod ansi;
pub(crate) mod auto;
pub(crate) mod filter;
mod prefilter;
pub(crate) mod store;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use serde::Deserialize;

pub(crate) use auto::{AUTO, GENERIC, Picked};
pub(crate) use filter::{Filtered, StreamFilter};

/// The name that asks for no template at all: the output as it came.
pub(crate) const RAW: &str = "raw";
pub(crate) use store::TemplateStore;

/// The configuration file, relative to a directory on the way up from the working directory.
pub(crate) const CONFIG_PATH: &str = ".mcp-run/config.yaml";

const BUILTIN_YAML: &str = include_str!("builtin.yaml");

fn default_tail() -> usize {
    1
}

/// A template as written in YAML.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TemplateSpec {
    pub description: String,
    pub include_regex: String,
    #[serde(default = "default_tail")]
    pub tail_paragraphs: usize,
    #[serde(default)]
    pub suppress_on_success: bool,
    /// Lines never kept by the pattern or by the failure rules (boilerplate that looks like
    /// an error, such as Maven's `[ERROR] Re-run Maven using the -X switch`); the trailing
    /// paragraphs and a short failing stream are still kept whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exclude_regex: Option<String>,
}

/// A template ready to apply.
#[derive(Debug, Clone)]
pub struct Template {
    pub name: String,
    pub description: String,
    pub include_regex: String,
    pub tail_paragraphs: usize,
    pub suppress_on_success: bool,
    pub exclude_regex: Option<String>,
    include: regex::bytes::Regex,
    exclude: Option<regex::bytes::Regex>,
    /// The union of `include` and the generic rules, built on first use (see
    /// [`filter::any_pattern`]). Shared by the clones (each run filters with a clone of the
    /// catalog's template), so that it is compiled once per template, not once per run.
    any: Arc<OnceLock<regex::bytes::Regex>>,
    /// What a line must show to possibly match that union, checked on many lines at once to
    /// pass over the lines that match none of it (see [`prefilter`]); `None` when it cannot
    /// be built. Shared by the clones like `any`.
    prefilter: Arc<OnceLock<Option<Arc<prefilter::Prefilter>>>>,
    /// How this template was chosen (for the note).
    pub picked: Picked,
    /// For `auto`: the templates it picks from.
    auto: Option<Arc<AutoCatalog>>,
}

/// The templates `auto` picks from: a catalog's, without `auto` itself.
#[derive(Debug)]
pub(crate) struct AutoCatalog {
    templates: BTreeMap<String, Template>,
}

impl AutoCatalog {
    fn get(&self, name: &str) -> Option<&Template> {
        self.templates.get(name)
    }

    /// The template used when neither the command nor the output names a tool.
    fn generic(&self) -> Template {
        self.templates
            .get(GENERIC)
            .cloned()
            .unwrap_or_else(|| unreachable!("the built-in generic template is in every catalog"))
    }
}

impl Template {
    /// Compiles the spec's regexes; an error names the field (`include_regex`,
    /// `exclude_regex`).
    pub fn new(name: &str, spec: TemplateSpec) -> Result<Template, (&'static str, regex::Error)> {
        // Bounded so that a pathological pattern from a config file cannot eat memory.
        let compile = |p: &str| {
            regex::bytes::RegexBuilder::new(p)
                .size_limit(1 << 22)
                .build()
        };
        let include = compile(&spec.include_regex).map_err(|e| ("include_regex", e))?;
        let exclude = match &spec.exclude_regex {
            Some(p) => Some(compile(p).map_err(|e| ("exclude_regex", e))?),
            None => None,
        };
        Ok(Template {
            name: name.to_owned(),
            description: spec.description,
            include_regex: spec.include_regex,
            tail_paragraphs: spec.tail_paragraphs,
            suppress_on_success: spec.suppress_on_success,
            exclude_regex: spec.exclude_regex,
            include,
            exclude,
            any: Arc::new(OnceLock::new()),
            prefilter: Arc::new(OnceLock::new()),
            picked: Picked::Named,
            auto: None,
        })
    }

    /// Whether this is `auto`, which picks a template by the command or the output.
    pub fn is_auto(&self) -> bool {
        self.auto.is_some()
    }

    /// The template for a command: for `auto`, the built-in the command line points to
    /// (`cargo test` → `cargo-test`) or, when it points to none, `auto` still, which picks by
    /// the output; any other template is itself.
    pub fn for_command(&self, executable: &str, args: &[String]) -> Template {
        let Some(catalog) = &self.auto else {
            return self.clone();
        };
        let argv: Vec<String> = std::iter::once(executable.to_owned())
            .chain(args.iter().cloned())
            .collect();
        match auto::by_command(&argv).and_then(|n| catalog.get(n)) {
            Some(t) => {
                let mut t = t.clone();
                t.picked = Picked::Command;
                t
            }
            None => self.clone(),
        }
    }

    /// A line that matches none of this is left out unless a failure around it says
    /// otherwise.
    fn any(&self) -> &regex::bytes::Regex {
        self.any.get_or_init(|| {
            regex::bytes::RegexBuilder::new(&filter::any_pattern(&self.include_regex))
                .size_limit(1 << 24)
                .build()
                // Too large together: every line is looked at closely (slower, same result).
                .unwrap_or_else(|_| {
                    regex::bytes::Regex::new("").unwrap_or_else(|e| unreachable!("{e}"))
                })
        })
    }

    /// The prefilter for [`Template::any`]: a line it passes over matches none of `any`.
    fn prefilter(&self) -> Option<Arc<prefilter::Prefilter>> {
        self.prefilter
            .get_or_init(|| {
                // `any` too large matches every line: so does the prefilter then.
                let any = self.any().as_str();
                (!any.is_empty())
                    .then(|| prefilter::Prefilter::new(any))
                    .flatten()
                    .map(Arc::new)
            })
            .clone()
    }

    /// Whether a line is excluded (see [`TemplateSpec::exclude_regex`]).
    fn excludes(&self, line: &[u8]) -> bool {
        self.exclude.as_ref().is_some_and(|e| e.is_match(line))
    }

    /// Applies the template to one stream (see [`filter::apply`]).
    pub fn apply(&self, output: &[u8], exit_code: Option<i32>) -> Filtered {
        filter::apply(self, output, exit_code)
    }
}

/// Where a template comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    BuiltIn,
    Config(PathBuf),
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::BuiltIn => f.write_str("built-in"),
            Origin::Config(p) => write!(f, "{}", p.display()),
        }
    }
}

/// A template configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: invalid YAML: {message}", path.display())]
    Yaml { path: PathBuf, message: String },
    #[error("{}: template {template:?}: {message}", path.display())]
    Template {
        path: PathBuf,
        template: String,
        message: String,
    },
}

/// The file's shape. Other top-level keys are left for other features.
#[derive(Debug, Deserialize)]
struct ConfigFile {
    #[serde(default)]
    templates: BTreeMap<String, yaml_serde::Value>,
}

/// Parses a configuration file's text into templates. `path` names the file in errors.
pub(crate) fn parse_config(path: &Path, text: &str) -> Result<Vec<Template>, ConfigError> {
    let file: Option<ConfigFile> = yaml_serde::from_str(text).map_err(|e| ConfigError::Yaml {
        path: path.to_owned(),
        message: e.to_string(),
    })?;
    match file {
        Some(file) => parse_templates(path, file.templates),
        // An empty file: no templates.
        None => Ok(Vec::new()),
    }
}

/// Checks and compiles a `templates:` map read from `path`.
pub(crate) fn parse_templates(
    path: &Path,
    templates: BTreeMap<String, yaml_serde::Value>,
) -> Result<Vec<Template>, ConfigError> {
    let mut out = Vec::with_capacity(templates.len());
    for (name, value) in templates {
        let bad = |message: String| ConfigError::Template {
            path: path.to_owned(),
            template: name.clone(),
            message,
        };
        if !valid_name(&name) {
            return Err(bad(
                "a name is 1 to 64 of a-z, 0-9, '-', '_' and '.', starting with a letter or digit"
                    .into(),
            ));
        }
        if name == RAW {
            return Err(bad(format!(
                "{RAW:?} is reserved: it asks for the output as it came"
            )));
        }
        let spec: TemplateSpec = yaml_serde::from_value(value).map_err(|e| bad(e.to_string()))?;
        let patterns = (spec.include_regex.clone(), spec.exclude_regex.clone());
        let t = Template::new(&name, spec).map_err(|(field, e)| {
            let pattern = match field {
                "include_regex" => patterns.0.clone(),
                _ => patterns.1.clone().unwrap_or_default(),
            };
            bad(format!(
                "invalid {field} {pattern:?}: {}",
                regex_error_line(&e)
            ))
        })?;
        out.push(t);
    }
    Ok(out)
}

/// The cause of a regex error on one line (the parser's message draws a caret under the
/// pattern over several lines).
fn regex_error_line(e: &regex::Error) -> String {
    let text = e.to_string();
    let last = text.lines().last().unwrap_or_default().trim();
    last.strip_prefix("error: ").unwrap_or(last).to_owned()
}

/// Template names are enum values in a tool schema and flags on a command line.
fn valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && b[0].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"-_.".contains(c))
}

/// The nearest `.mcp-run/config.yaml` at or above `dir`.
pub(crate) fn find_config(dir: &Path) -> Option<PathBuf> {
    dir.ancestors()
        .map(|d| d.join(CONFIG_PATH))
        .find(|p| p.is_file())
}

/// The templates available in one place: the built-ins, then one configuration file's.
#[derive(Debug, Clone)]
pub struct Catalog {
    templates: BTreeMap<String, (Template, Origin)>,
    config: Option<PathBuf>,
}

impl Catalog {
    /// The built-in templates alone.
    pub fn builtin() -> Catalog {
        let templates = parse_config(Path::new("builtin.yaml"), BUILTIN_YAML)
            .unwrap_or_else(|e| unreachable!("the built-in templates are tested: {e}"));
        let mut c = Catalog {
            templates: templates
                .into_iter()
                .map(|t| (t.name.clone(), (t, Origin::BuiltIn)))
                .collect(),
            config: None,
        };
        c.refresh_auto();
        c
    }

    /// (Re)builds the built-in `auto` over this catalog's other templates (a configuration
    /// that overrides `pytest` makes `auto` pick its `pytest`); an `auto` of a configuration
    /// file is left as it is.
    fn refresh_auto(&mut self) {
        if matches!(self.templates.get(AUTO), Some((_, Origin::Config(_)))) {
            return;
        }
        let templates: BTreeMap<String, Template> = self
            .templates
            .iter()
            .filter(|(name, _)| name.as_str() != AUTO)
            .map(|(name, (t, _))| (name.clone(), t.clone()))
            .collect();
        let mut auto = Template::new(
            AUTO,
            TemplateSpec {
                description: "Picks the built-in for the tool by the command line (cargo test, pytest, npx eslint, go vet, make, mvn, ...) or, when the command says nothing, by the output; generic otherwise".into(),
                include_regex: "^$NEVER".into(),
                tail_paragraphs: 0,
                suppress_on_success: false,
                exclude_regex: None,
            },
        )
        .unwrap_or_else(|e| unreachable!("the auto template: {e:?}"));
        auto.auto = Some(Arc::new(AutoCatalog { templates }));
        self.templates.insert(AUTO.into(), (auto, Origin::BuiltIn));
    }

    /// The built-ins plus the nearest configuration file at or above `dir`, whose templates
    /// override built-ins of the same name.
    pub fn load(dir: &Path) -> Result<Catalog, ConfigError> {
        match find_config(dir) {
            Some(path) => Self::load_file(&path),
            None => Ok(Self::builtin()),
        }
    }

    /// The built-ins plus one configuration file.
    pub fn load_file(path: &Path) -> Result<Catalog, ConfigError> {
        Self::builtin().overlay_file(path)
    }

    /// This catalog plus one configuration file, whose templates override same-named ones.
    pub fn overlay_file(mut self, path: &Path) -> Result<Catalog, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        self.insert_all(path, parse_config(path, &text)?);
        self.config = Some(path.to_owned());
        Ok(self)
    }

    /// The built-ins plus the `templates:` of the gateway's configuration file (`path`
    /// names it in errors and listings).
    pub fn with_templates(
        path: &Path,
        templates: BTreeMap<String, yaml_serde::Value>,
    ) -> Result<Catalog, ConfigError> {
        let mut catalog = Self::builtin();
        catalog.insert_all(path, parse_templates(path, templates)?);
        Ok(catalog)
    }

    fn insert_all(&mut self, path: &Path, templates: Vec<Template>) {
        for t in templates {
            self.templates
                .insert(t.name.clone(), (t, Origin::Config(path.to_owned())));
        }
        self.refresh_auto();
    }

    /// The configuration file in use, if any.
    pub fn config_path(&self) -> Option<&Path> {
        self.config.as_deref()
    }

    pub fn get(&self, name: &str) -> Option<&Template> {
        self.templates.get(name).map(|(t, _)| t)
    }

    /// Names in sorted order (for a tool schema's enum).
    pub fn names(&self) -> Vec<String> {
        self.templates.keys().cloned().collect()
    }

    /// Every template with its origin, sorted by name.
    pub fn entries(&self) -> impl Iterator<Item = (&Template, &Origin)> {
        self.templates.values().map(|(t, o)| (t, o))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUILTINS: [&str; 30] = [
        "auto",
        "cargo-build",
        "cargo-test",
        "ctest",
        "docker-build",
        "eslint",
        "flake8",
        "generic",
        "go-build",
        "go-test",
        "gradle",
        "helm",
        "jest",
        "make",
        "maven-build",
        "maven-test",
        "mocha",
        "mypy",
        "node-test",
        "npm",
        "pip",
        "pylint",
        "pytest",
        "ruff",
        "rustc",
        "shellcheck",
        "terraform",
        "tsc",
        "unittest",
        "vitest",
    ];

    #[test]
    fn auto_picks_by_command_then_by_output_and_names_its_pick() {
        let c = Catalog::builtin();
        let auto = c.get(AUTO).unwrap();
        assert!(auto.is_auto());
        let t = auto.for_command("cargo", &["test".into()]);
        assert_eq!((t.name.as_str(), t.picked), ("cargo-test", Picked::Command));
        // `npm test` says nothing: the output decides, and the note says which.
        let t = auto.for_command("npm", &["test".into()]);
        assert!(t.is_auto());
        let mut out = String::from("\nrunning 60 tests\n");
        for i in 0..60 {
            out.push_str(&format!("test t{i} ... ok\n"));
        }
        out.push_str("\ntest result: ok. 60 passed; 0 failed\n");
        let f = t.apply(out.as_bytes(), Some(0));
        assert_eq!(f.template, "cargo-test (auto, by the output)");
        let text = String::from_utf8(f.output).unwrap();
        assert!(
            text.starts_with("[template cargo-test (auto, by the output): "),
            "{text}"
        );
        assert!(
            text.ends_with("test result: ok. 60 passed; 0 failed\n"),
            "{text}"
        );
        // Nothing recognisable: the generic template, which leaves a passing run without a
        // summary line as it came (`cat`, `ls`), and filters a failing one.
        let data = "x\n".repeat(40) + "\nlast\n";
        let f = t.apply(data.as_bytes(), Some(0));
        assert_eq!(f.template, "generic (auto, by the output)");
        assert_eq!(f.output, data.as_bytes());
        let f = t.apply(data.as_bytes(), Some(1));
        assert_eq!(
            f.output,
            b"[template generic (auto, by the output): 41 of 42 lines left out]\nlast\n"
        );
        let with_summary = data + "3 passed, 0 failed\n";
        let f = t.apply(with_summary.as_bytes(), Some(0));
        assert!(
            f.output.ends_with(b"]\nlast\n3 passed, 0 failed\n"),
            "{:?}",
            String::from_utf8_lossy(&f.output)
        );
    }

    #[test]
    fn auto_follows_a_configured_override_and_raw_is_reserved() {
        let root = tempfile::tempdir().unwrap();
        write(
            root.path(),
            "templates:\n  pytest:\n    description: ours\n    include_regex: OURS\n",
        );
        let c = Catalog::load(root.path()).unwrap();
        let t = c.get(AUTO).unwrap().for_command("pytest", &[]);
        assert_eq!(
            (t.name.as_str(), t.description.as_str()),
            ("pytest", "ours")
        );
        write(
            root.path(),
            "templates:\n  raw:\n    description: x\n    include_regex: X\n",
        );
        let e = Catalog::load(root.path()).unwrap_err().to_string();
        assert!(e.contains("reserved"), "{e}");
    }

    #[test]
    fn builtins_parse_and_are_complete() {
        let c = Catalog::builtin();
        assert_eq!(c.names(), BUILTINS);
        for (t, o) in c.entries() {
            assert_eq!(*o, Origin::BuiltIn);
            assert!(!t.description.is_empty(), "{}", t.name);
            // The one-pass pattern compiles (its fallback would only be slower).
            regex::bytes::RegexBuilder::new(&filter::any_pattern(&t.include_regex))
                .size_limit(1 << 24)
                .build()
                .unwrap_or_else(|e| panic!("{}: {e}", t.name));
        }
    }

    fn write(dir: &Path, text: &str) -> PathBuf {
        let p = dir.join(CONFIG_PATH);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn discovery_walks_up_and_the_nearest_file_wins() {
        let root = tempfile::tempdir().unwrap();
        let sub = root.path().join("a/b");
        std::fs::create_dir_all(&sub).unwrap();
        assert_eq!(Catalog::load(&sub).unwrap().names(), BUILTINS);

        let top = write(
            root.path(),
            "templates:\n  mine:\n    description: top\n    include_regex: X\n",
        );
        let c = Catalog::load(&sub).unwrap();
        assert_eq!(c.config_path(), Some(top.as_path()));
        assert_eq!(c.get("mine").unwrap().description, "top");
        assert_eq!(c.get("mine").unwrap().tail_paragraphs, 1);
        assert_eq!(c.names().len(), BUILTINS.len() + 1);

        let near = write(
            &root.path().join("a"),
            "templates:\n  mine:\n    description: near\n    include_regex: Y\n    tail_paragraphs: 3\n",
        );
        let c = Catalog::load(&sub).unwrap();
        assert_eq!(c.config_path(), Some(near.as_path()));
        assert_eq!(c.get("mine").unwrap().description, "near");
        assert_eq!(c.get("mine").unwrap().tail_paragraphs, 3);
        assert!(
            c.entries()
                .any(|(t, o)| t.name == "mine" && *o == Origin::Config(near.clone()))
        );
    }

    #[test]
    fn a_custom_template_overrides_a_builtin() {
        let root = tempfile::tempdir().unwrap();
        let p = write(
            root.path(),
            "templates:\n  pytest:\n    description: ours\n    include_regex: OURS\n    suppress_on_success: true\n",
        );
        let c = Catalog::load(root.path()).unwrap();
        let t = c.get("pytest").unwrap();
        assert_eq!(t.description, "ours");
        assert!(t.suppress_on_success);
        assert_eq!(c.names(), BUILTINS);
        let origin = c.entries().find(|(t, _)| t.name == "pytest").unwrap().1;
        assert_eq!(*origin, Origin::Config(p));
    }

    #[test]
    fn invalid_configuration_names_the_file_and_the_template() {
        let root = tempfile::tempdir().unwrap();
        let p = write(
            root.path(),
            "templates:\n  broken:\n    description: x\n    include_regex: '(unclosed'\n",
        );
        let e = Catalog::load(root.path()).unwrap_err().to_string();
        assert!(e.contains(&p.display().to_string()), "{e}");
        assert!(
            e.contains("\"broken\"") && e.contains("include_regex"),
            "{e}"
        );
        assert!(
            e.ends_with("invalid include_regex \"(unclosed\": unclosed group"),
            "{e}"
        );

        write(root.path(), "templates: [\n");
        let e = Catalog::load(root.path()).unwrap_err();
        assert!(matches!(e, ConfigError::Yaml { .. }), "{e}");
        assert!(e.to_string().contains(&p.display().to_string()));

        write(
            root.path(),
            "templates:\n  typo:\n    description: x\n    include_regexp: X\n",
        );
        let e = Catalog::load(root.path()).unwrap_err().to_string();
        assert!(
            e.contains("\"typo\"") && e.contains("include_regexp"),
            "{e}"
        );

        write(
            root.path(),
            "templates:\n  Bad Name:\n    description: x\n    include_regex: X\n",
        );
        let e = Catalog::load(root.path()).unwrap_err().to_string();
        assert!(e.contains("\"Bad Name\""), "{e}");

        write(root.path(), "");
        assert_eq!(Catalog::load(root.path()).unwrap().names(), BUILTINS);
    }
}
