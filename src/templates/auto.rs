//! The `auto` template: picks a built-in by the command line and, when the command says
//! nothing, by the first lines of the output; `generic` when neither does.
//!
//! The pick only chooses the tool-specific patterns: every template also applies the generic
//! rules of [`super::filter`] (failures, diagnostics, summaries), so a wrong or missing pick
//! loses the tool's extras, not the failure.

use std::sync::LazyLock;

use regex::bytes::RegexSet;

/// The template that `auto` uses when nothing points to a tool.
pub(crate) const GENERIC: &str = "generic";

/// The name that asks for a pick.
pub(crate) const AUTO: &str = "auto";

/// How a template was chosen, for the note that names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Picked {
    /// Named by the caller.
    Named,
    /// `auto`, by the command line.
    Command,
    /// `auto`, by the output.
    Output,
}

/// The file name of a path (`/usr/bin/python3` → `python3`, `.\mvnw.cmd` → `mvnw.cmd`).
fn base(word: &str) -> &str {
    word.rsplit(['/', '\\']).next().unwrap_or(word)
}

/// Words that only wrap the real command: `env A=1 X`, `time X`, `nice X`, `timeout 60 X`.
fn skip_wrappers(argv: &[String]) -> &[String] {
    let mut rest = argv;
    loop {
        let Some(first) = rest.first() else {
            return rest;
        };
        match base(first) {
            "env" | "time" | "nice" | "nohup" | "stdbuf" | "xvfb-run" | "unbuffer" => {
                rest = &rest[1..];
                while rest
                    .first()
                    .is_some_and(|w| w.starts_with('-') || w.contains('='))
                {
                    rest = &rest[1..];
                }
            }
            "timeout" => {
                rest = &rest[1..];
                while rest.first().is_some_and(|w| w.starts_with('-')) {
                    rest = &rest[1..];
                }
                // The duration.
                rest = rest.get(1..).unwrap_or_default();
            }
            w if w.contains('=') && !w.starts_with('-') => rest = &rest[1..],
            _ => return rest,
        }
    }
}

/// The first word of `args` that is not an option.
fn subcommand(args: &[String]) -> Option<&str> {
    // `+nightly` picks a toolchain.
    args.iter()
        .map(String::as_str)
        .find(|a| !a.starts_with('-') && !a.starts_with('+'))
}

/// The template for a command line, by its program and subcommand; `None` when the command
/// says nothing (a script, `npm test`, an unknown tool).
pub(crate) fn by_command(argv: &[String]) -> Option<&'static str> {
    by_command_depth(argv, 0)
}

