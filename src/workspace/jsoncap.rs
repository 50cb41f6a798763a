//! Readers that bound what parsing a posted manifest may cost, so that it streams from the
//! request body without its text being held: [`JsonStringCap`] fails a JSON string longer
//! than a bound before serde_json's buffer grows to it, [`BodyCap`] fails a body over
//! `workspaces.max_manifest_bytes`, and [`Hashing`] computes the body's key on the way.

use std::io::Read;

/// The longest JSON string accepted in raw bytes: a path or target of
/// [`super::manifest::MAX_MANIFEST_STRING`] bytes with every character escaped (`\u` and
/// four hex digits).
pub(crate) const MAX_RAW_STRING: usize = 6 * super::manifest::MAX_MANIFEST_STRING + 64;

/// Fails the read that would pass a JSON string longer than [`MAX_RAW_STRING`] bytes.
pub(crate) struct JsonStringCap<R> {
    inner: R,
    in_string: bool,
    escaped: bool,
    len: usize,
}

impl<R: Read> JsonStringCap<R> {
    pub(crate) fn new(inner: R) -> Self {
        Self {
            inner,
            in_string: false,
            escaped: false,
            len: 0,
        }
    }
}

impl<R: Read> Read for JsonStringCap<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        let mut rest = &buf[..n];
        // Jumps from quote to quote (and backslash) rather than looking at every byte.
        while !rest.is_empty() {
            if !self.in_string {
                match memchr::memchr(b'"', rest) {
                    Some(i) => {
                        self.in_string = true;
                        self.len = 0;
                        rest = &rest[i + 1..];
                    }
                    None => break,
                }
                continue;
            }
            if self.escaped {
                self.escaped = false;
                self.len += 1;
                rest = &rest[1..];
            } else {
                match memchr::memchr2(b'"', b'\\', rest) {
                    Some(i) => {
                        self.len += i;
                        if rest[i] == b'"' {
                            self.in_string = false;
                        } else {
                            self.escaped = true;
                            self.len += 1;
                        }
                        rest = &rest[i + 1..];
                    }
                    None => {
                        self.len += rest.len();
                        rest = &[];
                    }
                }
            }
            if self.len > MAX_RAW_STRING {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!(
                        "a string is longer than {MAX_RAW_STRING} bytes (paths and symlink targets are at most {} bytes, PATH_MAX)",
                        super::manifest::MAX_MANIFEST_STRING
                    ),
                ));
            }
        }
        Ok(n)
    }
}

/// Fails the read that passes byte `max + 1`.
pub(crate) struct BodyCap<R> {
    inner: R,
    n: u64,
    max: u64,
}

impl<R: Read> BodyCap<R> {
    pub(crate) fn new(inner: R, max: u64) -> Self {
        Self { inner, n: 0, max }
    }
}

impl<R: Read> Read for BodyCap<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.n += n as u64;
        if self.n > self.max {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "the manifest is larger than {} bytes (workspaces.max_manifest_bytes)",
                    self.max
                ),
            ));
        }
        Ok(n)
    }
}

/// Hashes what passes.
pub(crate) struct Hashing<R> {
    pub inner: R,
    pub hasher: sha2::Sha256,
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use sha2::Digest as _;
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_strings_fail_short_ones_and_escapes_pass() {
        let ok = format!(r#"{{"a":"{}\"\\","b":"x"}}"#, "y".repeat(1000));
        let mut out = String::new();
        JsonStringCap::new(ok.as_bytes())
            .read_to_string(&mut out)
            .unwrap();
        assert_eq!(out, ok);
        let long = format!(r#"{{"a":"{}"}}"#, "y".repeat(MAX_RAW_STRING + 1));
        assert!(
            JsonStringCap::new(long.as_bytes())
                .read_to_string(&mut String::new())
                .is_err()
        );
        let mut big = BodyCap::new(&[0u8; 100][..], 99);
        assert!(big.read_to_end(&mut Vec::new()).is_err());
    }
}
