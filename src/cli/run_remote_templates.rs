//! Templates in `run-remote`: `--template NAME` collects the command's output, saves it
//! whole to a file and prints it filtered when the command ends; `run-remote templates`
//! lists what is available here.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::outcome::{self, Failure, Outcome};
use crate::templates::{Catalog, StreamFilter, Template};

/// The template `name` as configured for `dir` (built-ins plus the nearest
/// `.mcp-run/config.yaml`); an invalid configuration or an unknown name is a configuration
/// error.
pub(crate) fn resolve(name: &str, dir: &Path) -> Result<Template, Failure> {
    let catalog = Catalog::load(dir).map_err(|e| Failure::config(e.to_string()))?;
    catalog.get(name).cloned().ok_or_else(|| {
        Failure::config(format!(
            "unknown template {name:?}; available: {} (see `run-remote templates`)",
            catalog.names().join(", ")
        ))
    })
}

/// Collects a run's output for a template: every chunk goes to the raw file as it arrives
/// (in arrival order, as a terminal would show it) and to one streaming filter per stream
/// (bounded memory, whatever the output's size).
pub(crate) struct TemplateSink {
    raw: std::fs::File,
    raw_path: PathBuf,
    stdout: StreamFilter,
    stderr: StreamFilter,
}

impl TemplateSink {
    /// Creates the raw output file in `dir` (the temporary directory).
    pub(crate) fn create(template: Template, dir: &Path) -> Result<TemplateSink, Failure> {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or_default();
        let raw_path = dir.join(format!(
            "run-remote-{}-{stamp}-{}.log",
            template.name,
            std::process::id()
        ));
        let raw = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&raw_path)
            .map_err(|e| {
                Failure::output(format!(
                    "cannot create {} for the full output: {e}",
                    raw_path.display()
                ))
            })?;
        Ok(TemplateSink {
            stdout: StreamFilter::new(&template),
            stderr: StreamFilter::new(&template),
            raw,
            raw_path,
        })
    }

    pub(crate) fn stdout(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.stdout.push(data);
        self.raw.write_all(data)
    }

    #[cfg(test)]
    fn raw_path(&self) -> &Path {
        &self.raw_path
    }

    pub(crate) fn stderr(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.stderr.push(data);
        self.raw.write_all(data)
    }

    /// Writes the filtered streams and, when lines were left out, a closing note naming the
    /// raw file. `exit_code` is the
    /// command's (`None` when it did not exit normally, which the template treats as a
    /// failure).
    pub(crate) fn finish(
        self,
        exit_code: Option<i32>,
        out: &mut impl Write,
        err: &mut impl Write,
    ) -> std::io::Result<()> {
        let o = self.stdout.finish(exit_code, None);
        let e = self.stderr.finish(exit_code, None);
        out.write_all(&o.output)?;
        out.flush()?;
        err.write_all(&e.output)?;
        if o.omitted_lines() + e.omitted_lines() == 0 {
            // Nothing left out: nothing added, and no file to keep.
            drop(self.raw);
            let _ = std::fs::remove_file(&self.raw_path);
            return Ok(());
        }
        // Per stream, as each stream's own note counts its lines (a sum over both read as a
        // contradiction of the stdout note).
        let mut counts = Vec::new();
        for (name, f) in [("stdout", &o), ("stderr", &e)] {
            if f.omitted_lines() > 0 {
                counts.push(format!(
                    "{} of {} {name} lines",
                    f.omitted_lines(),
                    f.total_lines
                ));
            }
        }
        writeln!(
            err,
            "run-remote: template {}: {} left out; the full output is in {}",
            if o.omitted_lines() > 0 {
                &o.template
            } else {
                &e.template
            },
            counts.join(" and "),
            self.raw_path.display()
        )
    }
}

/// `run-remote templates`: lists the templates available in the current directory.
pub(crate) fn list(args: &[String]) -> Outcome {
    let mut stdout = std::io::stdout().lock();
    if let Some(a) = args.first() {
        if a == "-h" || a == "--help" {
            return match stdout.write_all(LIST_HELP.as_bytes()) {
                Ok(()) => Outcome::Done,
                Err(e) => outcome::write_failed(&e, "the help"),
            };
        }
        return Failure::usage(format!(
            "templates takes no argument, got {a:?}; usage: run-remote templates"
        ))
        .into();
    }
    let catalog = std::env::current_dir()
        .map_err(|e| Failure::config(format!("cannot read the current directory: {e}")))
        .and_then(|dir| Catalog::load(&dir).map_err(|e| Failure::config(e.to_string())));
    match catalog.map(|c| write_list(&c, &mut stdout)) {
        Ok(Ok(())) => Outcome::Done,
        Ok(Err(e)) => outcome::write_failed(&e, "the list"),
        Err(f) => f.into(),
    }
}