fn by_command_depth(argv: &[String], depth: usize) -> Option<&'static str> {
    let argv = skip_wrappers(argv);
    let (first, rest) = argv.split_first()?;
    let program = base(first);
    let program = program.strip_suffix(".exe").unwrap_or(program);
    let sub = subcommand(rest);
    let has = |flag: &str| rest.iter().any(|a| a == flag);
    Some(match program {
        "sh" | "bash" | "zsh" | "dash" | "ksh" if depth == 0 => {
            // `sh -c 'cd x && cargo test 2>&1'`, `bash -lc '...'`: the last command of the
            // script that names a tool (`cd`, `export` and the like do not).
            let script = rest.iter().skip_while(|a| !is_command_flag(a)).nth(1)?;
            return script.split(['&', ';', '|', '\n']).rev().find_map(|part| {
                let words: Vec<String> = part
                    .split_whitespace()
                    .filter(|w| !w.contains('>') && !w.contains('<'))
                    .map(str::to_owned)
                    .collect();
                by_command_depth(&words, depth + 1)
            });
        }
        "cargo" => match sub? {
            "test" | "nextest" | "t" => "cargo-test",
            "build" | "b" | "check" | "c" | "clippy" | "run" | "r" | "doc" | "install" => {
                "cargo-build"
            }
            _ => return None,
        },
        "rustc" => "rustc",
        "go" => match sub? {
            "test" => "go-test",
            "build" | "vet" | "install" | "run" | "generate" => "go-build",
            _ => return None,
        },
        "pytest" | "py.test" => "pytest",
        // `coverage run -m pytest` runs a module as `python -m` does.
        "coverage" if sub == Some("run") => {
            let i = rest.iter().position(|a| a == "-m")?;
            return by_command_depth(&rest[i + 1..], depth + 1);
        }
        // Environment managers that run a command inside a project's environment.
        "uv" | "poetry" | "pipenv" | "pdm" | "hatch" | "rye" if sub == Some("run") => {
            let i = rest.iter().position(|a| a == "run")?;
            return by_command_depth(rest_after_options(&rest[i + 1..]), depth + 1);
        }
        p if is_python(p) => {
            if let Some(i) = rest.iter().position(|a| a == "-m") {
                return by_command_depth(&rest[i + 1..], depth + 1).or(
                    match rest.get(i + 1)?.as_str() {
                        "unittest" => Some("unittest"),
                        _ => None,
                    },
                );
            }
            return None;
        }
        "mypy" | "dmypy" => "mypy",
        "ruff" => "ruff",
        "flake8" | "pyflakes" | "pycodestyle" => "flake8",
        "pylint" => "pylint",
        "pip" | "pip3" | "uv" if matches!(sub, Some("install" | "download" | "wheel")) => "pip",
        "pip" | "pip3" | "uv" if sub == Some("pip") => "pip",
        "eslint" => "eslint",
        "tsc" | "vue-tsc" => "tsc",
        "jest" => "jest",
        "vitest" => "vitest",
        "mocha" | "_mocha" => "mocha",
        "node" | "bun" | "deno" if has("--test") || sub == Some("test") => "node-test",
        "npx" | "pnpx" | "bunx" => return by_command_depth(rest_after_options(rest), depth + 1),
        "npm" | "pnpm" | "yarn" | "bun" => match sub {
            Some("install" | "i" | "ci" | "add" | "update" | "up" | "upgrade") => "npm",
            // `yarn` alone installs.
            None if program == "yarn" => "npm",
            Some("exec" | "dlx" | "x") => {
                let i = rest.iter().position(|a| Some(a.as_str()) == sub)?;
                return by_command_depth(rest_after_options(&rest[i + 1..]), depth + 1);
            }
            // `npm test`, `npm run build`: a script, whose tool the output shows.
            Some("test" | "t" | "run" | "run-script" | "start") | None => return None,
            // `yarn jest`, `pnpm vitest run`: a package's binary (or a script of that name,
            // which is most often the tool itself).
            Some(_) if program != "npm" && depth == 0 => {
                return by_command_depth(rest_after_options(rest), depth + 1);
            }
            _ => return None,
        },
        "make" | "gmake" | "ninja" | "gcc" | "g++" | "cc" | "c++" | "clang" | "clang++" => "make",
        "cmake" if has("--build") => "make",
        "ctest" => "ctest",
        "mvn" | "mvnw" | "mvnw.cmd" | "mvn.cmd" => {
            if rest.iter().any(|a| {
                matches!(
                    a.as_str(),
                    "test" | "verify" | "install" | "package" | "deploy"
                ) || a.starts_with("surefire:")
                    || a.starts_with("-Dtest=")
            }) {
                "maven-test"
            } else {
                "maven-build"
            }
        }
        "gradle" | "gradlew" | "gradlew.bat" => "gradle",
        "shellcheck" => "shellcheck",
        // `docker build`, `docker buildx build`, `docker image build`, `podman build`.
        "docker" | "podman" | "buildah" | "nerdctl"
            if rest.iter().any(|a| a == "build" || a == "bud") =>
        {
            "docker-build"
        }
        "terraform" | "tofu" | "terragrunt" => match sub? {
            "validate" | "plan" | "apply" | "init" | "destroy" | "fmt" | "run-all" => "terraform",
            _ => return None,
        },
        "helm" => match sub? {
            "lint" | "template" | "install" | "upgrade" | "package" | "dependency" => "helm",
            _ => return None,
        },
        _ => return None,
    })
}

/// A shell's option word that takes the script: `-c`, `-lc`, `-ec`, `-euxc`.
fn is_command_flag(word: &str) -> bool {
    word.len() >= 2
        && word.starts_with('-')
        && !word.starts_with("--")
        && word[1..].bytes().all(|b| b.is_ascii_alphabetic())
        && word.contains('c')
}

