//! The client's side of the upload protocol: walks a directory, posts its manifest, uploads
//! the contents the gateway lacks (gzip tar streams), and downloads sync-back results.
//! `run-remote --workspace`, `mcp-run stdio --workspace` and the remote backend use it.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt as _;

use super::manifest::{PostResponse, UploadResponse};
use super::tarball::ChannelWriter;
use super::walk::{HashCache, Walked, walk};
use crate::contract::{ChangedFile, ErrorBody, ErrorCode};

/// Contents per upload request, by uncompressed size (one larger file is a request alone).
const BUNDLE_BYTES: u64 = 16 * 1024 * 1024;
/// Upload requests in flight at once.
const PARALLEL_UPLOADS: usize = 4;

/// A gateway's workspace endpoints.
#[derive(Clone)]
pub struct WorkspaceClient {
    http: reqwest::Client,
    /// The gateway's base URL (its `/raw` URL without `/raw`).
    base: reqwest::Url,
    token: Option<String>,
}

/// What a sync did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Synced {
    /// The id to send as `workspace`.
    pub workspace: String,
    /// The tree's version (SHA-256 of its manifest).
    pub version: String,
    pub files: usize,
    pub bytes: u64,
    /// Contents uploaded, and their size before compression.
    pub uploaded_files: usize,
    pub uploaded_bytes: u64,
}

/// Why sending a workspace failed on this side (what the gateway answers is relayed as its
/// `ErrorBody`).
#[derive(Debug, thiserror::Error)]
enum SendError {
    /// `chain`: the error and its causes.
    #[error("cannot reach the gateway at {url}: {chain}")]
    Unreachable { url: String, chain: String },
    #[error("the gateway asked for {0}, which is not in the manifest")]
    NotInManifest(String),
    /// `what`: the request answered.
    #[error("invalid answer to {what}: {source}")]
    BadAnswer {
        what: &'static str,
        source: AnswerError,
    },
    #[error("{0}")]
    Encode(serde_json::Error),
    #[error("{0}")]
    Compress(std::io::Error),
    #[error("{0}")]
    Join(tokio::task::JoinError),
    #[error("cannot read a workspace file: {0}")]
    ReadFile(std::io::Error),
}

impl From<SendError> for ErrorBody {
    fn from(e: SendError) -> Self {
        let code = match e {
            SendError::Unreachable { .. } => ErrorCode::GatewayUnreachable,
            SendError::NotInManifest(_) | SendError::BadAnswer { .. } => ErrorCode::ProtocolError,
            SendError::Encode(_)
            | SendError::Compress(_)
            | SendError::Join(_)
            | SendError::ReadFile(_) => ErrorCode::Internal,
        };
        ErrorBody::new(code, e.to_string())
    }
}

fn unreachable(url: &reqwest::Url, e: &reqwest::Error) -> SendError {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    SendError::Unreachable {
        url: url.to_string(),
        chain: s,
    }
}

/// The error body of a failed answer, or a protocol error naming the status.
async fn error_of(resp: reqwest::Response) -> ErrorBody {
    let status = resp.status();
    ErrorBody::from_answer(status, &resp.text().await.unwrap_or_default())
}

