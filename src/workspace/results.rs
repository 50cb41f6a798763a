//! What a caller accepts back from a runner (sync-back), whoever reports it: `run-remote`
//! and `mcp-run stdio --workspace` writing into the caller's tree, and a gateway with the
//! remote backend storing an upstream's results. A runner, and a gateway in front of it, are
//! untrusted: a reported file is written only when
//! - its path is a plain relative path (no `..`, not absolute) without control or invisible
//!   formatting characters (newlines, escape codes, right-to-left overrides),
//! - no component is `.git` (compared case-insensitively, with what Windows and macOS file
//!   systems ignore stripped, as git itself does since CVE-2014-9390),
//! - it matches one of the globs the caller asked for (rsync's check since CVE-2022-29154),
//! - and its content is exactly the announced size and hash (checked while it streams).
//!
//! Its mode becomes 0644 or 0755 (executable or not): setuid, setgid, sticky and
//! group/world-write bits never come back.

use super::manifest::PathError;
use crate::contract::{ChangedFile, ErrorBody, ErrorCode};

/// The longest result path accepted (Linux's PATH_MAX).
pub(crate) const MAX_RESULT_PATH: usize = 4096;

/// Why a request's `sync_back` globs do not compile: `400 invalid_request`.
#[derive(Debug, thiserror::Error)]
pub enum GlobsError {
    #[error("invalid sync_back glob {pattern:?}: {source}")]
    Glob {
        pattern: String,
        source: globset::Error,
    },
    #[error("invalid sync_back globs: {0}")]
    Set(globset::Error),
}

impl From<GlobsError> for ErrorBody {
    fn from(e: GlobsError) -> Self {
        ErrorBody::new(ErrorCode::InvalidRequest, e.to_string())
    }
}

/// Why a reported result is not written. Not a wire error by itself: the client says it,
/// the kube sync-back and a remote gateway leave the file out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// `path`: escaped; `c`: the character.
    #[error(
        "refused result {path:?}: its name contains the control or formatting character U+{:04X}",
        *c as u32
    )]
    Invisible { path: String, c: char },
    #[error("refused result: {0}")]
    Path(#[from] PathError),
    #[error("refused result {0:?}: results are never written into a .git directory")]
    Git(String),
    #[error("refused result {0:?}: it matches none of the requested --sync-back globs")]
    NotRequested(String),
    #[error("refused result {0:?}: no valid content hash")]
    NoHash(String),
}

/// The rules for one run's results: the globs it asked for.
pub struct ResultRules {
    globs: globset::GlobSet,
}

impl ResultRules {
    /// `globs` as sent in the request's `sync_back` (same syntax as the gateway's).
    pub fn new(globs: &[String]) -> Result<Self, GlobsError> {
        Ok(Self {
            globs: self::globs(globs)?,
        })
    }

    /// Why `f` must not be written, if it must not.
    pub fn check(&self, f: &ChangedFile) -> Result<(), Refused> {
        check_result_path(&f.path)?;
        if !self.globs.is_match(&f.path) {
            return Err(Refused::NotRequested(f.path.clone()));
        }
        if !super::is_hash(&f.hash) {
            return Err(Refused::NoHash(f.path.clone()));
        }
        Ok(())
    }
}

/// Compiles the sync-back globs: `*` stays within one path component, `**` spans several.
pub(crate) fn globs(patterns: &[String]) -> Result<globset::GlobSet, GlobsError> {
    let mut b = globset::GlobSetBuilder::new();
    for p in patterns {
        let g = globset::GlobBuilder::new(p)
            .literal_separator(true)
            .build()
            .map_err(|source| GlobsError::Glob {
                pattern: p.clone(),
                source,
            })?;
        b.add(g);
    }
    b.build().map_err(GlobsError::Set)
}

/// The mode a result is written with: 0755 when any execute bit is set, else 0644.
pub(crate) fn safe_mode(mode: u32) -> u32 {
    if mode & 0o111 != 0 {
        super::manifest::MODE_EXEC
    } else {
        super::manifest::MODE_FILE
    }
}

/// A path's own checks (not the globs): plain, printable, not into `.git`.
pub(crate) fn check_result_path(path: &str) -> Result<(), Refused> {
    if let Some(c) = path.chars().find(|c| invisible_or_control(*c)) {
        return Err(Refused::Invisible {
            path: path.escape_debug().to_string(),
            c,
        });
    }
    super::manifest::check_path(path, MAX_RESULT_PATH)?;
    if path.split('/').any(is_git_dir_name) {
        return Err(Refused::Git(path.to_owned()));
    }
    Ok(())
}

/// Whether a path component names `.git` for git on some file system: case-insensitive
/// (Windows, macOS), with trailing dots and spaces (Windows) and ignorable code points (HFS+)
/// left out; also the 8.3 short name `git~1`.
fn is_git_dir_name(component: &str) -> bool {
    let kept: String = component
        .chars()
        .filter(|c| !hfs_ignorable(*c))
        .collect::<String>()
        .trim_end_matches(['.', ' '])
        .to_ascii_lowercase();
    kept == ".git" || kept == "git~1"
}

/// Code points HFS+ ignores in names (git's `is_hfs_dotgit`).
fn hfs_ignorable(c: char) -> bool {
    matches!(c as u32, 0x200c..=0x200f | 0x202a..=0x202e | 0x206a..=0x206f | 0xfeff)
}

/// C0 and C1 controls, DEL, and Unicode format characters (bidirectional overrides and
/// isolates, zero-width characters, the byte-order mark): what makes a name print as another.
fn invisible_or_control(c: char) -> bool {
    c.is_control()
        || matches!(
            c as u32,
            0x00ad
                | 0x0600..=0x0605
                | 0x061c
                | 0x06dd
                | 0x070f
                | 0x180e
                | 0x200b..=0x200f
                | 0x2028..=0x202e
                | 0x2060..=0x2064
                | 0x2066..=0x206f
                | 0xfeff
                | 0xfff9..=0xfffb
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn changed(path: &str) -> ChangedFile {
        ChangedFile {
            path: path.into(),
            mode: 0o644,
            size: 1,
            hash: "a".repeat(64),
        }
    }

    #[test]
    fn git_control_characters_and_unrequested_paths_are_refused() {
        let rules = ResultRules::new(&["**".into()]).unwrap();
        for bad in [
            ".git/hooks/pre-commit",
            ".GIT/config",
            "sub/.Git/config",
            ".git./config",
            ".git /x",
            "git~1/config",
            ".g\u{200c}it/config",
            "a\nb",
            "a\u{1b}[31mb",
            "evil\u{202e}txt.exe",
            "../x",
            "/etc/passwd",
        ] {
            assert!(rules.check(&changed(bad)).is_err(), "{bad:?}");
        }
        for good in ["out/a.xml", ".github/x", "git/x", ".gitignore", "dir.git/x"] {
            rules.check(&changed(good)).unwrap();
        }
        let narrow = ResultRules::new(&["target/*.xml".into()]).unwrap();
        narrow.check(&changed("target/a.xml")).unwrap();
        assert!(narrow.check(&changed("Makefile")).is_err());
        assert!(narrow.check(&changed("target/sub/a.xml")).is_err());
        assert_eq!(safe_mode(0o4777), 0o755);
        assert_eq!(safe_mode(0o2666), 0o644);
        assert_eq!(safe_mode(0o1644), 0o644);
    }
}
