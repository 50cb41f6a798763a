//! The workspace endpoints as a client sees them: every bad input is a 4xx with a JSON
//! error body and leaves nothing in the cache; ids are bound to the identity that posted
//! them; the cache stays within its bound and a run whose contents were evicted is refused
//! (409) until they are uploaded again, which `run-remote` does by itself.

use crate::support;

use std::io::Write as _;

use mcp_run::hash_bytes;
use serde_json::{Value, json};
use support::{Gateway, config_file, http, raw};

fn gateway(dir: &tempfile::TempDir, extra: &str, env: &[(&str, &str)]) -> Gateway {
    let cfg = config_file(
        dir,
        &format!(
            "workspaces:\n  local_dir: {}\n  cache_dir: {}\n{extra}",
            dir.path().join("runs").display(),
            dir.path().join("cache").display()
        ),
    );
    Gateway::start_with_env(&["--config", cfg.to_str().unwrap()], env)
}

fn file(path: &str, data: &[u8]) -> Value {
    json!({"path": path, "mode": 420, "size": data.len(), "hash": hash_bytes(data)})
}

/// `POST /workspaces` → (status, body).
async fn post(gw: &Gateway, token: Option<&str>, body: Vec<u8>) -> (u16, Value) {
    let mut req = http()
        .post(gw.url("/workspaces"))
        .header("content-type", "application/json")
        .body(body);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.expect("a JSON body"))
}

async fn post_manifest(gw: &Gateway, token: Option<&str>, entries: Value) -> (u16, Value) {
    post(
        gw,
        token,
        serde_json::to_vec(&json!({ "entries": entries })).unwrap(),
    )
    .await
}

/// A gzip tar stream of `(name, bytes)` entries.
fn bundle(entries: &[(&str, &[u8])]) -> Vec<u8> {
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut tar = tar::Builder::new(gz);
    for (name, data) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        tar.append_data(&mut h, name, *data).unwrap();
    }
    tar.into_inner().unwrap().finish().unwrap()
}

async fn upload(gw: &Gateway, token: Option<&str>, id: &str, body: Vec<u8>) -> (u16, Value) {
    let mut req = http()
        .post(gw.url(&format!("/workspaces/{id}/blobs")))
        .header("content-encoding", "gzip")
        .body(body);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.expect("a JSON body"))
}

fn code(v: &Value) -> &str {
    v["error"]["code"]
        .as_str()
        .unwrap_or_else(|| panic!("no error body: {v}"))
}

