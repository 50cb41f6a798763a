//! A guard in front of the `tar` crate for tar streams the gateway did not write (uploads,
//! a runner's sync-back results): the crate reads a GNU long name, long link or PAX header
//! whole into memory, whatever size its header announces, so a few hundred KiB of gzip could
//! make it allocate hundreds of MiB. [`CappedHeaders`] watches the stream as it passes and
//! fails the read that would hand over such a header when it announces more than
//! [`MAX_EXTENDED_HEADER`] bytes, before the crate allocates anything for it. GNU sparse
//! entries (never needed here) are refused too, since their extension blocks would need more
//! parsing to follow.

use std::io::Read;

/// The largest GNU long name/link or PAX header accepted: paths are at most 4096 bytes
/// (`PATH_MAX`), and a PAX header carries a few of them with some times. (Go's archive/tar
/// allows 1 MiB.)
pub(crate) const MAX_EXTENDED_HEADER: u64 = 64 * 1024;

const BLOCK: usize = 512;

/// A reader of a tar stream that refuses oversized extended headers (module docs).
pub(crate) struct CappedHeaders<R> {
    inner: R,
    /// Bytes of the current entry's data (with its padding) still to pass.
    data_left: u64,
    /// The header block being collected.
    header: [u8; BLOCK],
    header_len: usize,
}

impl<R: Read> CappedHeaders<R> {
    pub(crate) fn new(inner: R) -> Self {
        Self {
            inner,
            data_left: 0,
            header: [0; BLOCK],
            header_len: 0,
        }
    }

    /// Follows the bytes that just passed; an error for a header that must not pass.
    fn watch(&mut self, mut bytes: &[u8]) -> std::io::Result<()> {
        while !bytes.is_empty() {
            if self.data_left > 0 {
                let k = (self.data_left.min(bytes.len() as u64)) as usize;
                self.data_left -= k as u64;
                bytes = &bytes[k..];
                continue;
            }
            let k = (BLOCK - self.header_len).min(bytes.len());
            self.header[self.header_len..self.header_len + k].copy_from_slice(&bytes[..k]);
            self.header_len += k;
            bytes = &bytes[k..];
            if self.header_len == BLOCK {
                self.header_len = 0;
                self.data_left = self.header_block()?;
            }
        }
        Ok(())
    }

    /// Checks a complete header block; the bytes of data that follow it.
    fn header_block(&self) -> std::io::Result<u64> {
        let h = &self.header;
        if h.iter().all(|b| *b == 0) {
            return Ok(0);
        }
        let size = octal_or_binary(&h[124..136]).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "a tar header has an invalid size field",
            )
        })?;
        let kind = h[156];
        let what = match kind {
            b'L' => Some("GNU long name"),
            b'K' => Some("GNU long link name"),
            b'x' => Some("PAX header"),
            b'g' => Some("PAX global header"),
            _ => None,
        };
        if let Some(what) = what
            && size > MAX_EXTENDED_HEADER
        {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "a tar {what} of {size} bytes is over the limit of {MAX_EXTENDED_HEADER} bytes"
                ),
            ));
        }
        if kind == b'S' {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "GNU sparse tar entries are not accepted",
            ));
        }
        Ok(size.div_ceil(BLOCK as u64) * BLOCK as u64)
    }
}

/// A tar numeric field: octal digits (space or NUL terminated), or base-256 when the first
/// byte's high bit is set.
fn octal_or_binary(field: &[u8]) -> Option<u64> {
    if field[0] & 0x80 != 0 {
        let mut n: u64 = u64::from(field[0] & 0x7f);
        for b in &field[1..] {
            n = n.checked_mul(256)?.checked_add(u64::from(*b))?;
        }
        return Some(n);
    }
    let text = std::str::from_utf8(field).ok()?;
    let digits = text.trim_matches(|c: char| c == ' ' || c == '\0');
    if digits.is_empty() {
        return Some(0);
    }
    u64::from_str_radix(digits, 8).ok()
}

impl<R: Read> Read for CappedHeaders<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.watch(&buf[..n])?;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn archive_with_long_name(len: usize) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(3);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        b.append_data(&mut h, "x".repeat(len), &b"abc"[..]).unwrap();
        b.into_inner().unwrap()
    }

    fn names(data: &[u8]) -> std::io::Result<Vec<String>> {
        let mut a = tar::Archive::new(CappedHeaders::new(data));
        let mut out = Vec::new();
        for e in a.entries()? {
            let mut e = e?;
            let mut s = String::new();
            e.read_to_string(&mut s)?;
            out.push(format!("{}={s}", e.path()?.display().to_string().len()));
        }
        Ok(out)
    }

    #[test]
    fn long_names_pass_up_to_the_cap_only() {
        assert_eq!(names(&archive_with_long_name(300)).unwrap(), ["300=abc"]);
        assert_eq!(names(&archive_with_long_name(4000)).unwrap(), ["4000=abc"]);
        let err = names(&archive_with_long_name(70_000)).unwrap_err();
        assert!(err.to_string().contains("GNU long name"), "{err}");
        assert!(octal_or_binary(b"00000001000\0").unwrap() == 512);
        let mut bin = [0u8; 12];
        bin[0] = 0x80;
        bin[11] = 5;
        assert_eq!(octal_or_binary(&bin), Some(5));
    }
}