const LIST_HELP: &str = "\
List the output templates available here: the built-ins and those of the nearest
.mcp-run/config.yaml at or above the current directory.

Usage: run-remote templates
";

/// One line per template: name, origin, description, in aligned columns.
pub(crate) fn write_list(catalog: &Catalog, out: &mut impl Write) -> std::io::Result<()> {
    let rows: Vec<(String, String, String)> = catalog
        .entries()
        .map(|(t, o)| (t.name.clone(), o.to_string(), t.description.clone()))
        .collect();
    let w0 = rows.iter().map(|r| r.0.len()).max().unwrap_or(0).max(4);
    let w1 = rows.iter().map(|r| r.1.len()).max().unwrap_or(0).max(6);
    writeln!(out, "{:w0$}  {:w1$}  DESCRIPTION", "NAME", "ORIGIN")?;
    for (n, o, d) in rows {
        writeln!(out, "{n:w0$}  {o:w1$}  {d}")?;
    }
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::outcome::Reason;

    #[test]
    fn unknown_template_and_bad_config_are_configuration_errors() {
        let dir = tempfile::tempdir().unwrap();
        let f = resolve("nope", dir.path()).unwrap_err();
        assert_eq!(f.reason, Reason::Config);
        assert!(f.message.contains("cargo-test"), "{}", f.message);
        std::fs::create_dir_all(dir.path().join(".mcp-run")).unwrap();
        std::fs::write(
            dir.path().join(crate::templates::CONFIG_PATH),
            "templates: [",
        )
        .unwrap();
        let f = resolve("cargo-test", dir.path()).unwrap_err();
        assert_eq!(f.reason, Reason::Config);
        assert!(f.message.contains("config.yaml"), "{}", f.message);
    }

    #[test]
    fn sink_keeps_everything_in_the_file_and_prints_filtered() {
        let dir = tempfile::tempdir().unwrap();
        let t = resolve("cargo-test", dir.path()).unwrap();
        let mut sink = TemplateSink::create(t, dir.path()).unwrap();
        let mut noise = String::new();
        for i in 0..50 {
            noise.push_str(&format!("test t{i} ... ok\n"));
        }
        sink.stdout(noise.as_bytes()).unwrap();
        sink.stderr(b"error: test failed\n").unwrap();
        sink.stdout(
            b"test x ... FAILED\n\nfailures:\n    x\n\ntest result: FAILED. 50 passed; 1 failed\n",
        )
        .unwrap();
        let path = sink.raw_path().to_owned();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        sink.finish(Some(101), &mut out, &mut err).unwrap();
        let out = String::from_utf8(out).unwrap();
        let err = String::from_utf8(err).unwrap();
        assert!(
            out.contains("test x ... FAILED\n") && !out.contains("test t7 ... ok"),
            "{out}"
        );
        assert!(out.ends_with("test result: FAILED. 50 passed; 1 failed\n"));
        assert!(err.starts_with("error: test failed\n"), "{err}");
        assert!(
            err.contains(&path.display().to_string()) && err.contains("51 of 56 stdout lines"),
            "{err}"
        );
        let raw = std::fs::read_to_string(&path).unwrap();
        assert!(raw.starts_with(&noise) && raw.contains("error: test failed\ntest x"));
    }

    #[test]
    fn list_shows_origin() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(crate::templates::CONFIG_PATH);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(
            &p,
            "templates:\n  mine:\n    description: Mine\n    include_regex: X\n",
        )
        .unwrap();
        let mut out = Vec::new();
        write_list(&Catalog::load(dir.path()).unwrap(), &mut out).unwrap();
        let out = String::from_utf8(out).unwrap();
        assert!(out.starts_with("NAME"), "{out}");
        let mine = out.lines().find(|l| l.starts_with("mine ")).unwrap();
        assert!(mine.contains(&p.display().to_string()) && mine.ends_with("Mine"));
        let tsc = out.lines().find(|l| l.starts_with("tsc ")).unwrap();
        assert!(tsc.contains("built-in"));
    }
}