#[tokio::test]
async fn bad_manifests_and_uploads_are_4xx_and_store_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(
        &dir,
        "  max_files: 3\n  max_file_bytes: 1000\n  max_path_bytes: 64\n",
        &[],
    );
    let ok = file("a.txt", b"hello");
    for (entries, want) in [
        (json!([file("../x", b"x")]), "invalid_request"),
        (json!([file("/etc/x", b"x")]), "invalid_request"),
        (json!([file("a/./b", b"x")]), "invalid_request"),
        (json!([file("a\u{0}b", b"x")]), "invalid_request"),
        (json!([ok, ok]), "invalid_request"),
        (json!([ok, file("a.txt/b", b"x")]), "invalid_request"),
        (
            json!([{"path": "l", "kind": "symlink", "target": "../../etc"}]),
            "invalid_request",
        ),
        (
            json!([{"path": "h", "size": 1, "hash": "XYZ"}]),
            "invalid_request",
        ),
        (
            json!([{"path": "m", "size": 1, "mode": 2541, "hash": hash_bytes(b"x")}]),
            "invalid_request",
        ),
        (json!([file(&"p".repeat(65), b"x")]), "invalid_request"),
        (
            json!([
                file("a", b"1"),
                file("b", b"2"),
                file("c", b"3"),
                file("d", b"4")
            ]),
            "payload_too_large",
        ),
        (
            json!([{"path": "big", "size": 1001, "hash": hash_bytes(b"x")}]),
            "payload_too_large",
        ),
    ] {
        let (status, body) = post_manifest(&gw, None, entries.clone()).await;
        assert!((400..500).contains(&status), "{entries}: {status} {body}");
        assert_eq!(code(&body), want, "{entries}: {body}");
    }
    // Not JSON, not UTF-8, unknown fields.
    for body in [
        &b"{\"entries\": [ {\"path\": \"\xff\xfe\"} ]}"[..],
        b"nope",
        b"{\"entries\":[],\"x\":1}",
    ] {
        let (status, v) = post(&gw, None, body.to_vec()).await;
        assert_eq!((status, code(&v)), (400, "invalid_request"), "{v}");
    }

    let (status, posted) = post_manifest(&gw, None, json!([ok])).await;
    assert_eq!(status, 200, "{posted}");
    let id = posted["workspace"].as_str().unwrap().to_owned();
    let h = hash_bytes(b"hello");
    assert_eq!(posted["missing"], json!([h]));
    // Wrong bytes under the hash; too short; undeclared content; cut-off stream.
    let (s, v) = upload(&gw, None, &id, bundle(&[(&h, b"hellO")])).await;
    assert_eq!((s, code(&v)), (400, "hash_mismatch"), "{v}");
    let (s, v) = upload(&gw, None, &id, bundle(&[(&h, b"hell")])).await;
    assert_eq!((s, code(&v)), (400, "invalid_request"), "{v}");
    let other = hash_bytes(b"other");
    let (s, v) = upload(&gw, None, &id, bundle(&[(&other, b"other")])).await;
    assert_eq!((s, code(&v)), (400, "invalid_request"), "{v}");
    let full = bundle(&[(&h, b"hello")]);
    let (s, v) = upload(&gw, None, &id, full[..full.len() / 2].to_vec()).await;
    assert_eq!((s, code(&v)), (400, "invalid_request"), "{v}");
    let (s, v) = upload(&gw, None, "ws_nope", full.clone()).await;
    assert_eq!((s, code(&v)), (404, "unknown_workspace"), "{v}");
    // Nothing was stored: the content is still missing, and a run is refused.
    let (_, again) = post_manifest(&gw, None, json!([ok])).await;
    assert_eq!(again["missing"], json!([h]));
    let run = raw(&gw, json!({"executable": "true", "workspace": id})).await;
    assert_eq!(run.status, 409);
    assert_eq!(
        run.rejection.unwrap().error.code.as_str(),
        "workspace_incomplete"
    );
    let entries = std::fs::read_dir(dir.path().join("cache/blobs"))
        .unwrap()
        .count();
    assert_eq!(entries, 0, "no content in the cache");

    // The real upload, then bad run requests.
    let (s, v) = upload(&gw, None, &id, full).await;
    assert_eq!((s, v["stored"].as_u64()), (200, Some(1)), "{v}");
    let run = raw(
        &gw,
        json!({"executable": "cat", "args": ["a.txt"], "workspace": id}),
    )
    .await;
    assert_eq!(run.stdout_str(), "hello");
    for (body, status, want) in [
        (
            json!({"executable": "true", "workspace": "ws_0000"}),
            404,
            "unknown_workspace",
        ),
        (
            json!({"executable": "true", "workspace": id, "cwd": "../x"}),
            400,
            "invalid_request",
        ),
        (
            json!({"executable": "true", "workspace": id, "cwd": "/abs"}),
            400,
            "invalid_request",
        ),
        (
            json!({"executable": "true", "workspace": id, "cwd": "a.txt"}),
            400,
            "invalid_request",
        ),
        (
            json!({"executable": "true", "sync_back": ["*"]}),
            400,
            "invalid_request",
        ),
        (
            json!({"executable": "true", "workspace": id, "sync_back": ["a[" ]}),
            400,
            "invalid_request",
        ),
    ] {
        let run = raw(&gw, body.clone()).await;
        assert_eq!(run.status, status, "{body}");
        assert_eq!(run.rejection.unwrap().error.code.as_str(), want, "{body}");
    }
    // A request without a workspace behaves as before.
    let run = raw(&gw, json!({"executable": "echo", "args": ["plain"]})).await;
    assert_eq!(run.stdout_str(), "plain\n");
    // Downloads: only hashes, only what the caller has.
    let resp = http()
        .get(gw.url("/workspaces/blobs/..%2Fetc"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let resp = http()
        .get(gw.url(&format!("/workspaces/blobs/{other}")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 404);
}

#[tokio::test]
async fn a_workspace_is_usable_only_by_the_identity_that_posted_it() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(
        &dir,
        "local:\n  allow_multiple_identities: true\n",
        &[(
            "MCP_RUN_AUTH_TOKENS",
            "alice:tok-alice-1234567890,bob:tok-bob-1234567890",
        )],
    );
    let (alice, bob) = (Some("tok-alice-1234567890"), Some("tok-bob-1234567890"));
    let (_, posted) = post_manifest(&gw, alice, json!([file("s", b"secret")])).await;
    let id = posted["workspace"].as_str().unwrap().to_owned();
    let h = hash_bytes(b"secret");
    let (s, _) = upload(&gw, alice, &id, bundle(&[(&h, b"secret")])).await;
    assert_eq!(s, 200);
    // Bob cannot upload to it, run in it, or learn that alice has the content.
    let (s, v) = upload(&gw, bob, &id, bundle(&[(&h, b"secret")])).await;
    assert_eq!((s, code(&v)), (404, "unknown_workspace"));
    let resp = http()
        .post(gw.raw_url())
        .bearer_auth(bob.unwrap())
        .json(&json!({"executable": "cat", "args": ["s"], "workspace": id}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 404);
    let (_, theirs) = post_manifest(&gw, bob, json!([file("s", b"secret")])).await;
    assert_eq!(theirs["missing"], json!([h]), "bob must prove he has it");
    assert_ne!(theirs["workspace"], posted["workspace"]);
    let resp = http()
        .get(gw.url(&format!("/workspaces/blobs/{h}")))
        .bearer_auth(bob.unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 404);
    // Without a token: 401 as everywhere.
    let (s, _) = post_manifest(&gw, None, json!([])).await;
    assert_eq!(s, 401);
}

#[tokio::test]
async fn the_cache_keeps_its_bound_and_run_remote_uploads_again_after_eviction() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(
        &dir,
        "  max_cache_bytes: 4096\n  max_file_bytes: 2048\n",
        &[],
    );
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    for i in 0..3u8 {
        std::fs::write(a.path().join(format!("f{i}")), vec![b'a' + i; 1200]).unwrap();
        std::fs::write(b.path().join(format!("f{i}")), vec![b'x' + i; 1200]).unwrap();
    }
    let run = |tree: &std::path::Path, args: &[&str]| {
        let out = gw
            .run_remote()
            .env("XDG_CACHE_HOME", dir.path())
            .current_dir(tree)
            .args(["--workspace", "--output-format", "json"])
            .args(args)
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    };
    let cached = || -> u64 {
        walkdir::WalkDir::new(dir.path().join("cache/blobs"))
            .into_iter()
            .flatten()
            .filter(|e| e.file_type().is_file())
            .map(|e| e.metadata().unwrap().len())
            .sum()
    };
    assert_eq!(
        run(a.path(), &["--", "true"])["workspace"]["uploaded_files"],
        3
    );
    // b's 3600 bytes do not fit beside a's in 4096: a's least recently used contents go.
    assert_eq!(
        run(b.path(), &["--", "true"])["workspace"]["uploaded_files"],
        3
    );
    assert!(cached() <= 4096, "cache holds {} bytes", cached());
    // a again: its evicted contents are uploaded again, and the run sees the whole tree.
    let again = run(
        a.path(),
        &["--", "sh", "-c", "cat f0 f1 f2 | md5sum | cut -c1-32"],
    );
    assert!(
        again["workspace"]["uploaded_files"].as_u64().unwrap() >= 1,
        "{again}"
    );
    let mut all = Vec::new();
    for i in 0..3u8 {
        all.extend(vec![b'a' + i; 1200]);
    }
    let out = std::process::Command::new("sh")
        .args(["-c", "md5sum | cut -c1-32"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().unwrap().write_all(&all)?;
            c.wait_with_output()
        })
        .unwrap();
    assert_eq!(
        again["outputs"][0]["stdout"],
        String::from_utf8_lossy(&out.stdout).as_ref()
    );
    assert!(cached() <= 4096);
    // A tree larger than the whole cache is refused up front.
    std::fs::write(a.path().join("big"), vec![b'z'; 2000]).unwrap();
    std::fs::write(a.path().join("big2"), vec![b'y'; 2000]).unwrap();
    let out = gw
        .run_remote()
        .env("XDG_CACHE_HOME", dir.path())
        .current_dir(a.path())
        .args(["--workspace", "--", "true"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(stderr.contains("payload_too_large"), "{stderr}");
    let _ = std::io::stderr().flush();
}

#[tokio::test]
async fn the_policy_sees_the_workspace_below_slash_workspace() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, "policy:\n  cwd: {allow: [/workspace/sub]}\n", &[]);
    let data = b"#!/bin/sh\necho ok\n";
    let mut entry = file("sub/run.sh", data);
    entry["mode"] = json!(493);
    let (_, posted) = post_manifest(&gw, None, json!([entry])).await;
    let id = posted["workspace"].as_str().unwrap().to_owned();
    let h = hash_bytes(data);
    let (s, _) = upload(&gw, None, &id, bundle(&[(&h, data)])).await;
    assert_eq!(s, 200);
    let ok = raw(
        &gw,
        json!({"executable": "./run.sh", "workspace": id, "cwd": "sub"}),
    )
    .await;
    assert_eq!(ok.stdout_str(), "ok\n", "{:?}", ok.rejection);
    let refused = raw(&gw, json!({"executable": "true", "workspace": id})).await;
    assert_eq!(refused.status, 403);
    assert_eq!(
        refused.rejection.unwrap().error.code.as_str(),
        "policy_violation"
    );
}

/// `PUT /workspaces/{id}/blobs/{hash}`: `(status, body)`.
async fn put_blob(gw: &Gateway, id: &str, hash: &str, body: Vec<u8>, gz: bool) -> (u16, Value) {
    let mut req = http()
        .put(gw.url(&format!("/workspaces/{id}/blobs/{hash}")))
        .body(body);
    if gz {
        req = req.header("content-encoding", "gzip");
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.expect("a JSON body"))
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(data).unwrap();
    gz.finish().unwrap()
}

/// The single-content upload: plain or gzip, with the batch's checks (bytes that hash to
/// something else, too short, too long, not a content of the workspace, not the caller's
/// workspace, broken gzip), and nothing stored by a refused one.
#[tokio::test]
async fn a_single_content_is_put_and_checked_like_a_batch() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, "", &[]);
    let (a, b) = (&b"first content\n"[..], &b"second\n"[..]);
    let (ha, hb) = (hash_bytes(a), hash_bytes(b));
    let (s, v) = post_manifest(&gw, None, json!([file("a.txt", a), file("b.txt", b)])).await;
    assert_eq!(s, 200, "{v}");
    let id = v["workspace"].as_str().unwrap().to_owned();
    let other = hash_bytes(b"not in the manifest");
    let mut cut_gzip = gzip(a);
    cut_gzip.truncate(cut_gzip.len() / 2);
    for (hash, body, gz, status, want) in [
        (
            &ha,
            b"first CONTENT\n".to_vec(),
            false,
            400,
            "hash_mismatch",
        ),
        (&ha, a[..5].to_vec(), false, 400, "invalid_request"),
        (&ha, [a, b"!"].concat(), false, 400, "invalid_request"),
        (&ha, cut_gzip, true, 400, "invalid_request"),
        (&other, a.to_vec(), false, 400, "invalid_request"),
    ] {
        let (s, v) = put_blob(&gw, &id, hash, body, gz).await;
        assert_eq!((s, code(&v)), (status, want), "{v}");
    }
    let (s, v) = put_blob(
        &gw,
        "ws_00000000000000000000000000000000",
        &ha,
        a.to_vec(),
        false,
    )
    .await;
    assert_eq!((s, code(&v)), (404, "unknown_workspace"), "{v}");
    let (_, v) = post_manifest(&gw, None, json!([file("a.txt", a), file("b.txt", b)])).await;
    let mut missing = vec![ha.clone(), hb.clone()];
    missing.sort();
    assert_eq!(v["missing"], json!(missing), "nothing was stored");

    let (s, v) = put_blob(&gw, &id, &ha, a.to_vec(), false).await;
    assert_eq!((s, &v), (200, &json!({"stored": 1, "bytes": a.len()})));
    let (s, v) = put_blob(&gw, &id, &hb, gzip(b), true).await;
    assert_eq!((s, &v), (200, &json!({"stored": 1, "bytes": b.len()})));
    let (_, v) = post_manifest(&gw, None, json!([file("a.txt", a), file("b.txt", b)])).await;
    assert_eq!(v["missing"], json!([]));
    let run = raw(
        &gw,
        json!({"executable": "cat", "args": ["a.txt", "b.txt"], "workspace": id}),
    )
    .await;
    assert_eq!(run.stdout_str(), "first content\nsecond\n");
}