/// Why an answer of the gateway could not be read.
#[derive(Debug, thiserror::Error)]
enum AnswerError {
    #[error(transparent)]
    Read(#[from] reqwest::Error),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

/// A JSON answer (reqwest is built without its `json` feature).
async fn json<T: serde::de::DeserializeOwned>(resp: reqwest::Response) -> Result<T, AnswerError> {
    let body = resp.bytes().await?;
    Ok(serde_json::from_slice(&body)?)
}

/// Why a sync-back result was not written into the caller's tree.
#[derive(Debug, thiserror::Error)]
pub enum ResultError {
    /// Its path breaks a rule.
    #[error(transparent)]
    Refused(#[from] super::results::Refused),
    #[error("refused result {path}: {} is not a directory", dir.display())]
    NotADirectory { path: String, dir: PathBuf },
    #[error("refused result {path}: the local path is not a regular file")]
    NotAFile { path: String },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}", .0.message)]
    Gateway(ErrorBody),
    #[error("the download broke off: {0}")]
    BrokeOff(reqwest::Error),
    #[error("the gateway sent more than the {size} bytes it announced")]
    TooLong { size: u64 },
    #[error("the gateway sent {got} bytes, not the {size} it announced")]
    Short { got: u64, size: u64 },
    #[error("the content does not hash to its announced hash")]
    Hash,
    #[error("{0}")]
    Write(std::io::Error),
    #[error("{0}")]
    Join(#[from] tokio::task::JoinError),
    #[error("cannot download {path}: {source}")]
    Download {
        path: String,
        source: Box<ResultError>,
    },
}

fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> ResultError + '_ {
    move |source| ResultError::Io {
        path: path.to_owned(),
        source,
    }
}

impl WorkspaceClient {
    /// `raw_url` is the gateway's `/raw` URL (the workspace endpoints are beside it).
    pub fn new(http: reqwest::Client, raw_url: &reqwest::Url, token: Option<String>) -> Self {
        let mut base = raw_url.clone();
        let path = base
            .path()
            .trim_end_matches('/')
            .trim_end_matches("/raw")
            .to_owned();
        base.set_path(&path);
        Self { http, base, token }
    }

    fn url(&self, tail: &str) -> reqwest::Url {
        let mut u = self.base.clone();
        let path = format!("{}{tail}", u.path().trim_end_matches('/'));
        u.set_path(&path);
        u
    }

    fn auth(&self, b: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.token {
            Some(t) => b.bearer_auth(t),
            None => b,
        }
    }

    /// Walks `root` and syncs it: posts the manifest, uploads what is missing.
    pub async fn sync_dir(&self, root: &Path) -> Result<Synced, SyncError> {
        let root2 = root.to_owned();
        let walked = tokio::task::spawn_blocking(move || {
            let mut cache = HashCache::load(&root2);
            let w = walk(&root2, &mut cache);
            if w.is_ok() {
                cache.save();
            }
            w
        })
        .await
        .map_err(|e| SyncError::Local(format!("walking failed: {e}")))?
        .map_err(|e| SyncError::Local(e.to_string()))?;
        self.sync(&walked).await.map_err(SyncError::Gateway)
    }

    /// Posts a walked tree's manifest and uploads the contents the gateway lacks.
    pub async fn sync(&self, walked: &Walked) -> Result<Synced, ErrorBody> {
        let posted = self.post(walked).await?;
        let mut missing: Vec<(String, PathBuf, u64)> = Vec::new();
        for hash in &posted.missing {
            let Some(path) = walked.sources.get(hash) else {
                return Err(SendError::NotInManifest(hash.clone()).into());
            };
            let size = walked
                .manifest
                .entries
                .iter()
                .find(|e| &e.hash == hash)
                .map(|e| e.size)
                .unwrap_or(0);
            missing.push((hash.clone(), path.clone(), size));
        }
        let mut bundles: Vec<Vec<(String, PathBuf, u64)>> = Vec::new();
        let mut current = Vec::new();
        let mut size = 0;
        for m in missing {
            if size + m.2 > BUNDLE_BYTES && !current.is_empty() {
                bundles.push(std::mem::take(&mut current));
                size = 0;
            }
            size += m.2;
            current.push(m);
        }
        if !current.is_empty() {
            bundles.push(current);
        }
        let id = posted.workspace.clone();
        let mut uploaded = futures_util::stream::iter(bundles)
            .map(|b| self.upload(&id, b))
            .buffer_unordered(PARALLEL_UPLOADS);
        let (mut files, mut bytes) = (0, 0);
        while let Some(r) = uploaded.next().await {
            let r = r?;
            files += r.stored;
            bytes += r.bytes;
        }
        Ok(Synced {
            workspace: posted.workspace,
            version: posted.version,
            files: posted.files,
            bytes: posted.bytes,
            uploaded_files: files,
            uploaded_bytes: bytes,
        })
    }

    async fn post(&self, walked: &Walked) -> Result<PostResponse, ErrorBody> {
        let text = serde_json::to_vec(&walked.manifest).map_err(SendError::Encode)?;
        let body = tokio::task::spawn_blocking(move || {
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            gz.write_all(&text).and_then(|()| gz.finish())
        })
        .await
        .map_err(SendError::Join)?
        .map_err(SendError::Compress)?;
        let url = self.url("/workspaces");
        let resp = self
            .auth(self.http.post(url.clone()))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(reqwest::header::CONTENT_ENCODING, "gzip")
            .body(body)
            .send()
            .await
            .map_err(|e| unreachable(&url, &e))?;
        if !resp.status().is_success() {
            return Err(error_of(resp).await);
        }
        json::<PostResponse>(resp).await.map_err(|source| {
            SendError::BadAnswer {
                what: "POST /workspaces",
                source,
            }
            .into()
        })
    }

    /// Uploads contents as one gzip tar stream, produced on a blocking thread while sent.
    async fn upload(
        &self,
        id: &str,
        contents: Vec<(String, PathBuf, u64)>,
    ) -> Result<UploadResponse, ErrorBody> {
        let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Bytes>>(4);
        let producer = tokio::task::spawn_blocking(move || {
            let sink = std::io::BufWriter::with_capacity(64 * 1024, ChannelWriter(tx));
            let gz = flate2::write::GzEncoder::new(sink, flate2::Compression::fast());
            let mut tar = tar::Builder::new(gz);
            for (hash, path, size) in contents {
                let file = std::fs::File::open(&path)?;
                let mut header = tar::Header::new_gnu();
                header.set_size(size);
                header.set_mode(0o644);
                header.set_entry_type(tar::EntryType::Regular);
                // A file that changed since it was hashed would be refused by the gateway;
                // `take` keeps the entry at its declared size either way.
                use std::io::Read as _;
                tar.append_data(&mut header, &hash, file.take(size))?;
            }
            let gz = tar.into_inner()?;
            gz.finish()?;
            Ok::<(), std::io::Error>(())
        });
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        let url = self.url(&format!("/workspaces/{id}/blobs"));
        let resp = self
            .auth(self.http.post(url.clone()))
            .header(reqwest::header::CONTENT_TYPE, "application/x-tar")
            .header(reqwest::header::CONTENT_ENCODING, "gzip")
            .body(reqwest::Body::wrap_stream(stream))
            .send()
            .await;
        let produced = producer.await;
        let resp = resp.map_err(|e| unreachable(&url, &e))?;
        if !resp.status().is_success() {
            return Err(error_of(resp).await);
        }
        match produced {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                return Err(SendError::ReadFile(e).into());
            }
            Err(e) => return Err(SendError::Join(e).into()),
        }
        json::<UploadResponse>(resp).await.map_err(|source| {
            SendError::BadAnswer {
                what: "an upload",
                source,
            }
            .into()
        })
    }

    /// Starts the download of a content by hash: the answer, its status checked.
    pub async fn download_response(&self, hash: &str) -> Result<reqwest::Response, ErrorBody> {
        let url = self.url(&format!("/workspaces/blobs/{hash}"));
        let resp = self
            .auth(self.http.get(url.clone()))
            .timeout(Duration::from_secs(600))
            .send()
            .await
            .map_err(|e| unreachable(&url, &e))?;
        if !resp.status().is_success() {
            return Err(error_of(resp).await);
        }
        Ok(resp)
    }

    /// Downloads a content by hash into `out`, checking as it streams that it is at most
    /// `size` bytes, and at the end that it is exactly `size` bytes hashing to `hash`:
    /// a gateway cannot make the caller store more than it announced.
    pub async fn download_into(
        &self,
        hash: &str,
        size: u64,
        out: &mut std::fs::File,
    ) -> Result<(), ResultError> {
        use sha2::Digest as _;
        let mut resp = self
            .download_response(hash)
            .await
            .map_err(ResultError::Gateway)?;
        let mut hasher = sha2::Sha256::new();
        let mut n = 0u64;
        while let Some(chunk) = resp.chunk().await.map_err(ResultError::BrokeOff)? {
            n += chunk.len() as u64;
            if n > size {
                return Err(ResultError::TooLong { size });
            }
            hasher.update(&chunk);
            out.write_all(&chunk).map_err(ResultError::Write)?;
        }
        if n != size {
            return Err(ResultError::Short { got: n, size });
        }
        if super::hex(&hasher.finalize()) != hash {
            return Err(ResultError::Hash);
        }
        Ok(())
    }

    /// Writes sync-back results into `root`, each only if `rules` accept it: streamed into a
    /// temporary file beside its target, checked, then renamed into place; never through a
    /// symlink nor outside `root`. Returns the files written and those refused (with why).
    pub async fn sync_back(
        &self,
        root: &Path,
        files: &[ChangedFile],
        rules: &super::results::ResultRules,
    ) -> Result<(Vec<ChangedFile>, Vec<super::results::Refused>), ResultError> {
        let mut written = Vec::new();
        let mut refused = Vec::new();
        for f in files {
            if let Err(why) = rules.check(f) {
                refused.push(why);
                continue;
            }
            let (root2, f2) = (root.to_owned(), f.clone());
            let mut temp =
                tokio::task::spawn_blocking(move || ResultTemp::beside(&root2, &f2)).await??;
            if let Err(e) = self.download_into(&f.hash, f.size, &mut temp.file).await {
                return Err(ResultError::Download {
                    path: f.path.clone(),
                    source: Box::new(e),
                });
            }
            tokio::task::spawn_blocking(move || temp.commit()).await??;
            written.push(f.clone());
        }
        Ok((written, refused))
    }
}

/// A result being downloaded: a new file beside its destination, removed unless committed.
pub(crate) struct ResultTemp {
    path: PathBuf,
    dest: PathBuf,
    mode: u32,
    pub file: std::fs::File,
    done: bool,
}

impl ResultTemp {
    /// Checks the way to `f.path` below `root` (creating missing directories, refusing
    /// symlinks and non-directories on the way, and a destination that is not a regular
    /// file) and creates the temporary file (0600) beside it.
    pub(crate) fn beside(root: &Path, f: &ChangedFile) -> Result<Self, ResultError> {
        use std::os::unix::fs::OpenOptionsExt as _;
        super::results::check_result_path(&f.path).map_err(ResultError::Refused)?;
        let mut dir = root.to_owned();
        let parts: Vec<&str> = f.path.split('/').collect();
        for part in &parts[..parts.len() - 1] {
            dir.push(part);
            match std::fs::symlink_metadata(&dir) {
                Ok(m) if m.is_dir() => {}
                Ok(_) => {
                    return Err(ResultError::NotADirectory {
                        path: f.path.clone(),
                        dir,
                    });
                }
                Err(_) => std::fs::create_dir(&dir).map_err(io_at(&dir))?,
            }
        }
        let dest = root.join(&f.path);
        if let Ok(m) = std::fs::symlink_metadata(&dest)
            && !m.is_file()
        {
            return Err(ResultError::NotAFile {
                path: f.path.clone(),
            });
        }
        let path = dest.with_file_name(format!(
            ".{}.mcp-run-{}-{:08x}",
            parts[parts.len() - 1],
            std::process::id(),
            rand::random::<u32>()
        ));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&path)
            .map_err(io_at(&path))?;
        Ok(Self {
            path,
            dest,
            mode: super::results::safe_mode(f.mode),
            file,
            done: false,
        })
    }

