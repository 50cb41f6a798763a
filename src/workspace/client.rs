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

fn unreachable(url: &reqwest::Url, e: &reqwest::Error) -> ErrorBody {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    ErrorBody::new(
        ErrorCode::GatewayUnreachable,
        format!("cannot reach the gateway at {url}: {s}"),
    )
}

/// The error body of a failed answer, or a protocol error naming the status.
async fn error_of(resp: reqwest::Response) -> ErrorBody {
    let status = resp.status();
    ErrorBody::from_answer(status, &resp.text().await.unwrap_or_default())
}

/// A JSON answer (reqwest is built without its `json` feature).
async fn json<T: serde::de::DeserializeOwned>(resp: reqwest::Response) -> Result<T, String> {
    let body = resp.bytes().await.map_err(|e| e.to_string())?;
    serde_json::from_slice(&body).map_err(|e| e.to_string())
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
                return Err(ErrorBody::new(
                    ErrorCode::ProtocolError,
                    format!("the gateway asked for {hash}, which is not in the manifest"),
                ));
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
        let text = serde_json::to_vec(&walked.manifest)
            .map_err(|e| ErrorBody::new(ErrorCode::Internal, e.to_string()))?;
        let body = tokio::task::spawn_blocking(move || {
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            gz.write_all(&text).and_then(|()| gz.finish())
        })
        .await
        .map_err(|e| ErrorBody::new(ErrorCode::Internal, e.to_string()))?
        .map_err(|e| ErrorBody::new(ErrorCode::Internal, e.to_string()))?;
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
        json::<PostResponse>(resp).await.map_err(|e| {
            ErrorBody::new(
                ErrorCode::ProtocolError,
                format!("invalid answer to POST /workspaces: {e}"),
            )
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
                return Err(ErrorBody::new(
                    ErrorCode::Internal,
                    format!("cannot read a workspace file: {e}"),
                ));
            }
            Err(e) => return Err(ErrorBody::new(ErrorCode::Internal, e.to_string())),
        }
        json::<UploadResponse>(resp).await.map_err(|e| {
            ErrorBody::new(
                ErrorCode::ProtocolError,
                format!("invalid answer to an upload: {e}"),
            )
        })
    }

    /// Downloads a content by hash and checks it.
    pub async fn download(&self, hash: &str) -> Result<Vec<u8>, ErrorBody> {
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
        let data = resp.bytes().await.map_err(|e| unreachable(&url, &e))?;
        if super::hash_bytes(&data) != hash {
            return Err(ErrorBody::new(
                ErrorCode::ProtocolError,
                format!("the content downloaded as {hash} does not hash to it"),
            ));
        }
        Ok(data.to_vec())
    }

    /// Writes sync-back results into `root`: each file downloaded, checked, and written
    /// without following symlinks and never outside `root`. Returns the files written.
    pub async fn sync_back(
        &self,
        root: &Path,
        files: &[ChangedFile],
    ) -> Result<Vec<ChangedFile>, String> {
        let mut written = Vec::new();
        for f in files {
            let data = self
                .download(&f.hash)
                .await
                .map_err(|e| format!("cannot download {}: {}", f.path, e.message))?;
            let root = root.to_owned();
            let file = f.clone();
            tokio::task::spawn_blocking(move || write_inside(&root, &file, &data))
                .await
                .map_err(|e| e.to_string())??;
            written.push(f.clone());
        }
        Ok(written)
    }
}

/// Writes one result file below `root`: the path must be a plain relative path, no
/// directory on the way may be a symlink, and an existing symlink is not written through.
pub fn write_inside(root: &Path, f: &ChangedFile, data: &[u8]) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt as _;
    super::manifest::check_path(&f.path, 4096).map_err(|m| format!("refused result: {m}"))?;
    let mut dir = root.to_owned();
    let parts: Vec<&str> = f.path.split('/').collect();
    for part in &parts[..parts.len() - 1] {
        dir.push(part);
        match std::fs::symlink_metadata(&dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(format!(
                    "refused result {}: {} is not a directory",
                    f.path,
                    dir.display()
                ));
            }
            Err(_) => std::fs::create_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?,
        }
    }
    let dest = root.join(&f.path);
    if let Ok(m) = std::fs::symlink_metadata(&dest)
        && !m.is_file()
    {
        return Err(format!(
            "refused result {}: the local path is not a regular file",
            f.path
        ));
    }
    // Written beside, then renamed over: never through a symlink, never half written.
    let tmp = dest.with_file_name(format!(
        ".{}.mcp-run-{}",
        parts[parts.len() - 1],
        std::process::id()
    ));
    std::fs::write(&tmp, data).map_err(|e| format!("{}: {e}", tmp.display()))?;
    let _ = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(f.mode & 0o777));
    std::fs::rename(&tmp, &dest).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("{}: {e}", dest.display())
    })
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
