//! The one protobuf body the double reads: a `SelfSubjectAccessReview`, which kubectl (`auth
//! can-i`, and its typed clients generally) sends as `application/vnd.kubernetes.protobuf`, as
//! a real API server accepts for built-in types. Every other protobuf body is still 415: the
//! double has no protobuf codec for pods.
//!
//! The wire format: the magic `k8s\0`, then a `runtime.Unknown` (1 typeMeta {1 apiVersion,
//! 2 kind}, 2 raw, 3 contentEncoding, 4 contentType) whose `raw` is the object
//! (k8s.io/api/authorization/v1 generated.proto): SelfSubjectAccessReview {1 metadata,
//! 2 spec {1 resourceAttributes {1 namespace, 2 verb, 3 group, 4 version, 5 resource,
//! 6 subresource, 7 name}, 2 nonResourceAttributes {1 path, 2 verb}}, 3 status}.

use serde_json::{Map, Value, json};

const MAGIC: &[u8] = b"k8s\0";

/// One field of a message: its number and, for length-delimited fields, the bytes.
struct Field<'a> {
    number: u64,
    bytes: Option<&'a [u8]>,
}

fn varint(buf: &[u8], pos: &mut usize) -> Result<u64, String> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *buf.get(*pos).ok_or("truncated varint")?;
        *pos += 1;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err("varint too long".into())
}

fn fields(buf: &[u8]) -> Result<Vec<Field<'_>>, String> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < buf.len() {
        let key = varint(buf, &mut pos)?;
        let number = key >> 3;
        let bytes = match key & 7 {
            0 => {
                varint(buf, &mut pos)?;
                None
            }
            1 => {
                pos += 8;
                None
            }
            2 => {
                let len = varint(buf, &mut pos)? as usize;
                let end = pos.checked_add(len).filter(|e| *e <= buf.len());
                let end = end.ok_or("length past the end")?;
                let b = &buf[pos..end];
                pos = end;
                Some(b)
            }
            5 => {
                pos += 4;
                None
            }
            t => return Err(format!("unsupported wire type {t}")),
        };
        if pos > buf.len() {
            return Err("truncated field".into());
        }
        out.push(Field { number, bytes });
    }
    Ok(out)
}

fn sub(buf: &[u8], number: u64) -> Result<Option<&[u8]>, String> {
    Ok(fields(buf)?
        .into_iter()
        .filter(|f| f.number == number)
        .find_map(|f| f.bytes))
}

/// The string fields of a message, by number, under the given JSON names.
fn strings(buf: &[u8], names: &[(u64, &str)]) -> Result<Value, String> {
    let mut m = Map::new();
    for f in fields(buf)? {
        if let (Some((_, name)), Some(b)) = (names.iter().find(|(n, _)| *n == f.number), f.bytes) {
            let s = std::str::from_utf8(b).map_err(|_| format!("{name} is not UTF-8"))?;
            m.insert((*name).to_string(), json!(s));
        }
    }
    Ok(Value::Object(m))
}

/// A protobuf SelfSubjectAccessReview as the JSON object the handler reads.
pub fn self_subject_access_review(body: &[u8]) -> Result<Value, String> {
    let unknown = body.strip_prefix(MAGIC).ok_or("no k8s protobuf envelope")?;
    let raw = sub(unknown, 2)?.ok_or("envelope without raw object")?;
    let mut spec = Map::new();
    if let Some(s) = sub(raw, 2)? {
        if let Some(r) = sub(s, 1)? {
            let names = [
                (1, "namespace"),
                (2, "verb"),
                (3, "group"),
                (4, "version"),
                (5, "resource"),
                (6, "subresource"),
                (7, "name"),
            ];
            spec.insert("resourceAttributes".into(), strings(r, &names)?);
        }
        if let Some(n) = sub(s, 2)? {
            spec.insert(
                "nonResourceAttributes".into(),
                strings(n, &[(1, "path"), (2, "verb")])?,
            );
        }
    }
    Ok(json!({
        "kind": "SelfSubjectAccessReview",
        "apiVersion": "authorization.k8s.io/v1",
        "spec": spec,
    }))
}

/// Encodes a SelfSubjectAccessReview for resource attributes as a client-go typed client
/// does (for the double's own tests).
pub fn encode_ssar(attrs: &[(u64, &str)]) -> Vec<u8> {
    fn field(out: &mut Vec<u8>, number: u64, bytes: &[u8]) {
        let mut key = (number << 3) | 2;
        loop {
            let b = (key & 0x7f) as u8;
            key >>= 7;
            if key == 0 {
                out.push(b);
                break;
            }
            out.push(b | 0x80);
        }
        let mut len = bytes.len() as u64;
        loop {
            let b = (len & 0x7f) as u8;
            len >>= 7;
            if len == 0 {
                out.push(b);
                break;
            }
            out.push(b | 0x80);
        }
        out.extend_from_slice(bytes);
    }
    let mut ra = Vec::new();
    for (n, v) in attrs {
        field(&mut ra, *n, v.as_bytes());
    }
    let mut spec = Vec::new();
    field(&mut spec, 1, &ra);
    let mut raw = Vec::new();
    field(&mut raw, 1, &[]);
    field(&mut raw, 2, &spec);
    let mut type_meta = Vec::new();
    field(&mut type_meta, 1, b"authorization.k8s.io/v1");
    field(&mut type_meta, 2, b"SelfSubjectAccessReview");
    let mut unknown = Vec::new();
    field(&mut unknown, 1, &type_meta);
    field(&mut unknown, 2, &raw);
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&unknown);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_what_it_encodes() {
        let body = encode_ssar(&[(1, "default"), (2, "create"), (5, "pods"), (6, "exec")]);
        let v = self_subject_access_review(&body).unwrap();
        assert_eq!(
            v["spec"]["resourceAttributes"],
            json!({"namespace": "default", "verb": "create", "resource": "pods", "subresource": "exec"})
        );
        assert!(self_subject_access_review(b"{}").is_err());
        assert!(self_subject_access_review(&body[..body.len() - 3]).is_err());
    }
}