/// `python`, `python3`, `python3.12`, `py`, `pypy3`.
fn is_python(program: &str) -> bool {
    let version = |v: &str| v.bytes().all(|b| b.is_ascii_digit() || b == b'.');
    program == "py"
        || program
            .strip_prefix("python")
            .or_else(|| program.strip_prefix("pypy"))
            .is_some_and(version)
}

/// The arguments after leading options (`npx --yes jest` → `jest`).
fn rest_after_options(args: &[String]) -> &[String] {
    let i = args
        .iter()
        .position(|a| !a.starts_with('-'))
        .unwrap_or(args.len());
    &args[i..]
}

/// Lines that only one tool prints, each with the template it points to; the first line of
/// the output that matches one decides.
const SIGNATURES: &[(&str, &str)] = &[
    (r"^={5,} test session starts ={5,}$", "pytest"),
    (
        r"^running \d+ tests?$|^test result: |^\s+Running (unittests |tests/|benches/)",
        "cargo-test",
    ),
    (r"^\s+(Compiling|Checking) \S+ v\d", "cargo-build"),
    (
        r"^=== RUN |^--- (FAIL|PASS): |^(ok|FAIL)\s+\S+\s+[\d.]+s$|^\?\s+\S+\s+\[no test files\]$",
        "go-test",
    ),
    (r"^ RUN  v\d", "vitest"),
    (r"^(PASS|FAIL) \S+\.(test|spec)\.[cm]?[jt]sx?\b", "jest"),
    (r"^TAP version \d+$|^ℹ tests \d+$|^# Subtest: ", "node-test"),
    (r"^\s+\d+ passing \(\d+", "mocha"),
    (
        r"^\[INFO\] -+< .* >-+$|^\[INFO\] Scanning for projects",
        "maven-build",
    ),
    (r"^> Task :|^BUILD (SUCCESSFUL|FAILED) in \d", "gradle"),
    (r"^Test project /", "ctest"),
    (r"^In \S+ line \d+:$", "shellcheck"),
    (
        r"^npm (ERR!|error) |^(Error: )?ERR_PNPM_|^yarn (install|add) v\d",
        "npm",
    ),
    (
        r"^Sending build context to Docker daemon|^Step 1/\d+ : FROM |^#\d+ \[internal\] load build definition",
        "docker-build",
    ),
    (
        r"^Success! The configuration is valid|^Terraform (has been successfully initialized|v\d)",
        "terraform",
    ),
    (r"^==> Linting ", "helm"),
    (
        r"^(Collecting|Looking in indexes:|Looking in links:|Requirement already satisfied:) ",
        "pip",
    ),
    (r"^\*{13} Module ", "pylint"),
    (
        r"^(Found \d+ errors? in \d+ files? \(checked|Success: no issues found in \d+ source files?$)",
        "mypy",
    ),
    (
        r"^(FAIL|ERROR): \w+ \([\w.]+\)$|^Ran \d+ tests? in [\d.]+s$",
        "unittest",
    ),
    (r"^\S+\(\d+,\d+\): error TS\d+: ", "tsc"),
    (
        r"^make(\[\d+\])?: |^\S+\.(c|cc|cpp|cxx|h|hpp):\d+:\d+: (error|warning): ",
        "make",
    ),
];

static SIGNATURE_SET: LazyLock<RegexSet> = LazyLock::new(|| {
    RegexSet::new(SIGNATURES.iter().map(|(re, _)| *re))
        .unwrap_or_else(|e| unreachable!("built-in regex: {e}"))
});