/// `workspaces.max_age_secs`: contents and workspace ids unused that long are dropped (the
/// next post asks for the contents again, the old id is unknown), while used ones stay.
#[tokio::test]
async fn contents_and_ids_unused_for_max_age_are_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, "  max_age_secs: 1\n", &[]);
    let (old, fresh) = (&b"old\n"[..], &b"fresh\n"[..]);
    let (_, v) = post_manifest(&gw, None, json!([file("old.txt", old)])).await;
    let old_id = v["workspace"].as_str().unwrap().to_owned();
    assert_eq!(
        upload(&gw, None, &old_id, bundle(&[(&hash_bytes(old), old)]))
            .await
            .0,
        200
    );
    let run = raw(
        &gw,
        json!({"executable": "cat", "args": ["old.txt"], "workspace": old_id}),
    )
    .await;
    assert_eq!(run.stdout_str(), "old\n");
    // Posting another workspace evicts what is unused for over a second (the bound is whole
    // seconds): post until the old content is gone from disk, which does not use the old id.
    let blobs = || -> Vec<String> {
        walkdir::WalkDir::new(dir.path().join("cache/blobs"))
            .into_iter()
            .flatten()
            .filter(|e| e.file_type().is_file())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let fresh_id = loop {
        let (_, v) = post_manifest(&gw, None, json!([file("fresh.txt", fresh)])).await;
        if !blobs().contains(&hash_bytes(old)) {
            break v["workspace"].as_str().unwrap().to_owned();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the old content stayed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(
        upload(&gw, None, &fresh_id, bundle(&[(&hash_bytes(fresh), fresh)]))
            .await
            .0,
        200
    );
    let run = raw(&gw, json!({"executable": "true", "workspace": old_id})).await;
    assert_eq!(run.status, 404, "the old id expired");
    assert_eq!(
        blobs(),
        [hash_bytes(fresh)],
        "only the fresh content is on disk"
    );
    let (_, v) = post_manifest(&gw, None, json!([file("old.txt", old)])).await;
    assert_eq!(v["missing"], json!([hash_bytes(old)]), "uploaded again");
    let run = raw(
        &gw,
        json!({"executable": "cat", "args": ["fresh.txt"], "workspace": fresh_id}),
    )
    .await;
    assert_eq!(run.stdout_str(), "fresh\n");
}