    /// Gives the file its mode (0644 or 0755) and renames it over the destination.
    pub(crate) fn commit(mut self) -> Result<(), ResultError> {
        use std::os::unix::fs::PermissionsExt as _;
        self.file
            .set_permissions(std::fs::Permissions::from_mode(self.mode))
            .map_err(io_at(&self.path))?;
        std::fs::rename(&self.path, &self.dest).map_err(io_at(&self.dest))?;
        self.done = true;
        Ok(())
    }
}

impl Drop for ResultTemp {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Writes one result file below `root` (the rules of [`ResultTemp`]).
#[cfg(test)]
fn write_inside(root: &Path, f: &ChangedFile, data: &[u8]) -> Result<(), ResultError> {
    let mut temp = ResultTemp::beside(root, f)?;
    temp.file.write_all(data).map_err(io_at(&temp.path))?;
    temp.commit()
}

/// Why a sync failed: on this machine (the tree) or at the gateway.
#[derive(Debug)]
pub enum SyncError {
    Local(String),
    Gateway(ErrorBody),
}

impl std::fmt::Display for SyncError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SyncError::Local(m) => f.write_str(m),
            SyncError::Gateway(e) => write!(f, "{} ({})", e.message, e.code),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn changed(path: &str) -> ChangedFile {
        ChangedFile {
            path: path.into(),
            mode: 0o644,
            size: 1,
            hash: String::new(),
        }
    }

    #[test]
    fn results_are_written_only_inside_and_never_through_symlinks() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let r = root.path();
        std::os::unix::fs::symlink(outside.path(), r.join("link")).unwrap();
        std::os::unix::fs::symlink(outside.path().join("f"), r.join("flink")).unwrap();
        for bad in ["../x", "/etc/x", "a/../../x", "link/f", "flink"] {
            assert!(write_inside(r, &changed(bad), b"x").is_err(), "{bad}");
        }
        assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
        write_inside(r, &changed("new/dir/f"), b"y").unwrap();
        assert_eq!(std::fs::read(r.join("new/dir/f")).unwrap(), b"y");
    }
}