/// The template a line points to, if it is one tool's signature.
pub(crate) fn by_line(line: &[u8]) -> Option<&'static str> {
    SIGNATURE_SET
        .matches(line)
        .iter()
        .next()
        .map(|i| SIGNATURES[i].1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pick(cmd: &str) -> Option<&'static str> {
        let argv: Vec<String> = cmd.split_whitespace().map(str::to_owned).collect();
        by_command(&argv)
    }

    #[test]
    fn picks_by_program_and_subcommand() {
        for (cmd, want) in [
            ("cargo test --workspace", Some("cargo-test")),
            ("cargo +nightly clippy --all-targets", Some("cargo-build")),
            ("/usr/bin/cargo build", Some("cargo-build")),
            ("cargo fmt", None),
            ("go test ./...", Some("go-test")),
            ("go vet ./...", Some("go-build")),
            ("python3 -m pytest -q", Some("pytest")),
            ("python -m unittest -v", Some("unittest")),
            ("python -m mypy src", Some("mypy")),
            ("python3 -m pip install -r r.txt", Some("pip")),
            ("python3 script.py", None),
            ("npx --yes eslint .", Some("eslint")),
            ("pnpm exec vitest run", Some("vitest")),
            ("npm test", None),
            ("npm ci", Some("npm")),
            ("yarn", Some("npm")),
            ("node --test", Some("node-test")),
            ("node server.js", None),
            ("./node_modules/.bin/jest --ci", Some("jest")),
            ("make -j4", Some("make")),
            ("cmake --build build", Some("make")),
            ("ctest --output-on-failure", Some("ctest")),
            ("mvn -B verify", Some("maven-test")),
            ("./mvnw compile", Some("maven-build")),
            ("./gradlew test", Some("gradle")),
            (
                "env RUST_LOG=debug timeout 60 cargo test",
                Some("cargo-test"),
            ),
            ("shellcheck a.sh", Some("shellcheck")),
            ("docker build -q -t x .", Some("docker-build")),
            ("docker buildx build .", Some("docker-build")),
            ("docker run x", None),
            ("podman build .", Some("docker-build")),
            ("terraform validate -no-color", Some("terraform")),
            ("env TF_LOG=INFO tofu plan", Some("terraform")),
            ("terraform output", None),
            ("helm lint charts/x", Some("helm")),
            ("pnpm install --store-dir s", Some("npm")),
            ("yarn install --verbose", Some("npm")),
            ("python3.12 -m pytest -x", Some("pytest")),
            ("pypy3 -m unittest", Some("unittest")),
            ("python3.12x -m pytest", None),
            ("uv run pytest -q", Some("pytest")),
            ("uv run --frozen mypy src", Some("mypy")),
            ("poetry run python -m unittest", Some("unittest")),
            ("uv pip install -e .", Some("pip")),
            ("coverage run -m pytest", Some("pytest")),
            ("yarn jest --ci", Some("jest")),
            ("pnpm vitest run", Some("vitest")),
            ("pnpm test", None),
            ("yarn test", None),
            ("yarn run build", None),
            ("npm run lint", None),
            ("npm start", None),
            ("yarn add left-pad", Some("npm")),
            ("bun test", Some("node-test")),
        ] {
            assert_eq!(pick(cmd), want, "{cmd}");
        }
        let sh = |s: &str| vec!["sh".to_owned(), "-c".to_owned(), s.to_owned()];
        assert_eq!(
            by_command(&sh("cd app && cargo test 2>&1")),
            Some("cargo-test")
        );
        assert_eq!(by_command(&sh("cd app; ls")), None);
        // Agents' shells: `bash -lc`, `sh -ec`.
        let shell = |flag: &str, s: &str| vec!["bash".to_owned(), flag.to_owned(), s.to_owned()];
        assert_eq!(
            by_command(&shell("-lc", "cd app && go test ./... 2>&1 | tail -40")),
            Some("go-test")
        );
        assert_eq!(by_command(&shell("-ec", "make -j2")), Some("make"));
        assert_eq!(by_command(&shell("--login", "make")), None);
    }

    #[test]
    fn signature_lines() {
        assert_eq!(by_line(b"running 12 tests"), Some("cargo-test"));
        assert_eq!(by_line(b"TAP version 13"), Some("node-test"));
        assert_eq!(by_line(b"Test project /src/build"), Some("ctest"));
        assert_eq!(
            by_line(b"Sending build context to Docker daemon  5.6kB"),
            Some("docker-build")
        );
        assert_eq!(by_line(b"==> Linting charts/web"), Some("helm"));
        assert_eq!(by_line(b"Error: ERR_PNPM_NO_MATCHING_VERSION"), Some("npm"));
        assert_eq!(by_line(b"hello"), None);
    }
}
