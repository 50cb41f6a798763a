//! Workspaces on the Kubernetes backend: before the command starts, the tree is streamed into
//! the pod as a tar archive on the stdin of `tar -x -f - -C <workspace_path>` (an exec, so
//! it works for warm-pool pods that existed before the request, and as any user, e.g.
//! runAsNonRoot 65532, that can write the profile's `emptyDir`). The image needs `tar` that
//! reads `-x -f - -C DIR` (GNU tar, busybox, bsdtar all do).

use kube::api::AttachParams;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_util::sync::CancellationToken;

use super::KubeExecutor;
use super::config::Profile;
use super::pod::CONTAINER;
use crate::contract::{ErrorBody, ErrorCode};
use crate::workspace::WorkspaceRun;

/// The most of `tar`'s stderr kept for an error message.
const MAX_STDERR: u64 = 16 * 1024;

/// The profile's workspace path, or why it takes no workspace.
pub fn workspace_path<'a>(
    profile_name: &str,
    p: &'a Profile,
    run: &WorkspaceRun,
) -> Result<&'a str, ErrorBody> {
    if !run.sync_back.is_empty() {
        return Err(ErrorBody::new(
            ErrorCode::InvalidRequest,
            "`sync_back` is not supported on the kubernetes backend yet (docs/workspaces.md)",
        ));
    }
    p.workspace_path.as_deref().ok_or_else(|| {
        ErrorBody::new(
            ErrorCode::InvalidRequest,
            format!(
                "profile {profile_name:?} takes no workspace: set profiles.{profile_name}.workspace_path (docs/workspaces.md)"
            ),
        )
    })
}

impl KubeExecutor {
    /// Writes the workspace into `pod` below `path`; returns the command's directory.
    pub(super) async fn place_workspace(
        &self,
        pod: &str,
        run: &WorkspaceRun,
        path: &str,
        cancel: &CancellationToken,
    ) -> Result<String, ErrorBody> {
        let pin = run.store.pin(&run.workspace)?;
        let failed = |m: String| {
            ErrorBody::new(
                ErrorCode::StartFailed,
                format!("cannot write the workspace into runner pod {pod} at {path}: {m}"),
            )
        };
        let params = AttachParams {
            container: Some(CONTAINER.into()),
            stdin: true,
            stdout: false,
            stderr: true,
            tty: false,
            ..Default::default()
        };
        let argv = vec!["tar", "-x", "-f", "-", "-C", path];
        let mut attached = tokio::select! {
            r = self.shared.pods.exec(pod, argv, &params) => r.map_err(|e| failed(format!("cannot exec tar: {e}")))?,
            _ = cancel.cancelled() => return Err(ErrorBody::new(ErrorCode::ShuttingDown, "the gateway is shutting down")),
        };
        let mut stdin = attached
            .stdin()
            .ok_or_else(|| failed("no stdin on the exec".into()))?;
        let stderr = attached.stderr();
        let status = attached.take_status();
        let (tx, mut rx) = tokio::sync::mpsc::channel::<std::io::Result<bytes::Bytes>>(4);
        let producer_run = run.clone();
        let producer = tokio::task::spawn_blocking(move || {
            let out = std::io::BufWriter::with_capacity(
                64 * 1024,
                crate::workspace::tarball::ChannelWriter(tx),
            );
            crate::workspace::tarball::write_tar(&producer_run, &pin, out)
        });
        // tar stops at the archive's end marker; stdin stays open until its status came, as
        // closing it ends the whole exec on servers without the v5 protocol.
        let feed = async move {
            while let Some(Ok(chunk)) = rx.recv().await {
                stdin.write_all(&chunk).await?;
            }
            stdin.flush().await?;
            Ok::<_, std::io::Error>(stdin)
        };
        let read_err = async move {
            let mut text = String::new();
            if let Some(e) = stderr {
                let _ = e.take(MAX_STDERR).read_to_string(&mut text).await;
            }
            text
        };
        // Until tar has exited (its stderr closed): a tar that fails early stops reading,
        // and feeding it must not wait forever.
        let mut feed = Box::pin(feed);
        tokio::pin!(read_err);
        let (mut fed, mut err_text) = (None, None);
        while err_text.is_none() {
            tokio::select! {
                r = &mut feed, if fed.is_none() => fed = Some(r),
                t = &mut read_err => err_text = Some(t),
                _ = cancel.cancelled() => {
                    attached.abort();
                    return Err(ErrorBody::new(ErrorCode::ShuttingDown, "the gateway is shutting down"));
                }
            }
        }
        let err_text = err_text.unwrap_or_default();
        if fed.is_none() {
            // tar read the end marker: the last writes are about to complete.
            fed = tokio::time::timeout(std::time::Duration::from_secs(2), &mut feed)
                .await
                .ok();
        }
        // Dropping the feed drops the channel, which ends a producer still writing.
        drop(feed);
        let produced = producer
            .await
            .map_err(|e| failed(format!("the tar stream failed: {e}")))?;
        let status = match status {
            Some(s) => tokio::select! {
                s = s => s,
                _ = cancel.cancelled() => {
                    attached.abort();
                    return Err(ErrorBody::new(ErrorCode::ShuttingDown, "the gateway is shutting down"));
                }
            },
            None => None,
        };
        let fed = match fed {
            Some(Ok(stdin)) => Ok(stdin),
            Some(Err(e)) => Err(format!("writing to tar's stdin: {e}")),
            None => Err("tar ended before it read the whole archive".to_owned()),
        };
        let ok = status.as_ref().and_then(|s| s.status.as_deref()) == Some("Success");
        if !ok {
            let why = status
                .and_then(|s| s.message)
                .unwrap_or_else(|| "no exit status".into());
            let hint = if err_text.contains("not found") || why.contains("not found") {
                " (the image needs `tar`)"
            } else {
                ""
            };
            return Err(failed(format!("{}{hint}: {}", why.trim(), err_text.trim())));
        }
        if let Err(e) = fed {
            return Err(failed(e));
        }
        if let Err(e) = produced {
            return Err(failed(format!("reading the cache: {e}")));
        }
        let base = path.trim_end_matches('/');
        Ok(if run.cwd.is_empty() {
            base.to_owned()
        } else {
            format!("{base}/{}", run.cwd)
        })
    }
}
